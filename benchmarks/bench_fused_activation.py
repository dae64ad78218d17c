"""The fused anti-aliased activation kernel on the GPU: per shape, then in the whole decode.

Per shape of a 512-frame `auk` decode: the eager module against the tiled
kernel (channels-first signals) over a launch sweep and the sliding kernel
(channels-last signals) over a lanes / warps / chunk sweep, each an
`ActivationKernel` passed to `fused_activation`. Times are CUDA-graph replays
of back-to-back launches rotating over buffers larger than the L2 (no launch
overhead, cold-ish data), next to the copy bandwidth measured in the run and
the kernel's memory floor (8 bytes per sample at 3.5 TB/s). `--sines`: each way
of evaluating sin^2 in both kernels, with its distance from the eager module.
`--dtype float16`: fp16 signals in and out, as the fp16 decoder runs them (the
kernel computes in fp32 either way; the floor is then 4 bytes per sample).
Then the whole decode (eager, fused, plain graphs, compiled buckets) per
length, the tiled kernel at the sweep's best launch; `--channels-last` adds the
channels-last decode, `--first-windows` the time to a long clip's first tile.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_fused_activation.py
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_fused_activation.py --sines --skip-decode
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_fused_activation.py --dtype float16 --sines --skip-decode
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_fused_activation.py --skip-per-shape \
        --buckets 64 128 512 --first-windows 0 64 128
"""

import argparse
import collections
import sys
import time

import torch
import triton

from auk_triton.codec import ActivationKernel, AuKVAE, AuKVAEDecodeGraph
from auk_triton.codec.activation import SINE_METHODS, Activation1d
from auk_triton.codec.activation_kernel import empty_like_layout, fused_activation
from auk_triton.cuda_graph import capture
from common import copy_bandwidth, heading, latents, median_ms, rel_l2, say, synthetic_checkpoint

# (channels, samples) of each stage's activations in the `auk` geometry at 512 frames,
# and how many activations of that shape one decode runs.
SHAPES_512 = [(768, 2560, 18), (384, 10240, 18), (192, 30720, 18), (96, 61440, 18), (48, 122880, 18), (24, 245760, 19)]

def floor_us(channels: int, length: int) -> float:
    """Reading and writing the signal once at 3.5 TB/s."""
    return 2 * signal_dtype.itemsize * channels * length / 3.5e12 * 1e6

