"""The pipeline under load: auk_dit batching its requests, against the same server with batching off.

For each recipe (`flash`: 4 unguided steps; `base`: 32 steps, guidance 2) and for
`auk_dit` with batching off (`max_batch_requests` 1: one request per sampler run,
as before batching) and on (the shipped config), a real tritonserver
(auk_dit + auk_vae_decode + auk_pipeline, synthetic released-dims weights) is
started and driven over gRPC streams:

- one client, `--reps` requests after a warm-up: first audio and total, median;
- `--clients` closed-loop clients (each sends its next request when its stream
  has ended), `--requests` each after `--warmup-requests` each (the graphs of the
  batch sizes the loop forms are captured then): first audio and total p50/p99,
  throughput (requests completed per second over the window), and auk_dit's
  requests per execute (Triton's counters over the window).

In process, before the servers: the graphed velocity step per batch size (as
served: bf16 under autocast, one CUDA graph per shape), a whole sampler run of
that batch against its steps, and a padded batch's latents against each
request alone (max error over the largest value, cosine), per recipe. With N closed-loop clients every request needs its share of the
DiT's time, so first audio cannot fall below about N x (steps x step time at
batch N / N): the table prints that floor.

    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_pipeline_load.py --cache-dir /tmp/auk-bench
    # the script's check on a CPU (tiny sizes; the numbers are no measurement):
    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_pipeline_load.py --device cpu --preset small \\
        --seconds 0.5 --tokens 8 --clients 3 --requests 2 --reps 2 --base-steps 3 --batch-sizes 1 2 4
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

from auk_triton.diffusion import Request, load_sampler
from common import (executes, heading, model_repository_copy, percentile, read_traces, recipe_checkpoints, recipes,
                    say, start_server, trace_arguments)

MODELS = ("auk_dit", "auk_vae_decode", "auk_pipeline")
MODES = {"off": "1", "on": ""}  # max_batch_requests: 1, or the shipped default


# ---- in process ------------------------------------------------------------------------------


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def step_ms(checkpoint: Path, device: str, recipe: dict, embeds: np.ndarray, seconds: float,
            batch_sizes, iters: int = 20) -> dict[int, float]:
    """Median ms of one velocity step (graphed on a GPU) for `b` requests of the same shape."""
    sampler = load_sampler(checkpoint, device, max_graphs=1)
    times = {}
    for b in batch_sizes:
        plans = [sampler.plan(Request(torch.from_numpy(embeds), seconds, seed, **recipe)) for seed in range(b)]
        with torch.inference_mode():
            ctx, noise, _ = sampler._batch_context(plans, plans[0].schedule.guided)
            graphed = None if sampler.graphs is None else sampler.graphs.velocity(ctx, noise.shape)

            def velocity(x, t):
                if graphed is not None:
                    return graphed(x, t)
                with sampler._autocast():
                    return sampler.model.step(x, t, ctx)

            t = plans[0].schedule.grid[1]  # a time of the run's grid (CPU): its modulation is in the table
            for _ in range(3):
                velocity(noise, t)
            samples = []
            for _ in range(iters):
                sync(device)
                began = time.perf_counter()
                velocity(noise, t)
                sync(device)
                samples.append((time.perf_counter() - began) * 1e3)
        times[b] = statistics.median(samples)
        # A whole sampler run as the model makes it (context, noise, the graphed steps, checks):
        # what it takes beyond its steps is host work the step graphs do not hide.
        run = []
        for rep in range(4):
            sync(device)
            began = time.perf_counter()
            sampler.generate_batch(plans)
            sync(device)
            if rep:
                run.append((time.perf_counter() - began) * 1e3)
        say(f"  step, batch {b}: {times[b]:.2f} ms ({times[b] / b:.2f} ms a request); whole run "
            f"{statistics.median(run):.1f} ms against {len(plans[0].schedule.grid) - 1} steps")
    del sampler
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return times


def batched_vs_alone(checkpoint: Path, device: str, recipe: dict, seconds: float, tokens: int) -> tuple[float, float]:
    """A padded batch of four (prompts and targets of different lengths): the worst row's max
    error over its largest value, and its cosine, against each request alone."""
    sampler = load_sampler(checkpoint, device, max_graphs=4)
    rng = np.random.default_rng(7)
    shapes = [(tokens, seconds), (max(1, tokens // 2), seconds * 0.7), (tokens, seconds), (max(1, tokens // 3), seconds * 0.3)]
    requests = [Request(torch.from_numpy(rng.standard_normal((n, 2048)).astype(np.float32)), s, 10 + i, **recipe)
                for i, (n, s) in enumerate(shapes)]
    rows = sampler.generate_batch([sampler.plan(r) for r in requests])
    worst_rel, worst_cos = 0.0, 1.0
    for request, row in zip(requests, rows):
        alone = sampler.generate(request)
        worst_rel = max(worst_rel, float((row - alone).abs().max() / alone.abs().max()))
        worst_cos = min(worst_cos, float(torch.nn.functional.cosine_similarity(row.flatten(), alone.flatten(), dim=0)))
    del sampler
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return worst_rel, worst_cos


# ---- served ----------------------------------------------------------------------------------


def one_request(url: str, embeds: np.ndarray, seconds: float, seed: int, recipe: dict) -> tuple[float, float]:
    """(first audio ms, total ms) of one pipeline stream."""
    from auk_client.pipeline import stream_pipeline

    began = time.perf_counter()
    first = None
    for tile in stream_pipeline(embeds, seconds, seed, url=url, **recipe):
        if first is None:
            first = tile.arrived_s * 1e3
    return first, (time.perf_counter() - began) * 1e3


def one_client(url, embeds, seconds, recipe, reps: int) -> dict:
    one_request(url, embeds, seconds, 0, recipe)  # warm-up: the connection, the graphs of this shape
    runs = [one_request(url, embeds, seconds, 1 + rep, recipe) for rep in range(reps)]
    return {"first_p50": statistics.median(r[0] for r in runs), "total_p50": statistics.median(r[1] for r in runs)}


def closed_loop(url, embeds, seconds, recipe, clients: int, requests: int, warmup: int = 1,
                metrics_url: str | None = None) -> dict:
    """`clients` threads, each `warmup` requests then `requests` measured ones, back to back;
    with `metrics_url`, also auk_dit's requests per execute over the measured ones.

    The warm-up is itself a closed loop: auk_dit's batcher forms runs of many sizes, and each
    size's step graph is captured on its first run (about two eager steps), which in the
    window would count as sampling time."""
    results, errors = [], []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)
    window = {}

    def client(index: int) -> None:
        for rep in range(warmup):
            try:
                one_request(url, embeds, seconds, 1000 * index + rep, recipe)
            except Exception as err:  # noqa: BLE001  (reported below)
                errors.append(err)
        barrier.wait()
        for rep in range(requests):
            try:
                outcome = one_request(url, embeds, seconds, 1000 * index + warmup + rep, recipe)
                with lock:
                    results.append(outcome)
                    window["end"] = time.perf_counter()
            except Exception as err:  # noqa: BLE001
                errors.append(err)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    before = dit_counts(metrics_url) if metrics_url else None
    for thread in threads:
        thread.join()
    after = dit_counts(metrics_url) if metrics_url else None
    if errors:
        say(f"  {len(errors)} requests failed, the first: {errors[0]}")
    elapsed = window.get("end", time.perf_counter()) - began
    firsts, totals = [r[0] for r in results], [r[1] for r in results]
    return {"first_p50": percentile(firsts, 50), "first_p99": percentile(firsts, 99),
            "total_p50": percentile(totals, 50), "total_p99": percentile(totals, 99),
            "throughput": len(results) / elapsed, "errors": len(errors), "window": (began, began + elapsed),
            "batch": (after[0] - before[0]) / (after[1] - before[1]) if after and after[1] > before[1] else float("nan")}


def dit_runs_report(trace_file: Path, window: tuple[float, float]) -> list[str]:
    """What tritonserver's trace says of auk_dit's sampler runs in the closed loop's window:
    how busy it was, and each batch size's run times (the first run of a size captures its
    step graph). The requests of one `execute` share its COMPUTE_START."""
    runs = executes((request.first("COMPUTE_START"), request.first("COMPUTE_END"))
                    for request in read_traces(trace_file).values() if request.model == "auk_dit")
    if not runs:
        return ["  no auk_dit traces (tritonserver wrote none)"]
    began, ended = (int(t * 1e9) for t in window)
    seen: set[int] = set()
    by_rows: dict[int, list[tuple[float, bool]]] = {}  # rows -> (ms, first of its size) in the window
    busy_ns, idle_ms, last_end = 0, [], None
    for start in sorted(runs):
        end, rows = runs[start]
        first = rows not in seen
        seen.add(rows)
        if began <= start and end <= ended:
            by_rows.setdefault(rows, []).append(((end - start) / 1e6, first))
            busy_ns += end - start
            if last_end is not None:
                idle_ms.append((start - last_end) / 1e6)
            last_end = end
    count = sum(len(v) for v in by_rows.values())
    captures = sum(first for v in by_rows.values() for _, first in v)
    lines = [f"  auk_dit in the window (traced): {count} runs, busy {busy_ns / max(1, ended - began) * 100:.0f}% "
             f"(idle between runs p50 {percentile(idle_ms, 50):.1f} / max {max(idle_ms, default=0):.1f} ms); "
             f"{captures} first runs of a batch size (with CUDA graphs, each captures its graph)"]
    for rows, times in sorted(by_rows.items()):
        later = [ms for ms, first in times if not first]
        firsts = [ms for ms, first in times if first]
        lines.append(f"    runs of {rows}: {len(times)}" +
                     (f", first {firsts[0]:.1f} ms" if firsts else "") +
                     (f", later p50 {statistics.median(later):.1f} ms" if later else ""))
    return lines


def dit_counts(metrics_url: str) -> tuple[float, float]:
    """auk_dit's (requests, executions) on Triton's metrics port: their growth over a run is
    the dynamic batcher's requests per execute."""
    text = urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=5).read().decode()

    def total(name: str) -> float:
        return sum(float(value) for value in re.findall(rf'^{name}\{{[^}}]*model="auk_dit"[^}}]*\}} (\S+)$', text, re.M))

    return total("nv_inference_count"), total("nv_inference_exec_count")


