"""The front door's gRPC port (auk_triton/front_door/grpc_front.py), through the session's
front-door server (CPU, small synthetic weights, max_frames FRONT_MAX_FRAMES): what it
refuses reaches no model, and what it passes on, however the client frames it, decodes
exactly.

The raw client below drives an HTTP/2 connection with h2, so a test can split
frames anywhere: no gRPC library sends a message one byte a frame."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from triton_harness import FRONT_MAX_FRAMES, DecodeStream, decode_once, library_tiles, unregister_shared_memory

h2_connection = pytest.importorskip("h2.connection")
h2_config = pytest.importorskip("h2.config")
h2_events = pytest.importorskip("h2.events")
grpc = pytest.importorskip("grpc")
from tritonclient.grpc import service_pb2  # noqa: E402

OFFLINE, STREAMING = "auk_vae_decode_offline", "auk_vae_decode"
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
# A row count whose byte size (rows x 64 x 4) wraps around 64 bits to that of 3 rows: Triton
# 2.51's own byte-size check passes it, and the model's stub process dies on it.
WRAPPING_ROWS = 2**62 + 3


def latents(frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((frames, 64)).astype(np.float32)


def infer_request(model: str, shape, data: np.ndarray, request_id: str = "") -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="LATENTS", datatype="FP32", shape=list(shape))
    request.raw_input_contents.append(data.tobytes())
    return request


def message(payload: bytes) -> bytes:
    """A gRPC length-prefixed message (uncompressed)."""
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def messages_of(data: bytes) -> list[bytes]:
    found = []
    while data:
        length = int.from_bytes(data[1:5], "big")
        found.append(data[5:5 + length])
        data = data[5 + length:]
    return found


class RawCall:
    """One gRPC call on an h2 client connection: the request bytes go in DATA frames of
    `piece` bytes; the responses and trailers are read as they come. (No padding: grpc-core
    resets a stream that pads its DATA frames, PROTOCOL_ERROR, as Triton's own port does.)"""

    def __init__(self, url: str):
        host, port = url.rsplit(":", 1)
        self.socket = socket.create_connection((host, int(port)), timeout=120)
        self.h2 = h2_connection.H2Connection(h2_config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.socket.sendall(self.h2.data_to_send())

    def call(self, path: str, body: bytes, piece: int) -> tuple[list[bytes], dict]:
        stream = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                      (":authority", "test"), ("content-type", "application/grpc"), ("te", "trailers")])
        pieces = [body[at:at + piece] for at in range(0, len(body), piece)]
        data, trailers = b"", None
        for index, part in enumerate(pieces):
            while self.h2.local_flow_control_window(stream) < len(part):
                data, trailers = self._receive(stream, data)
            self.h2.send_data(stream, part, end_stream=index == len(pieces) - 1)
            self.socket.sendall(self.h2.data_to_send())
        while trailers is None:
            data, trailers = self._receive(stream, data)
        return messages_of(data), trailers

    def _receive(self, stream: int, data: bytes) -> tuple[bytes, dict | None]:
        received = self.socket.recv(1 << 16)
        if not received:
            raise AssertionError("the front door closed the connection")
        trailers = None
        for event in self.h2.receive_data(received):
            if isinstance(event, h2_events.DataReceived) and event.stream_id == stream:
                data += event.data
                self.h2.acknowledge_received_data(event.flow_controlled_length, stream)
            elif isinstance(event, h2_events.TrailersReceived) and event.stream_id == stream:
                trailers = dict(event.headers)
            elif isinstance(event, h2_events.StreamReset) and event.stream_id == stream:
                raise AssertionError(f"the stream was reset: {event.error_code!r}")
        self.socket.sendall(self.h2.data_to_send())
        return data, trailers

    def close(self) -> None:
        self.socket.close()


def stream_decode(front_door, clip: np.ndarray) -> np.ndarray:
    outcome = decode_once(front_door.grpc_url, clip)
    assert outcome.error is None, outcome
    return outcome.waveform()