DEFAULT = ActivationKernel()
# The tiled kernel: (block, warps). The sliding kernel: (lanes per program, warps, chunk), the default first.
SWEEP = [ActivationKernel(block=b, num_warps=w)
         for b, w in [(512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]]
CL_SWEEP = [ActivationKernel(lanes=n, channels_last_warps=w, chunk=c)
            for n, w, c in [(128, 4, 16), (128, 4, 8), (128, 4, 24), (128, 4, 32), (256, 8, 16), (64, 2, 16),
                            (256, 4, 16), (512, 8, 16)]]
L2_BYTES = 50 * 2**20
SIGNAL_DTYPES = {"float32": torch.float32, "float16": torch.float16}
signal_dtype = torch.float32  # --dtype


def graph_us(calls, repeats: int = 4) -> float:
    """Median time of one call: `calls` (zero-argument launches, each on its own buffers),
    `repeats` times over, captured back to back in one CUDA graph and replayed."""

    def run():
        for _ in range(repeats):
            for call in calls:
                call()

    with torch.no_grad():
        graph, _ = capture(run, warmups=1)  # the warm-up compiles and allocates
    ms = median_ms(graph.replay, iters=10, warmup=2)
    return ms * 1e3 / (repeats * len(calls))


def activation(channels: int) -> Activation1d:
    """An activation of `channels` with seeded SnakeBeta parameters, on the GPU."""
    torch.manual_seed(channels)
    act = Activation1d(channels).cuda().requires_grad_(False)
    act.act.alpha.normal_(0, 0.5)
    act.act.beta.normal_(0, 0.5)
    return act


def signals(channels: int, length: int, channels_last: bool = False) -> list[torch.Tensor]:
    """Enough [1, C, L] signals to fill three L2s (at least two)."""
    count = max(2, -(-3 * L2_BYTES // (2 * channels * length * signal_dtype.itemsize)))
    if channels_last:
        return [torch.randn(1, length, channels, device="cuda", dtype=signal_dtype).transpose(1, 2)
                for _ in range(count)]
    return [torch.randn(1, channels, length, device="cuda", dtype=signal_dtype) for _ in range(count)]


def fused_us(act, buffers, kernel: ActivationKernel) -> float:
    outs = [empty_like_layout(x, x.dtype) for x in buffers]
    return graph_us([lambda x=x, y=y: fused_activation(x, act, out=y, kernel=kernel) for x, y in zip(buffers, outs)])


def per_shape(copy_bw: float) -> ActivationKernel:
    """The per-shape table; returns the tiled kernel's launch (SWEEP) with the least decode-weighted
    time, for the channels-first decode below."""
    say("\n## One activation per shape (auk geometry, 512 frames)\n")
    say("Times: one CUDA graph of back-to-back launches over rotating buffers (> L2), per launch.\n")
    say("| C @ L | eager us | fused us | speedup | fused GB/s | % of copy BW | floor us (3.5 TB/s) | best launch "
        "| channels-last us | best channels-last launch |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    totals = {"eager": 0.0, "fused": 0.0, "channels-last": 0.0}
    cl_weighted: dict[ActivationKernel, float] = {}
    weighted: dict[ActivationKernel, float] = {}
    measured: dict[ActivationKernel, int] = {}
    for channels, length, count in SHAPES_512:
        act = activation(channels)
        nbytes = 2 * channels * length * signal_dtype.itemsize  # read once, write once
        buffers = signals(channels, length)
        eager = graph_us([lambda x=x: act.eager(x) for x in buffers])
        timings = {}
        for kernel in SWEEP:
            try:
                timings[kernel] = fused_us(act, buffers, kernel)
            except Exception as err:  # a launch that does not compile (registers, shared memory)
                say(f"(launch {kernel.block}/{kernel.num_warps}w failed: {type(err).__name__}: {str(err)[:200]})")
        buffers = signals(channels, length, channels_last=True)
        cl_timings = {}
        for kernel in CL_SWEEP:
            try:
                cl_timings[kernel] = fused_us(act, buffers, kernel)
            except Exception as err:
                say(f"(channels-last launch {kernel.lanes}/{kernel.channels_last_warps}w chunk {kernel.chunk} "
                    f"failed: {type(err).__name__}: {str(err)[:200]})")
        del buffers
        cl_best = min(cl_timings, key=cl_timings.get)
        for kernel, us in cl_timings.items():
            cl_weighted[kernel] = cl_weighted.get(kernel, 0.0) + count * us
        channels_last = cl_timings.get(DEFAULT, cl_timings[cl_best])
        totals["channels-last"] += count * channels_last
        best = min(timings, key=timings.get)
        for kernel, us in timings.items():
            weighted[kernel] = weighted.get(kernel, 0.0) + count * us
            measured[kernel] = measured.get(kernel, 0) + 1
        fused = timings.get(DEFAULT, timings[best])
        totals["eager"] += count * eager
        totals["fused"] += count * fused
        say(
            f"| {channels} @ {length} | {eager:.1f} | {fused:.1f} | {eager / fused:.1f}x | "
            f"{nbytes / fused / 1e3:.0f} | {100 * nbytes / (fused * 1e-6) / copy_bw:.0f}% | "
            f"{floor_us(channels, length):.1f} | {best.block}/{best.num_warps}w {timings[best]:.1f} us | "
            f"{channels_last:.1f} | {cl_best.lanes} lanes/{cl_best.channels_last_warps}w chunk {cl_best.chunk} "
            f"{cl_timings[cl_best]:.1f} us |"
        )
    say(
        f"\nAll 109 activations of a 512-frame decode: eager {totals['eager'] / 1e3:.2f} ms, "
        f"fused {totals['fused'] / 1e3:.2f} ms (default launch {DEFAULT.block}/{DEFAULT.num_warps}w), "
        f"floor {sum(count * floor_us(c, n) for c, n, count in SHAPES_512) / 1e3:.2f} ms at 3.5 TB/s."
    )
    say(f"Channels-last kernel, all 109 activations: {totals['channels-last'] / 1e3:.2f} ms "
        f"(default launch). Sweep (lanes/warps/chunk, decode-weighted ms): " + ", ".join(
        f"{k.lanes}/{k.channels_last_warps}w/{k.chunk} {t / 1e3:.2f}"
        for k, t in sorted(cl_weighted.items(), key=lambda kv: kv[1])))
    say("Launch sweep, decode-weighted total (ms): " + ", ".join(
        f"{k.block}/{k.num_warps}w {t / 1e3:.2f}" for k, t in sorted(weighted.items(), key=lambda kv: kv[1])))
    complete = [kernel for kernel in weighted if measured[kernel] == len(SHAPES_512)]
    chosen = min(complete, key=weighted.get)
    say(f"Using launch {chosen.block}/{chosen.num_warps}w for the decode below.")
    return chosen


def sine_table() -> None:
    """Per shape: both kernels with each way of evaluating sin^2 (SINE_METHODS), the sliding
    kernel at chunks of 16 and 32, and each method's distance from the eager module."""
    say("\n## sin^2 per method, one activation per shape (us per launch; rel. L2 vs eager)\n")
    methods = list(SINE_METHODS)
    columns = [("tiled", None)] + [("sliding", chunk) for chunk in (16, 32)]
    say("| C @ L | eager us | " + " | ".join(
        f"{kind}{f' chunk {chunk}' if chunk else ''}: {method}" for kind, chunk in columns for method in methods)
        + " | " + " | ".join(f"rel. L2 {method}" for method in methods) + " |")
    say("|" + " --- |" * (2 + len(columns) * len(methods) + len(methods)))
    totals = collections.Counter()
    for channels, length, count in SHAPES_512:
        act = activation(channels)
        first = signals(channels, length)
        last = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in first]
        with torch.no_grad():
            reference = act.eager(first[0])
        cells = [f"{graph_us([lambda x=x: act.eager(x) for x in first]):.1f}"]
        errors = {}
        for kind, chunk in columns:
            buffers = first if kind == "tiled" else last
            outs = [empty_like_layout(x, x.dtype) for x in buffers]
            for method in methods:
                kernel = ActivationKernel(sine=method, chunk=chunk or DEFAULT.chunk)
                us = graph_us([lambda x=x, y=y: fused_activation(x, act, out=y, kernel=kernel)
                               for x, y in zip(buffers, outs)])
                totals[(kind, chunk, method)] += count * us
                cells.append(f"{us:.1f}")
                errors[method] = max(errors.get(method, 0.0), rel_l2(outs[0], reference))
            del outs
        cells += [f"{errors[method]:.1e}" for method in methods]
        say(f"| {channels} @ {length} | " + " | ".join(cells) + " |")
    say("\nAll 109 activations of a 512-frame decode (ms): " + ", ".join(
        f"{kind}{f' chunk {chunk}' if chunk else ''} {method} {us / 1e3:.2f}" for (kind, chunk, method), us in totals.items()))


def decode_part(args, kernel: ActivationKernel) -> None:
    directory = synthetic_checkpoint(preset="auk")
    vae = AuKVAE.from_pretrained(directory, device="cuda")
    clips = {f: latents(f, "cuda") for f in args.frames}
    header = " | ".join(f"{f} frames" for f in args.frames)
    say(f"\n## Whole decode, auk preset (ms, CUDA-event medians of {args.iters} calls)\n")
    say(f"| variant | {header} | build s |")
    say("| --- |" + " --- |" * len(args.frames) + " --- |")
    reference = {}

    def row(name: str, call, build_s: float = 0.0, check: bool = True) -> None:
        cells = []
        for frames, clip in clips.items():
            with torch.no_grad():
                try:
                    ms = median_ms(lambda: call(clip), args.iters if frames <= 512 else max(5, args.iters // 3))
                    cell = f"{ms:.2f}"
                    if check and frames in reference:
                        cell += f" ({rel_l2(call(clip), reference[frames]):.0e})"
                except Exception as err:  # keep the table going
                    cell = f"error: {type(err).__name__}"
            cells.append(cell)
        say(f"| {name} | " + " | ".join(cells) + f" | {build_s:.0f} |")

    def compiled_row(codec: AuKVAE, label: str, first_tile_frames: int | None = None) -> AuKVAEDecodeGraph:
        """Build the compiled buckets of `codec`, time them as one row, and return them."""
        began = time.perf_counter()
        graph = AuKVAEDecodeGraph(codec, compile_shapes=args.buckets, first_tile_frames=first_tile_frames)
        graph.warmup("cuda")
        build = time.perf_counter() - began
        missing = [b for b in args.buckets if graph.compiled_bucket(b) != b]
        name = f"compiled buckets {list(args.buckets)}{label}"
        row(name + (f" (buckets {missing} FAILED)" if missing else ""), graph, build)
        return graph

    with torch.no_grad():
        for frames, clip in clips.items():
            reference[frames] = vae.decode(clip)
        row("eager", vae.decode, check=False)
        vae.configure_decoder(activation_kernel=kernel)
        row("eager + fused activation", vae.decode)

        for fused in (False, True):
            vae.configure_decoder(activation_kernel=kernel if fused else None)
            row(f"plain CUDA graph{' + fused' if fused else ''}", AuKVAEDecodeGraph(vae, compile_shapes=()))

        vae.configure_decoder()
        compiled_row(vae, "")
        vae.configure_decoder(activation_kernel=kernel)
        full_tiles = {"fused activation": compiled_row(vae, " + fused")}
        codecs = {"fused activation": vae}

        if args.channels_last:
            # A second codec: converting weights moves them, and the graphs above hold their addresses.
            vae_cl = AuKVAE.from_pretrained(directory, device="cuda", activation_kernel=kernel, channels_last=True)
            row("eager + fused activation, channels-last", vae_cl.decode)
            row("plain CUDA graph + fused, channels-last", AuKVAEDecodeGraph(vae_cl, compile_shapes=()))
            full_tiles["fused activation, channels-last"] = compiled_row(vae_cl, " + fused, channels-last")
            codecs["fused activation, channels-last"] = vae_cl

        if args.first_windows:
            for label, codec in codecs.items():
                first_windows(codec, full_tiles[label], args, label)
        full_tiles.clear()

        if args.max_autotune:
            vae.configure_decoder()
            began = time.perf_counter()
            compiled = torch.compile(vae.decode, mode="max-autotune", dynamic=False)
            clip = clips.get(512) if 512 in clips else next(iter(clips.values()))
            compiled(clip)
            build = time.perf_counter() - began
            ms = median_ms(lambda: compiled(clip), args.iters)
            say(f"| torch.compile(max-autotune) eager decode, {clip.shape[1]} frames only | {ms:.2f} | | | {build:.0f} |")
    say(
        "\nParenthesised: relative L2 against the eager decode (a clip shorter than its bucket differs "
        "in its last frames, the upsamplers' lookahead sees the pad). Clips longer than the largest bucket are tiled."
    )


def first_windows(vae: AuKVAE, full_tiles: AuKVAEDecodeGraph, args, label: str) -> None:
    """Time to the first tile of a long clip, in process, per first window (0: none), with each
    tile copied to the host as the served model does. `full_tiles` serves window 0; each other
    window compiles the same buckets anew, for a wrapper made with that first window."""
    frames = round(args.long_seconds * vae.sample_rate / vae.hop_size)
    clip = latents(frames, "cuda")
    say(f"\n## First tile of a {args.long_seconds:g} s clip ({frames} frames), {label}, "
        f"compiled buckets {list(full_tiles.compile_shapes)} (ms, medians of {args.iters})\n")
    say("| first window | first tile ms | total ms | tiles |")
    say("| --- | --- | --- | --- |")
    for window in args.first_windows:
        if window:
            torch._dynamo.reset()  # a fresh compile per wrapper, not a pile of recompiles
            graph = AuKVAEDecodeGraph(vae, compile_shapes=args.buckets, first_tile_frames=window)
            graph.warmup("cuda")
        else:
            graph = full_tiles
        firsts, totals, tiles = [], [], 0
        for _ in range(args.iters + 2):
            torch.cuda.synchronize()
            began = time.perf_counter()
            first, tiles = None, 0
            for _, wave in graph.decode_tiles(clip):
                host = torch.empty(wave.shape[1], pin_memory=True)
                host.copy_(wave[0])  # synchronizes: the tile is on the host
                first = first if first is not None else time.perf_counter() - began
                tiles += 1
            firsts.append(first * 1e3)
            totals.append((time.perf_counter() - began) * 1e3)
        firsts, totals = sorted(firsts[2:]), sorted(totals[2:])
        say(f"| {window or 'none (full tiles)'} | {firsts[len(firsts) // 2]:.2f} | {totals[len(totals) // 2]:.2f} | {tiles} |")
        graph = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--buckets", type=int, nargs="+", default=[512])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--max-autotune", action="store_true",
                        help="also the eager decode under torch.compile(mode='max-autotune'), one length (minutes)")
    parser.add_argument("--first-windows", type=int, nargs="*", default=[],
                        help="first windows (frames; 0: none) to time on a long clip; each nonzero one must "
                             "be one of --buckets")
    parser.add_argument("--long-seconds", type=float, default=60.0)
    parser.add_argument("--channels-last", action="store_true",
                        help="also the decode on channels-last signals (eager, plain graph, compiled buckets)")
    parser.add_argument("--sines", action="store_true",
                        help=f"per shape, each way of evaluating sin^2 ({', '.join(SINE_METHODS)})")
    parser.add_argument("--dtype", choices=list(SIGNAL_DTYPES), default="float32",
                        help="the per-shape signals' dtype (in and out)")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-per-shape", action="store_true")
    args = parser.parse_args()
    global signal_dtype
    signal_dtype = SIGNAL_DTYPES[args.dtype]
    missing = sorted({window for window in args.first_windows if window} - set(args.buckets))
    if missing:
        parser.error(f"--first-windows {missing} must be compiled buckets: add them to --buckets {args.buckets}")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    say(heading("Fused anti-aliased activation", extra=f", triton {triton.__version__}, {args.dtype} signals"))
    began = time.perf_counter()
    bw = copy_bandwidth()
    say(f"\nDevice-to-device copy: {bw / 1e9:.0f} GB/s (read + write).")
    if args.sines:
        sine_table()
    kernel = DEFAULT
    if not args.skip_per_shape:
        kernel = per_shape(bw)
    say(f"\n(per-shape part: {time.perf_counter() - began:.0f} s)")
    if not args.skip_decode:
        decode_part(args, kernel)
    say(f"\n(total {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
