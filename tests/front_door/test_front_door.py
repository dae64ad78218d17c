"""The front door in front of a real tritonserver, started as `make serve` starts it (the
launcher: the front on the public ports, tritonserver on loopback behind it, supervised).

Hostile requests are refused with errors that name the problem, and the server stays
ready, serves exact decodes next and holds no more memory; the launcher brings back a
tritonserver killed from outside. The decoders serve a `max_frames` of 256 here, so the
limits are small and an oversized request cheap to send.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from triton_harness import FRONT_MAX_FRAMES, DecodeStream, decode_once, library_tiles

MAX_FRAMES = FRONT_MAX_FRAMES
OFFLINE = "auk_vae_decode_offline"
RSS_BOUND = 200 * 2**20  # the most the server may grow past its warm figure
HOSTILE_SHAPE = [2000000000, 64]  # the request: 192 numbers under this shape
TWO_GIGABYTE_FRAMES = 8388592  # 2 GB of LATENTS, just under gRPC's message limit


@pytest.fixture(scope="module")
def front(front_door):
    return front_door


def make_latents(frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((frames, 64)).astype(np.float32)


def post(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{url}{path}", data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def json_infer(shape, data) -> bytes:
    return json.dumps({"inputs": [{"name": "LATENTS", "shape": shape, "datatype": "FP32", "data": data}]}).encode()


def grpc_infer_error(url: str, frames: int) -> str:
    """What tritonclient's unary gRPC call to the offline model says to `frames` frames of zeros."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    latents = np.zeros((frames, 64), np.float32)
    tensor = grpcclient.InferInput("LATENTS", list(latents.shape), "FP32")
    tensor.set_data_from_numpy(latents)
    del latents
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer(OFFLINE, [tensor])
        return str(refused.value)
    finally:
        client.close()


def two_gigabyte_request_error(url: str) -> str:
    """What the server says to the issue's request: 2 GB of LATENTS in one ModelInfer message.

    The message is the one tritonclient would send (the protobuf header, then the raw
    tensor as field 7), built here from zeros in one allocation: tritonclient's own
    copies would add seconds and gigabytes to the client, not to the server."""
    import grpc
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=OFFLINE)
    request.inputs.add(name="LATENTS", datatype="FP32", shape=[TWO_GIGABYTE_FRAMES, 64])
    size = TWO_GIGABYTE_FRAMES * 64 * 4
    length = bytearray()
    while True:  # field 7's length, as a protobuf varint
        length.append((size & 0x7F) | (0x80 if size >> 7 else 0))
        size >>= 7
        if not size:
            break
    message = b"".join([request.SerializeToString(), b"\x3a", bytes(length), bytes(TWO_GIGABYTE_FRAMES * 64 * 4)])
    with grpc.insecure_channel(url, options=[("grpc.max_send_message_length", -1)]) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(message, timeout=120)
    return f"[{refused.value.code()}] {refused.value.details()}"


def assert_streams_the_library_decode(front, reference_vae, frames: int = 100) -> None:
    latents = make_latents(frames, seed=frames)
    outcome = decode_once(front.grpc_url, latents)
    assert outcome.error is None and outcome.events[-1] == "tile+final", outcome
    expected = library_tiles(reference_vae, latents, front)
    for (start, wave), (ref_start, reference) in zip(outcome.tiles, expected, strict=True):
        assert start == ref_start
        np.testing.assert_allclose(wave, reference, rtol=0, atol=1e-6)


def assert_still_the_same_server(front, pid: int) -> None:
    assert front.is_ready(), front.log()[-3000:]
    assert front.process.poll() is None and front.tritonserver_pid() == pid, "the server restarted"


def test_a_json_request_declaring_two_billion_frames_gets_400_and_the_server_serves_an_exact_decode_next(
    front, reference_vae
):
    pid = front.tritonserver_pid()
    status, reply = post(front.http_url, f"/v2/models/{OFFLINE}/infer", json_infer(HOSTILE_SHAPE, [0.1] * 192))
    assert status == 400
    assert reply["error"] == (
        f"input 'LATENTS' of model '{OFFLINE}' declares shape [2000000000, 64]; "
        f"this model takes at most [{MAX_FRAMES}, 64] (max_frames)"
    )
    assert_still_the_same_server(front, pid)
    # The same clip in JSON through the front equals the library's decode.
    latents = make_latents(100, seed=5)
    status, reply = post(front.http_url, f"/v2/models/{OFFLINE}/infer", json_infer(list(latents.shape), latents.ravel().tolist()))
    assert status == 200
    waveform = np.array(next(o for o in reply["outputs"] if o["name"] == "WAVEFORM")["data"], np.float32)
    expected = np.concatenate([wave for _, wave in library_tiles(reference_vae, latents, front)])
    np.testing.assert_allclose(waveform, expected, rtol=0, atol=1e-6)


def test_a_declared_shape_that_does_not_match_the_data_sent_gets_400_naming_both(front):
    status, reply = post(front.http_url, f"/v2/models/{OFFLINE}/infer", json_infer([3, 64], [0.1] * 190))
    assert (status, reply["error"]) == (400, "input 'LATENTS' declares shape [3, 64] (192 values) but its data holds 190")
    header = json.dumps({"inputs": [{"name": "LATENTS", "shape": [3, 64], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 768}}]}).encode()
    status, reply = post(front.http_url, f"/v2/models/{OFFLINE}/infer", header + bytes(700),
                         {"Inference-Header-Content-Length": str(len(header))})
    assert (status, reply["error"]) == (400, "the inputs declare 768 bytes of binary data; the request sends 700")
    assert front.is_ready()


