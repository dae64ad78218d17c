"""Decode speed of every tier, measured in one run on one GPU.

For each clip length: the eager decode (the baseline), one plain CUDA graph,
the compiled bucket graphs (tiled over buckets past the largest), and
`torch.compile(mode="reduce-overhead")` of the eager decode, which is what a
user would reach for without this project. The codec runs as `from_pretrained`
leaves it (eager activations, channels-first signals). Times are CUDA-event
medians of many replays after warm-up; peak memory is what the variant
allocates on top of the weights.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_decode.py --frames 128 256 512 2048
"""

import argparse
import time

import torch

from auk_triton.codec import DEFAULT_COMPILE_SHAPES, AuKVAE, AuKVAEDecodeGraph
from common import heading, latents, median_ms, synthetic_checkpoint


def measure(fn, iters: int) -> tuple[float, float, float]:
    """(median ms, peak MiB above what was allocated before, seconds of the first call)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - began
    ms = median_ms(fn, iters)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return ms, peak, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="auk", help="synthetic preset (seeded weights; speed depends only on it)")
    parser.add_argument("--checkpoint", help="an AuK checkpoint directory instead of a synthetic preset")
    parser.add_argument("--frames", type=int, nargs="+", default=[128, 256, 512, 2048])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--compile-shapes", type=int, nargs="+", default=list(DEFAULT_COMPILE_SHAPES))
    parser.add_argument("--reduce-overhead-frames", type=int, nargs="*", default=[128, 512],
                        help="lengths to also time with torch.compile(mode='reduce-overhead'); each compiles anew")
    args = parser.parse_args()
    if not set(args.reduce_overhead_frames) <= set(args.frames):
        parser.error("every --reduce-overhead-frames length must be one of --frames")

    vae = AuKVAE.from_pretrained(args.checkpoint or synthetic_checkpoint(preset=args.preset), device="cuda")
    hop, rate = vae.hop_size, vae.sample_rate
    clips = {f: latents(f, "cuda") for f in args.frames}
    eager_ms = {}

    print(heading(f"AuK decode, {args.checkpoint or args.preset}"))
    print("| frames (audio) | variant | ms | x real time | speed-up over eager | peak MiB | setup s |")
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)

    def report(frames, name, ms, peak, setup):
        audio = frames * hop / rate
        print(f"| {frames} ({audio:.2f} s) | {name} | {ms:.2f} | {audio * 1000 / ms:.0f} | "
              f"{eager_ms[frames] / ms:.2f} | {peak:.0f} | {setup:.1f} |", flush=True)

    def tiers():
        for f, clip in clips.items():
            ms, peak, first = measure(lambda: vae.decode(clip), args.iters)
            eager_ms[f] = ms
            report(f, "eager", ms, peak, 0.0)

        plain = AuKVAEDecodeGraph(vae, compile_shapes=(), tile_frames=0, max_graphs=len(clips) + 1)
        for f, clip in clips.items():
            report(f, "plain graph", *measure(lambda: plain(clip), args.iters))

    def compiled_tier():
        compiled = AuKVAEDecodeGraph(vae, compile_shapes=args.compile_shapes)
        bucket_seconds = {}
        compiled.warmup("cuda", on_bucket=lambda frames, s, ok: bucket_seconds.__setitem__(frames, s))
        for f, clip in clips.items():
            ms, peak, _ = measure(lambda: compiled(clip), args.iters)
            bucket = compiled.compiled_bucket(f)
            setup = bucket_seconds[bucket] if bucket else sum(bucket_seconds.values())
            name = "compiled bucket" if compiled.last_mode == "compiled" else "compiled buckets, tiled"
            report(f, name, ms, peak, setup)

    def reduce_overhead(f):
        clip = clips[f]
        torch._dynamo.reset()
        fn = torch.compile(vae.decode, mode="reduce-overhead", dynamic=False)
        began = time.perf_counter()
        for _ in range(3):  # compile, record the graph tree, replay
            fn(clip)
        torch.cuda.synchronize()
        setup = time.perf_counter() - began
        ms, peak, _ = measure(lambda: fn(clip), args.iters)
        report(f, "torch.compile reduce-overhead", ms, peak, setup)

    # Each tier in a function of its own: its graphs are freed before the next tier is measured.
    with torch.no_grad():
        tiers()
        compiled_tier()
        for f in args.reduce_overhead_frames:
            reduce_overhead(f)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
