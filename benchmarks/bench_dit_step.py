"""One DiT velocity step, replayed as a CUDA graph: the eager step against the compiled one.

The released dims (1.53 B parameters) with seeded synthetic weights built in
memory (nothing written to disk), bf16 weights under bf16 autocast as served,
`--frames` target frames and `--tokens` text tokens, no reference, batches of
`--batches` unguided rows. The context is masked as a bucketed run's is (a
target mask, additive key biases) unless `--unmasked`. Three steps on the same
inputs, each captured as a CUDA graph and timed by its replays:

- `eager, per-step modulation`: the step computing its AdaLN modulation from its
  time (61 linears per step), as before the modulation table;
- `eager, table`: the step reading its modulation from the run's table;
- `compiled, table`: the same through the compiled blocks (compiled.py,
  `--static` for a compilation per shape instead of dynamic shapes);
- with `--fp8`, `compiled, table, FP8 linears`: the compiled step of a copy of the
  model whose token linears are FP8 (fp8.py, the `fp8_linears` option), its velocity
  against the same eager bf16 step;
- with `--compare-without OPTION ...`, `compiled, table, without OPTION`: the compiled
  step with that `CompileOptions` switch off (`block_kernels`: the q/k norms and
  RoPE, the LayerNorms with their modulation and the gated residual as Inductor fuses
  the eager ops; `compile_edges`: the audio embedding and the output eager), for a
  ratio in the same run.

Printed per batch and step: ms per step (median replay), TFLOP/s (the step's
work by torch's FlopCounterMode over that time), the relative L2 of its velocity
against the eager bf16 step's, and what building it took (compile and capture;
a compiled step's first shape pays the compilation, later shapes what Dynamo
recompiles for them). Then one request's whole flash run (4 unguided steps) and
whole base run (32 guided steps) as auk_dit serves them on a GPU (its bucket,
compiled and graphed; with `--fp8` also with FP8 linears) against the same runs
stepped eagerly in bf16: the relative L2 of the latents.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_dit_step.py            # H200: 500 frames + 64 tokens, batch 1 and 16
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_dit_step.py --small    # smoke test on a CPU: tiny dims, no graphs

`--profile` adds, per batch, where the compiled step's GPU time goes (torch's
profiler over a few replays of the step's CUDA graph, as measured: kernel time by kind,
kernels per step, the time the GPU ran a kernel and the time it ran none, the longest
kernels), the table of the diffusion issue. `--inductor KEY=VALUE` sets an
Inductor option (`torch._inductor.config`) for the compiled step, to weigh one.
`--request` instead times one flash request as `auk_dit` samples it on a GPU, phase
by phase (its checks, its context, the steps, the whole run), and one full garbage
collection in a process that compiled. `--open-loop RATE ...` instead serves flash
requests in this process as `auk_dit`'s sampling thread does (rows joining runs between
steps, each one's latents copied to the host as it leaves), arriving one at a time and
then as a Poisson process at each RATE per second for `--duration` seconds: the sampling
time from arrival to latents on the host, without Triton, the front door or the decoder.

The compile caches go to a fresh folder unless `--cache-dir` names one: run twice
with the same folder for a warm start's figures. `--buckets` instead builds what
auk_dit builds at load (its default buckets, compiled; `--variant flash` for
unguided buckets only) and prints the time and memory that took.

On a CPU (`--small`) nothing is graphed: each step is timed as it runs, and the
compiled step uses Dynamo's `eager` backend (tracing without code generation;
Inductor on a CPU takes minutes), so its figures check the script, nothing else.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import gc
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from auk_triton.cuda_graph import capture
from auk_triton.diffusion.compiled import CompileOptions, compiled_blocks
from auk_triton.diffusion.fp8 import check_fp8_support, use_fp8_linears
from auk_triton.diffusion.gemm_workspace import without_gemm_workspace
from auk_triton.diffusion.buckets import ShapeBuckets
from auk_triton.diffusion.joined import JoinedRuns
from auk_triton.diffusion.sampler import AuKDiTSampler, Request, euler_integrate
from auk_triton.diffusion.synthetic import FLASH_T_GRID, synthetic_transformer
from auk_triton.serving.config import DiTSettings, use_compile_cache
from common import compile_time_breakdown, heading, median_ms, rel_l2, sampler_config, say

PATHS = ("eager, per-step modulation", "eager, table", "compiled, table")
FP8_PATH = "compiled, table, FP8 linears"
WITHOUT_PATH = "compiled, table, without {}"


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


def step_inputs(model, batch: int, frames: int, tokens: int, masked: bool, device, dtype):
    """Seeded x [batch, frames, C], the context of `batch` unguided rows, and a grid time (CPU)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, frames, model.latent_dim, generator=g).to(device)
    text = torch.randn(batch, tokens, model.text_hidden_dim, generator=g).to(device, dtype)
    masks = {}
    if masked:  # as a run that fills its bucket: masks present, every position valid
        masks = dict(c_mask=torch.ones(batch, tokens, dtype=torch.bool, device=device),
                     mask=torch.ones(batch, frames, dtype=torch.bool, device=device))
    t = torch.tensor(FLASH_T_GRID[1])
    with autocast(device, dtype):
        ctx = model.prepare(text, frames, **masks)
        table = model.modulation_table(torch.tensor(FLASH_T_GRID[:-1]))
    return x, ctx, t, table


