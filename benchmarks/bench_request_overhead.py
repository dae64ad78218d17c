r"""Where a one-tile request's time goes beyond its decode, way by way.

One client on the server's host sends the same clip (one window: at most
10.24 s) back to back and asks for WAVEFORM_PCM16, five ways:

- stream gRPC: the decoupled model on one gRPC stream, latents and samples in
  the messages (what `bench_serving.py` measures);
- stream shm: the same, with the latents and the samples in system
  shared-memory regions the client registered (Triton's extension, same host);
- offline gRPC: the one-response model, a unary gRPC call;
- offline shm: the same with the shared-memory regions;
- offline HTTP: the one-response model over HTTP, tensors in binary;
- floor stream gRPC, floor stream shm: the first two ways against
  `floor_model.py`, a model that does the least a decode model can (reads the
  latents, copies them to the device, waits out the in-process decode's time
  there, copies zeros back, sends them), so what is left over its wait is the
  floor under any model code: Triton, the Python backend and the transport.

`--perf-analyzer` then also runs perf_analyzer (the C++ client, through
`benchmarks/run_perf_analyzer.py`) at concurrency 1 on the stream model and,
with the floor ways, the floor model, both with system shared memory, once per
timed round. `--no-trace` serves without Triton's trace (its cost is then off
every request, and the split below is not made).

Before the server starts, the clip is decoded in this process by the graph
wrapper the model uses (`host_tiles`, int16 on the device before the copy to
the host), so "over the decode" compares within one run.

Triton's trace (TIMESTAMPS, every request) and the client's clock, both
CLOCK_MONOTONIC on one host, split every request into four parts:

- to the server: the client's send to Triton's REQUEST_START (building and
  sending the request, reading it on the server);
- waiting: to COMPUTE_START;
- in the model: to INFER_RESPONSE_COMPLETE, the response handed to the
  frontend. The model's own counters give the decode part (its window's launch
  to its samples in host memory, as in process); the rest is the hand-offs
  between Triton and the Python stub process, reading the request and building
  the response;
- back to the client: from there to the samples in the client's numpy array
  (copied out of the region where there is one).

Every response must equal the way's first, and the first is compared with the
in-process decode (the floor's only by length). Weights are synthetic (seeded,
not real audio).

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_request_overhead.py --device cuda --seconds 10
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_request_overhead.py \
        --device cpu --preset small --seconds 1 --reps 5 --rounds 2   # a check that it runs
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_request_overhead.py --seconds 10 \
        --ways "stream gRPC" "stream shm" "floor stream gRPC" "floor stream shm" \
        --perf-analyzer --perf-analyzer-options="--wheel-dir wheels"
"""

import argparse
import csv
import json
import os
import queue
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

from common import (
    FLOOR_MODEL,
    FRAMES_PER_SECOND,
    MODEL,
    MODEL_METRICS_LAG_S,
    OFFLINE_MODEL,
    SAMPLES_PER_FRAME,
    add_floor_model,
    clip_latents,
    heading,
    in_process_decode,
    model_repository_copy,
    model_seconds,
    perf_analyzer_script,
    start_server,
    synthetic_checkpoint,
)

BUCKET = 512  # the one compiled window: a clip of up to 10.24 s is one tile
WAYS = ("stream gRPC", "stream shm", "offline gRPC", "offline shm", "offline HTTP",
        "floor stream gRPC", "floor stream shm")
PARTS = ("to the server", "waiting", "in the model", "decode in the model", "back to the client")


