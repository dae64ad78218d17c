"""A source clip for editing, prepared as the reference pipeline prepares it (the AuK DiT spec, editing):
read a WAV (PCM16 or 32-bit float, any rate and channel count), mix it down to mono (the mean
over channels), resample it to 24 kHz with soxr. The server cuts it to whole 480-sample frames.

PCM16 is read as int / 32768, as soundfile and torchaudio read it. Resampling uses soxr's
default "HQ" quality (a linear-phase filter); a clip already at 24 kHz is left as it is.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .stream import HOP, SAMPLE_RATE, BadInput
from .wavio import read_wav


@dataclass
class SourceAudio:
    samples: np.ndarray  # float32 [n], mono at SAMPLE_RATE
    source_rate: int
    source_channels: int

    @property
    def seconds(self) -> float:
        return self.samples.size / SAMPLE_RATE

    @property
    def frames(self) -> int:
        """Whole latent frames the server encodes (the rest of the last frame is cut)."""
        return self.samples.size // HOP


def to_float(samples: np.ndarray) -> np.ndarray:
    """int16 PCM (/ 32768) or float samples as float32."""
    if samples.dtype == np.int16:
        return samples.astype(np.float32) / np.float32(32768.0)
    return samples.astype(np.float32, copy=False)


def prepare_source(samples: np.ndarray, rate: int) -> SourceAudio:
    """Samples [n] or [n, channels] at `rate` Hz -> mono float32 at 24 kHz."""
    samples = np.asarray(samples)
    channels = 1 if samples.ndim == 1 else samples.shape[1]
    if samples.ndim not in (1, 2) or channels < 1:
        raise BadInput(f"source audio must be [samples] or [samples, channels], got shape {list(samples.shape)}")
    if rate < 1:
        raise BadInput(f"source audio has a sample rate of {rate} Hz")
    audio = to_float(samples)
    if audio.ndim == 2:
        audio = audio.mean(axis=1, dtype=np.float64).astype(np.float32)
    if not np.isfinite(audio).all():
        raise BadInput("the source audio holds NaN or infinite samples")
    if rate != SAMPLE_RATE and audio.size:
        import soxr

        audio = soxr.resample(audio, rate, SAMPLE_RATE).astype(np.float32, copy=False)
    audio = np.ascontiguousarray(audio)
    if audio.size < HOP:
        raise BadInput(
            f"the source audio is {audio.size / SAMPLE_RATE * 1e3:.1f} ms at {SAMPLE_RATE} Hz, "
            f"shorter than one frame ({HOP} samples, 20 ms)"
        )
    return SourceAudio(audio, rate, channels)


def load_source(path: str) -> SourceAudio:
    """A WAV file as mono 24 kHz float32 samples; a missing or unreadable file is a BadInput."""
    try:
        rate, samples = read_wav(path)
    except FileNotFoundError:
        raise BadInput(f"no such audio file: {path}") from None
    except (ValueError, OSError, struct.error) as exc:
        raise BadInput(f"cannot read {path} as a WAV file: {exc}") from None
    return prepare_source(samples, rate)