def step_functions(model, x, ctx, t, table, blocks, device, dtype, fp8_model=None, other_blocks=None):
    """The three steps (and the FP8 model's compiled one, and a compiled one through each of
    `other_blocks`, a path name -> block runners), each a function of static buffers (what a
    graph captures)."""
    x = x.clone()
    t_device = t.to(device)
    mod = table.lookup(t).clone()

    def per_step():
        with autocast(device, dtype):
            return model.step(x, t_device, ctx)  # ctx has no table: the modulation is computed

    def eager():
        with autocast(device, dtype):
            return model.velocity(x, mod, ctx)

    def compiled():
        with autocast(device, dtype):
            return model.velocity(x, mod, ctx, blocks)

    def compiled_fp8():
        with autocast(device, dtype):
            return fp8_model.velocity(x, mod, ctx, blocks)

    def compiled_through(runners):
        def step():
            with autocast(device, dtype):
                return model.velocity(x, mod, ctx, runners)
        return step

    steps = dict(zip(PATHS, (per_step, eager, compiled)))
    if fp8_model is not None:
        steps[FP8_PATH] = compiled_fp8
    for name, runners in (other_blocks or {}).items():
        steps[name] = compiled_through(runners)
    return steps


def step_flops(fn) -> float:
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def measure(fn, device, iters: int) -> tuple[float, float, torch.Tensor, Callable[[], object]]:
    """(ms per step, seconds to build, velocity, what was timed): a CUDA graph's replays on a GPU,
    calls on a CPU.

    Building is the first call (a compiled step compiles then) and, on a GPU, the capture."""
    began = time.perf_counter()
    out = fn()
    if device.type != "cuda":
        built = time.perf_counter() - began
        times = []
        for _ in range(iters):
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times), built, out, fn
    torch.cuda.synchronize()
    graph, out = capture(fn, warmups=1)
    torch.cuda.synchronize()
    built = time.perf_counter() - began
    return median_ms(graph.replay, iters=iters), built, out.clone(), graph.replay