class Client:
    """One request at a time, each way; `request(way, request_id)` returns the samples."""

    def __init__(self, grpc_url: str, http_url: str, latents: np.ndarray, tag: str):
        import tritonclient.grpc as grpcclient

        self.grpc = grpcclient
        self.samples = latents.shape[0] * SAMPLES_PER_FRAME
        self.latents = latents
        self.regions = {
            "in": shared_memory.SharedMemory(name=f"{tag}_in", create=True, size=latents.nbytes),
            "out": shared_memory.SharedMemory(name=f"{tag}_out", create=True, size=2 * self.samples),
        }
        np.ndarray(latents.shape, np.float32, buffer=self.regions["in"].buf)[:] = latents
        self.tag = tag
        self.grpc_client = grpcclient.InferenceServerClient(grpc_url)
        self.http_url, self.http, self.http_client = http_url, None, None  # made at the first HTTP request
        for key, region in self.regions.items():
            self.grpc_client.register_system_shared_memory(f"{tag}_{key}", f"/{tag}_{key}", region.size)
        self.responses = queue.Queue()
        self.grpc_client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def _grpc_io(self, shm: bool):
        latents = self.grpc.InferInput("LATENTS", list(self.latents.shape), "FP32")
        waveform = self.grpc.InferRequestedOutput("WAVEFORM_PCM16")
        if shm:
            latents.set_shared_memory(f"{self.tag}_in", self.latents.nbytes)
            waveform.set_shared_memory(f"{self.tag}_out", 2 * self.samples)
        else:
            latents.set_data_from_numpy(self.latents)
        return [latents], [waveform, self.grpc.InferRequestedOutput("START_SAMPLE")]

    def request(self, way: str, request_id: str) -> np.ndarray:
        shm = way.endswith("shm")
        model = FLOOR_MODEL if way.startswith("floor") else MODEL
        if way == "offline HTTP":
            if self.http_client is None:
                import tritonclient.http as httpclient  # needs tritonclient[http]

                self.http, self.http_client = httpclient, httpclient.InferenceServerClient(self.http_url)
            latents = self.http.InferInput("LATENTS", list(self.latents.shape), "FP32")
            latents.set_data_from_numpy(self.latents, binary_data=True)
            outputs = [self.http.InferRequestedOutput("WAVEFORM_PCM16", binary_data=True)]
            return self.http_client.infer(OFFLINE_MODEL, [latents], outputs=outputs,
                                          request_id=request_id).as_numpy("WAVEFORM_PCM16")
        inputs, outputs = self._grpc_io(shm)
        if "stream" in way:
            self.grpc_client.async_stream_infer(model, inputs, outputs=outputs, request_id=request_id)
            result, error = self.responses.get(timeout=120)
            if error is not None:
                raise RuntimeError(f"{way}: {error}")
        else:
            result = self.grpc_client.infer(OFFLINE_MODEL, inputs, outputs=outputs, request_id=request_id)
        if shm:
            return np.ndarray((self.samples,), np.int16, buffer=self.regions["out"].buf).copy()
        return result.as_numpy("WAVEFORM_PCM16")

    def close(self) -> None:
        try:
            self.grpc_client.stop_stream()
            for key in self.regions:
                self.grpc_client.unregister_system_shared_memory(f"{self.tag}_{key}")
        finally:
            self.grpc_client.close()
            if self.http_client is not None:
                self.http_client.close()
            for region in self.regions.values():
                region.close()
                region.unlink()


def perf_analyzer_p50(model: str, grpc_url: str, http_url: str, seconds: float, requests: int, out: Path,
                      options: str) -> float:
    """perf_analyzer's p50 latency (the whole clip), ms: `model` streamed over gRPC, concurrency 1,
    latents and the float32 waveform (perf_analyzer asks for every output) in system shared memory."""
    argv = [sys.executable, str(perf_analyzer_script()),
            "--grpc-url", grpc_url, "--http-url", http_url, "--stream-model", model, "--models", "stream",
            "--seconds", f"{seconds:g}", "--concurrency", "1", "--measurement-mode", "count_windows",
            "--measurement-request-count", str(requests), "--max-trials", "10", "--first-audio-requests", "0",
            "--out-dir", str(out), *shlex.split(options),
            "--", "--shared-memory", "system",
            "--output-shared-memory-size", str(4 * int(seconds * FRAMES_PER_SECOND) * SAMPLES_PER_FRAME)]
    subprocess.run(argv, check=True)
    with open(out / "summary.csv") as summary:
        return float(next(csv.DictReader(summary))["latency_p50_ms"])


def trace_timestamps(path: Path) -> dict[str, dict[str, int]]:
    """Triton's trace file: {request id: {timestamp name: ns}}, the first of each name."""
    by_trace: dict[int, dict] = {}
    for record in json.loads(path.read_text()):
        entry = by_trace.setdefault(record["id"], {"stamps": {}})
        if "request_id" in record:
            entry["request_id"] = record["request_id"]
        for stamp in record.get("timestamps", []):
            entry["stamps"].setdefault(stamp["name"], int(stamp["ns"]))
    return {entry["request_id"]: entry["stamps"] for entry in by_trace.values() if "request_id" in entry}


