"""The streaming decode model, or the pipeline, under many clients: first audio,
underruns, throughput and backlog, against the capacity.

A real `tritonserver` (started here on a synthetic checkpoint, or `--url` on this
host) is driven over gRPC streaming, one client and stream per simulated user in
its own thread. `--front-door` starts it as users do (the launcher: the front
door on the public ports, tritonserver behind it), waits for every model to
answer READY through the front door, and sends the load to the front door's gRPC
port, each stream on a connection of its own. The users are spread over
`--client-processes` worker processes: in one Python process, every stream's
tiles would queue for one interpreter lock and the client itself would delay
first audio. Closed loop: each client sends its next request when the last has
ended. Open loop: seeded Poisson arrivals (each worker process an independent
share of the rate, which sums to a Poisson process of the full rate) on a
bounded pool of streams (arrivals that find none idle in their process are
counted, not started); every second it counts the requests in flight (arrived
and not ended, unstarted ones too), and reports their mean over the first and
last fifth of the arrivals and their least-squares slope: a backlog that grows
has a positive one. `--find-max-load` steps the load up to the highest that
keeps first audio p99 within target with no underrun. Clip lengths are drawn
per request from `--clips`. `--mode closed open` runs both on one server.

`--model decode` (the default) sends seeded latents to `auk_vae_decode`.
`--model pipeline` sends `auk_pipeline` (the DiT, then the decoder, in one process) what
`auk_client.pipeline` sends: seeded stand-in prompt embeddings (`--tokens`), the
clip's seconds, a seed, and the recipe's knobs (`--recipe flash`, the default,
serves a flash checkpoint and sends none; `base`, 32 guided steps); its audio
comes as WAVEFORM (float32), ceil(50 x seconds) frames of it. Before its runs the
pipeline's references are measured on the server: one client's first audio
(`--one-client-requests` one after another after a warm-up), then the capacity,
a closed loop of `--capacity-clients` at saturation (after a warm-up loop) whose
requests per second `--load` takes fractions of. The pipeline's table puts each
run against them (p99 / one client's p50).

Per request the client checks START_SAMPLE continuity, the final flag and the
sample count, and times first audio and total; an underrun is a tile that
arrives after the audio before it has played out, played from the first tile.
The server's metrics, read around each run, give the decoder's windows per
replay, its first audio and underruns, and the shares of the run its thread spent
decoding (launch and wait) and sending; `--trace FILE` has tritonserver trace
every request, and the report places each run's slowest first audios step by
step. The decode model's capacity (GPU): `decode_rows` of the served graph
wrapper timed per bucket and rows, each clip's windows at their bucket's best
rate; the decode alone, the most audio per second the GPU can make for the mix.
`--device cpu --preset small` checks the script; its numbers are no measurement.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_load.py --mode closed --clients 1 4 16 --clips 10 60 --each-clip
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_load.py --mode open --load 0.8 --clips 2 10 30 60
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_load.py --device cpu --preset small --mode closed \\
        --clients 1 2 --clips 0.5 1 --seconds-per-run 8
    # the pipeline through the front door: flash, 10 s clips, open loop at 0.7 of the capacity
    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_load.py --model pipeline --front-door --mode open \\
        --clips 10 --load 0.7 --duration 60 --cache-dir /tmp/auk-bench
    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_load.py --device cpu --preset small --model pipeline \\
        --front-door --mode open --clips 0.5 --tokens 8 --capacity-clients 2 --capacity-seconds 8 \\
        --capacity-warmup-seconds 2 --one-client-requests 3 --load 0.7 --duration 8 --max-streams 8
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import gc
import math
import multiprocessing
import os
import queue
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from auk_triton.codec import DEFAULT_COMPILE_SHAPES
from auk_triton.serving.config import DecodeSettings, use_compile_cache
from common import (
    FRAMES_PER_SECOND,
    MODEL,
    MODEL_METRICS_LAG_S,
    REPO_ROOT,
    SAMPLES_PER_FRAME,
    SEED,
    clip_latents,
    executes,
    heading,
    model_repository_copy,
    percentile,
    read_traces,
    recipe_checkpoints,
    recipes,
    replay_ms,
    revision_commit,
    revision_tree,
    say,
    served_graph,
    start_launcher,
    start_server,
    synthetic_checkpoint,
    trace_arguments,
)

SAMPLE_RATE = FRAMES_PER_SECOND * SAMPLES_PER_FRAME
OUTPUTS = {"pcm16": "WAVEFORM_PCM16", "float32": "WAVEFORM"}
PIPELINE_MODEL = "auk_pipeline"
PIPELINE_MODELS = (PIPELINE_MODEL,)  # what the server loads for the pipeline: both stages in one model
# Longest wait for one response; past it the request is an error and its stream is reopened.
RESPONSE_TIMEOUT_S = 120.0
# Longest wait for an open loop's requests once its arrivals have ended.
DRAIN_TIMEOUT_S = 300.0
LOAD_STEPS = (0.5, 0.7, 0.8, 0.9, 1.0, 1.1)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
# Options that set the tile scheduler's config parameters: option -> parameter.
SCHEDULER_PARAMETERS = {"batch_sizes": "batch_sizes", "batch_frames": "batch_frames",
                        "max_active": "max_active_requests", "first_tile_frames": "first_tile_frames"}


# ---- requests on one stream -----------------------------------------------------------------


@dataclass(frozen=True)
class Clip:
    """One clip length of the mix, as its requests send it."""

    seconds: float
    samples: int  # what its responses must add up to
    inputs: Callable  # tritonclient.grpc -> the request's InferInputs (each stream makes them once)


@dataclass
class RequestOutcome:
    """One request as its client saw it."""

    clip_seconds: float
    first_audio_ms: float | None = None
    total_ms: float | None = None
    tiles: int = 0
    audio_seconds: float = 0.0
    underruns: int = 0  # tiles that arrived after the audio before them had played out
    error: str | None = None
    start_lag_ms: float = 0.0  # open loop: sent this long after its arrival was due
    ended: float = 0.0  # perf_counter at its final response (or its error)
    request_id: str = ""
    sent: float = 0.0  # perf_counter when the client handed the request to its stream


def clip_frames(seconds: float) -> int:
    """Latent frames of a clip of `seconds`, as `common.clip_latents` makes it."""
    return int(seconds * FRAMES_PER_SECOND)


def pipeline_frames(seconds: float) -> int:
    """Latent frames `auk_dit` makes for a GEN_SECONDS of `seconds`: the FP32 the request carries,
    read back as the decimal it stands for (0.1 s is 5 frames, not 6), at 50 frames a second
    rounded up (`auk_triton.serving.requests`, `AuKDiTSampler.target_frames`)."""
    return max(1, math.ceil(float(str(np.float32(seconds))) * SAMPLE_RATE / SAMPLES_PER_FRAME))


@dataclass(frozen=True)
class Workload:
    """What the requests of a run are, as the worker processes make them: `auk_vae_decode` with
    seeded latents (LATENTS), or `auk_pipeline` with seeded stand-in prompt embeddings
    (PROMPT_EMBEDS [tokens, 2048]), GEN_SECONDS, SEED and the recipe's knobs, as
    `auk_client.pipeline` sends them. Each clip length has its own seed (the work is the same
    whatever the seed)."""

    model: str  # MODEL or PIPELINE_MODEL
    output: str  # the waveform output the client asks for
    clip_seconds: tuple[float, ...]
    knobs: tuple[tuple[str, float], ...] = ()  # the pipeline's recipe (NUM_STEPS, GUIDANCE, SWAY)
    tokens: int = 64  # the pipeline's prompt tokens

    def clips(self) -> dict[float, Clip]:
        """Every clip length's requests, made once per process (the same in every process)."""
        lengths = sorted(set(self.clip_seconds))
        if self.model == MODEL:
            return {seconds: self._decode_clip(seconds, clip_latents(seconds, seed=SEED + index))
                    for index, seconds in enumerate(lengths)}
        from auk_client.pipeline import random_prompt_embeds

        embeds = random_prompt_embeds(self.tokens, SEED)
        return {seconds: self._pipeline_clip(seconds, embeds, SEED + index) for index, seconds in enumerate(lengths)}

    @staticmethod
    def _decode_clip(seconds: float, latents: np.ndarray) -> Clip:
        def inputs(grpc) -> list:
            tensor = grpc.InferInput("LATENTS", list(latents.shape), "FP32")
            tensor.set_data_from_numpy(latents)
            return [tensor]

        return Clip(seconds, latents.shape[0] * SAMPLES_PER_FRAME, inputs)

    def _pipeline_clip(self, seconds: float, embeds: np.ndarray, seed: int) -> Clip:
        from auk_client.pipeline import pipeline_inputs

        knobs = dict(self.knobs)
        return Clip(seconds, pipeline_frames(seconds) * SAMPLES_PER_FRAME,
                    lambda grpc: pipeline_inputs(grpc, embeds, seconds, seed, **knobs))