# Kernel kinds by name, first match wins: Inductor's generated Triton kernels (its fused
# elementwise chains and norms, named after the ops they fuse), the fused attention
# kernels (cuDNN's, flash, memory-efficient), the position embedding's convolutions,
# cuBLAS / CUTLASS matrix multiplies (with the feed-forward's product and gate, swiglu_kernel.py),
# and the rest (eager elementwise, copies, casts,
# reductions).
KERNEL_KINDS = (
    ("Inductor's fused kernels", ("triton_",)),
    ("q/k norm and RoPE kernel", ("norm_rope",)),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("convolutions", ("fprop", "conv")),
    ("matrix multiplies", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "swiglu_product")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, marks in KERNEL_KINDS:
        if any(mark in lowered for mark in marks):
            return kind
    return "elementwise, norms, copies, casts"


def busy_and_idle(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """Kernels' (start, end) on one clock -> (the time at least one ran, the time between the first
    start and the last end when none did). Kernels on two streams overlap: their sum is not the
    time they took."""
    busy = idle = 0.0
    reach = None  # the latest end so far
    for start, end in sorted(spans):
        if reach is None or start >= reach:
            idle += 0.0 if reach is None else start - reach
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy, idle


def kernel_profile(replay, calls: int = 5, top: int = 12) -> list[str]:
    """Where one step's GPU time goes: torch's profiler over `calls` calls of `replay` (the CUDA
    graph's replay that was timed: un-graphed calls run the same kernels slower and with launch
    gaps between them), per step. Markdown lines."""
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            replay()
            torch.cuda.synchronize()  # each replay alone, so the idle time is the step's own
    kernels: dict[str, list[float]] = {}  # name -> [microseconds, count], all calls
    spans = []
    for event in sorted(prof.events(), key=lambda event: event.time_range.start):
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time_total
            entry[1] += 1
            spans.append((event.time_range.start, event.time_range.end))
    # Every replay runs the same kernels, one replay after the other.
    per_replay = len(spans) // calls
    busy, idle = (sum(part) / calls for part in zip(*(busy_and_idle(spans[i * per_replay:(i + 1) * per_replay])
                                                       for i in range(calls))))
    by_kind: dict[str, list[float]] = {}
    for name, (us, count) in kernels.items():
        entry = by_kind.setdefault(kernel_kind(name), [0.0, 0])
        entry[0] += us
        entry[1] += count
    total_us = sum(us for us, _ in by_kind.values())
    lines = [f"kernels per step {sum(c for _, c in kernels.values()) / calls:.0f}, "
             f"kernel time {total_us / calls / 1e3:.2f} ms per step; a kernel running {busy / 1e3:.2f} ms, "
             f"none between them {idle / 1e3:.2f} ms", "",
             "| kernel kind | ms per step | share | kernels per step |", "| --- | --- | --- | --- |"]
    for kind, (us, count) in sorted(by_kind.items(), key=lambda item: -item[1][0]):
        lines.append(f"| {kind} | {us / calls / 1e3:.2f} | {us / total_us:.0%} | {count / calls:.0f} |")
    lines += ["", "| longest kernels | ms per step | calls per step |", "| --- | --- | --- |"]
    for name, (us, count) in sorted(kernels.items(), key=lambda item: -item[1][0])[:top]:
        lines.append(f"| `{name[:90]}` | {us / calls / 1e3:.3f} | {count / calls:.0f} |")
    return lines


def set_inductor_options(pairs) -> None:
    """`KEY=VALUE` pairs onto torch._inductor.config (a dotted key reaches a sub-config)."""
    import torch._inductor.config as inductor_config

    for pair in pairs:
        key, _, value = pair.partition("=")
        *parents, leaf = key.split(".")
        target = inductor_config
        for parent in parents:
            target = getattr(target, parent)
        if not hasattr(target, leaf):
            sys.exit(f"--inductor: torch._inductor.config has no {key}")
        setattr(target, leaf, ast.literal_eval(value))


def whole_runs(model, frames: int, tokens: int, device, dtype, options: CompileOptions,
               fp8: bool = False) -> dict[str, float]:
    """Relative L2 of one request's latents, served (its bucket compiled and graphed; with `fp8`
    also with FP8 linears) against eager."""
    config = sampler_config(model)
    eager = AuKDiTSampler(model, config, device, dtype)
    text = torch.randn(tokens, model.text_hidden_dim, generator=torch.Generator().manual_seed(1))
    recipes = {"flash (4 steps)": dict(t_grid=tuple(FLASH_T_GRID), guidance=0.0),
               "base (32 guided steps)": dict(num_steps=32, guidance=2.0, sway=-1.0)}
    requests = {name: Request(text, frames / eager.frame_rate, 7, **knobs) for name, knobs in recipes.items()}
    target = eager.plan(requests["flash (4 steps)"]).frames  # frames, as the duration's ceil makes them
    bucket = ShapeBuckets((tokens,), (target,), (), max_tokens=2 * (tokens + target), max_requests=1)
    expected = {name: eager.generate(r) for name, r in requests.items()}
    results = {}
    for linears in ("bf16", "FP8") if fp8 else ("bf16",):
        served = AuKDiTSampler(copy.deepcopy(model) if linears == "FP8" else model, config, device, dtype,
                               buckets=bucket, compile=options, fp8_linears=linears == "FP8")
        served.warmup()
        for name, r in requests.items():
            results[f"{name}, {linears} linears"] = rel_l2(served.generate(r), expected[name])
        assert served.graphs.request_captures == served.graphs.eager_runs == 0, "the runs replayed their bucket's graphs"
    return results


def request_phases(model, frames: int, tokens: int, device, dtype, options: CompileOptions, runs: int = 20) -> list[str]:
    """Where one flash request's time goes in the sampler as auk_dit serves it on a GPU (the
    default bucket that holds it, compiled and graphed): wall ms per phase, each synchronized,
    median of `runs`; then the whole run as `execute` makes it, and the steps' GPU time alone."""
    settings = DiTSettings()
    buckets = settings.shape_buckets()
    shape = buckets.shape(tokens, frames)
    bucket = ShapeBuckets((shape.text,), (shape.frames,), (), max_tokens=shape.tokens, max_requests=1)
    served = AuKDiTSampler(model, sampler_config(model, "flash"), device, dtype, buckets=bucket, compile=options)
    served.warmup()
    text = torch.randn(tokens, model.text_hidden_dim, generator=torch.Generator().manual_seed(1))
    request = Request(text, frames / served.frame_rate, 7)

    def timed(fn) -> float:
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - began) * 1e3

    phases: dict[str, list[float]] = {}
    with torch.inference_mode():
        plan = served.plan(request)
        ctx, noise, mask = served._batch_context([plan], False)
        velocity = served.graphs.velocity(ctx, noise.shape)
        grid = plan.schedule.grid

        def context():
            run_ctx, run_noise, _ = served._batch_context([plan], False)
            served.graphs.velocity(run_ctx, run_noise.shape)

        for _ in range(runs):
            for name, fn in (
                ("plan (the request's checks)", lambda: served.plan(request)),
                ("context (prompt projection, noise, masks) and loading the graph's inputs", context),
                (f"{grid.numel() - 1} steps (graph replays and the Euler updates)",
                 lambda: euler_integrate(velocity, noise, grid, 0.0, None, mask)),
                ("generate_batch (context, steps, the finite check)", lambda: served.generate_batch([plan])[0]),
                ("the whole run, as execute makes it (plan, sampling, to the CPU)",
                 lambda: served.generate_batch([served.plan(request)])[0].to("cpu")),
            ):
                phases.setdefault(name, []).append(timed(fn))
        gpu = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            euler_integrate(velocity, noise, grid, 0.0, None, mask)
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end))
    assert served.graphs.request_captures == served.graphs.eager_runs == 0, "the runs replayed their bucket's graphs"
    lines = [f"one flash request, {frames} frames + {tokens} tokens in bucket {shape.text} x {shape.frames}, "
             f"wall ms per phase (median of {runs}):"]
    lines += [f"  {name}: {statistics.median(ms):.2f}" for name, ms in phases.items()]
    lines.append(f"  the steps' GPU time (CUDA events): {statistics.median(gpu):.2f}")
    began = time.perf_counter()
    gc.collect()
    lines.append(f"a full garbage collection in this process (the model built and compiled, "
                 f"{len(gc.get_objects())} objects tracked): {(time.perf_counter() - began) * 1e3:.1f} ms")
    return lines