def parts_ms(sent_ns: int, done_ns: int, stamps: dict[str, int]) -> dict[str, float] | None:
    """The request's parts in ms (decode in the model is filled in by the caller)."""
    needed = ("REQUEST_START", "COMPUTE_START", "INFER_RESPONSE_COMPLETE")
    if any(name not in stamps for name in needed):
        return None
    start, compute, response = (stamps[name] for name in needed)
    return {
        "to the server": (start - sent_ns) / 1e6,
        "waiting": (compute - start) / 1e6,
        "in the model": (response - compute) / 1e6,
        "back to the client": (done_ns - response) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="auk")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where both decodes run")
    parser.add_argument("--seconds", type=float, default=10,
                        help=f"clip length (one tile: at most {BUCKET / FRAMES_PER_SECOND} s)")
    parser.add_argument("--reps", type=int, default=40, help="timed requests per way and round")
    parser.add_argument("--rounds", type=int, default=3, help="round 0 warms every way up and is left out")
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS, metavar="WAY")
    parser.add_argument("--perf-analyzer", action="store_true",
                        help="also run perf_analyzer (C++ client, shared memory) on the stream and floor models")
    parser.add_argument("--no-trace", action="store_true",
                        help="serve without Triton's trace (its cost off every request; no split into parts)")
    parser.add_argument("--perf-analyzer-options", default="",
                        help="options for benchmarks/run_perf_analyzer.py, e.g. \"--wheel-dir wheels\"")
    args = parser.parse_args()
    if not 0 < args.seconds * FRAMES_PER_SECOND <= BUCKET:
        parser.error(f"--seconds must give 1 to {BUCKET} frames (one window)")

    work = Path(tempfile.mkdtemp(prefix="auk-overhead-"))
    checkpoint = synthetic_checkpoint(work / "checkpoint", args.preset)
    cuda = args.device == "cuda"
    print(heading(f"One-tile requests through the server, {args.preset} (synthetic)", args.device), flush=True)
    local, references = in_process_decode(checkpoint, [args.seconds], args.reps, BUCKET, args.device,
                                          ["pcm16"], args.seconds, [BUCKET])
    decode_ms = local["pcm16"][args.seconds][1]
    reference = references["pcm16"]
    print(f"in process: {args.seconds:g} s clip, PCM16, {decode_ms:.2f} ms (median of {args.reps})", flush=True)

    trace = work / "trace.json"
    repository = model_repository_copy(work / "model_repository", [BUCKET])
    floor = any(way.startswith("floor") for way in args.ways)
    floor_waits = work / "floor_waits.json"
    if floor:
        add_floor_model(repository, decode_ms, BUCKET, args.device, floor_waits)
    process, grpc_url, http_url, metrics_url = start_server(
        checkpoint, work / "cache", work / "tritonserver.log",
        models=(MODEL, OFFLINE_MODEL) + ((FLOOR_MODEL,) if floor else ()),
        device="gpu" if cuda else "cpu",
        model_repository=repository,
        extra_args=[] if args.no_trace else [
            f"--trace-config=triton,file={trace}", "--trace-config=level=TIMESTAMPS",
            "--trace-config=rate=1", "--trace-config=count=-1"])
    client = Client(grpc_url, http_url, clip_latents(args.seconds), f"auk_bench_{os.getpid()}")
    timed: dict[tuple[str, int], list] = {}  # (way, round): [(request id, sent ns, done ns)]
    decode_per_request: dict[tuple[str, int], float] = {}
    perf_p50: dict[str, list[float]] = {}
    try:
        for round_ in range(args.rounds):
            for way in args.ways:
                model = MODEL  # whose counters: the offline model's requests are decoded there (the floor has none)
                first = client.request(way, f"{way}/{round_}/warm-up")
                if round_ == 0 and way.startswith("floor"):
                    if first.shape != reference.shape:
                        raise RuntimeError(f"{way}: {first.shape[0]} samples, not {reference.shape[0]}")
                elif round_ == 0:
                    diff = np.abs(first.astype(np.int32) - reference.astype(np.int32))
                    print(f"{way}: served vs in-process, max difference {diff.max()} int16 steps "
                          f"({np.count_nonzero(diff)} of {diff.size} samples differ)", flush=True)
                for rep in range(4):  # warm the way up
                    client.request(way, f"{way}/{round_}/warm-up-{rep}")
                time.sleep(MODEL_METRICS_LAG_S)
                before = model_seconds(metrics_url, model)
                rows = timed[way, round_] = []
                for rep in range(args.reps):
                    request_id = f"{way}/{round_}/{rep}"
                    sent = time.monotonic_ns()
                    pcm = client.request(way, request_id)
                    done = time.monotonic_ns()
                    if not np.array_equal(pcm, first):
                        raise RuntimeError(f"{way}: the samples differ from the first response's")
                    rows.append((request_id, sent, done))
                time.sleep(MODEL_METRICS_LAG_S)
                after = model_seconds(metrics_url, model)
                if before and after and not way.startswith("floor"):
                    decode_per_request[way, round_] = 1e3 * (after[1] - before[1]) / args.reps
        if args.perf_analyzer:
            for pass_ in range(args.rounds - 1):
                for model in (MODEL, FLOOR_MODEL) if floor else (MODEL,):
                    print(f"perf_analyzer: {model}, shared memory, pass {pass_ + 1}", flush=True)
                    perf_p50.setdefault(model, []).append(perf_analyzer_p50(
                        model, grpc_url, http_url, args.seconds, 2 * args.reps, work / f"perf_{model}_{pass_}",
                        args.perf_analyzer_options))
    finally:
        client.close()
        process.terminate()  # Triton writes its trace file on the way out
        process.wait(timeout=60)

    stamps = trace_timestamps(trace) if trace.exists() else {}
    waits = json.loads(floor_waits.read_text()) if floor_waits.exists() else []
    wait_ms = {request_id: 1e3 * seconds for request_id, seconds in waits}
    for (way, round_), rows in timed.items():
        if way.startswith("floor") and all(request_id in wait_ms for request_id, _, _ in rows):
            decode_per_request[way, round_] = statistics.median(wait_ms[request_id] for request_id, _, _ in rows)
    print(f"\n{args.seconds:g} s clip, PCM16, one client; in-process decode {decode_ms:.2f} ms. "
          "Medians of each part over the round's requests, ms.\n")
    print("| way | round | client p50 | over the decode | " + " | ".join(PARTS) + " |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in PARTS) + " |")
    for (way, round_), rows in timed.items():
        if round_ == 0:
            continue
        client_ms = statistics.median((done - sent) / 1e6 for _, sent, done in rows)
        split = [parts_ms(sent, done, stamps.get(request_id, {})) for request_id, sent, done in rows]
        split = [parts for parts in split if parts is not None]
        cells = {part: statistics.median(p[part] for p in split) for part in split[0]} if split else {}
        cells["decode in the model"] = decode_per_request.get((way, round_))
        # The floor is measured over its own wait (its "decode in the model"), the others over the decode.
        base_ms = cells["decode in the model"] if way.startswith("floor") else decode_ms
        if base_ms is None:
            raise RuntimeError(f"{way}: the floor model recorded no waits (was it unloaded cleanly?)")
        over = client_ms - base_ms
        print(f"| {way} | {round_} | {client_ms:.2f} | {over:.2f} ({100 * over / decode_ms:.0f}%) | "
              + " | ".join("n/a" if cells.get(part) is None else f"{cells[part]:.2f}" for part in PARTS) + " |",
              flush=True)
    if perf_p50:
        print("\nperf_analyzer, stream over gRPC, latents and float32 waveform in system shared memory, "
              "p50 of the whole clip, ms:\n")
        print("| model | pass | p50 | over the decode (the floor: over its wait) |")
        print("| --- | --- | --- | --- |")
        for model, p50s in perf_p50.items():
            if model == FLOOR_MODEL:
                theirs = [1e3 * seconds for request_id, seconds in waits if "/" not in request_id]  # not ours
                if not theirs:
                    raise RuntimeError("the floor model recorded no waits for perf_analyzer's requests")
                base_ms = statistics.median(theirs)
            else:
                base_ms = decode_ms
            for pass_, p50 in enumerate(p50s, 1):
                over = p50 - base_ms
                print(f"| {model} | {pass_} | {p50:.2f} | {over:.2f} ({100 * over / decode_ms:.0f}%) |", flush=True)


if __name__ == "__main__":
    main()