def own_connection_arguments(grpc) -> list[tuple]:
    """tritonclient's default channel arguments, and a connection of the channel's own: gRPC
    shares one connection among a process's channels to the same address otherwise, and the
    front door takes at most 64 streams on one connection (AUK_GRPC_MAX_STREAMS)."""
    keepalive = grpc.KeepAliveOptions()
    return [("grpc.max_send_message_length", grpc.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", grpc.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            ("grpc.use_local_subchannel_pool", 1)]


class StreamClient:
    """One simulated user: its own gRPC client and stream, one request at a time."""

    def __init__(self, url: str, name: str, model: str, output: str, own_connection: bool = False):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.name, self.model, self.output = name, model, output
        self.client = grpcclient.InferenceServerClient(
            url, channel_args=own_connection_arguments(grpcclient) if own_connection else None)
        self.requested = [grpcclient.InferRequestedOutput(n) for n in (output, "START_SAMPLE")]
        self._inputs: dict[float, list] = {}  # serialized once per clip length
        self.sent = 0
        self.closed = False  # set at the end (or on Ctrl-C): no request or stream after it
        self._open()

    def _open(self) -> None:
        responses = self.responses = queue.Queue()  # a reopened stream gets a queue of its own
        self.client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))

    def reopen(self) -> None:
        """A new stream, after an error or a timeout left this one in an unknown state."""
        with contextlib.suppress(Exception):
            self.client.stop_stream(cancel_requests=True)
        if not self.closed:
            with contextlib.suppress(Exception):  # the server is gone: the next request fails in turn
                self._open()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(Exception):
            self.client.stop_stream(cancel_requests=True)  # close() alone waits for pending requests
            self.client.close()

    def _input(self, clip: Clip) -> list:
        if clip.seconds not in self._inputs:
            self._inputs[clip.seconds] = clip.inputs(self._grpc)
        return self._inputs[clip.seconds]

    def request(self, clip: Clip, due: float | None = None) -> RequestOutcome:
        """Stream one request of `clip` and check its responses; `due`: when it should have been
        sent (perf_counter), for the open loop's start lag."""
        self.sent += 1
        request_id = f"{self.name}-{self.sent}"
        outcome = RequestOutcome(clip.seconds, request_id=request_id)
        sent = outcome.sent = time.perf_counter()
        if due is not None:
            outcome.start_lag_ms = (sent - due) * 1e3
        try:
            self.client.async_stream_infer(self.model, self._input(clip), outputs=self.requested,
                                           request_id=request_id, enable_empty_final_response=True)
            self._receive(clip, request_id, sent, outcome)
        except Exception as err:  # the stream broke: this request fails, the next gets a new stream
            outcome.error = outcome.error or f"{type(err).__name__}: {err}"
        if outcome.error is not None:
            outcome.ended = outcome.ended or time.perf_counter()
            self.reopen()
        return outcome

    def _receive(self, clip: Clip, request_id: str, sent: float, outcome: RequestOutcome) -> None:
        received = 0  # samples so far: where the next tile must start
        first_arrival = None
        while True:
            try:
                arrived, result, error = self.responses.get(timeout=RESPONSE_TIMEOUT_S)
            except queue.Empty:
                outcome.error = f"no response in {RESPONSE_TIMEOUT_S:g} s after {outcome.tiles} tiles"
                return
            if error is not None:  # an error response ends its request
                outcome.error = f"server: {error}"
                outcome.ended = arrived
                return
            response = result.get_response()
            if response.id and response.id != request_id:
                continue  # not this request's (only possible after a reopen; kept out all the same)
            samples = result.as_numpy(self.output)
            if samples is not None:
                start = result.as_numpy("START_SAMPLE")
                if outcome.error is None and (start is None or int(start[0]) != received):
                    outcome.error = f"tile {outcome.tiles} starts at {None if start is None else int(start[0])}, " \
                                    f"expected {received}"
                if first_arrival is None:
                    first_arrival = arrived
                    outcome.first_audio_ms = (arrived - sent) * 1e3
                elif arrived > first_arrival + received / SAMPLE_RATE:
                    outcome.underruns += 1
                received += samples.size
                outcome.tiles += 1
            params = response.parameters  # a protobuf map: look before indexing, which would add the key
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                break
        outcome.total_ms, outcome.ended = (arrived - sent) * 1e3, arrived
        outcome.audio_seconds = received / SAMPLE_RATE
        if outcome.error is None and received != clip.samples:
            outcome.error = f"{received} samples of {clip.samples}"


class StreamPool:
    """A worker's streams, made as runs need them and kept for later runs (their connections stay up)."""

    def __init__(self, url: str, workload: Workload, prefix: str, own_connections: bool):
        self.url, self.workload, self.prefix, self.own_connections = url, workload, prefix, own_connections
        self.streams: list[StreamClient] = []

    def take(self, count: int) -> list[StreamClient]:
        while len(self.streams) < count:
            self.streams.append(StreamClient(self.url, f"{self.prefix}s{len(self.streams)}", self.workload.model,
                                             self.workload.output, self.own_connections))
        return self.streams[:count]

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


def in_threads(target, items) -> None:
    """`target(index, item)` for every item, each in its own thread; returns when all have."""
    threads = [threading.Thread(target=target, args=(index, item), daemon=True) for index, item in enumerate(items)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def wait_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.perf_counter()))


class LoadError(RuntimeError):
    """A run that cannot end: the runs after it are not made."""


# ---- a worker process's share of a run -------------------------------------------------------
# perf_counter is CLOCK_MONOTONIC on Linux, one clock for every process of the host: the
# parent gives each share the moment it starts, and reads the outcomes' times against it.


# A worker's warm-up requests at once: a whole pool of 256 streams at once would pass the
# server's own limit (max_active_requests + max_queued_requests) and be refused.
WARM_UP_WAVE = 32
# The open loop counts its requests in flight this often.
BACKLOG_INTERVAL_S = 1.0


class Share(NamedTuple):
    """What a worker's share of a run gives back."""

    outcomes: list[RequestOutcome]
    not_started: int = 0  # open loop: arrivals that found every stream busy
    in_flight: list[int] = []  # open loop: requests arrived and not finished, every BACKLOG_INTERVAL_S


def warm_up(pool: StreamPool, count: int, mix: tuple[Clip, ...], others: bool) -> Share:
    """The mix's shortest clip on `count` streams, WARM_UP_WAVE at once (their connections, the
    server's first windows), then (`others`) every other length once on the first stream."""
    streams = pool.take(count)
    shortest = min(mix, key=lambda clip: clip.seconds)
    outcomes: list[RequestOutcome] = []
    for begin in range(0, len(streams), WARM_UP_WAVE):
        in_threads(lambda _, stream: outcomes.append(stream.request(shortest)), streams[begin : begin + WARM_UP_WAVE])
    for clip in mix if others else ():
        if clip is not shortest:
            outcomes.append(streams[0].request(clip))
    return Share(outcomes)


def closed_clients(pool: StreamPool, mix: tuple[Clip, ...], indices: list[int], clients: int, seconds: float,
                   requests: int | None, seed: int, start_at: float) -> Share:
    """Closed-loop clients `indices` (of `clients`), each on a stream of its own: from `start_at`,
    its next request when the last has ended, for `seconds` (or `requests` each), clip lengths
    drawn per request from a generator of its own."""
    outcomes: list[RequestOutcome] = []

    def client(slot: int, stream: StreamClient) -> None:
        draws = np.random.default_rng([seed, clients, indices[slot]])
        wait_until(start_at)
        deadline, sent = start_at + seconds, 0
        while not stream.closed and ((sent < requests) if requests is not None else time.perf_counter() < deadline):
            outcomes.append(stream.request(mix[draws.integers(len(mix))]))
            sent += 1

    in_threads(client, pool.take(len(indices)))
    return Share(outcomes)


def poisson_arrivals(rate: float, duration: float, clip_count: int, draws: np.random.Generator):
    """(seconds from the start, clip index) of each arrival of a Poisson process of `rate`."""
    arrivals, at = [], draws.exponential(1 / rate)
    while at < duration:
        arrivals.append((at, int(draws.integers(clip_count))))
        at += draws.exponential(1 / rate)
    return arrivals


