r"""What the front door costs one client: the same requests through it and straight to
tritonserver's internal port, in one run.

The server is started as `make serve` starts it (`python -m auk_triton.front_door.launcher`:
the front door on the public ports, tritonserver on loopback behind it). One client
sends the same clip back to back on one gRPC stream to the streaming decoder, asking
for WAVEFORM_PCM16, and times the first response (first audio) and the final one
(all of it; a clip of one window is one response, so the two agree). Rounds
alternate the two targets (front, direct) so drift on the machine falls on both;
round 0 warms up and is left out. ServerLive calls, timed the same way, give the hop
alone (no model work). With `--http` the offline model over HTTP
(binary tensors) is timed the same way. With `--floor MS` the floor model
(floor_model.py: it waits MS, then answers the clip's length in zeros) takes the
decoder's place: the front door's cost for a clip's bytes with no decode in the
way, which a CPU can measure too. Every response must equal the first one direct.
Weights are synthetic (seeded, not real audio).

    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_front_door.py --device cuda --seconds 10
    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_front_door.py \
        --device cpu --preset small --seconds 1 --reps 5 --rounds 2   # a check that it runs
    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_front_door.py --device cpu --preset small --floor 1
"""

import argparse
import queue
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from common import (FLOOR_MODEL, MODEL, OFFLINE_MODEL, add_floor_model, clip_latents, heading, model_repository_copy, say,
                    start_launcher, synthetic_checkpoint)

BUCKET = 512  # one window: a clip of at most this many frames is one response


class StreamClient:
    """One gRPC stream; `request()` returns (first response s, final response s, samples)."""

    def __init__(self, url: str, latents: np.ndarray, model: str = MODEL):
        import tritonclient.grpc as grpcclient

        self.grpc, self.latents, self.model = grpcclient, latents, model
        self.client = grpcclient.InferenceServerClient(url)
        self.responses = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((time.perf_counter(), result, error)))

    def request(self, request_id: str):
        tensor = self.grpc.InferInput("LATENTS", list(self.latents.shape), "FP32")
        tensor.set_data_from_numpy(self.latents)
        outputs = [self.grpc.InferRequestedOutput("WAVEFORM_PCM16"), self.grpc.InferRequestedOutput("START_SAMPLE")]
        began = time.perf_counter()
        self.client.async_stream_infer(self.model, [tensor], outputs=outputs, request_id=request_id,
                                       enable_empty_final_response=True)
        first, tiles = None, []
        while True:
            at, result, error = self.responses.get(timeout=120)
            if error is not None:
                raise RuntimeError(f"{request_id}: {error}")
            response = result.get_response()
            if response.outputs:
                first = first or at
                tiles.append(result.as_numpy("WAVEFORM_PCM16"))
            if response.parameters["triton_final_response"].bool_param:
                return first - began, at - began, np.concatenate(tiles)

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


class PingClient:
    """ServerLive over gRPC: a call with no model work, so its time is the hop alone."""

    def __init__(self, url: str, reference: np.ndarray):
        import tritonclient.grpc as grpcclient

        self.client, self.reference = grpcclient.InferenceServerClient(url), reference

    def request(self, request_id: str):
        began = time.perf_counter()
        if not self.client.is_server_live():
            raise RuntimeError("the server is not live")
        took = time.perf_counter() - began
        return took, took, self.reference

    def close(self) -> None:
        self.client.close()


class HttpClient:
    """The offline model over HTTP, binary tensors; `request()` as StreamClient's."""

    def __init__(self, url: str, latents: np.ndarray):
        import tritonclient.http as httpclient

        self.http, self.latents = httpclient, latents
        self.client = httpclient.InferenceServerClient(url, network_timeout=300)

    def request(self, request_id: str):
        tensor = self.http.InferInput("LATENTS", list(self.latents.shape), "FP32")
        tensor.set_data_from_numpy(self.latents, binary_data=True)
        outputs = [self.http.InferRequestedOutput("WAVEFORM_PCM16", binary_data=True)]
        began = time.perf_counter()
        samples = self.client.infer(OFFLINE_MODEL, [tensor], outputs=outputs, request_id=request_id).as_numpy("WAVEFORM_PCM16")
        took = time.perf_counter() - began
        return took, took, samples

    def close(self) -> None:
        self.client.close()


