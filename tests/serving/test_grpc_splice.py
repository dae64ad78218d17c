"""The gRPC port's splice (auk_triton/serving/grpc_splice.py), through the session's front-door
server (CPU, small synthetic weights, max_frames FRONT_MAX_FRAMES): what it holds back
reaches no model, and what it passes on, however the client frames it, decodes exactly.

The raw client below speaks HTTP/2 itself, so a test can split and pad frames anywhere:
no gRPC library sends a message one byte a frame."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from triton_harness import FRONT_MAX_FRAMES, DecodeStream, library_tiles

hpack = pytest.importorskip("hpack")
grpc = pytest.importorskip("grpc")
from tritonclient.grpc import service_pb2  # noqa: E402

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 4, 6, 7, 8
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
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


class RawCall:
    """One gRPC call over a plain socket: HEADERS, then the request bytes in DATA frames of
    `piece` bytes (every third one padded), then the responses and trailers as they come,
    each DATA frame's window given back as it is read."""

    def __init__(self, url: str):
        host, port = url.rsplit(":", 1)
        self.socket = socket.create_connection((host, int(port)), timeout=120)
        self.socket.sendall(PREFACE + frame(SETTINGS, 0, 0))
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()
        self.buffer = b""

    def call(self, path: str, body: bytes, piece: int) -> tuple[list[bytes], dict]:
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "test"),
                   ("content-type", "application/grpc"), ("te", "trailers")]
        out = [frame(HEADERS, 0x4, 1, self.encoder.encode(headers))]
        pieces = [body[at:at + piece] for at in range(0, len(body), piece)]
        for index, part in enumerate(pieces):
            end = 0x1 if index == len(pieces) - 1 else 0
            if index % 3 == 2:  # PADDED: a pad length, the data, then that many zeros
                out.append(frame(DATA, end | 0x8, 1, b"\x02" + part + b"\x00\x00"))
            else:
                out.append(frame(DATA, end, 1, part))
        self.socket.sendall(b"".join(out))
        data, trailers = b"", None
        while trailers is None:
            kind, flags, stream, payload = self._frame()
            if kind == SETTINGS and not flags & 0x1:
                self.socket.sendall(frame(SETTINGS, 0x1, 0))
            elif kind == PING and not flags & 0x1:
                self.socket.sendall(frame(PING, 0x1, 0, payload))
            elif kind == HEADERS and stream == 1:
                block = dict((k.decode(), v.decode()) for k, v in self.decoder.decode(payload, raw=True))
                if flags & 0x1:
                    trailers = block
            elif kind == DATA and stream == 1:
                data += payload[1:len(payload) - payload[0]] if flags & 0x8 else payload
                if payload:  # read: the window it took is the server's again
                    credit = len(payload).to_bytes(4, "big")
                    self.socket.sendall(frame(WINDOW_UPDATE, 0, 0, credit) + frame(WINDOW_UPDATE, 0, 1, credit))
            elif kind == GOAWAY:
                raise AssertionError(f"GOAWAY: {payload!r}")
        messages = []
        while data:
            length = int.from_bytes(data[1:5], "big")
            messages.append(data[5:5 + length])
            data = data[5 + length:]
        return messages, trailers

    def _frame(self):
        while True:
            if len(self.buffer) >= 9:
                length = int.from_bytes(self.buffer[:3], "big")
                if len(self.buffer) >= 9 + length:
                    head, self.buffer = self.buffer[:9 + length], self.buffer[9 + length:]
                    return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, head[9:]
            received = self.socket.recv(1 << 16)
            if not received:
                raise AssertionError("the front door closed the connection")
            self.buffer += received

    def close(self) -> None:
        self.socket.close()


def stream_decode(front_door, clip: np.ndarray) -> np.ndarray:
    stream = DecodeStream(front_door.grpc_url)
    try:
        stream.send(clip, request_id="reference")
        outcome = stream.collect()["reference"]
    finally:
        stream.close()
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
            infer_request(STREAMING, [40, 64], clip, "good").SerializeToString()), piece=1 << 20)
    finally:
        raw.close()
    responses = [service_pb2.ModelStreamInferResponse.FromString(m) for m in messages]
    assert trailers.get("grpc-status") == "0" and f"declares shape [{WRAPPING_ROWS}, 64]" in responses[0].error_message
    expected = np.concatenate([wave for _, wave in library_tiles(reference_vae, clip, front_door)])
    np.testing.assert_allclose(streamed_waveform(responses[1:]), expected, rtol=0, atol=1e-6)
    assert front_door.tritonserver_pid() == pid and front_door.is_ready()


def test_a_field_after_the_tensor_bytes_ends_the_call_before_the_model_sees_it(front_door):
    """An input added after raw_input_contents would reach the model unchecked."""
    good = infer_request(OFFLINE, [3, 64], latents(3))
    late = service_pb2.ModelInferRequest()
    late.inputs.add(name="LATENTS", datatype="FP32", shape=[WRAPPING_ROWS, 64])
    error = unary_error(front_door.grpc_url, good.SerializeToString() + late.SerializeToString())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "field 5 after its tensor bytes" in error.details()


def test_a_compressed_inference_request_is_refused_with_what_to_do_instead(front_door):
    """The splice reads a request's inputs as they pass, which it cannot do compressed. (Zeros:
    grpc-core sends a message it cannot shrink uncompressed.)"""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(front_door.grpc_url)
    try:
        tensor = grpcclient.InferInput("LATENTS", [30, 64], "FP32")
        tensor.set_data_from_numpy(np.zeros((30, 64), np.float32))
        with pytest.raises(InferenceServerException, match="send it uncompressed"):
            client.infer(OFFLINE, [tensor], compression_algorithm="gzip")
    finally:
        client.close()


@pytest.mark.parametrize("piece", [1, 7, 1000])
def test_a_stream_sent_in_small_padded_frames_gets_the_refusal_and_the_decode_that_tritonclient_gets(
        front_door, piece):
    """A refused request first (the splice answers it, before the server has said anything on
    the stream), then a good one: sent a byte, 7 bytes or 1000 bytes a frame, every third
    frame padded, the answers equal those of a stream from tritonclient. (Padded frames go
    on unpadded: straight to tritonserver, a padded DATA frame resets the stream.)"""
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
