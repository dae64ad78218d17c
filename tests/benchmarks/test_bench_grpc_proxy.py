"""benchmarks/bench_grpc_proxy.py: the frame-reading splice reads gRPC messages' lengths
out of an HTTP/2 byte stream however it arrives."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_grpc_proxy import MessagePrefixes  # noqa: E402


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def message(length: int) -> bytes:
    return b"\x00" + length.to_bytes(4, "big") + bytes(length)


def client_bytes() -> bytes:
    """The preface, SETTINGS, HEADERS and DATA of two streams: stream 1's second message
    split over two DATA frames (the split inside its prefix), stream 3's padded."""
    one = message(70_000) + message(1_234_567)
    split = 70_000 + 5 + 2  # two bytes into the second prefix
    return (MessagePrefixes.PREFACE + frame(4, 0, 0, b"") + frame(1, 4, 1, b"\x83\x86")
            + frame(0, 0, 1, one[:split]) + frame(1, 4, 3, b"\x83")
            + frame(0, 0x8, 3, b"\x03" + message(9_000_000)[:40] + b"\x00\x00\x00")
            + frame(0, 1, 1, one[split:]))


def test_message_lengths_are_read_from_frames_split_anywhere_across_reads():
    stream = client_bytes()
    for chunk in (1, 7, 4096, len(stream)):
        reader = MessagePrefixes()
        for at in range(0, len(stream), chunk):
            reader.feed(stream[at:at + chunk])
        assert reader.largest == 9_000_000
        assert reader.streams[1] == [0, b""]  # both of stream 1's messages read to their end


def test_a_padded_frames_padding_is_not_read_as_message_bytes():
    reader = MessagePrefixes()
    reader.feed(MessagePrefixes.PREFACE + frame(0, 0x8, 5, b"\x05" + message(3) + b"\x00\x00\x01\x00\x00"))
    reader.feed(frame(0, 0, 5, message(42)))
    assert reader.largest == 42