def ms(values) -> str:
    values = sorted(values)
    return f"{statistics.median(values) * 1e3:.3f} / {values[int(0.9 * (len(values) - 1))] * 1e3:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="auk")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--seconds", type=float, default=10, help=f"clip length (one window: at most {BUCKET / 50:g} s)")
    parser.add_argument("--reps", type=int, default=50, help="timed requests per target and round")
    parser.add_argument("--rounds", type=int, default=4, help="round 0 warms up and is left out")
    parser.add_argument("--http", action="store_true", help="also time the offline model over HTTP (binary)")
    parser.add_argument("--floor", type=float, metavar="MS", help="stream to the floor model, which waits MS per request")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="auk-front-door-"))
    checkpoint = synthetic_checkpoint(work / "checkpoint", args.preset)
    latents = clip_latents(args.seconds)
    model = MODEL if args.floor is None else FLOOR_MODEL
    answered_by = f"{args.preset} (synthetic)" if args.floor is None else f"the floor model ({args.floor:g} ms)"
    say(heading(f"The front door's cost at one client, {answered_by}, {args.seconds:g} s clip, PCM16", args.device))
    models = (model, OFFLINE_MODEL) if args.http else (model,)
    repository = model_repository_copy(work / "model_repository", [BUCKET])
    if args.floor is not None:
        add_floor_model(repository, args.floor, BUCKET, args.device)
    process, public, internal = start_launcher(checkpoint, work / "cache", work / "launcher.log", models,
                                               device="gpu" if args.device == "cuda" else "cpu",
                                               model_repository=repository)
    ways = {
        "stream gRPC": lambda port: StreamClient(f"127.0.0.1:{port['grpc']}", latents, model),
        "ServerLive gRPC": lambda port: PingClient(f"127.0.0.1:{port['grpc']}", np.zeros(1)),
    }
    if args.http:
        ways["offline HTTP"] = lambda port: HttpClient(f"127.0.0.1:{port['http']}", latents)
    timings: dict[tuple[str, str], list] = {}
    try:
        for way, make in ways.items():
            clients = {"direct": make(internal), "front": make(public)}
            reference = clients["direct"].request("reference")[2]
            for round_ in range(args.rounds):
                order = ("direct", "front") if round_ % 2 == 0 else ("front", "direct")
                for target in order:
                    for rep in range(args.reps):
                        first, total, samples = clients[target].request(f"{target}/{round_}/{rep}")
                        if not np.array_equal(samples, reference):
                            raise RuntimeError(f"{way} {target}: the samples differ from the direct reference")
                        if round_:
                            timings.setdefault((way, target), []).append((first, total))
            for client in clients.values():
                client.close()
    finally:
        process.terminate()
        process.wait(timeout=60)

    say()
    say("| way | target | first audio p50 / p90 ms | all of it p50 / p90 ms | requests |")
    say("| --- | --- | --- | --- | --- |")
    for (way, target), rows in timings.items():
        say(f"| {way} | {target} | {ms(r[0] for r in rows)} | {ms(r[1] for r in rows)} | {len(rows)} |")
    say()
    for way in ways:
        front = statistics.median(r[1] for r in timings[way, "front"])
        direct = statistics.median(r[1] for r in timings[way, "direct"])
        say(f"{way}: the front door adds {(front - direct) * 1e3:.3f} ms per request at the median "
            f"({(front / direct - 1) * 100:.1f}%)")


if __name__ == "__main__":
    main()
