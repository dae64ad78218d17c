"""Statuses on gRPC streams, through the front door: a stream whose client opens it with
Triton's header `triton_grpc_error: true` ends at its first error with that error's status
(INVALID_ARGUMENT for a client's mistake) and its message; without the header, errors stay
in the stream as Triton sends them and the stream goes on. The session's front-door server
(CPU, small synthetic weights)."""

from __future__ import annotations

import numpy as np
import pytest

from triton_harness import FRONT_MAX_FRAMES, DecodeStream, library_tiles

STATUSES = {"triton_grpc_error": "true"}


def latents(frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((frames, 64)).astype(np.float32)


def with_nan(frames: int) -> np.ndarray:
    bad = latents(frames)
    bad[3, 5] = np.nan
    return bad


@pytest.fixture
def stream_of(front_door):
    streams = []

    def make(headers=None) -> DecodeStream:
        streams.append(DecodeStream(front_door.grpc_url, headers=headers))
        return streams[-1]

    yield make
    for stream in streams:
        stream.close()


@pytest.mark.parametrize(
    "bad, words",
    [
        (with_nan(20), ["LATENTS", "NaN", "frame 3"]),  # refused by the model
        (latents(0), ["LATENTS", "zero frames"]),  # refused by the model
        (latents(FRONT_MAX_FRAMES + 1), ["LATENTS", str(FRONT_MAX_FRAMES + 1), "max_frames"]),  # by the front door
    ],
    ids=["nan", "zero-frames", "too-long"],
)
def test_a_stream_that_asks_for_statuses_ends_with_invalid_argument_and_the_message_alone(stream_of, bad, words):
    stream = stream_of(STATUSES)
    stream.send(bad, request_id="bad")
    outcome = stream.collect(timeout=60)["bad"]
    assert outcome.events == ["error"], outcome
    assert "StatusCode.INVALID_ARGUMENT" in outcome.error, outcome.error
    assert "[INVALID_ARGUMENT]" not in outcome.error, "the status is taken out of the message"
    for word in words:
        assert word in outcome.error, f"{word!r} not in {outcome.error!r}"


def test_a_stream_that_asks_for_statuses_serves_good_requests_as_any_stream(stream_of, front_door, reference_vae):
    clip = latents(150, seed=1)  # a short first window, then full ones
    with_statuses, plain = stream_of(STATUSES), stream_of()
    for stream in (with_statuses, plain):
        stream.send(clip, request_id="good")
    got, expected = with_statuses.collect()["good"], plain.collect()["good"]
    assert got.error is None and got.events == expected.events and got.events[-1] == "tile+final"
    for (start, wave), (start_expected, wave_expected) in zip(got.tiles, expected.tiles, strict=True):
        assert start == start_expected
        np.testing.assert_array_equal(wave, wave_expected)
    library = np.concatenate([wave for _, wave in library_tiles(reference_vae, clip, front_door)])
    np.testing.assert_allclose(got.waveform(), library, rtol=0, atol=1e-6)


def test_without_the_header_an_error_stays_in_the_stream_without_a_status_and_the_next_request_is_served(stream_of):
    stream = stream_of()
    stream.send(with_nan(20), request_id="bad")
    bad = stream.collect(timeout=60)["bad"]
    assert bad.events == ["error"] and "NaN" in bad.error and "[INVALID_ARGUMENT]" not in bad.error, bad
    stream.send(latents(20), request_id="good")
    good = stream.collect()["good"]
    assert good.error is None and good.events == ["tile+final"], good
