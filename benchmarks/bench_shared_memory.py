"""A one-tile clip through the server three ways, from a client on the server's host.

Every request of a round goes to the decoupled decode model over one gRPC
stream and asks for WAVEFORM_PCM16:

- gRPC: latents and waveform inside the gRPC messages (what `bench_serving.py` measures);
- shm out: the waveform written into a system shared-memory region the client registered;
- shm in+out: the latents read from a second region as well.

Client time runs from the send to the samples in a numpy array of the client's
(copied out of the region where there is one). The model's own counters on the
metrics port give its decode and send time per request, so the three ways can be
put next to the decode they wrap. Every response's samples must equal the first
one's. Weights are synthetic (seeded, not real audio).

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_shared_memory.py --seconds 10
"""

import argparse
import datetime
import os
import queue
import statistics
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch

from auk_triton.synthetic import write_synthetic_checkpoint
from bench_serving import MODEL, clip_latents, model_repository_with_buckets, model_seconds, start_server

HOP = 480
WAYS = ("gRPC", "shm out", "shm in+out")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="auk")
    parser.add_argument("--device", default="gpu", choices=("gpu", "cpu"), help="the server's model config")
    parser.add_argument("--seconds", type=float, default=10, help="clip length (one tile: at most 10.24 s)")
    parser.add_argument("--reps", type=int, default=40, help="timed requests per way and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import tritonclient.grpc as grpcclient

    work = Path(tempfile.mkdtemp(prefix="auk-shm-"))
    checkpoint = write_synthetic_checkpoint(work / "checkpoint", args.preset)
    repository = model_repository_with_buckets([512], work / "model_repository")
    device = torch.cuda.get_device_name() if args.device == "gpu" else "CPU"
    print(f"# One-tile clip through the server, {args.preset} (synthetic), {device}, {datetime.date.today()}", flush=True)
    process, url, _, metrics_url = start_server(checkpoint, work / "cache", work / "tritonserver.log",
                                                device=args.device, model_repository=repository)
    latents = clip_latents(args.seconds)
    samples = latents.shape[0] * HOP
    tag = f"auk_bench_{os.getpid()}"
    regions = {
        "in": shared_memory.SharedMemory(name=f"{tag}_in", create=True, size=latents.nbytes),
        "out": shared_memory.SharedMemory(name=f"{tag}_out", create=True, size=2 * samples),
    }
    np.ndarray(latents.shape, np.float32, buffer=regions["in"].buf)[:] = latents
    client = grpcclient.InferenceServerClient(url)
    try:
        for key, region in regions.items():
            client.register_system_shared_memory(f"{tag}_{key}", f"/{tag}_{key}", region.size)
        responses = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
        first = None
        print("| round | way | client p50 ms | client mean ms | decode in model ms | send in model ms |")
        print("| --- | --- | --- | --- | --- | --- |")
        for round_ in range(args.rounds):
            for way in WAYS:
                latents_in = grpcclient.InferInput("LATENTS", list(latents.shape), "FP32")
                if way == "shm in+out":
                    latents_in.set_shared_memory(f"{tag}_in", latents.nbytes)
                else:
                    latents_in.set_data_from_numpy(latents)
                waveform = grpcclient.InferRequestedOutput("WAVEFORM_PCM16")
                if way != "gRPC":
                    waveform.set_shared_memory(f"{tag}_out", 2 * samples)
                outputs = [waveform, grpcclient.InferRequestedOutput("START_SAMPLE")]
                before, times = model_seconds(metrics_url), []
                for rep in range(args.reps + 5):  # the first five warm the way up
                    sent = time.perf_counter()
                    client.async_stream_infer(MODEL, [latents_in], outputs=outputs)
                    _, result, error = responses.get(timeout=120)
                    if error is not None:
                        raise RuntimeError(f"{way}: {error}")
                    if way == "gRPC":
                        pcm = result.as_numpy("WAVEFORM_PCM16")
                    else:
                        pcm = np.ndarray((samples,), np.int16, buffer=regions["out"].buf).copy()
                    done = time.perf_counter()
                    first = pcm.copy() if first is None else first
                    if not np.array_equal(pcm, first):
                        raise RuntimeError(f"{way}: the samples differ from the first response's")
                    if rep >= 5:
                        times.append((done - sent) * 1e3)
                after = model_seconds(metrics_url)
                tiles = after[0] - before[0]
                print(f"| {round_} | {way} | {statistics.median(times):.2f} | {statistics.mean(times):.2f} | "
                      f"{1e3 * (after[1] - before[1]) / tiles:.2f} | {1e3 * (after[2] - before[2]) / tiles:.2f} |",
                      flush=True)
        client.stop_stream()
    finally:
        try:
            for key in regions:
                client.unregister_system_shared_memory(f"{tag}_{key}")
        finally:
            client.close()
            for region in regions.values():
                region.close()
                region.unlink()
            process.kill()


if __name__ == "__main__":
    main()
