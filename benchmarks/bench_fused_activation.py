"""The fused anti-aliased activation on the GPU: per shape, then in the whole decode.

Notes and predictions (written before any GPU run; compare with the tables):

- The kernel reads each input sample once and writes each output once, so its
  memory floor is 8 bytes per sample (fp32 in + out). At ~3.5 TB/s (about what
  a device-to-device copy reaches on an H200; measured below in the same run):

  | shape (C @ L)   | samples | bytes    | floor at 3.5 TB/s |
  | --------------- | ------- | -------- | ----------------- |
  | 768 @ 2560      | 1.97 M  | 15.7 MB  | 4.5 us            |
  | 384 @ 10240     | 3.93 M  | 31.5 MB  | 9.0 us            |
  | 192 @ 30720     | 5.90 M  | 47.2 MB  | 13.5 us           |
  | 96 @ 61440      | 5.90 M  | 47.2 MB  | 13.5 us           |
  | 48 @ 122880     | 5.90 M  | 47.2 MB  | 13.5 us           |
  | 24 @ 245760     | 5.90 M  | 47.2 MB  | 13.5 us           |

  A 512-frame decode runs 18 activations per stage plus activation_post:
  18 * (4.5 + 9.0 + 4 * 13.5) + 13.5 = 1.23 ms of activations at the floor.
- My expectation is that the kernel does NOT reach that floor: per output
  sample it evaluates two precise sinf (libdevice, as torch), 12 + 12 FMAs,
  six cached loads (index-clamped only in edge tiles) and five shared-memory
  shifts (tl.gather), about 140-150 instructions, i.e. ~1.2 issue cycles per sample per SM: ~26 us for the
  5.9 M-sample shapes (compute-bound, ~2x the floor, ~1.8 TB/s effective),
  ~9 us for 768 @ 2560 (partly launch and tail), so ~2.4 ms of activations per
  512-frame decode, against tens of ms eager. If a shape lands far above that,
  look at the launch sweep (block / warps) first.
- Per-shape times are CUDA-graph replays of back-to-back launches rotating over
  buffers about 3x the 50 MB L2 (cold-ish data, no launch overhead). Inside a
  decode an activation's input is often still in the L2, so it can run faster.

Run (H200, ~3-4 minutes: two Inductor compiles of the 512-frame bucket):

    PYTHONPATH=. python3 benchmarks/bench_fused_activation.py

Options: --buckets 128 512 (compile the 128 bucket too, ~+80 s), --max-autotune
(torch.compile(mode="max-autotune") of the eager decode at 512 frames, minutes),
--skip-decode (per-shape part only), --skip-per-shape, --sines (per shape, each
way of evaluating sin^2 with its distance from eager), --first-windows (time to
the first tile of a 60 s clip per first window, 0: none, with the fused compiled
buckets; every nonzero window must be one of --buckets), e.g.

    PYTHONPATH=. python3 benchmarks/bench_fused_activation.py --buckets 64 128 512 --first-windows 0 64 128
"""

import argparse
import collections
import datetime
import sys
import tempfile
import time

import torch
import triton

from auk_triton import fused_activation as fa
from auk_triton.activations import Activation1d
from auk_triton.decode_graph import AuKVAEDecodeGraph
from auk_triton.synthetic import write_synthetic_checkpoint
from auk_triton.vae import AuKVAE
from bench_decode import median_ms  # this folder is on sys.path when run as a script

