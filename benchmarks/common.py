"""What the benchmark scripts share; not run itself.

The scripts import it as `common` (run as `python3 benchmarks/<script>.py`, this
folder is the first entry of the module path): the seeded synthetic checkpoint,
seeded clip latents, the DiT's recipes, the decode as served, timing with CUDA
events, and a real `tritonserver` on a copy of `model_repository/` with free
loopback ports, alone or behind the front door (the launcher).
"""

from __future__ import annotations

import datetime
import io
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from auk_triton.codec import DEFAULT_COMPILE_SHAPES, AuKVAE, AuKVAEDecodeGraph, activation_kernel_for
from auk_triton.codec.cudnn_timing import time_convolutions
from auk_triton.codec.pcm16 import to_pcm16
from auk_triton.codec.synthetic import write_synthetic_checkpoint
from auk_triton.diffusion.sampler import DEFAULTS
from auk_triton.diffusion.synthetic import FLASH_T_GRID, write_synthetic_dit_checkpoint
from auk_triton.serving.config import GPU_DECODE_PRECISION, DecodeSettings
from auk_triton.serving.readiness import BUILD_AFTER_READY, BUILT_AFTER_READY

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
SEED = 0
LATENT_DIM = 64
FRAMES_PER_SECOND = 50
SAMPLES_PER_FRAME = 480
MODEL, OFFLINE_MODEL = "auk_vae_decode", "auk_vae_decode_offline"
# The decode model reports its counters this long after a request ends, at most.
MODEL_METRICS_LAG_S = 0.1
FLOOR_MODEL = "auk_vae_floor"  # floor_model.py, where a script adds it


def say(line: str = "") -> None:
    print(line, flush=True)


def where(device: str = "cuda") -> str:
    """The GPU's name, or the CPU and its core count."""
    return torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"


def heading(title: str, device: str = "cuda", extra: str = "") -> str:
    """A results heading: what, on which device, torch (and `extra`), today's date."""
    return f"# {title}, {where(device)}, torch {torch.__version__}{extra}, {datetime.date.today()}"


# ---- weights and inputs ----------------------------------------------------------------------


def synthetic_checkpoint(directory: Path | str | None = None, preset: str = "auk", dit: bool = False) -> Path:
    """The seeded synthetic checkpoint of `preset` in `directory` (a new temporary folder when
    None), written once: the codec, and with `dit` the DiT's base weights beside it."""
    if directory is None:
        directory = tempfile.mkdtemp(prefix="auk-bench-")
    path = write_synthetic_checkpoint(Path(directory), preset=preset, seed=SEED)
    if dit:
        write_synthetic_dit_checkpoint(path, preset=preset, seed=SEED, variant="base")
    return path


def recipe_checkpoints(root: Path, preset: str) -> dict[str, Path]:
    """One base and one flash checkpoint directory; the flash one links the base one's weights."""
    base = synthetic_checkpoint(root / f"{preset}-base", preset, dit=True)
    flash = root / f"{preset}-flash"
    flash.mkdir(exist_ok=True)
    for name in ("vae.safetensors", "auk.safetensors"):
        if not (flash / name).exists():
            (flash / name).symlink_to((base / name).resolve())
    config = json.loads((base / "config.json").read_text())
    config["variant"] = "flash"
    (flash / "config.json").write_text(json.dumps(config, indent=1))
    return {"base": base, "flash": flash}


def recipes(base_steps: int = 32) -> dict[str, dict]:
    """The DiT's recipes as a request asks for them (`auk_client.pipeline`'s knobs): `flash`
    (a flash checkpoint, its fixed 4-step recipe: no knob) and `base` (`base_steps` Euler
    steps, classifier-free guidance 2, the default sway)."""
    return {"flash": {}, "base": dict(num_steps=base_steps, guidance=2.0, sway=-1.0)}


def sampler_config(model, variant: str = "base") -> dict:
    """The sampler's config for a DiT built in memory: the checkpoint's as the synthetic one writes it."""
    return {"vae": {"latent_dim": model.latent_dim}, "variant": variant, "flash_t_grid": FLASH_T_GRID,
            "defaults": DEFAULTS}


