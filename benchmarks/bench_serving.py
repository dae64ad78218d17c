"""End-to-end decode latency through a real Triton server, against the same decode in-process.

One run, one GPU: first the decode in this process (the wrapper the model uses,
with the served defaults: the fused activation kernel on channels-last signals,
buckets 32/128/256/512, a first window of the smallest bucket; warmed up the
same way), then a real
`tritonserver` serving `model_repository/` on the same synthetic checkpoint,
driven over gRPC streaming by `concurrency` clients, each on its own persistent
stream. Time to first audio is the arrival of the first tile; total is the
arrival of the final response (the last tile carries the final flag, so for a
one-tile clip both are the same response). The serving overhead is the
server's median total over the in-process median total at concurrency 1.
Weights are synthetic (seeded, not real audio); speed depends on geometry only.

Triton's own statistics for the model, read before and after each cell, split
that overhead at concurrency 1: the server side is Triton's mean request
duration (from the request's arrival in the server to the end of `execute`,
which sends every tile) minus the in-process decode; the rest, the client's
mean total minus Triton's request duration, is gRPC transfer and the Python
client. Statistics a server does not report print as n/a.

With `--perf-analyzer PATH`, `benchmarks/run_perf_analyzer.py` then runs a
short pass of perf_analyzer against the same server (both decode models).
`--device cpu` runs the same pass on the CPU (eager decode, the CPU model
config): slow, a check that the script works, not a measurement to quote.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_serving.py --seconds 2 10 60 --concurrency 1 4 16
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_serving.py --device cpu --preset small --seconds 2 \
        --concurrency 1 --reps 2

Each cell runs once per sample format (`--formats`): float32 asks for all outputs
(so WAVEFORM, as a client that names none), pcm16 names WAVEFORM_PCM16 and gets
int16 samples, half the bytes; its in-process reference converts on the device
before the copy to the host, as the model does.

Before the cells, one request per format with the longest clip checks that the
server's samples equal the in-process decode's. `--buckets` compiles fewer
buckets, in process and in the server (a copy of `model_repository/` with those
`compile_shapes`): `--buckets 32 512` serves a 10 s clip (one 512-frame window)
and a 60 s clip's first audio (the 32-frame first window) as the default does,
in half the warm-up.
"""

import argparse
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from auk_triton.codec import DEFAULT_COMPILE_SHAPES
from common import (
    MODEL,
    MODEL_METRICS_LAG_S,
    OFFLINE_MODEL,
    clip_latents,
    heading,
    in_process_decode,
    model_repository_copy,
    model_seconds,
    percentile,
    perf_analyzer_script,
    start_server,
    synthetic_checkpoint,
)

# Triton's cumulative per-model statistics (inference_stats), each a count and nanoseconds.
STAT_FIELDS = ("queue", "compute_input", "compute_infer", "compute_output", "success")
# Sample formats: the output each client asks for (None: all outputs, the float32 WAVEFORM).
OUTPUTS = {"float32": None, "pcm16": "WAVEFORM_PCM16"}


def check_served(url: str, seconds: float, references: dict) -> None:
    """One streamed request per format with `clip_latents(seconds)`: the served samples against
    the in-process ones (the same compiled decode in another process)."""
    from auk_client.stream import stream_decode

    for fmt, expected in references.items():
        tiles = list(stream_decode(clip_latents(seconds), url=url, pcm16=fmt == "pcm16"))
        served = np.concatenate([tile.waveform for tile in tiles])
        if served.shape != expected.shape:
            print(f"served {fmt}: {served.size} samples, in-process {expected.size}", flush=True)
            continue
        diff = np.abs(served.astype(np.float64) - expected.astype(np.float64))
        rel = np.linalg.norm(diff) / max(np.linalg.norm(expected.astype(np.float64)), 1e-30)
        print(f"served vs in-process, {fmt}, {seconds:g} s clip, {len(tiles)} tiles: "
              f"rel. L2 {rel:.1e}, max abs {diff.max():.3g}{' (int16 steps)' if fmt == 'pcm16' else ''}", flush=True)