def open_arrivals(pool: StreamPool, mix: tuple[Clip, ...], rate: float, duration: float, streams: int,
                  seed: list[int], start_at: float, label: str) -> Share:
    """Poisson arrivals of `rate` per second for `duration` seconds from `start_at`, each a new
    request on an idle stream of `streams`; an arrival that finds none idle is counted, not started.
    Every BACKLOG_INTERVAL_S of the arrivals it counts the requests in flight: those due by then
    (sent or not, started or not) less those that have ended."""
    mine = pool.take(streams)
    arrivals = poisson_arrivals(rate, duration, len(mix), np.random.default_rng(seed))
    outcomes: list[RequestOutcome] = []
    arrival_times = [at for at, _ in arrivals]
    in_flight: list[int] = []

    def count_in_flight() -> None:
        for tick in range(1, int(duration / BACKLOG_INTERVAL_S) + 1):
            wait_until(start_at + tick * BACKLOG_INTERVAL_S)
            in_flight.append(bisect.bisect_right(arrival_times, tick * BACKLOG_INTERVAL_S) - len(outcomes))

    counter = threading.Thread(target=count_in_flight, daemon=True)
    counter.start()
    idle: queue.SimpleQueue = queue.SimpleQueue()
    inboxes = [queue.SimpleQueue() for _ in mine]

    def worker(index: int, stream: StreamClient) -> None:
        while (item := inboxes[index].get()) is not None:
            clip, due = item
            outcomes.append(stream.request(clip, due))
            idle.put(index)

    threads = [threading.Thread(target=worker, args=(i, s), daemon=True) for i, s in enumerate(mine)]
    for index, thread in enumerate(threads):
        thread.start()
        idle.put(index)
    not_started = 0
    for at, clip_index in arrivals:
        wait_until(start_at + at)
        try:
            index = idle.get_nowait()
        except queue.Empty:
            not_started += 1
            continue
        inboxes[index].put((mix[clip_index], start_at + at))
    counter.join()
    for inbox in inboxes:
        inbox.put(None)
    drain_until = time.perf_counter() + DRAIN_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, drain_until - time.perf_counter()))
    if any(thread.is_alive() for thread in threads):
        raise LoadError(f"requests still running {DRAIN_TIMEOUT_S:g} s after the last arrival at {label}: "
                        "the server is far past its capacity")
    return Share(outcomes, not_started, in_flight)


SHARES = {"warm_up": warm_up, "closed": closed_clients, "open": open_arrivals}