def served_decoder_options(device: str, precision: str = GPU_DECODE_PRECISION) -> dict:
    """`AuKVAE.configure_decoder`'s options as the decode models use them by default: on a GPU
    the fused activation kernel with its launch for that precision, channels-last signals and the
    default precision (`precision`: fp16 or tf32). For fp16 it also turns on cuDNN's
    timing with the decoder's errata file, as the models do."""
    if device != "cuda":
        return {}
    if precision == "fp16":
        time_convolutions()
    else:
        torch.backends.cudnn.benchmark = False
    dtype = torch.float16 if precision == "fp16" else torch.float32
    return {"activation_kernel": activation_kernel_for(dtype), "channels_last": True, "dtype": dtype}


def served_graph(checkpoint: Path, settings: DecodeSettings, precompiled: Path | None = None,
                 stream_priority: int | None = None) -> AuKVAEDecodeGraph:
    """The graph wrapper as the decode model builds it on a GPU (decode_model.initialize); with
    `precompiled`, the decode's trace saved there and loaded by later runs, as the model keeps it;
    with `stream_priority`, its graphs captured for a stream of that priority (the pipeline's)."""
    vae = AuKVAE.from_pretrained(checkpoint, device="cuda", **served_decoder_options("cuda"))
    return AuKVAEDecodeGraph(
        vae, enabled=settings.enable_cuda_graphs, frame_alignment=settings.frame_alignment,
        max_graphs=settings.max_graphs, compile_shapes=settings.buckets(), tile_frames=settings.tile_frames,
        first_tile_frames=settings.first_window_frames(), batch_sizes=settings.batch_sizes,
        batch_frames=settings.batch_frames, compile_dynamic=settings.compile_dynamic, precompiled=precompiled,
        stream_priority=stream_priority,
    )


def latents(frames: int, device: str = "cpu", seed: int = SEED) -> torch.Tensor:
    """Seeded normalized latents of one clip, [1, frames, 64], the same on every device."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, frames, LATENT_DIM, generator=generator).to(device)


def clip_latents(seconds: float, seed: int = SEED) -> np.ndarray:
    """`latents` of a clip of `seconds` as a request sends them, [frames, 64]."""
    return latents(int(seconds * FRAMES_PER_SECOND), seed=seed)[0].numpy()


# ---- timing ----------------------------------------------------------------------------------


def median_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` by CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def replay_ms(graph: AuKVAEDecodeGraph, frames: int, rows: int, iters: int) -> float:
    """Median ms of `decode_rows` of `rows` windows of `frames` (seeded latents)."""
    batch = [latents(frames, "cuda", seed=SEED + 100 + row) for row in range(rows)]
    return median_ms(lambda: graph.decode_rows(batch), iters=iters)


def copy_bandwidth() -> float:
    """A device-to-device copy of 1 GiB, bytes read + written per second."""
    src = torch.empty(2**28, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() * 4 / (ms / 1e3)


def compile_time_breakdown(top: int = 16) -> str:
    """The `top` longest phases of torch.compile in this process so far (Dynamo's cumulative
    metrics: tracing, AOT, Inductor codegen, kernel compilation), to see where a build's time goes."""
    from torch._dynamo.utils import compile_times

    phases = []
    for line in str(compile_times(repr="str", aggregate=True)).splitlines():
        name, _, seconds = line.rpartition(",")
        try:
            phases.append((float(seconds), name.strip()))
        except ValueError:  # the title and header lines
            continue
    phases.sort(reverse=True)
    return "; ".join(f"{name} {seconds:.1f} s" for seconds, name in phases[:top])