# (channels, samples) of each stage's activations in the `auk` geometry at 512 frames,
# and how many activations of that shape one decode runs.
SHAPES_512 = [(768, 2560, 18), (384, 10240, 18), (192, 30720, 18), (96, 61440, 18), (48, 122880, 18), (24, 245760, 19)]
PREDICTED_FLOOR_US = {c: 8 * c * l / 3.5e12 * 1e6 for c, l, _ in SHAPES_512}
SWEEP = [(512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]
# The channels-last kernel: (lanes per program, warps, chunk). The first is the default.
CL_SWEEP = [(128, 4, 16), (128, 4, 8), (128, 4, 32), (256, 8, 16), (64, 2, 16), (256, 4, 16)]


def say(line: str = "") -> None:
    print(line, flush=True)


def graph_us(calls, repeats: int = 4) -> float:
    """Median time of one call: `calls` (zero-argument launches, each on its own buffers),
    `repeats` times over, captured back to back in one CUDA graph and replayed. The graph
    hides Python launch overhead, as the decode's graphs do; rotating over buffers larger
    than the L2 keeps the data cold-ish."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for call in calls:  # compile, allocate
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        for _ in range(repeats):
            for call in calls:
                call()
    ms = median_ms(graph.replay, iters=10, warmup=2)
    del graph
    return ms * 1e3 / (repeats * len(calls))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    seconds = graph_us([lambda: dst.copy_(src)], repeats=5) / 1e6
    return 2 * 2**28 * 4 / seconds


L2_BYTES = 50 * 2**20


def per_shape(copy_bw: float) -> None:
    say("\n## One activation per shape (auk geometry, 512 frames)\n")
    say("Times: one CUDA graph of back-to-back launches over rotating buffers (> L2), per launch.\n")
    say("| C @ L | eager us | fused us | speedup | fused GB/s | % of copy BW | floor us (3.5 TB/s) | best launch "
        "| channels-last us | best channels-last launch |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    totals = {"eager": 0.0, "fused": 0.0, "channels-last": 0.0}
    cl_weighted: dict[tuple[int, int, int], float] = {}
    weighted: dict[tuple[int, int], float] = {}
    measured: dict[tuple[int, int], int] = {}
    default = dict(fa.LAUNCH)
    for channels, length, count in SHAPES_512:
        torch.manual_seed(channels)
        act = Activation1d(channels).cuda().requires_grad_(False)
        act.act.alpha.normal_(0, 0.5)
        act.act.beta.normal_(0, 0.5)
        nbytes = 2 * channels * length * 4  # read once, write once
        buffers = [torch.randn(1, channels, length, device="cuda") for _ in range(max(2, -(-3 * L2_BYTES // nbytes)))]
        outs = [torch.empty_like(x) for x in buffers]
        act.fused = False
        eager = graph_us([lambda x=x: act(x) for x in buffers])
        timings = {}
        for block, warps in SWEEP:
            fa.LAUNCH.update(block=block, num_warps=warps)
            try:
                timings[(block, warps)] = graph_us(
                    [lambda x=x, y=y: fa.fused_activation(x, act, out=y) for x, y in zip(buffers, outs)]
                )
            except Exception as err:  # a launch that does not compile (registers, shared memory)
                say(f"(launch {block}/{warps}w failed: {type(err).__name__}: {str(err)[:200]})")
        fa.LAUNCH.update(default)
        del buffers, outs
        # The same activation on channels-last signals (the sliding kernel), per launch in CL_SWEEP.
        buffers = [torch.randn(1, length, channels, device="cuda").transpose(1, 2)
                   for _ in range(max(2, -(-3 * L2_BYTES // nbytes)))]
        outs = [fa.empty_like_layout(x) for x in buffers]
        cl_default = dict(fa.CHANNELS_LAST_LAUNCH)
        cl_timings = {}
        for lanes, warps, chunk in CL_SWEEP:
            fa.CHANNELS_LAST_LAUNCH.update(lanes=lanes, num_warps=warps, chunk=chunk)
            try:
                cl_timings[(lanes, warps, chunk)] = graph_us(
                    [lambda x=x, y=y: fa.fused_activation(x, act, out=y) for x, y in zip(buffers, outs)]
                )
            except Exception as err:
                say(f"(channels-last launch {lanes}/{warps}w chunk {chunk} failed: {type(err).__name__}: {str(err)[:200]})")
            fa.CHANNELS_LAST_LAUNCH.update(cl_default)
        del buffers, outs
        cl_best = min(cl_timings, key=cl_timings.get)
        for key, us in cl_timings.items():
            cl_weighted[key] = cl_weighted.get(key, 0.0) + count * us
        channels_last = cl_timings.get(CL_SWEEP[0], cl_timings[cl_best])
        totals["channels-last"] += count * channels_last
        best = min(timings, key=timings.get)
        for key, us in timings.items():
            weighted[key] = weighted.get(key, 0.0) + count * us
            measured[key] = measured.get(key, 0) + 1
        fused = timings.get((default["block"], default["num_warps"]), timings[best])
        totals["eager"] += count * eager
        totals["fused"] += count * fused
        say(
            f"| {channels} @ {length} | {eager:.1f} | {fused:.1f} | {eager / fused:.1f}x | "
            f"{nbytes / fused / 1e3:.0f} | {100 * nbytes / (fused * 1e-6) / copy_bw:.0f}% | "
            f"{PREDICTED_FLOOR_US[channels]:.1f} | {best[0]}/{best[1]}w {timings[best]:.1f} us | "
            f"{channels_last:.1f} | {cl_best[0]} lanes/{cl_best[1]}w chunk {cl_best[2]} "
            f"{cl_timings[cl_best]:.1f} us |"
        )
    say(
        f"\nAll 109 activations of a 512-frame decode: eager {totals['eager'] / 1e3:.2f} ms, "
        f"fused {totals['fused'] / 1e3:.2f} ms (default launch {default['block']}/{default['num_warps']}w), "
        f"floor {sum(count * PREDICTED_FLOOR_US[c] for c, _, count in SHAPES_512) / 1e3:.2f} ms at 3.5 TB/s."
    )
    say(f"Channels-last kernel, all 109 activations: {totals['channels-last'] / 1e3:.2f} ms "
        f"(default launch). Sweep (lanes/warps/chunk, decode-weighted ms): " + ", ".join(
        f"{l}/{w}w/{c} {t / 1e3:.2f}" for (l, w, c), t in sorted(cl_weighted.items(), key=lambda kv: kv[1])))
    say("Launch sweep, decode-weighted total (ms): " + ", ".join(
        f"{b}/{w}w {t / 1e3:.2f}" for (b, w), t in sorted(weighted.items(), key=lambda kv: kv[1])))
    complete = [key for key in weighted if measured[key] == len(SHAPES_512)]
    chosen = min(complete, key=weighted.get)
    fa.LAUNCH.update(block=chosen[0], num_warps=chosen[1])
    say(f"Using launch {chosen[0]}/{chosen[1]}w for the decode below.")


def sine_table() -> None:
    """Per shape: both kernels with each way of evaluating sin^2 (fa.SINE_METHODS), the sliding
    kernel at chunks of 16 and 32, and each method's distance from the eager module."""
    say("\n## sin^2 per method, one activation per shape (us per launch; rel. L2 vs eager)\n")
    methods = list(fa.SINE_METHODS)
    columns = [("tiled", None)] + [("sliding", chunk) for chunk in (16, 32)]
    say("| C @ L | eager us | " + " | ".join(
        f"{kind}{f' chunk {chunk}' if chunk else ''}: {method}" for kind, chunk in columns for method in methods)
        + " | " + " | ".join(f"rel. L2 {method}" for method in methods) + " |")
    say("|" + " --- |" * (2 + len(columns) * len(methods) + len(methods)))
    saved_sine, saved_launch = fa.SINE, dict(fa.CHANNELS_LAST_LAUNCH)
    totals = collections.Counter()
    for channels, length, count in SHAPES_512:
        torch.manual_seed(channels)
        act = Activation1d(channels).cuda().requires_grad_(False)
        act.act.alpha.normal_(0, 0.5)
        act.act.beta.normal_(0, 0.5)
        nbytes = 2 * channels * length * 4
        copies = max(2, -(-3 * L2_BYTES // nbytes))
        first = [torch.randn(1, channels, length, device="cuda") for _ in range(copies)]
        last = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in first]
        act.fused = False
        with torch.no_grad():
            reference = act(first[0])
        cells = [f"{graph_us([lambda x=x: act(x) for x in first]):.1f}"]
        errors = {}
        for kind, chunk in columns:
            buffers = first if kind == "tiled" else last
            outs = [fa.empty_like_layout(x) for x in buffers]
            if chunk:
                fa.CHANNELS_LAST_LAUNCH.update(chunk=chunk)
            for method in methods:
                fa.SINE = method
                us = graph_us([lambda x=x, y=y: fa.fused_activation(x, act, out=y) for x, y in zip(buffers, outs)])
                totals[(kind, chunk, method)] += count * us
                cells.append(f"{us:.1f}")
                error = ((outs[0] - reference).double().norm() / reference.double().norm()).item()
                errors[method] = max(errors.get(method, 0.0), error)
            del outs
        fa.SINE = saved_sine
        fa.CHANNELS_LAST_LAUNCH.update(saved_launch)
        cells += [f"{errors[method]:.1e}" for method in methods]
        say(f"| {channels} @ {length} | " + " | ".join(cells) + " |")
    say("\nAll 109 activations of a 512-frame decode (ms): " + ", ".join(
        f"{kind}{f' chunk {chunk}' if chunk else ''} {method} {us / 1e3:.2f}" for (kind, chunk, method), us in totals.items()))


def decode_part(args) -> None:
    torch.manual_seed(0)
    directory = write_synthetic_checkpoint(tempfile.mkdtemp(prefix="auk-bench-fused-"), "auk")
    vae = AuKVAE.from_pretrained(directory, device="cuda")
    clips = {f: torch.randn(1, f, vae.latent_dim, device="cuda") for f in args.frames}
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
                        out = call(clip)
                        err = ((out - reference[frames]).norm() / reference[frames].norm()).item()
                        cell += f" ({err:.0e})"
                except Exception as err:  # keep the table going
                    cell = f"error: {type(err).__name__}"
            cells.append(cell)
        say(f"| {name} | " + " | ".join(cells) + f" | {build_s:.0f} |")

    with torch.no_grad():
        vae.use_fused_activation(False)
        for frames, clip in clips.items():
            reference[frames] = vae.decode(clip)
        row("eager", vae.decode, check=False)
        vae.use_fused_activation(True)
        row("eager + fused activation", vae.decode)

        for fused in (False, True):
            vae.use_fused_activation(fused)
            plain = AuKVAEDecodeGraph(vae, compile_shapes=())
            row(f"plain CUDA graph{' + fused' if fused else ''}", plain)
            del plain

        def compiled_row(codec: AuKVAE, label: str) -> AuKVAEDecodeGraph:
            """Build the compiled buckets of `codec`, time them as one row, and return them."""
            began = time.perf_counter()
            graph = AuKVAEDecodeGraph(codec, compile_shapes=args.buckets)
            graph.warmup("cuda")
            build = time.perf_counter() - began
            missing = [b for b in args.buckets if graph.compiled_bucket(b) != b]
            name = f"compiled buckets {list(args.buckets)}{label}"
            row(name + (f" (buckets {missing} FAILED)" if missing else ""), graph, build)
            return graph

        graphs = {}
        for fused in (False, True):
            vae.use_fused_activation(fused)
            graphs[fused] = compiled_row(vae, " + fused" if fused else "")

        if args.channels_last:
            # A second codec: converting weights moves them, and the graphs above hold their addresses.
            vae_cl = AuKVAE.from_pretrained(directory, device="cuda").use_fused_activation(True)
            vae_cl.use_channels_last(True)
            row("eager + fused activation, channels-last", vae_cl.decode)
            plain = AuKVAEDecodeGraph(vae_cl, compile_shapes=())
            row("plain CUDA graph + fused, channels-last", plain)
            del plain
            graphs["channels-last"] = compiled_row(vae_cl, " + fused, channels-last")

        if args.first_windows:
            first_windows(graphs[True], vae, args)
            if "channels-last" in graphs:
                first_windows(graphs["channels-last"], vae, args, "fused activation, channels-last")

        if args.max_autotune:
            vae.use_fused_activation(False)
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


def first_windows(graph: AuKVAEDecodeGraph, vae: AuKVAE, args, label: str = "fused activation") -> None:
    """Time to the first tile of a long clip, in process, per first window (0: none), with
    each tile copied to the host as the served model does; the same compiled buckets."""
    frames = round(args.long_seconds * vae.sample_rate / vae.hop_size)
    clip = torch.randn(1, frames, vae.latent_dim, device="cuda")
    say(f"\n## First tile of a {args.long_seconds:g} s clip ({frames} frames), {label}, "
        f"compiled buckets {list(graph.compile_shapes)} (ms, medians of {args.iters})\n")
    say("| first window | first tile ms | total ms | tiles |")
    say("| --- | --- | --- | --- |")
    saved = graph.first_tile_frames
    for window in args.first_windows:
        graph.first_tile_frames = window or None
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
    graph.first_tile_frames = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--buckets", type=int, nargs="+", default=[512])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--max-autotune", action="store_true")
    parser.add_argument("--first-windows", type=int, nargs="*", default=[],
                        help="first windows (frames; 0: none) to time on a long clip; each nonzero one must "
                             "be one of --buckets")
    parser.add_argument("--long-seconds", type=float, default=60.0)
    parser.add_argument("--channels-last", action="store_true",
                        help="also the decode on channels-last signals (eager, plain graph, compiled buckets)")
    parser.add_argument("--sines", action="store_true",
                        help="per shape, each way of evaluating sin^2 (fused_activation.SINE_METHODS)")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-per-shape", action="store_true")
    args = parser.parse_args()
    missing = sorted({window for window in args.first_windows if window} - set(args.buckets))
    if missing:
        parser.error(f"--first-windows {missing} must be compiled buckets: add them to --buckets {args.buckets}")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    say(
        f"# Fused anti-aliased activation, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, {datetime.date.today()}"
    )
    began = time.perf_counter()
    bw = copy_bandwidth()
    say(f"\nDevice-to-device copy: {bw / 1e9:.0f} GB/s (read + write).")
    if args.sines:
        sine_table()
    if not args.skip_per_shape:
        per_shape(bw)
    say(f"\n(per-shape part: {time.perf_counter() - began:.0f} s)")
    if not args.skip_decode:
        decode_part(args)
    say(f"\n(total {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
