r"""How long the server takes to become READY, as a user starts it, with cold caches and warm.

Starts the launcher (`python -m auk_triton.front_door.launcher`: the front door and
tritonserver behind it) `--starts` times in a row, one after another, on one cache folder
(`--cache-dir`; by default a new empty one, so the first start is cold and the rest warm),
serving `--models` on `--device`'s configs, and times each start from the command to the
front door's `/v2/health/ready` answering 200 (a new connection per poll, as a probe makes).
`--artifacts-dir` points AUK_ARTIFACTS_DIR at a folder `make artifacts` filled (a fresh
machine given the artifacts: a new `--cache-dir` with an existing `--artifacts-dir`).
After each start the models' start-up lines from the server log (Triton loading each,
the Python backend starting its instance, the models' own lines) are printed with their
offsets. Weights are a seeded synthetic checkpoint written beforehand (not real audio).
`--serve-seconds` keeps each start serving that long after READY, one client asking for
10 s of audio after another through the front door (from `auk_pipeline` when it is among
the models, else decoding a clip), and reports their first audio by time since READY:
what a request meets while the deferred graphs are still being built.

    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_startup.py --models auk_vae_decode auk_vae_decode_offline
    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_startup.py \
        --device cpu --preset small --starts 1   # a check that it runs
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from auk_triton.serving.readiness import server_is_ready
from common import MODEL, free_port, heading, percentile, say, startup_lines, synthetic_checkpoint

READY_TIMEOUT_S = 900.0


def serve_after_ready(grpc_port: int, seconds: float, pipeline: bool) -> list[tuple[float, float]]:
    """One client asking for 10 s of audio back to back for `seconds` (a pipeline request of 64
    prompt tokens, or a clip to decode): (s since READY, first audio ms) each."""
    from auk_client.pipeline import random_prompt_embeds, stream_pipeline
    from auk_client.stream import random_latents, stream_decode

    url = f"127.0.0.1:{grpc_port}"
    clip, embeds = random_latents(10.0, seed=1), random_prompt_embeds(64, seed=1)
    ready, served = time.perf_counter(), []
    while time.perf_counter() - ready < seconds:
        began = time.perf_counter()
        tiles = stream_pipeline(embeds, 10.0, seed=1, url=url) if pipeline else stream_decode(clip, url=url)
        next(tiles)
        first = time.perf_counter() - began
        for _ in tiles:
            pass
        served.append((began - ready, first * 1e3))
    return served


def report_served(served: list[tuple[float, float]], window_s: float = 10.0) -> None:
    """First audio per `window_s` since READY: requests, p50, p99 and the slowest."""
    for start in range(0, int(max(at for at, _ in served)) + 1, int(window_s)):
        firsts = [ms for at, ms in served if start <= at < start + window_s]
        if firsts:
            say(f"  {start:4d}-{start + window_s:g} s after READY: {len(firsts)} requests, first audio "
                f"p50 {percentile(firsts, 50):.1f} ms, p99 {percentile(firsts, 99):.1f} ms, "
                f"slowest {max(firsts):.1f} ms")


def one_start(env: dict, log_path: Path, serve_seconds: float = 0.0, pipeline: bool = False) -> float:
    """Launch, wait for READY, serve for `serve_seconds`, stop; the seconds from the command to READY."""
    ports = {name: free_port() for name in ("HTTP", "GRPC", "METRICS", "INTERNAL_HTTP", "INTERNAL_GRPC")}
    env = dict(env, AUK_ADDRESS="127.0.0.1", **{f"AUK_{name}_PORT": str(port) for name, port in ports.items()})
    with open(log_path, "w") as log:
        began = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "auk_triton.front_door.launcher", "--exit-timeout-secs=5"],
                                   env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while not server_is_ready(ports["HTTP"]):
                if process.poll() is not None:
                    raise RuntimeError(f"the launcher exited with {process.returncode}; see {log_path}")
                if time.perf_counter() - began > READY_TIMEOUT_S:
                    raise RuntimeError(f"not READY after {READY_TIMEOUT_S:g} s; see {log_path}")
                time.sleep(0.2)
            ready = time.perf_counter() - began
            if serve_seconds > 0:
                report_served(serve_after_ready(ports["GRPC"], serve_seconds, pipeline))
            return ready
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=2, help="server starts in a row on one cache (default 2)")
    parser.add_argument("--models", nargs="+", default=[MODEL], help=f"models to load (default {MODEL})")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="the models' configs (default gpu)")
    parser.add_argument("--preset", default="auk", help="synthetic checkpoint preset (default auk)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="AUK_CACHE_DIR (default: a new empty folder: the first start is cold)")
    parser.add_argument("--artifacts-dir", type=Path, default=None,
                        help="AUK_ARTIFACTS_DIR (default: artifacts in the cache folder)")
    parser.add_argument("--serve-seconds", type=float, default=0.0,
                        help="after READY, ask for 10 s of audio (the pipeline's, else a decode) one request "
                             "after another for this long and report their first audio (default 0: stop at READY)")
    args = parser.parse_args()

    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="auk-startup-"))
    cache.mkdir(parents=True, exist_ok=True)
    artifacts = args.artifacts_dir or cache / "artifacts"
    cold = not artifacts.exists()
    checkpoint = synthetic_checkpoint(Path(tempfile.gettempdir()) / f"auk-startup-{args.preset}", args.preset,
                                      dit=any(m in ("auk_dit", "auk_pipeline", "auk_edit") for m in args.models))
    env = dict(os.environ, AUK_CHECKPOINT=str(checkpoint), AUK_CACHE_DIR=str(cache), AUK_DEVICE=args.device,
               AUK_MODELS=",".join(args.models), AUK_ARTIFACTS_DIR=str(artifacts))
    say(heading(f"Start-up to READY through the launcher: {', '.join(args.models)}, preset {args.preset}",
                "cuda" if args.device == "gpu" else "cpu", f", cache {cache}, artifacts {artifacts}"))
    rows = []
    for start in range(args.starts):
        state = "none yet" if cold and start == 0 else "present"
        log_path = cache / f"launcher-{start + 1}.log"
        seconds = one_start(env, log_path, args.serve_seconds, pipeline="auk_pipeline" in args.models)
        say(f"start {start + 1} (artifacts {state}): READY after {seconds:.1f} s; its start-up, from the log:")
        for line in startup_lines(log_path):
            say(f"  {line}")
        rows.append((start + 1, state, seconds))
    say()
    say("| start | artifacts | READY (s) |")
    say("| --- | --- | --- |")
    for start, state, seconds in rows:
        say(f"| {start} | {state} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