def client_process(url: str, workload: Workload, own_connections: bool, worker: int, connection) -> None:
    """A worker process: runs the shares its parent sends, (name, kwargs with `mix` as clip
    seconds), and answers each with ("ok", its Share as a tuple, the outcomes as dicts) or ("error", text)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes the workers
    clips = workload.clips()  # seeded: the same requests as every other process's
    pool = StreamPool(url, workload, f"w{worker}-", own_connections)
    try:
        while (command := connection.recv()) is not None:
            name, kwargs = command
            try:
                share = SHARES[name](pool, **{**kwargs, "mix": tuple(clips[s] for s in kwargs["mix"])})
                # Plain values: this module is __mp_main__ here, its classes unknown by that name to the parent.
                connection.send(("ok", ([dataclasses.asdict(o) for o in share.outcomes], *share[1:])))
            except Exception as err:  # noqa: BLE001  (the parent reports it and stops)
                connection.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        pool.close()


class ClientProcesses:
    """The simulated users' worker processes, each with streams of its own, kept across runs
    (`own_connections`: each stream on a connection of its own, else a process's streams share one)."""

    def __init__(self, url: str, workload: Workload, count: int, own_connections: bool = False):
        context = multiprocessing.get_context("spawn")  # no fork of a process that has used CUDA
        self.workers = []
        for worker in range(count):
            mine, theirs = context.Pipe()
            process = context.Process(target=client_process, args=(url, workload, own_connections, worker, theirs),
                                      daemon=True)
            process.start()
            theirs.close()
            self.workers.append((process, mine))
        self.warm = [0] * count  # streams warmed up, per worker

    def split(self, streams: int) -> list[int]:
        """Streams per worker: as even as can be, on the first min(streams, workers)."""
        used = min(streams, len(self.workers))
        return [streams // used + (worker < streams % used) for worker in range(used)]

    def run(self, name: str, shares: list[dict]) -> Share:
        """Share `name` on the first len(shares) workers at once, each with its own kwargs: their
        outcomes together, how many arrivals found no idle stream, and their requests in flight
        at each count, summed."""
        for (_, connection), kwargs in zip(self.workers, shares):
            connection.send((name, kwargs))
        outcomes, not_started, in_flight, failures = [], 0, None, []
        for (_, connection), _ in zip(self.workers, shares):
            try:
                status, value = connection.recv()
            except EOFError:
                status, value = "error", "a client process exited"
            if status == "error":
                failures.append(value)
                continue
            share = Share(*value)
            outcomes += [RequestOutcome(**fields) for fields in share.outcomes]
            not_started += share.not_started
            # Every worker counts at the same moments (the run's start_at + k intervals).
            in_flight = share.in_flight if in_flight is None else [a + b for a, b in zip(in_flight, share.in_flight)]
        if failures:
            raise LoadError(f"{len(failures)} client processes failed, the first: {failures[0]}")
        return Share(outcomes, not_started, in_flight or [])

    def warm_up(self, counts: list[int], mix: tuple[float, ...]) -> list[RequestOutcome]:
        outcomes = self.run("warm_up", [dict(count=count, mix=mix, others=worker == 0)
                                        for worker, count in enumerate(counts)]).outcomes
        for worker, count in enumerate(counts):
            self.warm[worker] = max(self.warm[worker], count)
        errors = [outcome.error for outcome in outcomes if outcome.error]
        if errors:
            say(f"warm-up: {len(errors)} of {len(outcomes)} requests failed, the first: {errors[0]}")
        return outcomes

    def close(self) -> None:
        for _, connection in self.workers:
            with contextlib.suppress(OSError):
                connection.send(None)
        for process, _ in self.workers:
            process.join(timeout=15)
            if process.is_alive():
                process.terminate()


def warmed_up_metrics(metrics_url: str | None, clients: ClientProcesses, counts: list[int], mix: tuple[float, ...]):
    """Warm up, and the metrics once they count the warm-up's tiles: a run's snapshot before it."""
    baseline = model_metrics(metrics_url)
    return metrics_after(metrics_url, baseline, clients.warm_up(counts, mix))


# ---- the server's numbers -------------------------------------------------------------------

METRIC_LINE = re.compile(r"^(auk_vae_\w+)(?:\{(.*)\})? (\S+)$")


def model_metrics(metrics_url: str | None) -> dict[str, float] | None:
    """The decode model's auk_vae_* samples on the metrics port, summed over versions;
    a histogram bucket is named `<name>:<le>`. None where the port does not answer."""
    if metrics_url is None:
        return None
    try:
        text = urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=5).read().decode()
    except OSError as err:
        say(f"no metrics from {metrics_url}: {err}")
        return None
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = METRIC_LINE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        found = dict(re.findall(r'(\w+)="([^"]*)"', labels or ""))
        if found.get("model") not in (MODEL, PIPELINE_MODEL):  # the pipeline's decoder reports as the pipeline
            continue
        if "le" in found:
            name = f"{name}:{found['le']}"
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def metrics_after(metrics_url: str | None, before: dict | None, outcomes, timeout_s: float = 5.0):
    """The metrics once they count the run's tiles and first tiles (the model reports them a few
    milliseconds after it sends them), or after `timeout_s`."""
    if before is None:
        return None
    tiles = sum(outcome.tiles for outcome in outcomes)
    firsts = sum(outcome.tiles > 0 for outcome in outcomes)
    deadline = time.perf_counter() + timeout_s
    while True:
        after = model_metrics(metrics_url)
        if after is None or "auk_vae_tiles_sent_total" not in after or time.perf_counter() > deadline:
            return after  # no model metrics on this server, or they never caught up
        grew = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
        if grew("auk_vae_tiles_sent_total") >= tiles and grew("auk_vae_first_audio_seconds_count") >= firsts:
            time.sleep(MODEL_METRICS_LAG_S)  # the last iteration's replay count comes in the same report
            return model_metrics(metrics_url)
        time.sleep(0.02)


def server_numbers(before: dict | None, after: dict | None, wall_s: float | None = None) -> dict | None:
    """The scheduler's numbers between two snapshots: replays, mean windows per replay, first
    audio (mean, and the histogram bucket that holds its p99) and underruns; and, over a run of
    `wall_s`, the shares of it that the decoder's thread spent launching decodes and waiting for
    their samples, and in response sends (at saturation: whether it waited on the GPU, or sent).
    None if absent."""
    if not before or not after or "auk_vae_windows_per_replay_count" not in after:
        return None

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    replays, firsts = grew("auk_vae_windows_per_replay_count"), grew("auk_vae_first_audio_seconds_count")
    prefix = "auk_vae_first_audio_seconds_bucket:"
    buckets = sorted((float(name[len(prefix):]), grew(name)) for name in after if name.startswith(prefix))
    p99_le = next((le for le, count in buckets if count >= 0.99 * firsts), None) if firsts else None
    return {
        "replays": replays,
        "windows_per_replay": grew("auk_vae_windows_per_replay_sum") / replays if replays else None,
        "first_audio_mean_ms": grew("auk_vae_first_audio_seconds_sum") / firsts * 1e3 if firsts else None,
        "first_audio_p99_le_ms": None if p99_le is None else p99_le * 1e3,
        "underruns": int(grew("auk_vae_underruns_total")),
        "first_tiles": int(firsts),  # requests whose first tile the model sent: the client's count, if clean
        "decode_share": grew("auk_vae_decode_seconds_total") / wall_s if wall_s else None,
        "send_share": grew("auk_vae_send_seconds_total") / wall_s if wall_s else None,
    }


# ---- runs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backlog:
    """Whether an open loop's requests in flight grew over its arrivals."""

    start: float  # mean in flight over the first fifth of the counts
    end: float  # over the last fifth
    slope: float  # least-squares line through every count, in requests per second


def backlog_trend(in_flight: list[int], interval_s: float = BACKLOG_INTERVAL_S) -> Backlog | None:
    """The trend of requests in flight counted every `interval_s` (the first count one interval
    after the start); None with fewer than two counts."""
    if len(in_flight) < 2:
        return None
    counts = np.asarray(in_flight, dtype=float)
    moments = np.arange(1, len(counts) + 1) * interval_s
    fifth = max(1, len(counts) // 5)
    return Backlog(float(counts[:fifth].mean()), float(counts[-fifth:].mean()),
                   float(np.polyfit(moments, counts, 1)[0]))


@dataclass
class Run:
    """One run's requests and what was measured around them."""

    mode: str
    load: str  # "4 clients", "12.0 req/s (0.80 of capacity)"
    clips: tuple[float, ...]
    outcomes: list[RequestOutcome]
    wall_s: float
    not_started: int = 0
    server: dict | None = None
    capacity: float | None = None  # audio seconds per second of the capacity for this mix
    offered: float | None = None  # open loop: requests per second
    duration_s: float | None = None  # open loop: seconds of arrivals
    in_flight: list[int] = dataclasses.field(default_factory=list)  # open loop: every BACKLOG_INTERVAL_S

    def done(self) -> list[RequestOutcome]:
        return [outcome for outcome in self.outcomes if outcome.error is None]

    def errors(self) -> list[RequestOutcome]:
        return [outcome for outcome in self.outcomes if outcome.error is not None]

    def audio_per_second(self) -> float:
        return sum(outcome.audio_seconds for outcome in self.done()) / self.wall_s if self.wall_s > 0 else 0.0

    def requests_per_second(self) -> float:
        """Requests completed (without error) per second, from the start to the last one's end."""
        return len(self.done()) / self.wall_s if self.wall_s > 0 else 0.0

    def arrivals(self) -> int:
        """Open loop: every arrival, started or not."""
        return len(self.outcomes) + self.not_started

    def backlog(self) -> Backlog | None:
        return backlog_trend(self.in_flight)

    def underruns(self) -> tuple[int, int]:
        """(underrun tiles, requests with any)."""
        return sum(o.underruns for o in self.outcomes), sum(o.underruns > 0 for o in self.outcomes)

    def percentiles(self, attribute: str) -> tuple[float | None, float | None]:
        values = [getattr(o, attribute) for o in self.done() if getattr(o, attribute) is not None]
        if not values:
            return None, None
        return float(np.percentile(values, 50)), float(np.percentile(values, 99))


# The moment a run starts, this long after its shares are sent: every worker has its share by then.
START_DELAY_S = 0.5


def run_closed_loop(clients: ClientProcesses, mix: tuple[float, ...], count: int, seconds: float,
                    requests: int | None, seed: int, metrics_url: str | None) -> Run:
    """`count` closed-loop clients over the workers (client i on worker i mod workers)."""
    counts = clients.split(count)
    before = warmed_up_metrics(metrics_url, clients, counts, mix)
    start_at = time.perf_counter() + START_DELAY_S
    shares = [dict(mix=mix, indices=list(range(worker, count, len(counts))), clients=count, seconds=seconds,
                   requests=requests, seed=seed, start_at=start_at) for worker in range(len(counts))]
    outcomes = clients.run("closed", shares).outcomes
    wall = max((outcome.ended for outcome in outcomes), default=start_at) - start_at
    after = metrics_after(metrics_url, before, outcomes)
    label = f"{count} client{'' if count == 1 else 's'}"
    return Run("closed", label, mix, outcomes, wall, server=server_numbers(before, after, wall))


def run_open_loop(clients: ClientProcesses, mix: tuple[float, ...], rate: float, duration: float, max_streams: int,
                  seed: int, metrics_url: str | None, label: str) -> Run:
    """Poisson arrivals of `rate` per second for `duration` seconds: each worker an independent
    share of the rate on its share of `max_streams` streams."""
    workers = len(clients.workers)
    per_worker = math.ceil(max_streams / workers)
    if all(warm >= per_worker for warm in clients.warm):
        before = model_metrics(metrics_url)  # the last run's metrics_after waited for its counters
    else:
        before = warmed_up_metrics(metrics_url, clients, [per_worker] * workers, mix)
    start_at = time.perf_counter() + START_DELAY_S
    shares = [dict(mix=mix, rate=rate / workers, duration=duration, streams=per_worker,
                   seed=[seed, int(rate * 1000), worker], start_at=start_at, label=label) for worker in range(workers)]
    outcomes, not_started, in_flight = clients.run("open", shares)
    wall = max((outcome.ended for outcome in outcomes), default=start_at) - start_at
    after = metrics_after(metrics_url, before, outcomes)
    return Run("open", label, mix, outcomes, wall, not_started, server_numbers(before, after, wall), offered=rate,
               duration_s=duration, in_flight=in_flight)


# ---- the pipeline's one-client figure and capacity, measured on the server -------------------


@dataclass
class MeasuredCapacity:
    """A closed loop's throughput at saturation, measured on the server in this run: the
    capacity of a model with none in process (the pipeline), for the mix it ran."""

    run: Run
    clients: int

    def covers(self, mix) -> bool:
        return tuple(mix) == self.run.clips

    def requests_per_second(self, mix) -> float:
        self._check(mix)
        return self.run.requests_per_second()

    def audio_per_second(self, mix) -> float:
        self._check(mix)
        return self.run.audio_per_second()

    def _check(self, mix) -> None:
        if not self.covers(mix):
            raise ValueError(f"the capacity was measured for clips {self.run.clips}, not {tuple(mix)}")


@dataclass
class Baseline:
    """The pipeline's references, measured before its runs: one client's first audio, and the
    capacity its open loop's load refers to."""

    one_client: Run | None = None
    capacity: MeasuredCapacity | None = None

    def one_client_first_ms(self) -> float | None:
        return self.one_client.percentiles("first_audio_ms")[0] if self.one_client else None


def measure_baseline(args, clients: ClientProcesses, metrics_url: str | None, baseline: Baseline, runs: list) -> None:
    """One client's `--one-client-requests` one after another (after its warm-up), then
    `--capacity-clients` closed-loop clients: a warm-up loop, and the measured one. The clip
    mix is the open loop's (all of `--clips`)."""
    mix = tuple(args.clips)
    one = run_closed_loop(clients, mix, 1, args.seconds_per_run, args.one_client_requests, args.seed, metrics_url)
    one.load = "1 client (one-client figure)"
    baseline.one_client = one
    runs.append(one)
    say(run_line(one, baseline))
    if not args.capacity_clients:
        return
    if args.capacity_warmup_seconds > 0:
        warm = run_closed_loop(clients, mix, args.capacity_clients, args.capacity_warmup_seconds, None, args.seed + 1,
                               metrics_url)
        say(f"warm-up (not kept): {run_line(warm, baseline)}")
    run = run_closed_loop(clients, mix, args.capacity_clients, args.capacity_seconds, None, args.seed, metrics_url)
    run.load += " (capacity)"
    baseline.capacity = MeasuredCapacity(run, args.capacity_clients)
    run.capacity = run.audio_per_second()
    runs.append(run)
    say(run_line(run, baseline))
    say(f"capacity, clips {'/'.join(f'{s:g}' for s in mix)} s: {run.requests_per_second():.2f} requests per s "
        f"({run.audio_per_second():.1f} audio s per s), closed loop of {args.capacity_clients} clients")


# ---- the in-process capacity ----------------------------------------------------------------


@dataclass
class Capacity:
    """What the served graphs decode in process: each batch key's best windows per second, and
    each clip length's windows by key."""

    windows_per_second: dict[int, float]
    window_keys: dict[float, list[int]]

    def covers(self, mix) -> bool:
        return all(seconds in self.window_keys for seconds in mix)

    def gpu_seconds(self, clip_seconds: float) -> float:
        return sum(1 / self.windows_per_second[key] for key in self.window_keys[clip_seconds])

    def requests_per_second(self, mix) -> float:
        """Requests per second of a uniform draw from `mix` (clip seconds)."""
        return 1 / float(np.mean([self.gpu_seconds(seconds) for seconds in mix]))

    def audio_per_second(self, mix) -> float:
        audio = np.mean([clip_frames(seconds) / FRAMES_PER_SECOND for seconds in mix])
        return float(audio) * self.requests_per_second(mix)


def measure_capacity(checkpoint: Path, settings: DecodeSettings, clip_seconds, iters: int) -> Capacity:
    """Time `decode_rows` of B rows per batch key and B, and keep each key's best rate."""
    graph = served_graph(checkpoint, settings)
    began = time.perf_counter()
    graph.warmup("cuda", on_bucket=lambda frames, seconds, ok: say(
        f"in-process bucket {frames} frames: {'built' if ok else 'FAILED'} in {seconds:.0f} s"))
    say(f"in-process warm-up {time.perf_counter() - began:.0f} s")
    device = torch.device("cuda")
    window_keys = {seconds: [graph.batch_key(size, device) for _, size, _, _ in graph.plan(clip_frames(seconds))]
                   for seconds in clip_seconds}
    keys = sorted(set(graph.compile_shapes) | {key for found in window_keys.values() for key in found})
    say("\n| batch key (frames) | rows | ms per replay | windows per s | tier |")
    say("| --- | --- | --- | --- | --- |")
    best: dict[int, float] = {}
    for key in keys:
        for rows in [b for b in graph.batch_sizes if b <= graph.batch_capacity(key)]:
            ms = replay_ms(graph, key, rows, iters)
            rate = rows / (ms / 1e3)
            best[key] = max(best.get(key, 0.0), rate)
            say(f"| {key} | {rows} | {ms:.2f} | {rate:.0f} | {graph.last_mode} |")
    del graph
    gc.collect()
    torch.cuda.empty_cache()  # the server's instance comes next on the same GPU
    return Capacity(best, window_keys)


# ---- the server -----------------------------------------------------------------------------


def scheduler_values(args) -> dict[str, str]:
    """The scheduler's config parameters given on the command line, as config text."""
    values = {}
    for option, parameter in SCHEDULER_PARAMETERS.items():
        value = getattr(args, option)
        if value is not None:
            values[parameter] = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return values


def set_model_parameters(model_dir: Path, values: dict[str, str]) -> None:
    """Write `values` into the empty parameters of both config files of a model."""
    for config in (model_dir / "config.pbtxt", model_dir / "configs" / "gpu.pbtxt"):
        text = config.read_text()
        for key, value in values.items():
            text, count = re.subn(rf'(key: "{key}", value: \{{ string_value: )"[^"]*"', rf'\1"{value}"', text)
            if count != 1:
                raise RuntimeError(f"no {key} parameter in {config}")
        config.write_text(text)


def served_values(args) -> dict[str, str]:
    """The config parameters the options set on the model that decodes."""
    values = scheduler_values(args)
    if args.decode_yields_to_dit:
        values["decode_yields_to_dit"] = "true"
    if args.no_decode_look_ahead_during_dit:
        values["decode_look_ahead_during_dit"] = "false"
    if args.no_first_tile_under_load:
        values["first_tile_under_load"] = "false"
    if args.first_tile_at_saturation:
        values["first_tile_at_saturation"] = "true"
    return values


def served_repository(args, dest: Path, project_root: Path = REPO_ROOT) -> Path:
    """A copy of `project_root`'s model_repository/ in `dest` with the options' buckets and
    parameters on the model that decodes: the decode model, or the pipeline, which decodes in its
    own process with its own copy of the decoder's parameters."""
    decoding_model = PIPELINE_MODEL if args.model == "pipeline" else MODEL
    buckets = None if tuple(args.buckets) == tuple(DEFAULT_COMPILE_SHAPES) else args.buckets
    repository = model_repository_copy(dest, buckets, decoding_model, project_root)
    set_model_parameters(repository / decoding_model, served_values(args))
    return repository


def serve(args, checkpoint: Path, cache: Path, stack: contextlib.ExitStack) -> tuple[str, str]:
    """Start tritonserver (a copy of model_repository/ where the options change it), alone or
    (`--front-door`) behind the front door as the launcher starts it, this checkout's or
    (`--revision`) that revision's; it is stopped when `stack` closes. Returns the gRPC address
    the load goes to and the metrics address."""
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="auk-load-server-")))
    project_root = revision_tree(args.revision_commit, folder / "revision") if args.revision else REPO_ROOT
    repository = None
    if served_values(args) or tuple(args.buckets) != tuple(DEFAULT_COMPILE_SHAPES):
        repository = served_repository(args, folder / "model_repository", project_root)
    models = PIPELINE_MODELS if args.model == "pipeline" else (MODEL,)
    options = dict(ready_timeout_s=args.ready_timeout, device="gpu" if args.device == "cuda" else "cpu",
                   model_repository=repository, extra_args=trace_arguments(Path(args.trace)) if args.trace else ())
    if args.front_door:
        process, public, _ = start_launcher(checkpoint, cache, Path(args.log), models, project_root=project_root,
                                            **options)
        url, metrics_url = f"127.0.0.1:{public['grpc']}", f"127.0.0.1:{public['metrics']}"
    else:
        process, url, _, metrics_url = start_server(checkpoint, cache, Path(args.log), models, **options)
    stack.callback(stop_server, process)
    return url, metrics_url


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