def repository(dest: Path, max_batch_requests: str, queue_delay_us: int | None) -> Path:
    """A copy of model_repository/ whose auk_dit configs set max_batch_requests (and the queue delay)."""
    model_repository_copy(dest)
    for config in (dest / "auk_dit").glob("**/*.pbtxt"):
        text, count = re.subn(r'(key: "max_batch_requests", value: \{ string_value: )"[^"]*"',
                              rf'\1"{max_batch_requests}"', config.read_text())
        if count != 1:
            raise RuntimeError(f"no max_batch_requests parameter in {config}")
        if queue_delay_us is not None:
            text = re.sub(r"max_queue_delay_microseconds: \d+", f"max_queue_delay_microseconds: {queue_delay_us}", text)
        config.write_text(text)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--preset", default="auk", help="synthetic preset for both the DiT and the codec")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=64, help="prompt tokens (seeded stand-in embeddings)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8, help="measured requests per closed-loop client")
    parser.add_argument("--warmup-requests", type=int, default=4,
                        help="closed-loop warm-up requests per client, before the measured ones")
    parser.add_argument("--reps", type=int, default=5, help="one-client requests")
    parser.add_argument("--base-steps", type=int, default=32)
    parser.add_argument("--recipes", nargs="+", default=["flash", "base"], choices=["flash", "base"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--queue-delay-us", type=int, default=None, help="auk_dit's dynamic batcher delay (default: as shipped)")
    parser.add_argument("--no-server", action="store_true", help="only the in-process figures")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="tritonserver traces every request (FILE.<recipe>-<mode>.json per server); the report "
                             "then sums up auk_dit's sampler runs in the closed loop")
    parser.add_argument("--cache-dir", default=None, help="checkpoints and compile caches (reused across runs)")
    parser.add_argument("--log", default="tritonserver-pipeline-load.log")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --device cpu --preset small to check the script)")

    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="auk-pipeline-load-"))
    dirs = recipe_checkpoints(cache, args.preset)
    all_recipes = recipes(args.base_steps)
    embeds = np.random.default_rng(0).standard_normal((args.tokens, 2048)).astype(np.float32)
    say(heading(f"AuK pipeline under load, {args.preset} (synthetic), {args.seconds:g} s of audio, "
                f"{args.tokens} prompt tokens, {args.clients} closed-loop clients", device=args.device))
    say(f"date {datetime.date.today().isoformat()}; command: python3 {' '.join(shlex.quote(a) for a in sys.argv)}")

    steps, accuracy = {}, {}
    for name in args.recipes:
        recipe = all_recipes[name]
        say(f"in process, {name}:")
        steps[name] = step_ms(dirs[name], args.device, recipe, embeds, args.seconds, args.batch_sizes)
        accuracy[name] = batched_vs_alone(dirs[name], args.device, recipe, args.seconds, args.tokens)
        say(f"  padded batch of 4 against each alone: max error {accuracy[name][0]:.2e} of the largest value, "
            f"cosine {accuracy[name][1]:.6f}")

    served = {}
    if not args.no_server:
        device = "gpu" if args.device == "cuda" else "cpu"
        for name in args.recipes:
            recipe = all_recipes[name]
            for mode in args.modes:
                repo = repository(cache / f"repository-{name}-{mode}", MODES[mode], args.queue_delay_us)
                trace = Path(f"{args.trace}.{name}-{mode}.json") if args.trace else None
                process, url, _, metrics_url = start_server(
                    dirs[name], cache, Path(args.log), MODELS, ready_timeout_s=900, device=device,
                    model_repository=repo, extra_args=trace_arguments(trace) if trace else ())
                try:
                    row = one_client(url, embeds, args.seconds, recipe, args.reps)
                    loop = closed_loop(url, embeds, args.seconds, recipe, args.clients, args.requests,
                                       args.warmup_requests, metrics_url)
                    row.update({f"load_{k}": v for k, v in loop.items()})
                finally:
                    process.terminate()
                    process.wait(timeout=120)
                served[name, mode] = row
                say(f"served, {name}, batching {mode}: one client first audio {row['first_p50']:.1f} ms; "
                    f"{args.clients} clients first audio p50 {row['load_first_p50']:.1f} / p99 {row['load_first_p99']:.1f} ms, "
                    f"{row['load_throughput']:.2f} requests/s, auk_dit {row['load_batch']:.2f} requests per execute")
                if trace:  # written as the server stopped
                    for line in dit_runs_report(trace, row["load_window"]):
                        say(line)

    say()
    say("| recipe | step ms by batch (per request) | batched vs alone: max err / cosine |")
    say("| --- | --- | --- |")
    for name in args.recipes:
        cells = ", ".join(f"{b}: {ms:.1f} ({ms / b:.2f})" for b, ms in steps[name].items())
        say(f"| {name} | {cells} | {accuracy[name][0]:.1e} / {accuracy[name][1]:.6f} |")
    if served:
        say()
        say(f"| recipe | auk_dit batching | 1 client: first audio p50 | total p50 | {args.clients} clients: first audio "
            "p50 | p99 | p99 / 1-client p50 | total p50 | p99 | requests/s | vs off | requests per execute "
            "| first-audio floor |")
        say("| --- " * 13 + "|")
        for (name, mode), row in served.items():
            off = served.get((name, "off"))
            gain = f"{row['load_throughput'] / off['load_throughput']:.2f}x" if off else "-"
            one = served.get((name, "off"), row)["first_p50"]
            b = max(steps[name])
            per_request = all_recipes[name].get("num_steps", 4) * steps[name][b] / b
            say(f"| {name} | {mode} | {row['first_p50']:.1f} | {row['total_p50']:.1f} | {row['load_first_p50']:.1f} | "
                f"{row['load_first_p99']:.1f} | {row['load_first_p99'] / one:.2f} | {row['load_total_p50']:.1f} | "
                f"{row['load_total_p99']:.1f} | {row['load_throughput']:.2f} | {gain} | {row['load_batch']:.2f} | "
                f"{args.clients * per_request:.0f} ms |")
        say("(p99 / 1-client p50: against batching off's one client, today's figure. The floor: clients x the "
            f"DiT's time per request at batch {max(args.batch_sizes)}; closed-loop first audio cannot go below it.)")


if __name__ == "__main__":
    main()