def client_loop(
    url: str, latents: np.ndarray, reps: int, out: list, barrier: threading.Barrier, waveform: str | None = None
) -> None:
    """`reps` requests on one stream; `waveform`: the output to ask for (None: all, so WAVEFORM)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    responses = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
    inputs = [grpcclient.InferInput("LATENTS", list(latents.shape), "FP32")]
    inputs[0].set_data_from_numpy(latents)
    outputs = None if waveform is None else [grpcclient.InferRequestedOutput(n) for n in (waveform, "START_SAMPLE")]
    barrier.wait()
    for _ in range(reps):
        sent = time.perf_counter()
        client.async_stream_infer(MODEL, inputs, outputs=outputs, enable_empty_final_response=True)
        first = None
        while True:
            arrived, result, error = responses.get(timeout=300)
            if error is not None:
                raise RuntimeError(str(error))
            # The last tile carries the final flag: one response may be both the first and the last.
            if first is None and result.as_numpy(waveform or "WAVEFORM") is not None:
                first = arrived - sent
            params = result.get_response().parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                if first is None:
                    raise RuntimeError("the stream ended without a tile")
                out.append((first * 1e3, (arrived - sent) * 1e3))
                break
    client.stop_stream()
    client.close()


def server_stats(url: str, model: str = MODEL) -> dict:
    """Triton's cumulative (count, ns) per statistic in STAT_FIELDS for `model`; absent ones left out.

    The JSON form writes 64-bit integers as strings and leaves out zeros, so an
    empty entry is a zero count.
    """
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        reply = client.get_inference_statistics(model_name=model, as_json=True)
    except Exception as err:  # a server without the statistics extension
        print(f"no inference statistics for {model}: {err}", flush=True)
        return {}
    finally:
        client.close()
    totals: dict = {}
    for entry in reply.get("model_stats", []):  # one per loaded version
        stats = entry.get("inference_stats", {})
        for field in STAT_FIELDS:
            if isinstance(stats.get(field), dict):
                count, ns = totals.get(field, (0, 0))
                totals[field] = (count + int(stats[field].get("count", 0)), ns + int(stats[field].get("ns", 0)))
    return totals


def stats_after(url: str, since: dict, requests: int, timeout_s: float = 5.0) -> dict:
    """Triton's statistics once it counts `requests` more successes than `since` (or after `timeout_s`).

    Triton counts a decoupled request when `execute` returns, which can be just
    after its final response has reached the client.
    """
    deadline = time.perf_counter() + timeout_s
    while True:
        stats = server_stats(url)
        counted = stats.get("success", (0, 0))[0] - since.get("success", (0, 0))[0]
        if "success" not in stats or counted >= requests or time.perf_counter() > deadline:
            return stats
        time.sleep(0.01)


def server_means(before: dict, after: dict) -> dict:
    """Mean ms per counted request of each statistic between two snapshots; None where unknown."""
    means: dict = {}
    for field in STAT_FIELDS:
        if field in before and field in after:
            count = after[field][0] - before[field][0]
            means[field] = (after[field][1] - before[field][1]) / count / 1e6 if count > 0 else None
        else:
            means[field] = None
    success = [snapshot["success"][0] for snapshot in (before, after) if "success" in snapshot]
    means["requests"] = success[1] - success[0] if len(success) == 2 else None
    return means


def ms(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def load(url: str, metrics_url: str, seconds: float, concurrency: int, reps: int, waveform: str | None = None) -> dict:
    latents = clip_latents(seconds)
    start = server_stats(url)
    client_loop(url, latents, 2, [], threading.Barrier(1), waveform)  # warm the connection and the plain graphs
    before = stats_after(url, start, 2)  # the cell's statistics leave the warm-up out
    model_before = model_seconds(metrics_url)
    samples: list = []
    barrier = threading.Barrier(concurrency + 1)
    threads = [
        threading.Thread(target=client_loop, args=(url, latents, reps, samples, barrier, waveform))
        for _ in range(concurrency)
    ]
    for thread in threads:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    server = server_means(before, stats_after(url, before, len(samples)))
    time.sleep(MODEL_METRICS_LAG_S)
    model_after = model_seconds(metrics_url)
    server["decode_per_request"] = server["send_per_request"] = None
    if model_before and model_after and model_after[0] > model_before[0]:
        server["decode_per_request"] = (model_after[1] - model_before[1]) * 1e3 / len(samples)
        server["send_per_request"] = (model_after[2] - model_before[2]) * 1e3 / len(samples)
    firsts, totals = [s[0] for s in samples], [s[1] for s in samples]
    return {
        "first_p50": statistics.median(firsts), "first_p99": percentile(firsts, 99),
        "total_p50": statistics.median(totals), "total_p99": percentile(totals, 99),
        "total_mean": statistics.fmean(totals),
        "audio_s_per_s": len(samples) * seconds / wall, "requests": len(samples),
        "server": server,
    }


def print_breakdown(rows: dict, local: dict, seconds_list, fmt: str) -> None:
    """Triton's per-request means at concurrency 1, and the overhead split into server and the rest.

    overhead = client mean total - in-process median total
             = (Triton request duration - in-process) + (client total - Triton request duration)

    "decode in model" is the model's own decode seconds per request (its tiles' launch to
    host memory, as in process) and "send in model" its time in `sender.send`, so request -
    decode - send is what the model spends on the rest: reading the request, building the
    responses, metrics.
    """
    print(f"\nServer side, {fmt}, concurrency 1 (Triton's statistics, mean ms per request):")
    print("| audio | requests | queue | compute input | compute infer | compute output | request (success) | "
          "in-process total | decode in model | send in model | client total (mean) | overhead | server side | "
          "gRPC + client |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for seconds in seconds_list:
        row = rows.get((fmt, seconds, 1))
        if row is None:
            continue
        server, decode, client = row["server"], local[fmt][seconds][1], row["total_mean"]
        request = server["success"]
        server_side = None if request is None else request - decode
        rest = None if request is None else client - request
        requests = "n/a" if server["requests"] is None else f"{server['requests']} (client {row['requests']})"
        cells = [ms(server[field]) for field in ("queue", "compute_input", "compute_infer", "compute_output")]
        in_model = f"{ms(server['decode_per_request'])} | {ms(server['send_per_request'])}"
        print(f"| {seconds:g} s | {requests} | " + " | ".join(cells) + f" | {ms(request)} | {ms(decode)} | "
              f"{in_model} | {ms(client)} | {ms(client - decode)} | {ms(server_side)} | {ms(rest)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="auk")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: eager decode in process and the CPU model config (a check, not a measurement)")
    parser.add_argument("--seconds", type=float, nargs="+", default=[2, 10, 60])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--reps", type=int, default=8, help="requests per client per cell")
    parser.add_argument("--buckets", type=int, nargs="+", default=list(DEFAULT_COMPILE_SHAPES),
                        help="compiled buckets, in process and served (a copy of model_repository/ where they "
                             "differ from its configs'); 32 512 cover a 10 s clip and a 60 s clip's first audio "
                             "in half the warm-up time")
    parser.add_argument("--first-tile-frames", type=int, default=None,
                        help="the in-process first window (default: the smallest bucket, as served); 0: off")
    parser.add_argument("--formats", nargs="+", default=["float32", "pcm16"], choices=list(OUTPUTS),
                        help="sample formats to measure: float32 (WAVEFORM) and pcm16 (WAVEFORM_PCM16, half the bytes)")
    parser.add_argument("--perf-analyzer", default=None, help="a perf_analyzer binary: also run a short pass of it")
    parser.add_argument("--cache-dir", default=None, help="AUK_CACHE_DIR for the server (compile caches)")
    parser.add_argument("--log", default="tritonserver.log")
    args = parser.parse_args()

    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="auk-serving-"))
    checkpoint = synthetic_checkpoint(cache / "bench_checkpoint", args.preset)
    print(heading(f"AuK serving, {args.preset} (synthetic)", args.device), flush=True)

    check_seconds = max(args.seconds)
    first_tile_frames = min(args.buckets) if args.first_tile_frames is None else args.first_tile_frames
    local, references = in_process_decode(checkpoint, args.seconds, args.reps, first_tile_frames, args.device,
                                          args.formats, check_seconds, args.buckets)
    for fmt in args.formats:
        print(f"in-process, {fmt}: one {local[fmt]['tile_frames']}-frame tile {local[fmt]['one_tile_ms']:.2f} ms",
              flush=True)
        for seconds in args.seconds:
            print(f"in-process, {fmt}, {seconds:g} s: first tile {local[fmt][seconds][0]:.2f} ms, "
                  f"total {local[fmt][seconds][1]:.2f} ms", flush=True)

    models = (MODEL, OFFLINE_MODEL) if args.perf_analyzer else (MODEL,)
    repository = None
    if tuple(args.buckets) != tuple(DEFAULT_COMPILE_SHAPES):
        repository = model_repository_copy(cache / "model_repository", args.buckets)
    process, url, http_url, metrics_url = start_server(
        checkpoint, cache, Path(args.log), models, device="gpu" if args.device == "cuda" else "cpu",
        model_repository=repository)
    try:
        check_served(url, check_seconds, references)
        print("| format | audio | concurrency | first audio p50 ms | p99 | total p50 ms | p99 | audio s per s "
              "| in-process total ms |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
        rows = {}
        for fmt in args.formats:
            for seconds in args.seconds:
                for concurrency in args.concurrency:
                    row = load(url, metrics_url, seconds, concurrency, args.reps, OUTPUTS[fmt])
                    rows[fmt, seconds, concurrency] = row
                    print(f"| {fmt} | {seconds:g} s | {concurrency} | {row['first_p50']:.1f} | {row['first_p99']:.1f} | "
                          f"{row['total_p50']:.1f} | {row['total_p99']:.1f} | {row['audio_s_per_s']:.0f} | "
                          f"{local[fmt][seconds][1]:.1f} |", flush=True)
        for fmt in args.formats:
            print_breakdown(rows, local, args.seconds, fmt)
        if args.perf_analyzer:
            subprocess.run(
                [sys.executable, str(perf_analyzer_script()), "--perf-analyzer", args.perf_analyzer, "--grpc-url", url,
                 "--http-url", http_url, "--seconds", "10", "--concurrency", "1,4",
                 "--measurement-mode", "count_windows", "--measurement-request-count", "20",
                 "--max-trials", "4", "--first-audio-requests", "8", "--out-dir", str(cache / "perf")],
                check=False,
            )
    finally:
        process.terminate()
        process.wait(timeout=60)

    for fmt in args.formats:
        if (fmt, 10.0, 1) in rows:
            overhead = rows[fmt, 10.0, 1]["total_p50"] / local[fmt][10.0][1] - 1
            print(f"serving overhead, {fmt}, 10 s clip, concurrency 1: {overhead * 100:.1f}% of the in-process decode")
        if (fmt, 60.0, 1) in rows:
            ratio = rows[fmt, 60.0, 1]["first_p50"] / local[fmt]["one_tile_ms"]
            print(f"time to first audio, {fmt}, 60 s clip, concurrency 1: {ratio:.2f} x one tile's decode")


if __name__ == "__main__":
    main()