# ---- Triton's request traces (common.trace_arguments) ---------------------------------------


def traces_by_request_id(trace_file: Path) -> dict[str, list[tuple[str, int]]]:
    """Request id -> the (name, ns) timestamps Triton traced for it, in time order. An
    ensemble's steps (traces whose parent is the request's) join it, each stamp named
    after its model: "auk_dit COMPUTE_START"."""
    traced = read_traces(trace_file)
    stamps: dict[str, list[tuple[str, int]]] = {}
    for request in traced.values():
        parent = traced.get(request.parent) if request.parent is not None else None
        if parent is None:
            stamps.setdefault(request.request_id, []).extend(request.stamps)
        else:
            stamps.setdefault(parent.request_id, []).extend((f"{request.model} {name}", ns)
                                                            for name, ns in request.stamps)
    return {request_id: sorted(found, key=lambda stamp: stamp[1]) for request_id, found in stamps.items()}


def print_slowest_traces(runs: list, traces: dict, count: int) -> None:
    """Each run's `count` slowest first audios, step by step: ms after the client's send."""
    if not traces:
        say("no request traces (tritonserver wrote none)")
        return
    for run in runs:
        slowest = sorted((o for o in run.done() if o.first_audio_ms is not None),
                         key=lambda o: o.first_audio_ms, reverse=True)[:count]
        say(f"\nslowest first audio, {run.mode} {run.load}, clips {'/'.join(f'{s:g}' for s in run.clips)} s "
            "(ms after the client's send):")
        for outcome in slowest:
            sent_ns = outcome.sent * 1e9
            steps, seen = [], set()
            for name, ns in traces.get(outcome.request_id, []):
                if name not in seen:  # the first of each: the way to the first tile
                    seen.add(name)
                    steps.append(f"{name} {(ns - sent_ns) / 1e6:.1f}")
            say(f"  {outcome.request_id} ({outcome.clip_seconds:g} s clip): first audio {outcome.first_audio_ms:.1f}; "
                + (", ".join(steps) if steps else "not traced"))


# Where a pipeline request's first audio goes on the server, between two traced stamps each
# (the first of each name: the way to the first tile).
PIPELINE_PHASES = (
    ("waiting for auk_dit", "REQUEST_START", "auk_dit COMPUTE_START"),
    ("auk_dit's execute (its batch)", "auk_dit COMPUTE_START", "auk_dit COMPUTE_END"),
    ("decode to the first tile", "auk_vae_decode REQUEST_START", "INFER_RESPONSE_COMPLETE"),
    ("the server's first audio", "REQUEST_START", "INFER_RESPONSE_COMPLETE"),
)


def phase_percentiles(stamps: list[dict[str, int]]) -> dict[str, tuple[float, float, float]]:
    """Per PIPELINE_PHASES phase: its p50, p90 and p99 in ms over the requests traced with both
    of its stamps. `stamps`: per request, each stamp name's first ns."""
    phases = {}
    for name, begin, end in PIPELINE_PHASES:
        spans = [(found[end] - found[begin]) / 1e6 for found in stamps if begin in found and end in found]
        if spans:
            phases[name] = tuple(percentile(spans, q) for q in (50, 90, 99))
    return phases


