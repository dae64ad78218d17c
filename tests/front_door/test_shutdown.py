"""Stopping the server under a live stream: the model unloads and tritonserver exits within
its exit timeout, cleanly. A real server per cycle (CPU, small synthetic weights).

Through the launcher (`make serve`), every time: a stream read to its end, a stream its
client keeps open after its last response, and a stream whose decode outlasts the exit
timeout. The front door half-closes each stream upstream, lets requests in flight run for
the drain, cuts the rest (its client gets UNAVAILABLE, the model stops it at its next
window) and only then signals tritonserver, which finds nothing to wait for.

A bare tritonserver drains a live stream to its end (or stops it at its next window once
its client cancels it) within its exit timeout too. But on it, a stream whose decode
outlasts the timeout, or a gRPC stream its client keeps open after its last response,
keeps Triton 2.51 to the timeout ("Exiting immediately"); docs/front-door.md, "The stop"."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from auk_triton.front_door import settings
from triton_harness import DecodeStream, copy_model_repository, start_front_door, start_triton

CYCLES = 6  # the two kinds in turn, three times each
LAUNCHER_CYCLES = 6  # the three kinds in turn, twice each: a launcher's cycle takes 8 to 20 s here
EXIT_TIMEOUT_S = 10
HOP = 480
LONG_FRAMES = 4000  # about 25 s of decode on the CPU: past the exit timeout
# Two windows: the first (its tile is the stream's cue to stop the server) and one more, which
# the stop lets finish. A window takes up to a second here, and the drain is 5 s: a stream of
# three more windows (200 frames) outlasted it once on a busy two-core machine.
DRAINED_FRAMES = 120


def test_repeated_stops_under_a_live_stream_each_exit_cleanly_within_the_exit_timeout(tmp_path, small_checkpoint):
    repository = copy_model_repository(tmp_path / "model_repository", models=("auk_vae_decode",))
    for cycle in range(CYCLES):
        # Every other stream would decode for longer than the exit timeout (about 25 s on the
        # CPU), and its client cancels it once the stop is sent: it must end at its next window.
        # The others are read to their end.
        cancelled = cycle % 2 == 1
        frames = LONG_FRAMES if cancelled else DRAINED_FRAMES
        server = start_triton(tmp_path, repository, small_checkpoint, extra_args=[f"--exit-timeout-secs={EXIT_TIMEOUT_S}"])
        stream = DecodeStream(server.grpc_url)
        try:
            latents = np.random.default_rng(cycle).standard_normal((frames, 64)).astype(np.float32)
            stream.send(latents, request_id="live")
            _, outcome = stream.next_event(timeout=120)
            assert outcome.events == ["tile"], f"cycle {cycle}: {outcome.events} {outcome.error}"

            stopped = time.monotonic()
            server.process.send_signal(signal.SIGINT)
            if not cancelled:
                outcome = stream.collect(timeout=EXIT_TIMEOUT_S + 30)["live"]
        finally:
            stream.close(cancel=cancelled)
        try:
            server.process.wait(timeout=EXIT_TIMEOUT_S + 10)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=10)
            pytest.fail(f"cycle {cycle}: tritonserver still running {EXIT_TIMEOUT_S + 10} s after SIGINT")
        exited = time.monotonic() - stopped
        log = server.log()

        assert f"exit_timeout                     | {EXIT_TIMEOUT_S} " in log, "the exit timeout asked for is not the one served"
        assert "Exiting immediately" not in log and "Signal (11)" not in log, f"cycle {cycle}:\n{log[-4000:]}"
        assert server.process.returncode == 0 and exited < EXIT_TIMEOUT_S, (
            f"cycle {cycle}: exit status {server.process.returncode} {exited:.1f} s after SIGINT"
        )
        if cancelled:
            assert "auk_vae_decode: request cancelled after the tile" in log, f"cycle {cycle}: not stopped"
        else:
            assert outcome.error is None and outcome.events[-1] == "tile+final", outcome
            assert outcome.waveform().shape == (frames * HOP,), "the stream drained to its end"


def stopped_within_the_timeout(server, stopped: float, what: str) -> float:
    try:
        server.process.wait(timeout=EXIT_TIMEOUT_S + 10)
    except subprocess.TimeoutExpired:
        server.stop()
        pytest.fail(f"{what}: still running {EXIT_TIMEOUT_S + 10} s after SIGINT:\n{server.log()[-4000:]}")
    return time.monotonic() - stopped


def assert_new_requests_are_refused_as_the_server_stops(server) -> None:
    body = json.dumps({"inputs": [{"name": "LATENTS", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]})
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/auk_vae_decode/infer", data=body.encode())
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 503 and "the server is stopping" in json.loads(refused.value.read())["error"]
    from tritonclient.utils import InferenceServerException

    late = DecodeStream(server.grpc_url)
    try:
        try:
            late.send(np.zeros((1, 64), np.float32), request_id="late")
        except InferenceServerException:
            pass  # the stream already ended: tritonclient reports why through the callback
        outcome = late.collect(timeout=10)["late"]
    finally:
        late.close()
    assert outcome.events == ["error"] and "UNAVAILABLE" in outcome.error and "the server is stopping" in outcome.error


def test_stops_through_the_launcher_under_a_live_stream_each_exit_cleanly_within_the_exit_timeout(tmp_path, small_checkpoint):
    repository = copy_model_repository(tmp_path / "model_repository", models=("auk_vae_decode",))
    drain = settings.stop_drain_seconds(EXIT_TIMEOUT_S)
    for cycle in range(LAUNCHER_CYCLES):
        kind = ("read to its end", "held open after its last response", "outlasting the exit timeout")[cycle % 3]
        frames = LONG_FRAMES if kind == "outlasting the exit timeout" else DRAINED_FRAMES
        server = start_front_door(tmp_path, repository, small_checkpoint, extra_args=[f"--exit-timeout-secs={EXIT_TIMEOUT_S}"])
        what = f"cycle {cycle} ({kind})"
        stream = DecodeStream(server.grpc_url)
        try:
            stream.send(np.random.default_rng(cycle).standard_normal((frames, 64)).astype(np.float32), request_id="live")
            if kind == "held open after its last response":
                outcome = stream.collect(timeout=120)["live"]  # and the stream stays open
            else:
                _, outcome = stream.next_event(timeout=120)
                assert outcome.events == ["tile"], f"{what}: {outcome.events} {outcome.error}"
            stopped = time.monotonic()
            server.process.send_signal(signal.SIGINT)
            if kind == "outlasting the exit timeout":  # while it drains
                assert_new_requests_are_refused_as_the_server_stops(server)
            outcome = stream.collect(timeout=EXIT_TIMEOUT_S + 30)["live"]
            ended = time.monotonic() - stopped
        finally:
            stream.close()
        exited = stopped_within_the_timeout(server, stopped, what)
        log = server.log()

        assert f"exit_timeout                     | {EXIT_TIMEOUT_S} " in log, "the exit timeout asked for is not the one served"
        assert "Exiting immediately" not in log and "Signal (11)" not in log, f"{what}:\n{log[-4000:]}"
        assert server.process.returncode == 0 and exited < EXIT_TIMEOUT_S, (
            f"{what}: the launcher's exit status {server.process.returncode} {exited:.1f} s after SIGINT:\n{log[-3000:]}"
        )
        assert "tritonserver exited with status 0 after the stop signal" in log, f"{what}:\n{log[-3000:]}"
        if kind == "outlasting the exit timeout":
            assert outcome.events[-1] == "error" and "UNAVAILABLE" in outcome.error, f"{what}: {outcome}"
            assert f"the server is stopping: the request was cut short after {drain:g} s of draining" in outcome.error
            assert drain <= ended < EXIT_TIMEOUT_S, f"{what}: cut {ended:.1f} s after SIGINT; the drain is {drain:g} s"
            assert "auk_vae_decode: request cancelled after the tile" in log, f"{what}: the model did not stop it"
        else:
            assert outcome.error is None and outcome.events[-1] == "tile+final", (
                f"{what}: {outcome} {ended:.1f} s after SIGINT:\n{log[-3000:]}")
            assert outcome.waveform().shape == (frames * HOP,), f"{what}: the stream did not drain to its end"