def open_loop(model, frames: int, tokens: int, device, dtype, options: CompileOptions, rates: list[float],
              duration: float, alone: int = 16, seed: int = 0) -> list[str]:
    """Flash requests served in process as auk_dit's sampling thread serves them (JoinedRuns on
    the default bucket that holds them, compiled and graphed): one at a time, then arriving as
    a Poisson process at each rate. Each request is planned when it arrives and its latents
    copied to the host when it leaves; its sampling time runs from its arrival to that copy."""
    settings = DiTSettings()
    shape = settings.shape_buckets().shape(tokens, frames)
    bucket = ShapeBuckets((shape.text,), (shape.frames,), (), settings.max_batch_tokens, settings.max_batch_requests)
    served = AuKDiTSampler(model, sampler_config(model, "flash"), device, dtype, buckets=bucket, compile=options)
    served.warmup()
    runs = JoinedRuns(served, settings.max_batch_requests)
    texts = [torch.randn(tokens, model.text_hidden_dim, generator=torch.Generator().manual_seed(i)) for i in range(8)]

    def serve(arrivals: list[float]) -> list[float]:
        """The sampling time, ms, of requests arriving at these offsets (s) from now."""
        began, waiting, took = time.perf_counter(), list(enumerate(arrivals))[::-1], []
        while waiting or len(runs):
            now = time.perf_counter() - began
            while waiting and waiting[-1][1] <= now:
                index, at = waiting.pop()
                runs.submit(served.plan(Request(texts[index % 8], frames / served.frame_rate, index)), at)
            if not len(runs):
                time.sleep(max(0.0, waiting[-1][1] - now))
                continue
            for at, latents in runs.step():
                latents.to("cpu")
                took.append((time.perf_counter() - began - at) * 1e3)
        return sorted(took)

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    one = serve([0.05 * k for k in range(alone)])  # 50 ms apart: each runs alone
    lines = [f"flash requests in process, {frames} frames + {tokens} tokens in bucket {shape.text} x {shape.frames}, "
             f"rows joining runs between steps; sampling time from arrival to latents on the host, ms:",
             f"  one at a time ({alone}): p50 {statistics.median(one):.1f} / p99 {pct(one, 0.99):.1f}"]
    rng = random.Random(seed)
    for rate in rates:
        arrivals, at = [], rng.expovariate(rate)
        while at < duration:
            arrivals.append(at)
            at += rng.expovariate(rate)
        steps, rows = runs.steps, runs.stepped_rows
        began = time.perf_counter()
        took = serve(arrivals)
        wall = time.perf_counter() - began
        lines.append(f"  Poisson at {rate:g} requests/s, {duration:g} s ({len(took)} requests): p50 "
                     f"{statistics.median(took):.1f} / p90 {pct(took, 0.9):.1f} / p99 {pct(took, 0.99):.1f} "
                     f"(p99 {pct(took, 0.99) / statistics.median(one):.2f}x one at a time); "
                     f"{(runs.steps - steps) / wall:.0f} steps/s, "
                     f"{(runs.stepped_rows - rows) / max(1, runs.steps - steps):.2f} requests a step")
    if served.graphs is not None:
        assert served.graphs.request_captures == served.graphs.eager_runs == 0, "the runs replayed their bucket's graphs"
    return lines