def test_a_two_gigabyte_grpc_request_is_refused_before_the_server_copies_it(front, reference_vae):
    pid = front.tritonserver_pid()
    rss, shm = front.rss_bytes(), front.shm_bytes()
    error = two_gigabyte_request_error(front.grpc_url)
    assert "RESOURCE_EXHAUSTED" in error and re.search(r"Received message larger than max \(2147479\d+ vs\. \d+\)", error), error
    assert_still_the_same_server(front, pid)
    assert front.rss_bytes() - rss <= RSS_BOUND and front.shm_bytes() <= shm
    assert_streams_the_library_decode(front, reference_vae)


def test_a_request_of_exactly_max_frames_is_served_and_one_frame_more_is_refused_on_grpc_and_http(front):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    stream = DecodeStream(front.grpc_url)
    try:
        stream.send(make_latents(MAX_FRAMES, seed=1), request_id="longest")
        streamed = stream.collect()["longest"]
        stream.send(make_latents(MAX_FRAMES + 1, seed=1), request_id="too long")
        refused = stream.collect()["too long"]
    finally:
        stream.close()
    assert streamed.error is None and len(streamed.waveform()) == MAX_FRAMES * 480
    assert refused.events == ["error"] and f"declares shape [{MAX_FRAMES + 1}, 64]" in refused.error

    client = httpclient.InferenceServerClient(front.http_url, network_timeout=120)
    try:
        tensor = httpclient.InferInput("LATENTS", [MAX_FRAMES, 64], "FP32")
        tensor.set_data_from_numpy(make_latents(MAX_FRAMES, seed=1), binary_data=True)
        whole = client.infer(OFFLINE, [tensor]).as_numpy("WAVEFORM")
        np.testing.assert_array_equal(whole, streamed.waveform())
        tensor = httpclient.InferInput("LATENTS", [MAX_FRAMES + 1, 64], "FP32")
        tensor.set_data_from_numpy(make_latents(MAX_FRAMES + 1, seed=1), binary_data=True)
        with pytest.raises(InferenceServerException, match=rf"at most \[{MAX_FRAMES}, 64\] \(max_frames\)"):
            client.infer(OFFLINE, [tensor])
    finally:
        client.close()


def hostile_round(front) -> None:
    """One of each oversized request, each refused as it should be."""
    status, reply = post(front.http_url, f"/v2/models/{OFFLINE}/infer", json_infer(HOSTILE_SHAPE, [0.1] * 192))
    assert status == 400, reply
    # A body that claims 2 GB: refused from its Content-Length, before it is read.
    status, reply = post(front.http_url, f"/v2/models/{OFFLINE}/infer", b"{}",
                         {"Content-Length": str(2**31), "Inference-Header-Content-Length": "2"})
    assert status == 413 and "takes at most" in reply["error"], reply
    assert "RESOURCE_EXHAUSTED" in grpc_infer_error(front.grpc_url, 64 * MAX_FRAMES)  # 8 MB, past the message limit
    assert "INVALID_ARGUMENT" in grpc_infer_error(front.grpc_url, MAX_FRAMES + 1)  # within it: the shape check


def test_twenty_oversized_requests_leave_the_server_s_memory_and_dev_shm_within_bound_of_warm(front):
    assert_no_error = DecodeStream(front.grpc_url)
    try:  # warm: the longest legitimate request, on both models
        assert_no_error.send(make_latents(MAX_FRAMES, seed=2), request_id="warm")
        assert assert_no_error.collect()["warm"].error is None
    finally:
        assert_no_error.close()
    assert grpc_infer_error(front.grpc_url, MAX_FRAMES + 1)
    pid, rss, shm = front.tritonserver_pid(), front.rss_bytes(), front.shm_bytes()
    for _ in range(20):
        hostile_round(front)
    assert_still_the_same_server(front, pid)
    grown = front.rss_bytes() - rss
    assert grown <= RSS_BOUND, f"the server grew by {grown / 2**20:.0f} MB (from {rss / 2**20:.0f} MB)"
    assert front.shm_bytes() <= shm, f"/dev/shm grew from {shm} to {front.shm_bytes()} bytes"


def test_a_stream_cancelled_through_the_front_door_stops_its_request_on_the_server(front):
    since = len(front.log())
    stream = DecodeStream(front.grpc_url)
    stream.send(make_latents(MAX_FRAMES, seed=3), request_id="gone")
    stream.next_event(timeout=60)  # its first tile: the request is decoding
    stream.close(cancel=True)
    deadline = time.monotonic() + 30
    while "auk_vae_decode: request cancelled" not in front.log()[since:]:
        assert time.monotonic() < deadline, "the server never saw the cancellation:\n" + front.log()[since:][-3000:]
        time.sleep(0.1)


def test_the_launcher_restarts_a_tritonserver_killed_from_outside_and_is_ready_again(front, reference_vae):
    killed = front.tritonserver_pid()
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while front.is_ready():  # not ready meanwhile
        assert time.monotonic() < deadline, "still ready after its tritonserver was killed"
        time.sleep(0.05)
    status, reply = post(front.http_url, f"/v2/models/{OFFLINE}/infer", json_infer([1, 64], [0.0] * 64))
    assert status == 503 and "killed by signal 9 (SIGKILL)" in reply["error"], (reply, front.log()[-3000:])
    deadline = time.monotonic() + 240
    while not front.is_ready():
        assert front.process.poll() is None, front.log()[-3000:]
        assert time.monotonic() < deadline, "not ready again:\n" + front.log()[-3000:]
        time.sleep(0.25)
    assert front.tritonserver_pid() != killed
    assert re.search(r"tritonserver was killed by signal 9 \(SIGKILL\) after \d+ s; restarting it in \d+ s", front.log())
    assert_streams_the_library_decode(front, reference_vae)
