"""Stopping the server under a live stream: the stream drains to its end (or stops at its next
window once its client cancels it), the model unloads and tritonserver exits within its exit
timeout, cleanly. A real tritonserver per cycle (CPU, small synthetic weights).

Not covered, because it cannot hold on Triton 2.51: a stream whose decode outlasts the exit
timeout, and a gRPC stream its client keeps open after its last response, keep the server
to the timeout ("Exiting immediately"); README, "Stopping the server"."""

from __future__ import annotations

import signal
import subprocess
import time

import numpy as np
import pytest

from triton_harness import DecodeStream, copy_model_repository, start_triton

CYCLES = 10
EXIT_TIMEOUT_S = 10
HOP = 480


def test_ten_stops_under_a_live_stream_each_exit_cleanly_within_the_exit_timeout(tmp_path, small_checkpoint):
    repository = copy_model_repository(tmp_path / "model_repository", models=("auk_vae_decode",))
    for cycle in range(CYCLES):
        # Every other stream would decode for longer than the exit timeout (about 25 s on the
        # CPU), and its client cancels it once the stop is sent: it must end at its next window.
        # The others are read to their end.
        cancelled = cycle % 2 == 1
        frames = 4000 if cancelled else 200
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
