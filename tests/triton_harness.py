"""Fixtures that run the real tritonserver (from nvidia-pytriton) on loopback ports, and the
clients and references the served tests compare against (a pytest plugin: conftest.py loads it).

`triton` is one server for the whole run: both decode models from a copy of
model_repository/ (with small tiles, so a short clip already spans several),
the "small" synthetic checkpoint passed through AUK_CHECKPOINT. `front_door` is the same
started as `make serve` starts it (the launcher's front door before a tritonserver on
loopback), with a `max_frames` of FRONT_MAX_FRAMES, also one for the whole run. Tests that
need a server of their own start it with `launch_triton` or `start_front_door`. A server's log is printed at the end
of the run when anything failed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_TILE_FRAMES = 128
DECODE_MODELS = ("auk_vae_decode", "auk_vae_decode_offline")
DECODING_MODELS = DECODE_MODELS + ("auk_pipeline",)  # the pipeline holds a decoder too
FRONT_MAX_FRAMES = 256  # the front_door server's limit: small, so an oversized request is cheap to send
START_TIMEOUT_S = float(os.environ.get("AUK_TEST_SERVER_TIMEOUT", "300"))

_server_logs: list[Path] = []


@dataclass
class TritonServer:
    grpc_url: str
    http_url: str
    metrics_url: str
    checkpoint_dir: Path
    model_repository: Path
    log_path: Path
    process: subprocess.Popen
    tile_frames: int = TEST_TILE_FRAMES  # what copy_model_repository writes into the configs
    first_tile_frames: int | None = None  # the served first window (served_first_window)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.metrics_url}/metrics", timeout=10) as reply:
            return reply.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
        total = 0.0
        for line in self.metrics().splitlines():
            match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
            if match:
                found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
                if all(found.get(k) == v for k, v in labels.items()):
                    total += float(match.group(2))
        return total

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=5) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def _free_ports(count: int) -> list[int]:
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def closed_port() -> int:
    """A loopback port that nothing listens on: the address of a server that is down."""
    return _free_ports(1)[0]


def copy_model_repository(
    dest: Path, tile_frames: int | None = TEST_TILE_FRAMES, models=DECODE_MODELS, parameters: dict | None = None,
    precision: str | None = "fp16",
) -> Path:
    """Copy the `models` of model_repository/ to `dest`, with `tile_frames`, `precision` (and any
    other config `parameters`) set in the CPU configs (config.pbtxt) of the decode models (and of
    auk_pipeline, which holds a decoder) that have them: `max_active_requests` in both, `max_frames` in auk_vae_decode alone (the offline
    model forwards to it). fp16 by default: a CPU decodes in fp32 anyway (and logs that it
    does), so the served tests that compare with the library's fp32 decode check that fallback too."""
    source = REPO_ROOT / "model_repository"
    dest.mkdir(parents=True)
    chosen = dict(parameters or {})
    if tile_frames is not None:
        chosen["tile_frames"] = tile_frames
    if precision is not None:
        chosen["precision"] = precision
    found = dict.fromkeys(chosen, 0)
    for model in models:
        shutil.copytree(source / model, dest / model, ignore=shutil.ignore_patterns("__pycache__"))
        if model not in DECODING_MODELS:
            continue
        config = dest / model / "config.pbtxt"
        for key, value in chosen.items():
            text, count = re.subn(
                rf'(key: "{key}", value: \{{ string_value: )"[^"]*"', rf'\1"{value}"', config.read_text()
            )
            found[key] += count
            config.write_text(text)
    if any(model in DECODE_MODELS for model in models):
        assert all(found.values()), f"no decode model copied has the parameters {[k for k, n in found.items() if not n]}"
    return dest


def checkpoint_with_dit(source: Path, dest: Path) -> Path:
    """A copy of the codec checkpoint `source` with the small synthetic DiT added (`source` stays
    codec-only)."""
    from auk_triton.diffusion.synthetic import write_synthetic_dit_checkpoint

    shutil.copytree(source, dest)
    return write_synthetic_dit_checkpoint(dest, preset="small", seed=0)


def served_first_window(model_repository: Path, model: str = "auk_vae_decode") -> int | None:
    """The first decode window `model` serves, by the model's own rule on its config's parameters."""
    from auk_triton.serving.config import DecodeSettings

    config_path = model_repository / model / "config.pbtxt"
    if not config_path.is_file():
        return None
    text = config_path.read_text()
    params = re.findall(r'key: "(\w+)", value: \{ string_value: "([^"]*)" \}', text)
    config = {"parameters": {key: {"string_value": value} for key, value in params}}
    return DecodeSettings.from_model_config(config, model_repository / model, environ={}).first_window_frames()