def dit_executes(stamps: list[dict[str, int]]) -> dict[int, list[float]]:
    """`auk_dit`'s executes among these requests (per request, each stamp name's first ns), by
    how many of them each execute held: their durations in ms."""
    by_size: dict[int, list[float]] = {}
    spans = ((found.get("auk_dit COMPUTE_START"), found.get("auk_dit COMPUTE_END")) for found in stamps)
    for start, (end, size) in executes(spans).items():
        by_size.setdefault(size, []).append((end - start) / 1e6)
    return dict(sorted(by_size.items()))


def print_pipeline_phases(runs: list, traces: dict) -> None:
    """Each run's server-side phases of first audio, from the traces, and what was left outside
    the server (client, front door, network): the client's first audio less the server's."""
    for run in runs:
        stamps, outside = [], []
        for outcome in run.done():
            found: dict[str, int] = {}
            for name, ns in traces.get(outcome.request_id, []):
                found.setdefault(name, ns)
            stamps.append(found)
            if outcome.first_audio_ms is not None and {"REQUEST_START", "INFER_RESPONSE_COMPLETE"} <= found.keys():
                outside.append(outcome.first_audio_ms - (found["INFER_RESPONSE_COMPLETE"] - found["REQUEST_START"]) / 1e6)
        phases = phase_percentiles(stamps)
        if not phases:
            continue
        if outside:
            phases["outside the server"] = tuple(percentile(outside, q) for q in (50, 90, 99))
        say(f"\nwhere first audio went, {run.mode} {run.load} (ms, p50 / p90 / p99):")
        for name, (p50, p90, p99) in phases.items():
            say(f"  {name}: {p50:.1f} / {p90:.1f} / {p99:.1f}")
        sizes = dit_executes(stamps)
        say(f"  auk_dit's executes: {sum(len(v) for v in sizes.values())}; by requests held, count and median ms: "
            + ", ".join(f"{size}: {len(ms)} x {statistics.median(ms):.1f}" for size, ms in sizes.items()))


# ---- the report -----------------------------------------------------------------------------


