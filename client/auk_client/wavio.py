"""Audio sinks for decoded tiles: a seekable WAV file and a raw PCM16 stream.

Sample conversion to PCM16 (used by both sinks and documented in docs/client.md):
clip to [-1, 1], multiply by 32767, round to the nearest integer (ties to
even, as numpy and Python's `round` do), store as signed 16-bit little-endian.
So 1.0 -> 32767, -1.0 -> -32767, and -32768 is never produced.

The WAV writer is our own rather than `wave.Wave_write` because it must (a)
place every tile at an absolute sample position, filling any gap with
zeros, and (b) write IEEE-float WAV (format tag 3), which `wave` cannot. The
PCM16 files it writes have the canonical 44-byte header, so the standard
`wave` module reads them back.
"""

from __future__ import annotations

import struct
from typing import BinaryIO

import numpy as np

SAMPLE_RATE = 24000

PCM16 = "pcm16"
FLOAT32 = "float32"
FORMATS = (PCM16, FLOAT32)

_WAVE_FORMAT_PCM = 1
_WAVE_FORMAT_IEEE_FLOAT = 3


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] to int16: clip, scale by 32767, round half to even.
    int16 samples (the server's WAVEFORM_PCM16, converted the same way) pass through."""
    samples = np.asarray(samples)
    if samples.dtype == np.int16:
        return samples.astype("<i2", copy=False)
    x = np.clip(samples.astype(np.float32, copy=False), -1.0, 1.0)
    return np.round(x.astype(np.float64) * 32767.0).astype("<i2")


def from_pcm16(samples: np.ndarray) -> np.ndarray:
    """int16 PCM back to float32 in [-1, 1] (divided by 32767, the scale of `to_pcm16`)."""
    return np.asarray(samples, dtype=np.int16).astype(np.float32) / np.float32(32767.0)


def _flat_samples(samples: np.ndarray) -> np.ndarray:
    """A flat int16 array as it is, anything else as float32."""
    samples = np.asarray(samples).reshape(-1)
    return samples if samples.dtype == np.int16 else samples.astype(np.float32, copy=False)


def _encode(samples: np.ndarray, fmt: str) -> bytes:
    if fmt == PCM16:
        return to_pcm16(samples).tobytes()
    if fmt == FLOAT32:
        if samples.dtype == np.int16:
            samples = from_pcm16(samples)
        return np.asarray(samples, dtype="<f4").tobytes()
    raise ValueError(f"unknown sample format {fmt!r}; expected one of {FORMATS}")


def bytes_per_sample(fmt: str) -> int:
    return 2 if fmt == PCM16 else 4


class WavWriter:
    """A mono WAV file written tile by tile, each tile at its start sample.

    The header is written first with zero sizes and patched on `close()`.
    Tiles may arrive in any order and may overlap (a later tile overwrites);
    the region between the end of the audio so far and a tile that starts
    after it is written as zeros (silence).
    """

    def __init__(self, path: str, fmt: str = PCM16, sample_rate: int = SAMPLE_RATE):
        if fmt not in FORMATS:
            raise ValueError(f"unknown sample format {fmt!r}; expected one of {FORMATS}")
        self.path = path
        self.fmt = fmt
        self.sample_rate = sample_rate
        self.width = bytes_per_sample(fmt)
        self.frames = 0  # samples in the file so far
        self._file: BinaryIO = open(path, "wb")
        self._write_header()

    # -- header -----------------------------------------------------------
    def _header(self, frames: int) -> bytes:
        data_bytes = frames * self.width
        if self.fmt == PCM16:
            fmt_chunk = struct.pack(
                "<HHIIHH", _WAVE_FORMAT_PCM, 1, self.sample_rate,
                self.sample_rate * 2, 2, 16,
            )
            chunks = b"fmt " + struct.pack("<I", len(fmt_chunk)) + fmt_chunk
        else:
            # Non-PCM formats carry an 18-byte fmt chunk (cbSize = 0) and a
            # fact chunk with the number of sample frames.
            fmt_chunk = struct.pack(
                "<HHIIHHH", _WAVE_FORMAT_IEEE_FLOAT, 1, self.sample_rate,
                self.sample_rate * 4, 4, 32, 0,
            )
            chunks = (
                b"fmt " + struct.pack("<I", len(fmt_chunk)) + fmt_chunk
                + b"fact" + struct.pack("<II", 4, frames)
            )
        chunks += b"data" + struct.pack("<I", data_bytes)
        riff_size = 4 + len(chunks) + data_bytes
        return b"RIFF" + struct.pack("<I", riff_size) + b"WAVE" + chunks

    def _write_header(self) -> None:
        header = self._header(self.frames)
        self._data_offset = len(header)
        self._file.seek(0)
        self._file.write(header)

    # -- samples ----------------------------------------------------------
    def place(self, start_sample: int, samples: np.ndarray) -> None:
        """Write `samples` (float in [-1, 1], or int16 PCM) so that the first lands at `start_sample`."""
        if start_sample < 0:
            raise ValueError(f"negative start sample {start_sample}")
        samples = _flat_samples(samples)
        if start_sample > self.frames:
            self._file.seek(self._data_offset + self.frames * self.width)
            self._file.write(b"\0" * ((start_sample - self.frames) * self.width))
            self.frames = start_sample
        self._file.seek(self._data_offset + start_sample * self.width)
        self._file.write(_encode(samples, self.fmt))
        self.frames = max(self.frames, start_sample + samples.size)

    def close(self) -> None:
        if self._file.closed:
            return
        data_bytes = self.frames * self.width
        if data_bytes % 2:  # RIFF chunks are word aligned (never true for mono 16/32 bit)
            self._file.seek(self._data_offset + data_bytes)
            self._file.write(b"\0")
        self._write_header()
        self._file.close()

    def __enter__(self) -> "WavWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RawPcm16Stream:
    """Raw PCM16 little-endian mono, written to a pipe as tiles arrive.

    A pipe cannot be rewritten, so tiles are expected in order: a gap before
    a tile is written as zeros, and the part of a tile that overlaps audio
    already written is dropped.
    """

    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.frames = 0

    def place(self, start_sample: int, samples: np.ndarray) -> None:
        samples = _flat_samples(samples)
        if start_sample > self.frames:
            self.stream.write(b"\0\0" * (start_sample - self.frames))
            self.frames = start_sample
        skip = self.frames - start_sample
        if skip < samples.size:
            self.stream.write(to_pcm16(samples[skip:]).tobytes())
            self.frames = start_sample + samples.size
        self.stream.flush()

    def close(self) -> None:
        self.stream.flush()


# WAVE_FORMAT_EXTENSIBLE carries the real format tag in the first two bytes of its SubFormat GUID.
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE


def read_wav(path: str) -> tuple[int, np.ndarray]:
    """Read a PCM16 or 32-bit float WAV (plain or WAVE_FORMAT_EXTENSIBLE): (sample rate,
    int16 or float32 samples), [samples] for mono and [samples, channels] for more."""
    with open(path, "rb") as f:
        blob = f.read()
    if blob[:4] != b"RIFF" or blob[8:12] != b"WAVE":
        raise ValueError(f"{path} is not a RIFF/WAVE file")
    pos, tag, channels, rate, bits, data = 12, None, None, None, None, None
    while pos + 8 <= len(blob):
        cid, size = blob[pos:pos + 4], struct.unpack_from("<I", blob, pos + 4)[0]
        body = blob[pos + 8:pos + 8 + size]
        if cid == b"fmt ":
            if len(body) < 16:
                raise ValueError(f"{path}: its fmt chunk has {len(body)} bytes, fewer than 16")
            tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", body)
            if tag == _WAVE_FORMAT_EXTENSIBLE and len(body) >= 26:
                tag = struct.unpack_from("<H", body, 24)[0]
        elif cid == b"data":
            data = body
        pos += 8 + size + (size & 1)
    if tag is None or data is None:
        raise ValueError(f"{path}: missing fmt or data chunk")
    if not channels:
        raise ValueError(f"{path}: its fmt chunk says 0 channels")
    if tag == _WAVE_FORMAT_PCM and bits == 16:
        samples = np.frombuffer(data[: len(data) - len(data) % (2 * channels)], dtype="<i2").copy()
    elif tag == _WAVE_FORMAT_IEEE_FLOAT and bits == 32:
        samples = np.frombuffer(data[: len(data) - len(data) % (4 * channels)], dtype="<f4").copy()
    else:
        raise ValueError(f"{path}: unsupported WAV format tag {tag} with {bits} bits (PCM16 or 32-bit float only)")
    return rate, samples if channels == 1 else samples.reshape(-1, channels)