def bucket_warmup(model, variant: str, device, dtype) -> None:
    """Build auk_dit's default buckets as its initialize does, and say what that took."""
    settings = DiTSettings()
    sampler = AuKDiTSampler(model, sampler_config(model, variant), device, dtype, max_graphs=settings.max_graphs,
                            buckets=settings.shape_buckets(), compile=CompileOptions())
    seconds: dict[bool, float] = {False: 0.0, True: 0.0}

    def on_bucket(shape, guided, graphs, took):
        seconds[guided] += took
        say(f"  bucket {shape.text} tokens, {shape.frames} frames, {shape.ref} reference frames, "
            f"{'guided' if guided else 'unguided'}: {graphs} graphs in {took:.2f} s")

    began = time.perf_counter()
    sampler.warmup(on_bucket)
    total = time.perf_counter() - began
    say(f"{sampler.graphs.captures} graphs of {len(sampler.buckets.shapes())} buckets ({variant}) in {total:.1f} s "
        f"(unguided {seconds[False]:.1f} s, guided {seconds[True]:.1f} s), "
        f"{sampler.graphs.compile_failures} compiled captures failed; "
        f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    say(compile_time_breakdown(8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="the tiny preset on the CPU: a smoke test")
    parser.add_argument("--preset", default=None, help="synthetic DiT preset (default: auk, or small with --small)")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --small")
    parser.add_argument("--frames", type=int, default=None, help="target frames (default 500; 24 with --small)")
    parser.add_argument("--tokens", type=int, default=None, help="text tokens (default 64; 8 with --small)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--iters", type=int, default=None, help="replays timed per step (default 50; 3 on a CPU)")
    parser.add_argument("--static", action="store_true", help="compile per shape instead of dynamic shapes")
    parser.add_argument("--backend", default=None, help="torch.compile backend (default inductor; eager on a CPU)")
    parser.add_argument("--unmasked", action="store_true", help="a context without masks (an unpadded batch)")
    parser.add_argument("--cache-dir", default=None, help="Inductor's and Triton's caches (default: a fresh folder)")
    parser.add_argument("--buckets", action="store_true", help="time auk_dit's load: every default bucket's graphs")
    parser.add_argument("--variant", default="base", choices=("base", "flash"), help="with --buckets")
    parser.add_argument("--profile", action="store_true", help="where the compiled step's GPU time goes, per batch")
    parser.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                        help="torch._inductor.config options for the compiled step")
    parser.add_argument("--no-whole-runs", action="store_true", help="skip the whole flash and base runs")
    parser.add_argument("--fp8", action="store_true",
                        help="also the compiled step and the whole runs with the token linears in FP8")
    parser.add_argument("--compare-without", nargs="+", default=[], metavar="OPTION",
                        choices=("block_kernels", "compile_edges"),
                        help="also the compiled step with this CompileOptions switch off")
    parser.add_argument("--request", action="store_true",
                        help="only where one flash request's time goes in the sampler, phase by phase (GPU)")
    parser.add_argument("--open-loop", type=float, nargs="+", default=None, metavar="RATE",
                        help="only flash requests served in process, rows joining between steps: one at a time, "
                             "then Poisson arrivals at each RATE per second")
    parser.add_argument("--duration", type=float, default=20.0, help="--open-loop: seconds of arrivals per rate")
    args = parser.parse_args()
    preset = args.preset or ("small" if args.small else "auk")
    device = torch.device(args.device or ("cpu" if args.small else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --small for the CPU smoke test)")
    if device.type == "cuda" or args.cache_dir:  # the CPU smoke test's eager backend writes no code
        use_compile_cache(Path(args.cache_dir or tempfile.mkdtemp(prefix="auk-dit-step-")))
    if device.type == "cuda":
        # As load_sampler does for the served DiT; the environment's sizes win, for comparisons.
        say(f"cuBLAS workspaces: {without_gemm_workspace()}")
    frames = args.frames or (24 if args.small else 500)
    tokens = args.tokens or (8 if args.small else 64)
    iters = args.iters or (50 if device.type == "cuda" else 3)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = args.backend or ("inductor" if device.type == "cuda" else "eager")

    began = time.perf_counter()
    model = synthetic_transformer(preset, seed=0, device=device, dtype=dtype)
    say(heading(f"DiT step, {preset} (synthetic), {frames} frames + {tokens} tokens, {dtype}", device.type,
                f", compile {backend} {'static' if args.static else 'dynamic'}")
        + f" (model built in {time.perf_counter() - began:.0f} s)")
    if args.buckets:
        if device.type != "cuda":
            sys.exit("--buckets captures CUDA graphs: it needs a GPU")
        bucket_warmup(model, args.variant, device, dtype)
        return
    options = CompileOptions(dynamic=not args.static, backend=backend)
    set_inductor_options(args.inductor)
    if args.request or args.open_loop:
        if args.request and device.type != "cuda":
            sys.exit("--request replays the served graphs: it needs a GPU")
        lines = (request_phases(model, frames, tokens, device, dtype, options) if args.request else
                 open_loop(model, frames, tokens, device, dtype, options, args.open_loop, args.duration))
        for line in lines:
            say(line)
        return
    if args.inductor:
        say(f"Inductor options: {' '.join(args.inductor)}")
    blocks = compiled_blocks(options)
    other_blocks = {WITHOUT_PATH.format(field): compiled_blocks(dataclasses.replace(options, **{field: False}))
                    for field in args.compare_without}
    profiles = {}
    fp8_model = None
    if args.fp8:
        check_fp8_support(device, dtype)
        fp8_model = copy.deepcopy(model)
        say(f"FP8 linears: {use_fp8_linears(fp8_model, dtype)} of the blocks' linears in a copy of the model")

    rows = []
    with torch.inference_mode():
        for batch in args.batches:
            x, ctx, t, table = step_inputs(model, batch, frames, tokens, not args.unmasked, device, dtype)
            fns = step_functions(model, x, ctx, t, table, blocks, device, dtype, fp8_model, other_blocks)
            # The compiled step does the eager step's work; the per-step modulation adds its linears.
            work = step_flops(fns[PATHS[1]])
            flops = {PATHS[0]: step_flops(fns[PATHS[0]]), PATHS[1]: work, PATHS[2]: work, FP8_PATH: work,
                     **{name: work for name in other_blocks}}
            say(f"  batch {batch}: {work / 1e9:.1f} GFLOP per step (from the table), "
                f"{flops[PATHS[0]] / 1e9:.1f} (modulation per step)")
            results = {}
            for name, fn in fns.items():
                try:
                    results[name] = measure(fn, device, iters)
                except Exception as err:  # a variant that fails to build is reported; the others are measured
                    say(f"  batch {batch}, {name}: FAILED: {type(err).__name__}: {str(err)[:300]}")
            reference = results[PATHS[1]][2].float()
            for name, (ms, built, out, _) in results.items():
                rows.append((batch, name, ms, flops[name] / (ms / 1e3) / 1e12, rel_l2(out.float(), reference), built))
                say(f"  batch {batch}, {name}: {ms:.2f} ms, built in {built:.1f} s")
            if args.profile and device.type == "cuda":
                for name in (PATHS[2], FP8_PATH, *other_blocks):
                    if name in results:
                        profiles[(batch, name)] = kernel_profile(results[name][3])

    say()
    say(f"| batch | step | ms per step | TFLOP/s | rel. L2 vs the eager step ({dtype}) | compile + capture s |")
    say("| --- | --- | --- | --- | --- | --- |")
    for batch, name, ms, tflops, rel, built in rows:
        say(f"| {batch} | {name} | {ms:.2f} | {tflops:.3g} | {rel:.2e} | {built:.1f} |")
    for (batch, name), lines in profiles.items():
        say()
        say(f"The {name} step at batch {batch}, by torch's profiler:")
        for line in lines:
            say(line)
    if device.type != "cuda" or args.no_whole_runs:
        return
    say()
    for name, rel in whole_runs(model, frames, tokens, device, dtype, options, args.fp8).items():
        say(f"whole {name} run, served (compiled, graphed, its bucket) vs eager: relative L2 {rel:.2e} of the latents")
    say(compile_time_breakdown(8))


if __name__ == "__main__":
    main()