def number(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def capacity_share(run: Run) -> str:
    return "n/a" if not run.capacity else f"{run.audio_per_second() / run.capacity * 100:.0f}%"


def server_cells(server: dict | None) -> tuple[str, str, str]:
    """(windows per replay, first audio mean / p99 bucket ms, underruns) of the server's numbers."""
    if server is None:
        return "n/a", "n/a", "n/a"
    p99 = server["first_audio_p99_le_ms"]
    first = f"{number(server['first_audio_mean_ms'])} / {'n/a' if p99 is None else f'<= {p99:g}'}"
    return number(server["windows_per_replay"], 2), first, str(server["underruns"])


def run_cells(run: Run, baseline: Baseline | None = None) -> dict[str, str]:
    """A run's numbers as text, for its line and its summary rows (`baseline`: the pipeline's)."""
    (first50, first99), (total50, total99) = run.percentiles("first_audio_ms"), run.percentiles("total_ms")
    tiles, requests = run.underruns()
    windows, server_first, server_underruns = server_cells(run.server)
    one = baseline.one_client_first_ms() if baseline else None
    backlog = run.backlog()
    lags = [o.start_lag_ms for o in run.outcomes]
    return {
        "first50": number(first50), "first99": number(first99), "total50": number(total50), "total99": number(total99),
        "audio": f"{run.audio_per_second():.1f}", "rate": f"{run.requests_per_second():.2f}",
        "share": capacity_share(run), "underruns": f"{tiles} ({requests})", "errors": str(len(run.errors())),
        "windows": windows, "server_first": server_first, "server_underruns": server_underruns,
        "vs_one": f"{first99 / one:.2f}" if first99 is not None and one else "n/a",
        "in_flight": f"{backlog.start:.1f} / {backlog.end:.1f}" if backlog else "n/a",
        "slope": f"{backlog.slope:+.3f}" if backlog else "n/a",
        "lag99": number(float(np.percentile(lags, 99))) if run.mode == "open" and lags else "n/a",
        "not_started": str(run.not_started),
    }


def run_line(run: Run, baseline: Baseline | None = None) -> str:
    cells, (tiles, requests) = run_cells(run, baseline), run.underruns()
    started = ""
    if run.mode == "open":
        lag = f", start lag p99 {cells['lag99']} ms" if run.outcomes else ""
        started = (f" ({run.not_started} not started{lag}; offered {run.offered:.2f} req/s, {run.arrivals()} arrived "
                   f"in {run.duration_s:g} s; in flight, first / last fifth {cells['in_flight']}, slope "
                   f"{cells['slope']} req/s)")
    versus = ""
    if baseline and baseline.one_client_first_ms() and run is not baseline.one_client:
        versus = f" ({cells['vs_one']}x one client's p50)"
    return (f"{run.mode}, {run.load}, clips {'/'.join(f'{s:g}' for s in run.clips)} s: {len(run.outcomes)} requests"
            f"{started}, first audio p50 {cells['first50']} / p99 {cells['first99']} ms{versus}, total p50 "
            f"{cells['total50']} / p99 {cells['total99']} ms, {cells['audio']} audio s/s ({cells['rate']} req/s, "
            f"{cells['share']} of capacity), underruns {tiles} in {requests} requests, errors {cells['errors']}; "
            f"server: {run.server['first_tiles'] if run.server else 'n/a'} requests, {cells['windows']} windows per "
            f"replay, first audio mean / p99 {cells['server_first']} ms, underruns {cells['server_underruns']}"
            f"{decoder_busy(run.server)}")


def decoder_busy(server: dict | None) -> str:
    """The decoder thread's busy shares of a run, for its line; empty where unknown."""
    if not server or server.get("decode_share") is None:
        return ""
    return (f", decoder thread {server['decode_share'] * 100:.0f}% decoding (launch and wait), "
            f"{server['send_share'] * 100:.0f}% sending")


SUMMARY_COLUMNS = ("first50", "first99", "total50", "total99", "audio", "rate", "share", "underruns", "errors",
                   "windows", "server_first", "server_underruns")


def print_summary(runs: list[Run]) -> None:
    say("\n| mode | clips s | load | requests | not started | first audio p50 ms | p99 | total p50 ms | p99 "
        "| audio s/s | req/s | of capacity | underruns (requests) | errors | server windows per replay "
        "| server first audio mean / p99 ms | server underruns |")
    say("| --- " * 17 + "|")
    for run in runs:
        cells = run_cells(run)
        say(f"| {run.mode} | {' '.join(f'{s:g}' for s in run.clips)} | {run.load} | {len(run.outcomes)} | "
            f"{run.not_started} | " + " | ".join(cells[column] for column in SUMMARY_COLUMNS) + " |")
    for run in runs:
        for outcome in run.errors()[:3]:
            say(f"error, {run.mode} {run.load}, {outcome.clip_seconds:g} s clip: {outcome.error}")


PIPELINE_COLUMNS = ("first50", "first99", "vs_one", "total50", "total99", "rate", "in_flight", "slope", "lag99",
                    "not_started", "underruns", "errors")


def print_pipeline_summary(runs: list[Run], baseline: Baseline, recipe: str) -> None:
    """The pipeline's runs after its baseline, each against one client's first audio and the
    measured capacity (the open loop's backlog: requests in flight, first and last fifth of its
    arrivals, and the least-squares slope of every count)."""
    one = baseline.one_client_first_ms()
    capacity = baseline.capacity
    reference = (f"| {recipe} | {' '.join(f'{s:g}' for s in baseline.one_client.clips) if baseline.one_client else 'n/a'}"
                 f" | {number(one)} | " + (f"{capacity.run.requests_per_second():.2f} ({capacity.clients})"
                                           if capacity else "n/a") + " | ")
    say("\n| recipe | clips s | one client: first audio p50 ms | capacity req/s (closed-loop clients) | run "
        "| first audio p50 ms | p99 | p99 / one client | total p50 ms | p99 | completed req/s "
        "| in flight, first / last fifth | backlog slope req/s | start lag p99 ms | not started | underruns (requests) "
        "| errors |")
    say("| --- " * 17 + "|")
    measured = [run for run in runs if run is not baseline.one_client and (not capacity or run is not capacity.run)]
    for run in measured or [None]:
        if run is None:  # no run past the baseline: its references alone
            say(reference + " | ".join(["n/a"] * (1 + len(PIPELINE_COLUMNS))) + " |")
            continue
        cells = run_cells(run, baseline)
        say(reference + f"{run.mode}, {run.load} | " + " | ".join(cells[column] for column in PIPELINE_COLUMNS) + " |")


def meets_target(run: Run, p99_target_ms: float) -> bool:
    """First audio p99 within the target, no underrun (client or server), error or unstarted request."""
    _, first99 = run.percentiles("first_audio_ms")
    server_underruns = run.server["underruns"] if run.server else 0
    return (first99 is not None and first99 <= p99_target_ms and run.underruns()[0] == 0
            and server_underruns == 0 and not run.errors() and run.not_started == 0)


# ---- main -----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("decode", "pipeline"), default="decode",
                        help=f"decode: {MODEL} (latents in); pipeline: {PIPELINE_MODEL} (the DiT, then the decoder, in one process: "
                             "prompt embeddings in)")
    parser.add_argument("--recipe", choices=("flash", "base"), default=None,
                        help="pipeline: the DiT's checkpoint and recipe (default flash: 4 steps; base: 32 guided)")
    parser.add_argument("--tokens", type=int, default=64, help="pipeline: prompt tokens (seeded stand-in embeddings)")
    parser.add_argument("--decode-yields-to-dit", action="store_true",
                        help=f"pipeline: serve {PIPELINE_MODEL} with its decode_yields_to_dit parameter on")
    parser.add_argument("--no-decode-look-ahead-during-dit", action="store_true",
                        help=f"pipeline: serve {PIPELINE_MODEL} with its decode_look_ahead_during_dit parameter off")
    parser.add_argument("--first-tile-at-saturation", action="store_true",
                        help=f"pipeline: serve {PIPELINE_MODEL} with its first_tile_at_saturation parameter on")
    parser.add_argument("--front-door", action="store_true",
                        help="start the server as users do (the launcher: the front door before tritonserver) and "
                             "send the load to the front door's gRPC port")
    parser.add_argument("--revision", default=None,
                        help="with --front-door: serve this repository's code at REVISION (a commit, tag or branch, "
                             "git archive'd into a temporary folder) through its own launcher, not this checkout's: "
                             "a baseline measured by this load generator, on this machine. The synthetic checkpoints "
                             "are this checkout's; give the revision a --cache-dir of its own")
    parser.add_argument("--connection-per-stream", action=argparse.BooleanOptionalAction, default=None,
                        help="each stream on a gRPC connection of its own (default: on with --front-door, which "
                             "takes 64 streams a connection; else a worker's streams share one)")
    parser.add_argument("--mode", choices=("closed", "open"), nargs="+", default=None,
                        help="closed, open, or both (in that order, on one server); default closed, or open with "
                             "--find-max-load")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="closed loop: clients per run")
    parser.add_argument("--seconds-per-run", type=float, default=15.0, help="closed loop: seconds of requests per run")
    parser.add_argument("--requests", type=int, default=None,
                        help="closed loop: requests per client per run, instead of --seconds-per-run")
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="open loop: offered requests per second")
    parser.add_argument("--load", type=float, nargs="+", default=None,
                        help="open loop: offered load as fractions of the capacity (decode: in process, GPU, "
                             "--capacity; pipeline: measured closed-loop, --capacity-clients)")
    parser.add_argument("--duration", type=float, default=60.0, help="open loop: seconds of arrivals per run")
    # 64 left a few arrivals unstarted at 0.8 of an H200's capacity (RESULTS.md, l13): the pool,
    # not the server, would then fail the step.
    parser.add_argument("--max-streams", type=int, default=256, help="open loop: streams in the pool")
    parser.add_argument("--find-max-load", action="store_true",
                        help=f"open loop: step the load up (default {' '.join(map(str, LOAD_STEPS))} of the "
                             "capacity, or --load / --rates) of the open loop until a step misses the target")
    parser.add_argument("--p99-target-ms", type=float, default=50.0, help="--find-max-load: first audio p99 target")
    parser.add_argument("--clips", type=float, nargs="+", default=[2, 10, 30, 60],
                        help="clip lengths in seconds, drawn uniformly per request")
    parser.add_argument("--each-clip", action="store_true",
                        help="closed loop: each clip length on its own instead of the mix (the open loop runs the mix)")
    parser.add_argument("--client-processes", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)),
                        help="worker processes the clients are spread over (default 4, at most half the cores)")
    parser.add_argument("--format", choices=list(OUTPUTS), default=None,
                        help="pcm16: WAVEFORM_PCM16 (int16; the decode model's default); float32: WAVEFORM (the "
                             "pipeline's only waveform output)")
    parser.add_argument("--seed", type=int, default=SEED, help="clip draws and arrivals")
    parser.add_argument("--preset", default="auk", help="synthetic checkpoint preset (small: for the CPU)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the CPU model config (a check that the script works, not a measurement)")
    parser.add_argument("--url", default=None, help="a running server's gRPC address on this host, instead of one "
                                                   "started here (its settings are its own)")
    parser.add_argument("--metrics-url", default=None, help="with --url: its metrics address (default port 8002)")
    parser.add_argument("--capacity", action=argparse.BooleanOptionalAction, default=None,
                        help="measure the in-process capacity (default: on with CUDA)")
    parser.add_argument("--capacity-iters", type=int, default=20, help="timed replays per batch key and rows")
    parser.add_argument("--capacity-clients", type=int, default=16,
                        help="pipeline: closed-loop clients whose throughput is the capacity (0: not measured)")
    parser.add_argument("--capacity-seconds", type=float, default=20.0,
                        help="pipeline: seconds of the measured capacity loop")
    parser.add_argument("--capacity-warmup-seconds", type=float, default=5.0,
                        help="pipeline: seconds of the same closed loop before it, not kept")
    parser.add_argument("--one-client-requests", type=int, default=8,
                        help="pipeline: one client's requests, one after another after its warm-up: the one-client "
                             "first audio")
    parser.add_argument("--ready-timeout", type=float, default=None,
                        help="seconds the server may take to READY (default 480; the pipeline: 900)")
    parser.add_argument("--buckets", type=int, nargs="+", default=list(DEFAULT_COMPILE_SHAPES),
                        help="compiled buckets (compile_shapes), served and in process")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="the scheduler's rows per replay (default 1 2 4 8 16; 1: batching off)")
    parser.add_argument("--batch-frames", type=int, default=None, help="frames per batched replay (default one tile)")
    parser.add_argument("--max-active", type=int, default=None, help="max_active_requests (default: DecodeSettings)")
    parser.add_argument("--first-tile-frames", type=int, default=None,
                        help="served: first_tile_frames, the first window of a longer clip (default: the smallest "
                             "bucket; 0: off)")
    parser.add_argument("--no-first-tile-under-load", action="store_true",
                        help="served: first_tile_under_load off, no short first window while another request has a "
                             "window waiting to decode")
    parser.add_argument("--cache-dir", default=None, help="compile caches and the checkpoint (default: a new folder)")
    parser.add_argument("--log", default="tritonserver.log")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="tritonserver traces every request into FILE; the report then places each run's "
                             "slowest first audios step by step")
    parser.add_argument("--trace-slowest", type=int, default=5, help="--trace: requests shown per run")
    args = parser.parse_args()

    if args.mode is None:
        args.mode = ["open"] if args.find_max_load else ["closed"]
    elif args.find_max_load and "open" not in args.mode:
        parser.error("--find-max-load steps the open loop: give --mode open (or closed open)")
    args.mode = [mode for mode in ("closed", "open") if mode in args.mode]
    if args.client_processes < 1:
        parser.error("--client-processes must be at least 1")
    pipeline = args.model == "pipeline"
    if pipeline:
        if args.capacity:
            parser.error("--capacity is the decode model's in process; the pipeline's is measured on the server "
                         "(--capacity-clients)")
        args.capacity = False
        args.recipe = args.recipe or "flash"
        args.format = args.format or "float32"
        if args.format != "float32":
            parser.error(f"{PIPELINE_MODEL} sends WAVEFORM (float32) only: no --format {args.format}")
        if args.tokens < 1 or args.one_client_requests < 1 or args.capacity_clients < 0:
            parser.error("--tokens and --one-client-requests must be at least 1, --capacity-clients at least 0")
    else:
        if (args.recipe is not None or args.decode_yields_to_dit or args.no_decode_look_ahead_during_dit
                or args.first_tile_at_saturation):
            parser.error("--recipe, --decode-yields-to-dit, --no-decode-look-ahead-during-dit and "
                         "--first-tile-at-saturation are the pipeline's (--model pipeline)")
        args.format = args.format or "pcm16"
    if args.capacity is None:
        args.capacity = args.device == "cuda" and torch.cuda.is_available()
    if args.capacity and (args.device != "cuda" or not torch.cuda.is_available()):
        parser.error("--capacity needs CUDA")
    if "open" in args.mode:
        if args.rates is None and args.load is None and not args.find_max_load:
            parser.error("the open loop needs --rates or --load (or --find-max-load)")
        if args.rates is None and pipeline and not args.capacity_clients:
            parser.error("--load and --find-max-load refer to the capacity measured closed-loop "
                         "(--capacity-clients); give --rates instead")
        if args.rates is None and not pipeline and not args.capacity:
            parser.error("--load and --find-max-load refer to the in-process capacity (GPU, --capacity); "
                         "give --rates instead")
    for address in filter(None, (args.url, args.metrics_url)):
        if address.rsplit(":", 1)[0] not in LOOPBACK_HOSTS:
            parser.error(f"{address}: only a server on this host (127.0.0.1) is driven")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA here (--device cpu checks the script on the CPU)")
    if args.revision and not args.front_door:
        parser.error("--revision serves that revision through its own launcher: add --front-door")
    args.revision_commit = revision_commit(args.revision) if args.revision else None
    if args.revision and args.revision_commit is None:
        parser.error(f"--revision {args.revision}: no such commit in this repository")
    if args.url and args.front_door:
        parser.error("--front-door starts a server here; --url drives one already running")
    if args.url and args.trace:
        parser.error("--trace configures a server started here, not --url's")
    if args.url and (served_values(args) or args.buckets != list(DEFAULT_COMPILE_SHAPES)):
        parser.error("--buckets, --batch-sizes, --batch-frames, --max-active, --first-tile-frames, "
                     "--no-first-tile-under-load, --decode-yields-to-dit, --no-decode-look-ahead-during-dit and "
                     "--first-tile-at-saturation configure a server started here, not --url's")
    if args.url and args.metrics_url is None:
        args.metrics_url = f"{args.url.rsplit(':', 1)[0]}:8002"
    if args.connection_per_stream is None:
        args.connection_per_stream = args.front_door
    if args.ready_timeout is None:
        args.ready_timeout = 900.0 if pipeline else 480.0
    return args


