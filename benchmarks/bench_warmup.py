r"""The decode model's warm-up in process, pass by pass, and the replay time of every graph it captured.

Each pass is a new Python process (cuDNN keeps its algorithm choices per process, and
Dynamo its traces), on one compile-cache folder (`--cache-dir`; by default a new empty
one, so the first pass is cold and the rest warm). A pass builds the decoder as the
streaming model does on a GPU (its default settings, fp16 with cuDNN's benchmark),
times `AuKVAEDecodeGraph.warmup` bucket by bucket, then times a replay of each bucket
and batched graph. `--limits` gives each pass's `torch.backends.cudnn.benchmark_limit`
(how many convolution algorithms cuDNN times per shape): the passes show what a limit
saves at start-up and what it costs the graphs. `--batch-frames` sets the decoder's
(2048: the 512-frame bucket batches 2 and 4 rows too) and also times the largest bucket
as a plain graph of one row, what its batched rows are made of. Weights are a seeded
synthetic checkpoint (not real audio).

    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_warmup.py --limits served served 4 2
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from auk_triton.codec import AuKVAEDecodeGraph
from auk_triton.serving.config import DecodeSettings, use_compile_cache
from common import (compile_time_breakdown, heading, latents, median_ms, replay_ms, say, served_graph,
                    synthetic_checkpoint)

SERVED = "served"  # as the decode model runs: it leaves torch's default limit


def one_pass(cache: Path, preset: str, limit: str, iters: int, batch_frames: int | None = None) -> dict:
    """Build and warm up the served graphs in this process (`batch_frames`: that setting instead of
    the model's); their timings as a dict."""
    use_compile_cache(cache)
    checkpoint = synthetic_checkpoint(cache / "checkpoint", preset)
    began = time.perf_counter()
    settings = DecodeSettings(batch_frames=batch_frames)
    graph = served_graph(checkpoint, settings)
    if limit != SERVED:
        torch.backends.cudnn.benchmark_limit = int(limit)
    loaded = time.perf_counter() - began
    buckets = {}
    began = time.perf_counter()
    graph.warmup("cuda", on_bucket=lambda frames, seconds, ok: buckets.update({frames: round(seconds, 1)}))
    warmup = time.perf_counter() - began
    replays = {}
    for frames in graph.compile_shapes:
        for rows in [b for b in graph.batch_sizes if b <= graph.batch_capacity(frames)]:
            replays[f"{frames} x {rows}"] = round(replay_ms(graph, frames, rows, iters), 3)
    if batch_frames:  # what a batched row is against besides the compiled bucket: the same kernels, one row
        largest = max(graph.compile_shapes)
        plain, clip = AuKVAEDecodeGraph(graph.vae, compile_shapes=()), latents(largest, "cuda")
        replays[f"{largest} x 1, plain graph"] = round(median_ms(lambda: plain(clip), iters), 3)
    return {"limit": torch.backends.cudnn.benchmark_limit, "loaded_s": round(loaded, 1), "warmup_s": round(warmup, 1),
            "buckets_s": buckets, "compile": compile_time_breakdown(6), "replay_ms": replays}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits", nargs="+", default=[SERVED, SERVED],
                        help=f"each pass's cuDNN benchmark_limit, or {SERVED!r} for the model's (default: two passes "
                             "as served, cold then warm)")
    parser.add_argument("--preset", default="auk", help="synthetic checkpoint preset (default auk)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="compile caches and the checkpoint (default: a new empty folder: the first pass is cold)")
    parser.add_argument("--iters", type=int, default=50, help="timed replays per graph (default 50)")
    parser.add_argument("--batch-frames", type=int, default=None,
                        help="the most frames one batched replay decodes (default: the model's, one tile): 2048 "
                             "also captures and times 2 and 4 rows of the 512-frame bucket")
    parser.add_argument("--one-pass", action="store_true", help=argparse.SUPPRESS)  # a pass's own process
    args = parser.parse_args()
    if args.one_pass:
        print(json.dumps(one_pass(args.cache_dir, args.preset, args.limits[0], args.iters, args.batch_frames)))
        return
    if not torch.cuda.is_available():
        sys.exit("bench_warmup needs CUDA: the warm-up compiles and captures GPU graphs")

    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="auk-warmup-"))
    cache.mkdir(parents=True, exist_ok=True)
    cold = not (cache / "inductor").exists()
    batching = f", batch_frames {args.batch_frames}" if args.batch_frames else ""
    say(heading(f"The streaming model's warm-up in process, preset {args.preset}", "cuda",
                f", cache {cache}{batching}"))
    passes = []
    for index, limit in enumerate(args.limits):
        caches = "cold" if cold and index == 0 else "warm"
        command = [sys.executable, __file__, "--one-pass", "--limits", limit, "--preset", args.preset,
                   "--cache-dir", str(cache), "--iters", str(args.iters)]
        if args.batch_frames:
            command += ["--batch-frames", str(args.batch_frames)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"pass {index + 1} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        result = json.loads(done.stdout.splitlines()[-1])
        result["caches"] = caches
        passes.append(result)
        buckets = ", ".join(f"{frames}: {seconds}" for frames, seconds in result["buckets_s"].items())
        say(f"pass {index + 1} ({caches} compile cache, cuDNN benchmark_limit {result['limit']}): checkpoint loaded "
            f"{result['loaded_s']} s, warm-up {result['warmup_s']} s (buckets {buckets})"
            + (f"; {result['compile']}" if result["compile"] else ""))
    say()
    say("| | " + " | ".join(f"pass {i + 1}: {p['caches']}, limit {p['limit']}" for i, p in enumerate(passes)) + " |")
    say("| --- |" + " --- |" * len(passes))
    say("| warm-up (s) | " + " | ".join(str(p["warmup_s"]) for p in passes) + " |")
    for graph in passes[0]["replay_ms"]:
        say(f"| {graph} replay (ms) | " + " | ".join(str(p["replay_ms"][graph]) for p in passes) + " |")


if __name__ == "__main__":
    main()
