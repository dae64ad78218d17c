"""Bounded work on the real server (CPU, small synthetic weights): at most max_active_requests
requests in the scheduler, the next max_queued_requests in its queue, and past them a request
refused at once with a status a client can act on, while the others are served in full: in the
streaming model, and in the offline one, which bounds the requests it forwards to the streaming
model the same way and passes that model's own refusal on."""

from __future__ import annotations

import queue
import re
import time

import numpy as np
import pytest

from triton_harness import DecodeStream, copy_model_repository, start_triton

MODEL, OFFLINE_MODEL = "auk_vae_decode", "auk_vae_decode_offline"
MODEL_FULL = "the model is at its limit (1 requests decoding, 1 waiting)"


def offline_inputs(module, latents):
    tensor = module.InferInput("LATENTS", list(latents.shape), "FP32")
    tensor.set_data_from_numpy(latents)
    return [tensor]


@pytest.fixture(scope="module")
def one_active_one_queued(tmp_path_factory, small_checkpoint):
    """A server whose decode models take one request each into their schedulers and queue one more."""
    workdir = tmp_path_factory.mktemp("queue_limits")
    repository = copy_model_repository(workdir / "model_repository",
                                       parameters={"max_active_requests": 1, "max_queued_requests": 1})
    server = start_triton(workdir, repository, small_checkpoint)
    yield server
    server.stop()


def make_latents(seed: int, frames: int = 600) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((frames, 64)).astype(np.float32)


def wait_until_queued(server, count: int, timeout_s: float = 10) -> None:
    """Until the streaming model's gauge shows `count` requests waiting in its scheduler's queue."""
    deadline = time.monotonic() + timeout_s
    while server.metric("auk_vae_queued_requests", model=MODEL) != count:
        assert time.monotonic() < deadline, f"the gauge never showed {count} requests waiting in the queue"
        time.sleep(0.05)


def test_past_the_active_limit_streams_queue_and_past_the_queue_one_is_refused_at_once(one_active_one_queued):
    server = one_active_one_queued
    streams = []
    try:
        # One request decoding (several seconds here: a long clip, so that it is still decoding
        # when the second has waited its half second), one waiting in the scheduler's queue, and
        # the third refused at once, with its reason; the first two are served in full.
        frames = (1800, 200, 200)
        for index in range(3):
            streams.append(DecodeStream(server.grpc_url))
            began = time.monotonic()
            streams[-1].send(make_latents(index, frames[index]), request_id=str(index))
            if index == 0:
                assert streams[0].next_event(timeout=60)[1].events == ["tile"]  # in the scheduler
            if index == 1:  # queued before the third is sent: each stream is a connection of its own
                wait_until_queued(server, 1)
        with pytest.raises(queue.Empty):
            streams[1].next_event(timeout=0.5)  # waiting: nothing to say yet
        refused = streams[2].next_event(timeout=5)[1]
        assert time.monotonic() - began < 5, "the refusal waited for the queue"
        assert refused.events == ["error"] and MODEL_FULL in refused.error, refused
        deadline = time.monotonic() + 10  # the gauges follow the scheduler's iterations
        while (server.metric("auk_vae_active_requests", model=MODEL),
               server.metric("auk_vae_queued_requests", model=MODEL)) != (1, 1):
            assert time.monotonic() < deadline, "the gauges never showed one decoding and one queued"
            time.sleep(0.05)
        for index, stream in enumerate(streams[:2]):
            outcome = stream.collect(timeout=120)[str(index)]
            assert outcome.error is None and outcome.events[-1] == "tile+final", outcome
            assert outcome.waveform().size == frames[index] * 480
    finally:
        for stream in streams:
            stream.close()
    # Served once the queue has room again.
    stream = DecodeStream(server.grpc_url)
    try:
        stream.send(make_latents(9, frames=200), request_id="again")
        assert stream.collect(timeout=120)["again"].events[-1] == "tile+final"
    finally:
        stream.close()


def test_the_offline_model_refuses_a_request_past_its_queue_with_unavailable_and_503(one_active_one_queued):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    server = one_active_one_queued
    inputs = offline_inputs
    client = grpcclient.InferenceServerClient(server.grpc_url)
    http = httpclient.InferenceServerClient(server.http_url)
    try:
        done = []
        # One decoding, then more than the scheduler and its queue of one can hold: the one
        # decoding (a long clip) takes several seconds here, these three less than two.
        for seed, frames in ((10, 1800), (11, 200), (12, 200)):
            client.async_infer(OFFLINE_MODEL, inputs(grpcclient, make_latents(seed, frames)),
                               lambda result, error, frames=frames: done.append((frames, result, error)))
            time.sleep(0.5)
        with pytest.raises(InferenceServerException, match=re.escape(MODEL_FULL)) as refused:
            client.infer(OFFLINE_MODEL, inputs(grpcclient, make_latents(13, frames=20)))
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
        with pytest.raises(InferenceServerException, match=re.escape(MODEL_FULL)) as refused:
            http.infer(OFFLINE_MODEL, inputs(httpclient, make_latents(14, frames=20)))
        assert refused.value.status() == "503"
        deadline = time.monotonic() + 120
        while len(done) < 3:
            assert time.monotonic() < deadline, "the requests sent first did not all end"
            time.sleep(0.05)
        served = [(frames, result) for frames, result, error in done if error is None]
        assert len(served) >= 2, done  # the one decoding and one waiting at least
        assert all(result.as_numpy("WAVEFORM").size == frames * 480 for frames, result in served)
        assert all(MODEL_FULL in str(error) for _, _, error in done if error is not None), done
    finally:
        client.close()
        http.close()


def test_the_offline_model_passes_the_streaming_model_s_refusal_on_with_unavailable_and_503(one_active_one_queued):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    server = one_active_one_queued
    streams = [DecodeStream(server.grpc_url) for _ in range(2)]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    http = httpclient.InferenceServerClient(server.http_url)
    try:
        # The streaming model full (one stream decoding, one waiting); the offline model has room.
        for index, stream in enumerate(streams):
            stream.send(make_latents(20 + index, frames=1800), request_id=str(index))
            if index == 0:
                assert stream.next_event(timeout=60)[1].events == ["tile"]
        wait_until_queued(server, 1)
        with pytest.raises(InferenceServerException, match=re.escape(MODEL_FULL)) as refused:
            client.infer(OFFLINE_MODEL, offline_inputs(grpcclient, make_latents(22, frames=20)))
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
        assert not refused.value.message().startswith("["), "the status in the message only where asked"
        with pytest.raises(InferenceServerException, match=re.escape(MODEL_FULL)) as refused:
            http.infer(OFFLINE_MODEL, offline_inputs(httpclient, make_latents(23, frames=20)))
        assert refused.value.status() == "503"
    finally:
        for stream in streams:
            stream.close(cancel=True)
        client.close()
        http.close()