def decode_settings(args) -> DecodeSettings:
    """The model's settings for these options (DecodeSettings' defaults where not given)."""
    default = DecodeSettings()
    return DecodeSettings(
        compile_shapes=tuple(args.buckets),
        batch_sizes=tuple(args.batch_sizes) if args.batch_sizes else default.batch_sizes,
        batch_frames=args.batch_frames or default.batch_frames,
        max_active_requests=args.max_active or default.max_active_requests,
        first_tile_frames=args.first_tile_frames,  # None: DecodeSettings' default
        first_tile_under_load=not args.no_first_tile_under_load,
    )


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO_ROOT) if script.is_relative_to(REPO_ROOT) else script
    return shlex.join(["python3", str(shown), *sys.argv[1:]])


def offered_rates(args, capacity: Capacity | MeasuredCapacity | None, mix: tuple[float, ...]) -> list[tuple[float, str]]:
    """(requests per second, label) of each open-loop run for a mix."""
    if args.rates is not None:
        return [(rate, f"{rate:g} req/s") for rate in args.rates]
    full = capacity.requests_per_second(mix)
    return [(fraction * full, f"{fraction * full:.2f} req/s ({fraction:g} of capacity)")
            for fraction in (args.load or LOAD_STEPS)]


def clip_mixes(args, mode: str) -> list[tuple[float, ...]]:
    """The clip mixes a mode runs: each length on its own (closed loop, --each-clip), or all of them."""
    return [(s,) for s in args.clips] if args.each_clip and mode == "closed" else [tuple(args.clips)]


def run_all(args, clients: ClientProcesses, capacity: Capacity | MeasuredCapacity | None, metrics_url: str | None,
            runs: list, baseline: Baseline | None = None) -> None:
    """Every run of the chosen modes, mix by mix; appends each to `runs` as it ends."""
    for mode in args.mode:
        for mix in clip_mixes(args, mode):
            steps = args.clients if mode == "closed" else offered_rates(args, capacity, mix)
            passed = None
            for step in steps:
                if mode == "closed":
                    run = run_closed_loop(clients, mix, step, args.seconds_per_run, args.requests, args.seed,
                                          metrics_url)
                else:
                    rate, label = step
                    run = run_open_loop(clients, mix, rate, args.duration, args.max_streams, args.seed, metrics_url,
                                        label)
                run.capacity = capacity.audio_per_second(mix) if capacity and capacity.covers(mix) else None
                runs.append(run)
                say(run_line(run, baseline))
                if args.find_max_load and mode == "open":
                    if not meets_target(run, args.p99_target_ms):
                        break  # the steps go up: the rest would miss it too
                    passed = run
            if args.find_max_load and mode == "open":
                verdict = f"{passed.load}, {passed.audio_per_second():.1f} audio s/s" if passed else "none of the steps"
                say(f"highest load with first audio p99 <= {args.p99_target_ms:g} ms and no underrun, error or "
                    f"unstarted request, clips {'/'.join(f'{s:g}' for s in mix)} s: {verdict}")


def main() -> None:
    args = parse_args()
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="auk-load-"))
    if args.device == "cuda":
        use_compile_cache(cache)  # the server inherits it: its buckets find what this process compiled
    pipeline = args.model == "pipeline"
    yielding = (", the decoder yielding to the DiT" if args.decode_yields_to_dit else "") + (
        ", no look-ahead while the DiT holds requests" if args.no_decode_look_ahead_during_dit else "") + (
        ", the short first window at saturation too" if args.first_tile_at_saturation else "")
    what = f"the pipeline ({args.recipe}, {args.tokens} prompt tokens{yielding})" if pipeline else "AuK"
    door = ", through the front door" if args.front_door else ""
    say(heading(f"{what} under load{door}, {args.preset} (synthetic), {args.format}", args.device))
    say(f"command: {command_line()}")
    if args.revision:
        say(f"served: the code of {args.revision} ({args.revision_commit}), not this checkout's")
    settings = decode_settings(args)
    where = ("the running server's settings are its own; in process" if args.url
             else f"this checkout's; {args.revision} serves its own" if args.revision
             else f"the decoder in {PIPELINE_MODEL}" if pipeline else "served and in process")
    say(f"settings ({where}): buckets {','.join(map(str, settings.buckets()))}, batch sizes "
        f"{','.join(map(str, settings.batch_sizes))}, batch frames {settings.batch_frames or 'one tile'}, "
        f"max active requests {settings.max_active_requests}, first window {settings.first_window_frames() or 'off'}"
        f"{'' if settings.first_tile_under_load else ' (none under load)'}")
    if pipeline:  # the DiT's recipe is its checkpoint's (flash, or base) and the request's knobs
        checkpoint = recipe_checkpoints(cache, args.preset)[args.recipe]
    else:
        checkpoint = synthetic_checkpoint(cache / f"bench_checkpoint_{args.preset}", args.preset)

    capacity = None
    if pipeline:
        pass  # measured on the server, first (measure_baseline)
    elif args.capacity:
        capacity = measure_capacity(checkpoint, settings, args.clips, args.capacity_iters)
        for mix in dict.fromkeys(mix for mode in args.mode for mix in clip_mixes(args, mode)):
            say(f"capacity, clips {'/'.join(f'{s:g}' for s in mix)} s: {capacity.audio_per_second(mix):.0f} "
                f"audio s per s ({capacity.requests_per_second(mix):.2f} requests per s)")
    else:
        say("in-process capacity: not measured (" + ("no CUDA" if args.device != "cuda" else "--no-capacity") + ")")

    runs: list[Run] = []
    baseline = Baseline() if pipeline else None
    knobs = tuple(recipes()[args.recipe].items()) if pipeline else ()
    workload = Workload(PIPELINE_MODEL if pipeline else MODEL, OUTPUTS[args.format], tuple(args.clips), knobs,
                        args.tokens)
    status = 0
    with contextlib.ExitStack() as stack:
        if args.url:
            url, metrics_url = args.url, args.metrics_url
        else:
            url, metrics_url = serve(args, checkpoint, cache, stack)
        say(f"{args.client_processes} client processes, "
            + ("a gRPC connection per stream" if args.connection_per_stream else "one gRPC connection per process"))
        clients = ClientProcesses(url, workload, args.client_processes, args.connection_per_stream)
        stack.callback(clients.close)
        try:
            if pipeline:
                measure_baseline(args, clients, metrics_url, baseline, runs)
                capacity = baseline.capacity
            run_all(args, clients, capacity, metrics_url, runs, baseline)
        except KeyboardInterrupt:
            say("interrupted: the runs so far follow")
            status = 130
        except LoadError as err:
            say(f"stopped: {err}")
            status = 1
    print_summary(runs)
    if pipeline:
        print_pipeline_summary(runs, baseline, args.recipe)
    if args.trace:  # written as the server stopped
        traces = traces_by_request_id(Path(args.trace))
        if pipeline:
            print_pipeline_phases(runs, traces)
        print_slowest_traces(runs, traces, args.trace_slowest)
    failed = sum(len(run.errors()) for run in runs)
    if failed:
        say(f"{failed} requests failed")
    sys.exit(status or (1 if failed else 0))


if __name__ == "__main__":
    main()
