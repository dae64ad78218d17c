"""Requests whose clients are gone free their place: a queue of abandoned requests does not
hold up the next good one (CPU, small synthetic weights). gRPC streams cancelled on the
session's plain tritonserver; HTTP /infer connections closed on the front door's server,
which answers /infer over gRPC and cancels the call when its client goes (Triton 2.51's own
HTTP server never sees such a client: triton-inference-server/server#7077).

The streaming model hands every request to its tile scheduler at once, so the abandoned requests
are all in it (decoding, or in its queue) and the good one's first window goes before their next
ones. The offline model forwards its first max_active_requests to it and holds the rest in its own
queue. An abandoned request is stopped by the model (at its next window, or before its first; the
offline model cancels the request it forwarded, which the decode model stops at its next window,
or never forwards it: it logs "request cancelled"), or, should one be cancelled before Triton
hands it over, by Triton, which answers it CANCELLED itself and counts it in
nv_inference_request_failure{reason="CANCELED"}."""

from __future__ import annotations

import contextlib
import gc
import json
import re
import socket
import statistics
import time

import numpy as np
import pytest

from auk_triton.codec.decode_graph import DEFAULT_COMPILE_SHAPES, plan_tiles
from triton_harness import TEST_TILE_FRAMES, DecodeStream

STREAM_MODEL = "auk_vae_decode"
OFFLINE_MODEL = "auk_vae_decode_offline"
# Abandoned requests per test (the count). They are cancelled once all are in the server:
# a stream's request cancelled before its client has sent it never arrives. More than the offline
# model's max_active_requests (16), so some wait in its queue.
ABANDONED = 20
CANCEL_NOTICE = re.compile(r"(auk_vae_decode\w*): request cancelled")