def unary_error(url: str, request: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(url) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(INFER)(request, timeout=60)
    return refused.value


def streamed_waveform(responses) -> np.ndarray:
    tiles = [r.infer_response for r in responses]
    assert all(not r.error_message for r in responses), [r.error_message for r in responses]
    return np.concatenate([
        np.frombuffer(t.raw_output_contents[[o.name for o in t.outputs].index("WAVEFORM")], np.float32) for t in tiles
    ])


def test_a_shape_whose_byte_size_wraps_to_the_data_sent_is_refused_and_the_model_keeps_serving(front_door, reference_vae):
    """Straight to tritonserver this request passes Triton's byte-size check and kills the
    model's stub process; through the front door it is refused by its row count, alone and
    within a stream, whose next request decodes exactly."""
    pid = front_door.tritonserver_pid()
    error = unary_error(front_door.grpc_url, infer_request(OFFLINE, [WRAPPING_ROWS, 64], latents(3)).SerializeToString())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"declares shape [{WRAPPING_ROWS}, 64]" in error.details() and "max_frames" in error.details()

    clip = latents(40, seed=4)
    bad = infer_request(STREAMING, [WRAPPING_ROWS, 64], latents(3), "wraps").SerializeToString()
    raw = RawCall(front_door.grpc_url)
    try:
        messages, trailers = raw.call(STREAM_INFER, message(bad) + message(
            infer_request(STREAMING, [40, 64], clip, "good").SerializeToString()), piece=16000)
    finally:
        raw.close()
    responses = [service_pb2.ModelStreamInferResponse.FromString(m) for m in messages]
    assert trailers.get("grpc-status") == "0" and f"declares shape [{WRAPPING_ROWS}, 64]" in responses[0].error_message
    expected = np.concatenate([wave for _, wave in library_tiles(reference_vae, clip, front_door)])
    np.testing.assert_allclose(streamed_waveform(responses[1:]), expected, rtol=0, atol=1e-6)
    assert front_door.tritonserver_pid() == pid and front_door.is_ready()


def test_an_input_added_after_the_tensor_bytes_is_checked_like_the_others(front_door):
    """Protobuf merges a field written after raw_input_contents into the request: the whole
    message is parsed before it goes on, so that input is checked too."""
    good = infer_request(OFFLINE, [3, 64], latents(3))
    late = service_pb2.ModelInferRequest()
    late.inputs.add(name="LATENTS", datatype="FP32", shape=[WRAPPING_ROWS, 64])
    error = unary_error(front_door.grpc_url, good.SerializeToString() + late.SerializeToString())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"declares shape [{WRAPPING_ROWS}, 64]" in error.details()


def test_a_gzip_compressed_request_is_checked_and_decoded_as_the_same_request_uncompressed(front_door):
    """grpc-core decompresses a message before the front door checks it (and bounds it by its
    decompressed length too), so compression changes nothing but the bytes on the wire."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(front_door.grpc_url)
    try:
        tensor = grpcclient.InferInput("LATENTS", [30, 64], "FP32")
        tensor.set_data_from_numpy(np.zeros((30, 64), np.float32))
        plain = client.infer(OFFLINE, [tensor]).as_numpy("WAVEFORM")
        compressed = client.infer(OFFLINE, [tensor], compression_algorithm="gzip").as_numpy("WAVEFORM")
        np.testing.assert_array_equal(compressed, plain)
        too_long = grpcclient.InferInput("LATENTS", [FRONT_MAX_FRAMES + 1, 64], "FP32")
        too_long.set_data_from_numpy(np.zeros((FRONT_MAX_FRAMES + 1, 64), np.float32))
        with pytest.raises(InferenceServerException, match=rf"declares shape \[{FRONT_MAX_FRAMES + 1}, 64\]"):
            client.infer(OFFLINE, [too_long], compression_algorithm="gzip")
    finally:
        client.close()


def test_a_request_of_the_wrong_rank_is_told_the_shape_the_model_takes(front_door):
    error = unary_error(front_door.grpc_url, infer_request(OFFLINE, [1, 20, 64], latents(20)).SerializeToString())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        f"input 'LATENTS' of model '{OFFLINE}' declares shape [1, 20, 64], 3 dimensions; "
        f"it takes 2: [n, 64] with n at most {FRONT_MAX_FRAMES} (max_frames)"
    )


@pytest.mark.parametrize("piece", [1, 7, 1000])
def test_a_stream_sent_in_small_frames_gets_the_refusal_and_the_decode_that_tritonclient_gets(
        front_door, piece):
    """A refused request first (the front door answers it, before the server has said anything
    on the stream), then a good one: sent a byte, 7 bytes or 1000 bytes a frame, the answers
    equal those of a stream from tritonclient."""
    clip = latents(30, seed=piece)
    refused = infer_request(STREAMING, [FRONT_MAX_FRAMES + 1, 64], latents(3), "too long").SerializeToString()
    good = infer_request(STREAMING, [30, 64], clip, "good").SerializeToString()
    raw = RawCall(front_door.grpc_url)
    try:
        messages, trailers = raw.call(STREAM_INFER, message(refused) + message(good), piece)
    finally:
        raw.close()
    assert trailers.get("grpc-status") == "0", trailers
    responses = [service_pb2.ModelStreamInferResponse.FromString(m) for m in messages]
    assert f"declares shape [{FRONT_MAX_FRAMES + 1}, 64]" in responses[0].error_message
    assert {r.infer_response.id for r in responses[1:]} == {"good"}
    np.testing.assert_array_equal(streamed_waveform(responses[1:]), stream_decode(front_door, clip))


def test_a_unary_request_sent_a_byte_a_frame_decodes_as_the_same_request_in_one_frame(front_door):
    clip = latents(20, seed=9)
    body = message(infer_request(OFFLINE, [20, 64], clip).SerializeToString())
    answers = []
    for piece in (1, len(body)):
        raw = RawCall(front_door.grpc_url)
        try:
            messages, trailers = raw.call(INFER, body, piece)
        finally:
            raw.close()
        assert trailers.get("grpc-status") == "0" and len(messages) == 1, trailers
        response = service_pb2.ModelInferResponse.FromString(messages[0])
        answers.append(response.raw_output_contents[[o.name for o in response.outputs].index("WAVEFORM")])
    assert answers[0] == answers[1] and len(answers[0]) == 20 * 480 * 4


def test_streams_at_once_on_separate_connections_and_on_one_stay_exact_and_independent(front_door, reference_vae):
    """Four tritonclient streams (a connection each) and three streams multiplexed on one gRPC
    channel, at once; some requests refused in the middle of their stream. Every good
    request decodes exactly as the library does, every refused one gets its own error."""
    from concurrent.futures import ThreadPoolExecutor

    clips = {f"c{i}": latents(12 + 5 * i, seed=20 + i) for i in range(7)}
    expected = {name: np.concatenate([w for _, w in library_tiles(reference_vae, clip, front_door)])
                for name, clip in clips.items()}

    def tritonclient_stream(name: str):
        stream = DecodeStream(front_door.grpc_url)
        try:
            for rep in range(3):
                stream.send(clips[name], request_id=f"{name}/{rep}")
                stream.collect()
                if rep == 1:  # one at a time: a stream's error names no request
                    stream.send(latents(FRONT_MAX_FRAMES + 1), request_id=f"{name}/too long")
                    stream.collect()
            return stream.collect()
        finally:
            stream.close()

    def shared_channel_streams(channel, name: str):
        requests = [infer_request(STREAMING, clips[name].shape, clips[name], f"{name}/{rep}").SerializeToString()
                    for rep in range(2)]
        requests.insert(1, infer_request(STREAMING, [WRAPPING_ROWS, 64], latents(3), f"{name}/wraps").SerializeToString())
        call = channel.stream_stream(STREAM_INFER)(iter(requests), timeout=120)
        return [service_pb2.ModelStreamInferResponse.FromString(m) for m in call]

    with grpc.insecure_channel(front_door.grpc_url) as channel, ThreadPoolExecutor(7) as pool:
        separate = {name: pool.submit(tritonclient_stream, name) for name in ("c0", "c1", "c2", "c3")}
        shared = {name: pool.submit(shared_channel_streams, channel, name) for name in ("c4", "c5", "c6")}
        for name, future in separate.items():
            outcomes = future.result()
            assert "declares shape" in outcomes[f"{name}/too long"].error
            for rep in range(3):
                np.testing.assert_allclose(outcomes[f"{name}/{rep}"].waveform(), expected[name], rtol=0, atol=1e-6)
        for name, future in shared.items():
            responses = future.result()
            errors = [r.error_message for r in responses if r.error_message]
            assert len(errors) == 1 and f"declares shape [{WRAPPING_ROWS}, 64]" in errors[0]
            for rep in range(2):
                mine = [r for r in responses if not r.error_message and r.infer_response.id == f"{name}/{rep}"]
                np.testing.assert_allclose(streamed_waveform(mine), expected[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_tritonclients_calls_pass_through_the_front_door_over_grpc_and_http(front_door, protocol):
    """Health, metadata, config, statistics, the repository index and system shared memory for
    the input and the output, as tritonclient makes them: each answered through the front door,
    and a decode through shared memory equal to the same decode sent inline."""
    import os
    from multiprocessing import shared_memory

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    module, url = (grpcclient, front_door.grpc_url) if protocol == "grpc" else (httpclient, front_door.http_url)
    as_json = {"as_json": True} if protocol == "grpc" else {}
    client = module.InferenceServerClient(url)
    clip = latents(30, seed=77)
    tag = f"auk_front_{protocol}_{os.getpid()}"
    regions = {"in": shared_memory.SharedMemory(name=f"{tag}_in", create=True, size=clip.nbytes),
               "out": shared_memory.SharedMemory(name=f"{tag}_out", create=True, size=30 * 480 * 2)}
    np.ndarray(clip.shape, np.float32, buffer=regions["in"].buf)[:] = clip
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(OFFLINE)
        assert client.get_server_metadata(**as_json)["name"] == "triton"
        assert [t["name"] for t in client.get_model_metadata(OFFLINE, **as_json)["inputs"]] == ["LATENTS"]
        config = client.get_model_config(OFFLINE, **as_json)
        assert config.get("config", config)["name"] == OFFLINE  # gRPC wraps it, HTTP does not
        assert client.get_inference_statistics(OFFLINE, **as_json)["model_stats"][0]["name"] == OFFLINE
        index = client.get_model_repository_index(**as_json)
        names = {m["name"] for m in (index["models"] if protocol == "grpc" else index)}
        assert {OFFLINE, STREAMING} <= names

        inline = module.InferInput("LATENTS", [30, 64], "FP32")
        inline.set_data_from_numpy(clip)
        expected = client.infer(OFFLINE, [inline], outputs=[module.InferRequestedOutput("WAVEFORM_PCM16")]).as_numpy(
            "WAVEFORM_PCM16")
        for key, region in regions.items():
            client.register_system_shared_memory(f"{tag}_{key}", f"/{tag}_{key}", region.size)
        status = client.get_system_shared_memory_status(**as_json)
        registered = status["regions"] if protocol == "grpc" else {r["name"]: r for r in status}
        assert {f"{tag}_in", f"{tag}_out"} <= set(registered)
        shared_in = module.InferInput("LATENTS", [30, 64], "FP32")
        shared_in.set_shared_memory(f"{tag}_in", clip.nbytes)
        shared_out = module.InferRequestedOutput("WAVEFORM_PCM16")
        shared_out.set_shared_memory(f"{tag}_out", regions["out"].size)
        client.infer(OFFLINE, [shared_in], outputs=[shared_out])
        np.testing.assert_array_equal(np.ndarray(expected.shape, np.int16, buffer=regions["out"].buf), expected)
    finally:
        try:
            unregister_shared_memory(client, [f"{tag}_{key}" for key in regions])
        finally:
            client.close()
            for region in regions.values():
                region.close()
                region.unlink()
    assert front_door.is_ready()