def start_triton(
    workdir: Path,
    model_repository: Path,
    checkpoint_dir: Path,
    extra_args=(),
    device: str = "cpu",
) -> TritonServer:
    """Start tritonserver on free loopback ports and wait until it reports ready; `device`
    is AUK_DEVICE (cpu: the models' config.pbtxt, gpu: their configs/gpu.pbtxt)."""
    server_module = pytest.importorskip("auk_triton.front_door.launcher")
    pytest.importorskip("tritonclient.grpc")
    http, grpc, metrics = _free_ports(3)
    env = dict(os.environ, AUK_CHECKPOINT=str(checkpoint_dir), AUK_DEVICE=device)
    env.setdefault("AUK_CACHE_DIR", str(workdir / "cache"))
    try:
        argv, env = server_module.server_command(
            model_repository,
            ports={"http": http, "grpc": grpc, "metrics": metrics},
            extra_args=[
                "--http-address=127.0.0.1",
                "--grpc-address=127.0.0.1",
                "--metrics-address=127.0.0.1",
                # A gRPC stream left open after its requests keeps its model live until the exit timeout.
                "--exit-timeout-secs=5",
                *extra_args,
            ],
            env=env,
        )
    except server_module.TritonNotFound as err:
        pytest.skip(f"tritonserver is not available: {err}")
    log_path = workdir / f"tritonserver-{http}.log"
    _server_logs.append(log_path)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = TritonServer(
        grpc_url=f"127.0.0.1:{grpc}",
        http_url=f"127.0.0.1:{http}",
        metrics_url=f"127.0.0.1:{metrics}",
        checkpoint_dir=Path(checkpoint_dir),
        model_repository=Path(model_repository),
        log_path=log_path,
        process=process,
        first_tile_frames=served_first_window(Path(model_repository)),
    )
    wait_until_ready(server)
    return server


@dataclass
class FrontDoorServer(TritonServer):
    """A server started as `make serve` starts it: the launcher's front door on the public ports,
    tritonserver behind it on loopback (`internal_*_url`), supervised."""

    internal_grpc_url: str = ""
    internal_http_url: str = ""

    def tritonserver_pid(self) -> int | None:
        """The tritonserver the launcher started last (it logs each start)."""
        started = re.findall(r"tritonserver started \(pid (\d+)\)", self.log())
        return int(started[-1]) if started else None

    def processes(self) -> list[int]:
        """The launcher, its tritonserver and the server's model (stub) processes."""
        server = self.tritonserver_pid()
        if not server:
            return [self.process.pid]
        try:
            stubs = [int(p) for p in Path(f"/proc/{server}/task/{server}/children").read_text().split()]
        except OSError:
            stubs = []
        return [self.process.pid, server, *stubs]

    def rss_bytes(self) -> int:
        """Resident memory of the launcher (the front door), tritonserver and its stubs together."""
        return sum(_rss_bytes(pid) for pid in self.processes())

    def shm_bytes(self) -> int:
        """/dev/shm in use by the server's regions (every file its tritonserver maps there)."""
        server = self.tritonserver_pid()
        maps = Path(f"/proc/{server}/maps").read_text() if server else ""
        files = set(re.findall(r"(/dev/shm/\S+)$", maps, re.M))
        return sum(os.stat(f).st_blocks * 512 for f in files if os.path.exists(f))

    def stop(self) -> None:
        child = self.tritonserver_pid()
        super().stop()
        if child and _rss_bytes(child):  # never left behind, even by a launcher that was killed
            os.kill(child, signal.SIGKILL)


def _rss_bytes(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) * 1024 if found else 0


def start_front_door(workdir: Path, model_repository: Path, checkpoint_dir: Path, extra_args=()) -> FrontDoorServer:
    """Start the launcher (`python -m auk_triton.front_door.launcher`) on free loopback ports and wait
    until its front door reports ready."""
    pytest.importorskip("aiohttp")
    launcher = pytest.importorskip("auk_triton.front_door.launcher")
    try:
        launcher.tritonserver_executable()
    except launcher.TritonNotFound as err:
        pytest.skip(f"tritonserver is not available: {err}")
    http, grpc, metrics, internal_http, internal_grpc = _free_ports(5)
    env = dict(
        os.environ, AUK_CHECKPOINT=str(checkpoint_dir), AUK_DEVICE="cpu", AUK_MODEL_REPOSITORY=str(model_repository),
        AUK_ADDRESS="127.0.0.1", AUK_HTTP_PORT=str(http), AUK_GRPC_PORT=str(grpc), AUK_METRICS_PORT=str(metrics),
        AUK_INTERNAL_HTTP_PORT=str(internal_http), AUK_INTERNAL_GRPC_PORT=str(internal_grpc),
    )
    env.setdefault("AUK_CACHE_DIR", str(workdir / "cache"))
    log_path = workdir / f"launcher-{http}.log"
    _server_logs.append(log_path)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "auk_triton.front_door.launcher", "--exit-timeout-secs=5", *extra_args],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    server = FrontDoorServer(
        grpc_url=f"127.0.0.1:{grpc}", http_url=f"127.0.0.1:{http}", metrics_url=f"127.0.0.1:{metrics}",
        checkpoint_dir=Path(checkpoint_dir), model_repository=Path(model_repository), log_path=log_path,
        process=process, first_tile_frames=served_first_window(Path(model_repository)),
        internal_grpc_url=f"127.0.0.1:{internal_grpc}", internal_http_url=f"127.0.0.1:{internal_http}",
    )
    wait_until_ready(server, "the launcher")
    return server