def make_latents(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((frames, 64)).astype(np.float32)


def served_window_seconds(server) -> float:
    """One full window's decode as `server` serves it, idle: the median gap between the tiles of a
    streamed clip's full windows (slower than the same decode in the test's own process, on the
    cores the server's processes share). The unit of delay."""
    stream = DecodeStream(server.grpc_url)
    try:
        stream.send(make_latents(2 * TEST_TILE_FRAMES, seed=70), request_id="unit", model=STREAM_MODEL)
        arrivals = []
        while True:
            _, outcome = stream.next_event(timeout=120)
            arrivals.append(time.perf_counter())
            if outcome.finished:
                break
    finally:
        stream.close()
    # A short first window, then three full ones (the small decoder's 53 frames of left context).
    assert outcome.error is None and len(arrivals) == 4, outcome
    return statistics.median(later - earlier for earlier, later in zip(arrivals[1:], arrivals[2:]))


def good_request_seconds(triton, model: str) -> float:
    """Time to the whole response of a one-tile clip on a fresh gRPC stream."""
    stream = DecodeStream(triton.grpc_url)
    try:
        began = time.perf_counter()
        stream.send(make_latents(20, seed=71), request_id="good", model=model)
        outcome = stream.collect(timeout=300)["good"]
        elapsed = time.perf_counter() - began
    finally:
        stream.close()
    assert outcome.error is None and outcome.events == ["tile+final"], outcome
    return elapsed


def cancelled_by_triton(server, model: str) -> int:
    """Requests of `model` that Triton answered CANCELLED itself, from its queue, so far."""
    return int(server.metric("nv_inference_request_failure", model=model, reason="CANCELED"))


def wait_until_all_in_server(server, model: str) -> None:
    """Wait until every abandoned request is in `model`, decoding or queued: in the streaming
    model's tile scheduler (its gauges follow the scheduler's iterations), forwarded by the
    offline model or waiting in its queue."""
    gauges = ("auk_vae_offline_active_requests", "auk_vae_offline_queued_requests") if model == OFFLINE_MODEL else (
        "auk_vae_active_requests", "auk_vae_queued_requests")
    deadline = time.monotonic() + 30
    while sum(server.metric(gauge, model=model) for gauge in gauges) < ABANDONED:
        assert time.monotonic() < deadline, "the abandoned requests did not all reach the server"
        time.sleep(0.02)


def stopped_requests(server, model: str, log_since: int, cancelled_before: int) -> tuple[int, int]:
    """How many requests of `model` were stopped since then: (by the model, its "request
    cancelled" notices past log offset `log_since`; by Triton, from its queue), waiting a while
    for ABANDONED in all (a model's log lines reach the server's log after its responses)."""
    deadline = time.monotonic() + 10
    while True:
        by_model = sum(1 for notice in CANCEL_NOTICE.finditer(server.log()[log_since:]) if notice.group(1) == model)
        by_triton = cancelled_by_triton(server, model) - cancelled_before
        if by_model + by_triton >= ABANDONED or time.monotonic() > deadline:
            return by_model, by_triton
        time.sleep(0.1)


@contextlib.contextmanager
def no_collector_pauses():
    """The test process's own garbage collector paused: late in the suite its heap is large, and a
    full collection while the good request is timed is the client's delay, not the server's."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def tiles_decoded(server) -> float:
    """Tiles the decode model has sent so far: to its streams, and to the offline model."""
    return server.metric("auk_vae_tiles_sent_total", model=STREAM_MODEL)


def tiles_in_full(server, vae, frames: int) -> int:
    """The tiles the server decodes a clip of `frames` into."""
    left, right = vae.decode_context_frames()
    return ABANDONED * len(plan_tiles(frames, server.tile_frames, left, right, DEFAULT_COMPILE_SHAPES,
                                      server.first_tile_frames))


def check_the_next_good_request(
    server, model: str, abandoned: str, idle: float, window_seconds: float, log_before: int, cancelled_before: int,
    tiles_before: float, tiles_abandoned: int,
) -> None:
    """After the abandoned requests, the next good one is not delayed past two windows, and every
    abandoned request was stopped, by the model or by Triton, before most of their tiles (of
    `tiles_abandoned` in all) were decoded."""
    after = good_request_seconds(server, model)
    delay = after - idle
    assert delay <= 2 * window_seconds, (
        f"the good request took {after:.2f} s after {ABANDONED} {abandoned}, {idle:.2f} s alone: "
        f"{delay:.2f} s of delay, more than two windows ({window_seconds:.2f} s each)"
    )
    by_model, by_triton = stopped_requests(server, model, log_before, cancelled_before)
    print(f"{model}: {ABANDONED} {abandoned}: {delay:.2f} s of delay (bound {2 * window_seconds:.2f} s); "
          f"stopped by the model {by_model}, by Triton {by_triton}")
    assert by_model + by_triton == ABANDONED, (by_model, by_triton, server.log()[log_before:][-3000:])
    time.sleep(0.2)  # the decode model reports its tiles a few milliseconds after sending them
    decoded = tiles_decoded(server) - tiles_before - 1  # the good request's one tile
    print(f"{model}: {decoded:.0f} of the abandoned requests' {tiles_abandoned} tiles decoded")
    assert decoded < tiles_abandoned / 2, f"{decoded:.0f} of the abandoned requests' {tiles_abandoned} tiles decoded"


@pytest.mark.parametrize("model", [STREAM_MODEL, OFFLINE_MODEL])
def test_requests_whose_grpc_streams_were_cancelled_do_not_delay_the_next_good_request_past_two_windows(
    triton, model, reference_vae
):
    window_seconds = served_window_seconds(triton)
    idle = min(good_request_seconds(triton, model) for _ in range(2))
    log_before, cancelled_before = len(triton.log()), cancelled_by_triton(triton, model)
    tiles_before = tiles_decoded(triton)
    # Each clip spans several windows (a short first window, then full ones): decoded, they
    # would take many windows, and the first is still decoding once the last is in the server.
    streams = [DecodeStream(triton.grpc_url) for _ in range(ABANDONED)]
    for index, stream in enumerate(streams):
        stream.send(make_latents(600, seed=72 + index), request_id=f"gone-{index}", model=model)
    wait_until_all_in_server(triton, model)
    with no_collector_pauses():
        for stream in streams:
            stream.close(cancel=True)

        # Every abandoned request was stopped (the ones decoding when their streams were cancelled at
        # their next window, the others before their first), none decoded to its end.
        check_the_next_good_request(triton, model, "cancelled streams", idle, window_seconds, log_before,
                                    cancelled_before, tiles_before, tiles_in_full(triton, reference_vae, 600))


def post_and_drop(http_url: str, latents: np.ndarray) -> socket.socket:
    """Send an HTTP /infer request to the offline model; return the socket, to be closed unread."""
    host, port = http_url.rsplit(":", 1)
    body = json.dumps(
        {"inputs": [{"name": "LATENTS", "shape": list(latents.shape), "datatype": "FP32", "data": latents.ravel().tolist()}]}
    ).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST /v2/models/{OFFLINE_MODEL}/infer HTTP/1.1\r\nHost: {http_url}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def test_http_requests_whose_connections_were_closed_do_not_delay_the_next_good_request_past_two_windows(
    front_door, reference_vae
):
    window_seconds = served_window_seconds(front_door)
    idle = min(good_request_seconds(front_door, OFFLINE_MODEL) for _ in range(2))
    log_before, cancelled_before = len(front_door.log()), cancelled_by_triton(front_door, OFFLINE_MODEL)
    tiles_before = tiles_decoded(front_door)
    # Nearly two full windows each (a short first window, a full one, part of another): the
    # first is still decoding when its connection closes; decoded, they would take many windows.
    frames = 2 * front_door.tile_frames - 28
    sockets = [post_and_drop(front_door.http_url, make_latents(frames, seed=90 + i)) for i in range(ABANDONED)]
    # Closed once the front has read, translated and passed on every request (all in the
    # offline model, forwarded or in its queue): what is timed is the server's stopping them,
    # not the front's reading of the JSON bodies on a busy machine.
    wait_until_all_in_server(front_door, OFFLINE_MODEL)
    with no_collector_pauses():
        for sock in sockets:
            sock.close()

        # Each was stopped by the model (those forwarded at their next window, the queued ones
        # before they were forwarded), none decoded to its end.
        check_the_next_good_request(
            front_door, OFFLINE_MODEL, "closed connections", idle, window_seconds, log_before, cancelled_before,
            tiles_before, tiles_in_full(front_door, reference_vae, frames))