def poisson(rate: float, duration: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process of `rate` per second over `duration` seconds."""
    draws, offsets, at = random.Random(seed), [], 0.0
    while (at := at + draws.expovariate(rate)) < duration:
        offsets.append(at)
    return offsets


def percentile(values, q: float) -> float:
    """The q-th percentile of `values` (numpy's linear interpolation); NaN when there are none."""
    return float(np.percentile(np.asarray(values), q)) if len(values) else float("nan")


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


# ---- the decode as served, in this process ---------------------------------------------------


def in_process_decode(
    checkpoint: Path, seconds_list, reps: int, first_tile_frames: int | None, device: str, formats,
    check_seconds: float, buckets=DEFAULT_COMPILE_SHAPES,
) -> tuple[dict, dict]:
    """The served decode in this process: the graph wrapper the model uses with its decoder
    options, `buckets` compiled, tiles copied to (pinned) host memory as the model does
    (pcm16: converted to int16 on the device first, as for WAVEFORM_PCM16).

    Returns, per format, median (first tile ms, total ms) per clip length plus "one_tile_ms"
    and "tile_frames"; and per format the stitched samples of `clip_latents(check_seconds)`,
    to compare the server's with."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    vae = AuKVAE.from_pretrained(checkpoint, device=device, **served_decoder_options(device))
    graph = AuKVAEDecodeGraph(vae, compile_shapes=tuple(buckets), first_tile_frames=first_tile_frames or None)
    graph.warmup(device, on_bucket=lambda frames, seconds, ok: say(
        f"in-process bucket {frames} frames: {'built' if ok else 'FAILED'} in {seconds:.0f} s"))
    if cuda:
        say(f"in-process compile phases: {compile_time_breakdown()}")
    results, references = {}, {}
    for fmt in formats:
        convert = to_pcm16 if fmt == "pcm16" else None
        results[fmt] = {}
        for seconds in seconds_list:
            clip = latents(int(seconds * FRAMES_PER_SECOND), device)
            firsts, totals = [], []
            for rep in range(reps + 2):
                sync()
                began = time.perf_counter()
                first = None
                # The model's own loop: tiles to host memory, the next launched first on a GPU.
                for _ in graph.host_tiles(clip, convert, look_ahead=cuda):
                    if first is None:
                        first = time.perf_counter() - began
                total = time.perf_counter() - began
                if rep >= 2:
                    firsts.append(first * 1e3)
                    totals.append(total * 1e3)
            results[fmt][seconds] = (statistics.median(firsts), statistics.median(totals))
        clip = torch.from_numpy(clip_latents(check_seconds))[None].to(device)
        references[fmt] = torch.cat([tile.samples for tile in graph.host_tiles(clip, convert)]).numpy()
    one_tile = latents(graph.tile_frames, device, seed=SEED + 1)
    tile_times = []
    for _ in range(20 if cuda else 4):
        sync()
        began = time.perf_counter()
        graph(one_tile).cpu()
        tile_times.append((time.perf_counter() - began) * 1e3)
    one_tile_ms = statistics.median(tile_times[len(tile_times) // 4:])
    for fmt in formats:
        results[fmt]["one_tile_ms"] = one_tile_ms
        results[fmt]["tile_frames"] = graph.tile_frames
    del graph, vae
    if cuda:
        torch.cuda.empty_cache()
    return results, references


# ---- a real server ---------------------------------------------------------------------------


def perf_analyzer_script() -> Path:
    """run_perf_analyzer.py, beside these scripts: it drives perf_analyzer."""
    return HERE / "run_perf_analyzer.py"


def model_repository_copy(dest: Path, buckets=None, decoding_model: str = MODEL,
                          project_root: Path = REPO_ROOT) -> Path:
    """A copy of `project_root`'s model_repository/ in `dest`; with `buckets`, `decoding_model`
    compiles those (the compile_shapes parameter of every config file of it: the decode model,
    which the offline model forwards to, or the pipeline, which decodes in its own process)."""
    shutil.copytree(project_root / "model_repository", dest, ignore=shutil.ignore_patterns("__pycache__"))
    if buckets is not None:
        shapes = ",".join(str(b) for b in buckets)
        for config in (dest / decoding_model).glob("**/*.pbtxt"):
            text, count = re.subn(r'(key: "compile_shapes", value: \{ string_value: )"[^"]*"',
                                  rf'\1"{shapes}"', config.read_text())
            if count != 1:
                raise RuntimeError(f"no compile_shapes parameter in {config}")
            config.write_text(text)
    return dest


def add_floor_model(repository: Path, wait_ms: float, max_frames: int, device: str, record_to: Path | None = None) -> None:
    """`floor_model.py` as FLOOR_MODEL in `repository`, with auk_vae_decode's tensors: it waits
    `wait_ms` per request and answers zeros (`record_to`: where it writes its waits)."""
    folder = repository / FLOOR_MODEL
    (folder / "1").mkdir(parents=True)
    shutil.copy(HERE / "floor_model.py", folder / "1" / "model.py")
    parameters = {"wait_ms": f"{wait_ms:.4f}", "max_frames": str(max_frames), "record_to": str(record_to or "")}
    parameters = ",\n".join(f'  {{ key: "{key}", value: {{ string_value: "{value}" }} }}'
                             for key, value in parameters.items())
    kind = "KIND_GPU" if device == "cuda" else "KIND_CPU"
    (folder / "config.pbtxt").write_text(f'''name: "{FLOOR_MODEL}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "LATENTS", data_type: TYPE_FP32, dims: [ -1, 64 ] }} ]
output [
  {{ name: "WAVEFORM", data_type: TYPE_FP32, dims: [ -1 ] }},
  {{ name: "WAVEFORM_PCM16", data_type: TYPE_INT16, dims: [ -1 ] }},
  {{ name: "START_SAMPLE", data_type: TYPE_INT64, dims: [ 1 ] }}
]
instance_group [ {{ kind: {kind}, count: 1 }} ]
parameters [
{parameters}
]
''')


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def revision_commit(revision: str) -> str | None:
    """The commit `revision` (a commit, tag or branch) names in this repository, or None."""
    found = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
                           capture_output=True, text=True)
    return found.stdout.strip() or None


def revision_tree(revision: str, dest: Path) -> Path:
    """This repository's files at `revision` (a commit, tag or branch), as `git archive` writes
    them, in `dest`: an earlier version to serve beside today's (`start_launcher`'s project_root)."""
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", "--format=tar", revision], capture_output=True)
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {revision}: {archive.stderr.decode(errors='replace').strip()}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def start_server(checkpoint: Path, cache: Path, log_path: Path, models=(MODEL,), ready_timeout_s: float = 480,
                 device: str = "gpu", model_repository: Path | None = None, extra_args=()):
    """A real tritonserver on free loopback ports, serving `models` (AUK_MODELS) of `model_repository`
    (default: the project's) on the `device` config ("gpu" or "cpu"), with `extra_args` for tritonserver.

    Returns the process and the gRPC, HTTP and metrics addresses."""
    from auk_triton.front_door.launcher import server_command

    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    env = dict(os.environ, AUK_CHECKPOINT=str(checkpoint), AUK_CACHE_DIR=str(cache), AUK_DEVICE=device,
               AUK_MODELS=",".join(models))
    argv, env = server_command(model_repository, ports=ports, env=env,
                               extra_args=["--exit-timeout-secs=5", *extra_args])
    log = open(log_path, "w")
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(process, f"127.0.0.1:{ports['http']}", models, log_path, ready_timeout_s, "tritonserver")
        return process, f"127.0.0.1:{ports['grpc']}", f"127.0.0.1:{ports['http']}", f"127.0.0.1:{ports['metrics']}"
    except BaseException:  # not ready, or Ctrl-C while waiting: the caller never gets the process to stop
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        raise


def start_launcher(checkpoint: Path, cache: Path, log_path: Path, models=(MODEL,), ready_timeout_s: float = 600,
                   device: str = "gpu", model_repository: Path | None = None, extra_args=(),
                   project_root: Path = REPO_ROOT):
    """The server as users start it (`make serve`): `python -m auk_triton.front_door.launcher`,
    the front door on free loopback ports and tritonserver behind it on free internal ones,
    serving `models` of `model_repository` (default: the project's) on the `device` config,
    with `extra_args` for tritonserver, its output in `log_path`. A tritonserver that exits
    ends the launcher (AUK_RESTART=off) rather than being restarted. `project_root`: whose
    code serves, this checkout's or an earlier revision's (`revision_tree`); the launcher runs
    in it, first on the module path of every process it starts.

    Returns the process and the public and internal ports ("http", "grpc", "metrics"; the
    metrics port is tritonserver's own, public) once every model answers READY through the
    front door."""
    public = {kind: free_port() for kind in ("http", "grpc", "metrics")}
    internal = {kind: free_port() for kind in ("http", "grpc")}
    project_root = Path(project_root).absolute()
    env = dict(
        os.environ, AUK_CHECKPOINT=str(Path(checkpoint).absolute()), AUK_CACHE_DIR=str(Path(cache).absolute()),
        AUK_DEVICE=device, AUK_MODELS=",".join(models),
        AUK_MODEL_REPOSITORY=str(Path(model_repository or project_root / "model_repository").absolute()),
        AUK_ADDRESS="127.0.0.1", AUK_RESTART="off",
        PYTHONPATH=os.pathsep.join(filter(None, (str(project_root), os.environ.get("PYTHONPATH")))),
        **{f"AUK_{k.upper()}_PORT": str(v) for k, v in public.items()},
        **{f"AUK_INTERNAL_{k.upper()}_PORT": str(v) for k, v in internal.items()},
    )
    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable, "-m", "auk_triton.front_door.launcher", "--exit-timeout-secs=5",
                                *extra_args], env=env, cwd=project_root, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(process, f"127.0.0.1:{public['http']}", models, log_path, ready_timeout_s, "the launcher")
        return process, public, internal
    except BaseException:  # not ready, or Ctrl-C while waiting: the caller never gets the process to stop
        if process.poll() is None:
            process.terminate()  # the launcher stops its tritonserver first; a kill would leave it running
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
        raise


def wait_ready(process: subprocess.Popen, http_url: str, models, log_path: Path, timeout_s: float, what: str) -> None:
    """Poll until every model answers READY on `http_url` (`what` serves it), then until the
    graphs the models left for after READY are built (`wait_built`), then print the start-up
    lines of `log_path`; raise if `process` exits first or `timeout_s` passes.

    A new HTTP connection per poll, as a readiness probe makes: a gRPC channel that kept
    failing to connect while the server warmed up backs off, for tens of seconds by then."""
    began = time.perf_counter()
    while time.perf_counter() - began < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}; see {log_path}")
        if all(model_ready(http_url, model) for model in models):
            ready = time.perf_counter()
            say(f"ready through {what} in {ready - began:.1f} s")
            wait_built(process, log_path, BUILT_TIMEOUT_S)
            say(f"its start-up, from the log ({time.perf_counter() - ready:.1f} s after READY):")
            for line in startup_lines(log_path):
                say(f"  {line}")
            return
        time.sleep(0.5)
    raise RuntimeError(f"not ready through {what} after {timeout_s:g} s; see {log_path}")


# A steady-state benchmark waits this long at most for the graphs built after READY (the DiT's
# take minutes), then measures anyway, saying so.
BUILT_TIMEOUT_S = 900.0
MODEL_LOG_LINE = re.compile(r"\b(auk_\w+): ")


def builds_pending(log_text: str) -> set[str]:
    """The models whose log left graphs for after READY and has not said yet that they are built
    (as many times: auk_pipeline's two stages each say both)."""
    pending: dict[str, int] = {}
    for line in log_text.splitlines():
        match = MODEL_LOG_LINE.search(line)
        if match is None:
            continue
        if BUILD_AFTER_READY in line:
            pending[match[1]] = pending.get(match[1], 0) + 1
        elif BUILT_AFTER_READY in line:
            pending[match[1]] = pending.get(match[1], 0) - 1
    return {model for model, count in pending.items() if count > 0}


def wait_built(process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Wait until no model of the server's log has graphs left to build after READY: until then
    a request may meet another tier, and the builders share the GPU, so what a benchmark of the
    steady state measured would be neither."""
    began = time.perf_counter()
    while (pending := builds_pending(Path(log_path).read_text(errors="replace"))):
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log_path}")
        if time.perf_counter() - began > timeout_s:
            say(f"WARNING: {', '.join(sorted(pending))} still building graphs {timeout_s:g} s after READY; "
                "measuring anyway")
            return
        time.sleep(1.0)


def model_ready(http_url: str, model: str) -> bool:
    """Whether `model` answers READY on the server's HTTP port (False while nothing listens)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/ready", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


# A Triton log line: severity, MMDD, time of day, thread, source file:line, message.
LOG_LINE = re.compile(r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) +\d+ (\S+?):\d+\] (.*)$")
# Where a model's start-up shows in the log: Triton loading it, the Python backend starting
# its instance, and the model's own lines (loaded, buckets, ready).
STARTUP_SOURCES = ("model_lifecycle.cc", "python_be.cc", "triton_common.py")


def startup_lines(log_path: Path) -> list[str]:
    """The log's start-up lines, each with its seconds since the log's first line."""
    first, lines = None, []
    for text in Path(log_path).read_text(errors="replace").splitlines():
        match = LOG_LINE.match(text)
        if match is None:
            continue
        hours, minutes, seconds, source, message = match.groups()
        at = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
        first = at if first is None else first
        if source in STARTUP_SOURCES:
            lines.append(f"{(at - first) % 86400:7.1f} s {message.strip(chr(34))}")
    return lines


def model_seconds(metrics_url: str, model: str = MODEL) -> tuple[float, float, float] | None:
    """(tiles sent, seconds decoding them, seconds in sends) so far, from `model`'s own counters on
    Triton's metrics port (auk_vae_tiles_sent_total, auk_vae_decode_seconds_total summed over tiers,
    auk_vae_send_seconds_total); None if absent. A tile's decode seconds are the time `host_tiles`
    spends launching its window and waiting for its samples in host memory. The model
    reports its counters a few milliseconds after each request ends (MODEL_METRICS_LAG_S)."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=5).read().decode()
    except OSError as err:
        say(f"no metrics from {metrics_url}: {err}")
        return None
    totals = {"auk_vae_tiles_sent_total": 0.0, "auk_vae_decode_seconds_total": 0.0,
              "auk_vae_send_seconds_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in totals and f'model="{model}"' in line:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return tuple(totals.values())


# ---- Triton's request traces ------------------------------------------------------------------
# tritonserver started with `trace_arguments` records every request's timestamps (level
# TIMESTAMPS, rate 1) and writes them as it stops: nanoseconds of the steady clock,
# CLOCK_MONOTONIC, the clock of the clients' perf_counter, so a request's steps can be placed
# against its client's send. An ensemble's steps are requests of their own, each with its
# parent's trace id.


def trace_arguments(trace_file: Path) -> list[str]:
    return [f"--trace-config=triton,file={Path(trace_file).absolute()}", "--trace-config=rate=1",
            "--trace-config=level=TIMESTAMPS", "--trace-config=triton,log-frequency=0"]


@dataclass
class TracedRequest:
    model: str
    request_id: str
    parent: int | None  # the ensemble request's trace id, for an ensemble step
    stamps: list[tuple[str, int]]  # (name, ns), in time order

    def first(self, name: str) -> int | None:
        return next((ns for found, ns in self.stamps if found == name), None)


def executes(spans) -> dict[int, list[int]]:
    """A model's executes from its requests' traced (COMPUTE_START, COMPUTE_END) ns, a pair
    with a stamp missing (None) skipped: the requests of one execute share its start.
    Start -> [its last end, its requests]."""
    found: dict[int, list[int]] = {}
    for start, end in spans:
        if start is None or end is None:
            continue
        execute = found.setdefault(start, [end, 0])
        execute[0], execute[1] = max(execute[0], end), execute[1] + 1
    return found


def read_traces(trace_file: Path) -> dict[int, TracedRequest]:
    """Trace id -> what Triton traced of that request ({} when it wrote nothing)."""
    if not trace_file.exists():
        return {}
    traced: dict[int, TracedRequest] = {}
    stamps: dict[int, list[tuple[str, int]]] = {}
    for entry in json.loads(trace_file.read_text() or "[]"):
        if "model_name" in entry:  # each trace's first entry
            traced[entry["id"]] = TracedRequest(entry["model_name"], entry.get("request_id", ""),
                                                entry.get("parent_id"), [])
        stamps.setdefault(entry["id"], []).extend((s["name"], int(s["ns"])) for s in entry.get("timestamps", []))
    for key, request in traced.items():
        request.stamps = sorted(stamps.get(key, []), key=lambda stamp: stamp[1])
    return traced
