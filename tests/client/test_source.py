"""A source clip for editing, read and prepared by the client alone (no server): WAV files of
PCM16 or 32-bit float with any channel count, mixed down to mono and resampled to 24 kHz."""

from __future__ import annotations

import struct
import wave

import numpy as np
import pytest

from auk_client.source import load_source, prepare_source
from auk_client.stream import BadInput
from auk_client.wavio import read_wav

RATE = 24000


def float32_extensible_wav(path, samples: np.ndarray, rate: int) -> None:
    """`samples` [n, channels] as WAVE_FORMAT_EXTENSIBLE with the IEEE float sub-format, by hand."""
    frames, channels = samples.shape
    guid = struct.pack("<H", 3) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    fmt = struct.pack("<HHIIHHHHI", 0xFFFE, channels, rate, rate * 4 * channels, 4 * channels, 32, 22, 32, 0) + guid
    data = samples.astype("<f4").tobytes()
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def pcm16_wav(path, samples: np.ndarray, rate: int, width: int = 2) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(samples.shape[1])
        wav.setsampwidth(width)
        wav.setframerate(rate)
        wav.writeframes(samples.astype(f"<i{width}").tobytes())


def test_a_float32_extensible_wav_of_three_channels_is_read_sample_for_sample(tmp_path):
    samples = np.random.default_rng(0).uniform(-1, 1, (1000, 3)).astype(np.float32)
    float32_extensible_wav(tmp_path / "three.wav", samples, 32000)
    rate, read = read_wav(str(tmp_path / "three.wav"))
    assert rate == 32000 and read.dtype == np.float32
    np.testing.assert_array_equal(read, samples)


def test_a_stereo_pcm16_wav_is_read_as_int16_frames_by_channels(tmp_path):
    samples = np.arange(-400, 400, dtype=np.int16).reshape(-1, 2)
    pcm16_wav(tmp_path / "stereo.wav", samples, 48000)
    rate, read = read_wav(str(tmp_path / "stereo.wav"))
    assert rate == 48000
    np.testing.assert_array_equal(read, samples)


def test_channels_are_mixed_down_to_their_mean_and_pcm16_is_read_over_32768(tmp_path):
    samples = np.array([[16384, 0], [-32768, 32767], [100, 300]] * 200, dtype=np.int16)
    pcm16_wav(tmp_path / "stereo24k.wav", samples, RATE)
    source = load_source(str(tmp_path / "stereo24k.wav"))
    assert (source.source_rate, source.source_channels, source.frames) == (RATE, 2, 1)
    expected = samples.astype(np.float64).mean(axis=1) / 32768.0
    np.testing.assert_allclose(source.samples, expected, rtol=0, atol=1e-7)


def test_a_clip_at_24_khz_is_passed_through_unchanged():
    audio = np.random.default_rng(1).uniform(-1, 1, 2000).astype(np.float32)
    np.testing.assert_array_equal(prepare_source(audio, RATE).samples, audio)


@pytest.mark.parametrize("rate", [44100, 48000, 16000])
def test_a_sine_is_resampled_to_the_same_sine_at_24_khz(rate):
    t = np.arange(rate) / rate  # one second
    source = prepare_source(np.stack([0.5 * np.sin(2 * np.pi * 1000 * t)] * 2, axis=1).astype(np.float32), rate)
    assert abs(source.samples.size - RATE) <= 1
    expected = 0.5 * np.sin(2 * np.pi * 1000 * np.arange(source.samples.size) / RATE)
    interior = slice(500, -500)  # away from the filter's edges
    assert np.abs(source.samples[interior] - expected[interior]).max() < 1e-3


def test_an_unsupported_wav_format_is_refused_naming_it(tmp_path):
    pcm16_wav(tmp_path / "pcm24.wav", np.zeros((100, 1)), RATE, width=4)
    with pytest.raises(BadInput, match="unsupported WAV format tag 1 with 32 bits"):
        load_source(str(tmp_path / "pcm24.wav"))
    with pytest.raises(BadInput, match="no such audio file"):
        load_source(str(tmp_path / "missing.wav"))


def test_non_finite_float_samples_are_refused_before_any_request():
    with pytest.raises(BadInput, match="NaN or infinite"):
        prepare_source(np.array([0.0, np.nan] * 500, np.float32), RATE)