def wait_until_ready(server: TritonServer, what: str = "tritonserver", timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not server.is_ready():
        if server.process.poll() is not None:
            pytest.fail(f"{what} exited with status {server.process.returncode} while starting:\n{server.log()[-6000:]}")
        if time.monotonic() > deadline:
            server.stop()
            pytest.fail(f"{what} was not ready after {timeout_s:.0f} s:\n{server.log()[-6000:]}")
        time.sleep(0.25)


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory) -> Path:
    synthetic = pytest.importorskip("auk_triton.codec.synthetic")
    return synthetic.write_synthetic_checkpoint(tmp_path_factory.mktemp("checkpoint") / "small", preset="small", seed=0)


@pytest.fixture(scope="session")
def launch_triton(tmp_path_factory):
    """Start a server: launch_triton(name, checkpoint_dir, models=..., extra_args=...); all stop at the end."""
    servers = []

    def launch(name: str, checkpoint_dir: Path, models=DECODE_MODELS, extra_args=()) -> TritonServer:
        workdir = tmp_path_factory.mktemp(name)
        repository = copy_model_repository(workdir / "model_repository", models=models)
        servers.append(start_triton(workdir, repository, checkpoint_dir, extra_args))
        return servers[-1]

    yield launch
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def triton(launch_triton, small_checkpoint) -> TritonServer:
    return launch_triton("triton", small_checkpoint)


@pytest.fixture(scope="session")
def front_door(tmp_path_factory, small_checkpoint) -> FrontDoorServer:
    """The launcher's front door and its tritonserver, both decode models, max_frames FRONT_MAX_FRAMES."""
    workdir = tmp_path_factory.mktemp("front_door")
    repository = copy_model_repository(workdir / "model_repository", parameters={"max_frames": FRONT_MAX_FRAMES})
    server = start_front_door(workdir, repository, small_checkpoint)
    yield server
    server.stop()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not (terminalreporter.stats.get("failed") or terminalreporter.stats.get("error")):
        return
    for path in _server_logs:
        if path.is_file():
            terminalreporter.section(f"tritonserver log {path.name}")
            terminalreporter.write(path.read_text(errors="replace")[-20000:] + "\n")


# ---- clients ----------------------------------------------------------------------------


@dataclass
class StreamOutcome:
    """What one streamed request got back, in arrival order."""

    tiles: list  # (START_SAMPLE, WAVEFORM) per tile response
    # In order: "tile", "tile+final" (a tile carrying the final flag), "final" (an
    # empty final response) or "error".
    events: list
    error: str | None = None

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1] in ("tile+final", "final", "error")

    def waveform(self):
        import numpy as np

        return np.concatenate([wave for _, wave in self.tiles]) if self.tiles else np.zeros(0, np.float32)


