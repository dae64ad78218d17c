"""Text condition to streamed audio on one GPU: the DiT alone, then the whole Triton pipeline.

Two recipes on the released dims (1.53 B DiT + the released codec, synthetic
seeded weights: the speed depends only on the geometry): `base`, 32 Euler steps
with classifier-free guidance (batch 2 per step) and the default sway, and
`flash`, the locked 4-step unguided recipe. For each:

- DiT time in this process: CUDA-synchronised wall time of `generate()` (bf16
  weights under autocast, as served), eagerly and with the velocity step replayed
  as a CUDA graph (as served), median of `--reps` after a warm-up request;
- through a real tritonserver (auk_dit + auk_vae_decode + auk_pipeline): the
  DiT's served time (a unary auk_dit request), and for auk_pipeline over a gRPC
  stream the time to first audio (first WAVEFORM tile) and the total (final flag).

    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_pipeline.py --seconds 10 --tokens 64 --reps 5
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_pipeline.py --no-server   # the in-process DiT only

The synthetic checkpoint (6.1 GB of fp32 DiT weights) is written once under
--cache-dir and reused.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from auk_triton.diffusion import Request, load_sampler
from common import heading, recipe_checkpoints, recipes, start_server

MODELS = ("auk_dit", "auk_vae_decode", "auk_pipeline")
RECIPES = recipes()


def in_process(checkpoint: Path, recipe: dict, embeds: np.ndarray, seconds: float, reps: int, graphs: int) -> float:
    """Median DiT milliseconds for one request, on cuda in bf16 (graphed steps when graphs > 0)."""
    sampler = load_sampler(checkpoint, "cuda", max_graphs=graphs)
    request = Request(torch.from_numpy(embeds), seconds, 0, **recipe)
    torch.cuda.synchronize()
    began = time.perf_counter()
    sampler.generate(request)  # warm-up: kernels, allocator, the graph capture
    torch.cuda.synchronize()
    print(f"  first request {(time.perf_counter() - began) * 1e3:.1f} ms (graphs {graphs})", flush=True)
    times = []
    for rep in range(reps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        sampler.generate(Request(torch.from_numpy(embeds), seconds, rep, **recipe))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
    del sampler
    torch.cuda.empty_cache()
    return statistics.median(times)


def served(url: str, recipe: dict, embeds: np.ndarray, seconds: float, reps: int) -> dict:
    from auk_client.pipeline import generate_latents, stream_pipeline

    dit, first, total = [], [], []
    for rep in range(reps + 1):  # the first request warms the connection and the decoder
        began = time.perf_counter()
        generate_latents(embeds, seconds, rep, url=url, **recipe)
        dit_ms = (time.perf_counter() - began) * 1e3
        began = time.perf_counter()
        arrivals = [tile.arrived_s for tile in stream_pipeline(embeds, seconds, rep, url=url, **recipe)]
        total_ms = (time.perf_counter() - began) * 1e3
        if rep:
            dit.append(dit_ms)
            first.append(arrivals[0] * 1e3)
            total.append(total_ms)
    return {"dit": statistics.median(dit), "first": statistics.median(first), "total": statistics.median(total)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="auk", help="synthetic preset for both the DiT and the codec")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=64, help="prompt tokens (seeded stand-in embeddings)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--recipes", nargs="+", default=["base", "flash"], choices=list(RECIPES))
    parser.add_argument("--no-server", action="store_true", help="only the in-process DiT times")
    parser.add_argument("--cache-dir", default=None, help="checkpoints and compile caches (reused across runs)")
    parser.add_argument("--log", default="tritonserver-pipeline.log")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")

    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="auk-pipeline-"))
    began = time.perf_counter()
    dirs = recipe_checkpoints(cache, args.preset)
    print(heading(f"AuK pipeline, {args.preset} (synthetic), {args.seconds:g} s of audio, {args.tokens} prompt tokens")
          + f" (checkpoints ready in {time.perf_counter() - began:.0f} s)", flush=True)
    embeds = np.random.default_rng(0).standard_normal((args.tokens, 2048)).astype(np.float32)

    rows = {}
    for name in args.recipes:
        rows[name] = {
            "eager": in_process(dirs[name], RECIPES[name], embeds, args.seconds, args.reps, graphs=0),
            "local": in_process(dirs[name], RECIPES[name], embeds, args.seconds, args.reps, graphs=4),
        }
        print(f"in-process DiT, {name}: eager {rows[name]['eager']:.1f} ms, "
              f"CUDA graphs {rows[name]['local']:.1f} ms", flush=True)
    if not args.no_server:
        for name in args.recipes:
            process, url, _, _ = start_server(dirs[name], cache, Path(args.log), MODELS, ready_timeout_s=900)
            try:
                rows[name].update(served(url, RECIPES[name], embeds, args.seconds, args.reps))
            finally:
                process.terminate()
                process.wait(timeout=120)
            print(f"served, {name}: DiT {rows[name]['dit']:.1f} ms, first audio {rows[name]['first']:.1f} ms, "
                  f"total {rows[name]['total']:.1f} ms", flush=True)

    print("| recipe | steps x batch | DiT eager ms | DiT graphed ms | DiT served ms | first audio ms | total ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        shape = "32 x 2 (CFG 2.0, sway -1)" if name == "base" else "4 x 1 (flash grid, no CFG)"
        cells = [f"{row[k]:.1f}" if k in row else "-" for k in ("eager", "local", "dit", "first", "total")]
        print(f"| {name} | {shape} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
