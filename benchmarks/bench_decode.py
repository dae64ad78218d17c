"""Decode speed of every tier, measured in one run on one GPU.

For each clip length: the eager decode (the baseline), one plain CUDA graph,
the compiled bucket graphs (tiled over buckets past the largest), and
`torch.compile(mode="reduce-overhead")` of the eager decode, which is what a
user would reach for without this project. Times are CUDA-event medians of
many replays after warm-up; peak memory is what the variant allocates on top
of the weights. Weights are synthetic (seeded, not the released checkpoint):
speed depends only on the geometry.

    python benchmarks/bench_decode.py --preset auk --frames 128 256 512 2048
"""

import argparse
import datetime
import statistics
import tempfile
import time

import torch

from auk_triton.decode_graph import DEFAULT_COMPILE_SHAPES, AuKVAEDecodeGraph
from auk_triton.synthetic import write_synthetic_checkpoint
from auk_triton.vae import AuKVAE


def median_ms(fn, iters: int, warmup: int = 3) -> float:
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


def load_vae(args) -> AuKVAE:
    if args.checkpoint:
        return AuKVAE.from_pretrained(args.checkpoint, device="cuda")
    directory = write_synthetic_checkpoint(tempfile.mkdtemp(prefix="auk-bench-"), args.preset)
    return AuKVAE.from_pretrained(directory, device="cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="auk")
    parser.add_argument("--checkpoint", help="an AuK checkpoint directory instead of a synthetic preset")
    parser.add_argument("--frames", type=int, nargs="+", default=[128, 256, 512, 2048])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--compile-shapes", type=int, nargs="+", default=list(DEFAULT_COMPILE_SHAPES))
    parser.add_argument("--reduce-overhead-frames", type=int, nargs="*", default=[128, 512],
                        help="lengths to also time with torch.compile(mode='reduce-overhead'); each compiles anew")
    args = parser.parse_args()

    torch.manual_seed(0)
    vae = load_vae(args)
    hop, rate = vae.hop_size, vae.sample_rate
    clips = {f: torch.randn(1, f, vae.latent_dim, device="cuda") for f in args.frames}
    eager_ms = {}

    print(f"# AuK decode, {args.checkpoint or args.preset}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, {datetime.date.today()}")
    print("| frames (audio) | variant | ms | x real time | speed-up over eager | peak MiB | setup s |")
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)

    def report(frames, name, ms, peak, setup):
        audio = frames * hop / rate
        print(f"| {frames} ({audio:.2f} s) | {name} | {ms:.2f} | {audio * 1000 / ms:.0f} | "
              f"{eager_ms[frames] / ms:.2f} | {peak:.0f} | {setup:.1f} |", flush=True)

    with torch.no_grad():
        for f, clip in clips.items():
            ms, peak, first = measure(lambda: vae.decode(clip), args.iters)
            eager_ms[f] = ms
            report(f, "eager", ms, peak, 0.0)

        plain = AuKVAEDecodeGraph(vae, compile_shapes=(), tile_frames=0, max_graphs=len(clips) + 1)
        for f, clip in clips.items():
            report(f, "plain graph", *measure(lambda: plain(clip), args.iters))
        del plain

        compiled = AuKVAEDecodeGraph(vae, compile_shapes=args.compile_shapes)
        bucket_seconds = {}
        compiled.warmup("cuda", on_bucket=lambda frames, s, ok: bucket_seconds.__setitem__(frames, s))
        for f, clip in clips.items():
            ms, peak, _ = measure(lambda: compiled(clip), args.iters)
            bucket = compiled.compiled_bucket(f)
            setup = bucket_seconds[bucket] if bucket else sum(bucket_seconds.values())
            name = "compiled bucket" if compiled.last_mode == "compiled" else "compiled buckets, tiled"
            report(f, name, ms, peak, setup)
        del compiled

        for f in args.reduce_overhead_frames:
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
            del fn
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