class DecodeStream:
    """One gRPC stream (tritonclient) to a decoupled model."""

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        import queue

        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self._events = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self._events.put((result, error)), headers=headers)
        self._pending: dict[str, StreamOutcome] = {}

    def send(
        self, latents, request_id: str = "0", model: str = "auk_vae_decode", datatype: str | None = None,
        outputs: list[str] | None = None,
    ):
        """Send one request; `outputs` names the outputs to ask for (None: all, Triton's default)."""
        from tritonclient.utils import np_to_triton_dtype

        tensor = self._grpc.InferInput("LATENTS", list(latents.shape), datatype or np_to_triton_dtype(latents.dtype))
        tensor.set_data_from_numpy(latents)
        requested = None if outputs is None else [self._grpc.InferRequestedOutput(name) for name in outputs]
        self._pending[request_id] = StreamOutcome(tiles=[], events=[])
        self.client.async_stream_infer(
            model, [tensor], outputs=requested, request_id=request_id, enable_empty_final_response=True
        )

    def next_event(self, timeout: float) -> tuple[str, StreamOutcome]:
        """Wait for one response; record it on its request and return (request id, outcome)."""
        result, error = self._events.get(timeout=timeout)
        if error is not None:
            # Errors carry no request id: only unambiguous with one request in flight.
            open_ids = [rid for rid, outcome in self._pending.items() if not outcome.finished]
            assert len(open_ids) == 1, f"error {error} with requests {open_ids} in flight"
            outcome = self._pending[open_ids[0]]
            outcome.events.append("error")
            outcome.error = str(error)
            return open_ids[0], outcome
        response = result.get_response()
        outcome = self._pending[response.id]
        final = response.parameters["triton_final_response"].bool_param
        if response.outputs:
            outcome.events.append("tile+final" if final else "tile")
            names = {output.name for output in response.outputs}
            assert len(names & {"WAVEFORM", "WAVEFORM_PCM16"}) == 1, f"one waveform per tile response, got {names}"
            wave = result.as_numpy("WAVEFORM_PCM16" if "WAVEFORM_PCM16" in names else "WAVEFORM")
            outcome.tiles.append((int(result.as_numpy("START_SAMPLE")[0]), wave))
        else:
            assert final, "only the final response may come without tensors"
            outcome.events.append("final")
        return response.id, outcome

    def collect(self, timeout: float = 120.0) -> dict[str, StreamOutcome]:
        """Wait until every request sent so far has finished."""
        deadline = time.monotonic() + timeout
        while not all(outcome.finished for outcome in self._pending.values()):
            self.next_event(max(0.1, deadline - time.monotonic()))
        return dict(self._pending)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def decode_once(url: str, latents, request_id: str = "0") -> StreamOutcome:
    """One streamed decode on a stream of its own, to the end."""
    stream = DecodeStream(url)
    try:
        stream.send(latents, request_id=request_id)
        return stream.collect()[request_id]
    finally:
        stream.close()


@pytest.fixture
def open_stream(triton):
    """A factory of gRPC streams to the session's server, closed after the test."""
    streams = []

    def factory() -> DecodeStream:
        streams.append(DecodeStream(triton.grpc_url))
        return streams[-1]

    yield factory
    for stream in streams:
        try:
            stream.close()
        except Exception:
            pass


def unregister_shared_memory(client, names, timeout_s: float = 10.0) -> None:
    """Unregister the system shared memory regions `names`, with either tritonclient, and check
    the server lists none of them after. Triton may release an answered request a moment after
    its response arrives, and refuses to unregister a region such a request still holds ("it is
    currently in use"), so a refused region is asked again until `timeout_s`: one still held
    then is leaked."""
    from tritonclient.utils import InferenceServerException

    pending, deadline = list(names), time.monotonic() + timeout_s
    while pending:
        for name in list(pending):
            try:
                client.unregister_system_shared_memory(name)
                pending.remove(name)
            except InferenceServerException as error:
                if "in use" not in str(error) or time.monotonic() > deadline:
                    raise
        time.sleep(0.05 if pending else 0)
    assert not set(names) & registered_shared_memory(client)


def registered_shared_memory(client) -> set[str]:
    """The names of the system shared memory regions the server lists, with either tritonclient."""
    import tritonclient.grpc as grpcclient

    if isinstance(client, grpcclient.InferenceServerClient):
        return set(client.get_system_shared_memory_status(as_json=True).get("regions", {}))
    return {region["name"] for region in client.get_system_shared_memory_status()}


@pytest.fixture
def http_client(triton):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton.http_url, connection_timeout=120, network_timeout=300)
    yield client
    client.close()


@pytest.fixture(scope="session")
def reference_vae(small_checkpoint):
    from auk_triton.codec.vae import AuKVAE

    return AuKVAE.from_pretrained(small_checkpoint)


# ---- what the server must send back -----------------------------------------------------


def library_tiles(vae, latents, server) -> list:
    """The library's tiled decode with the server's tile size and first window: (start sample,
    waveform) per tile."""
    import torch

    from auk_triton.codec.decode_graph import AuKVAEDecodeGraph

    graph = AuKVAEDecodeGraph(vae, tile_frames=server.tile_frames, first_tile_frames=server.first_tile_frames)
    with torch.no_grad():
        return [
            (start * vae.hop_size, wave[0].clone().numpy())
            for start, wave in graph.decode_tiles(torch.from_numpy(latents)[None])
        ]


def documented_pcm16(wave):
    """docs/client.md's conversion, written out here independently of the code under test:
    clip to [-1, 1], round(x * 32767) to nearest, ties to even."""
    import numpy as np

    return np.round(np.clip(wave, -1.0, 1.0).astype(np.float64) * 32767.0).astype(np.int16)
