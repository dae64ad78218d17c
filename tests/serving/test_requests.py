"""Request checks at the serving edge: each bad input named, for that request only."""

from __future__ import annotations

import numpy as np
import pytest

from auk_triton.serving.requests import RequestError, require_finite, throttled_check, validate_latents


def test_validate_latents_accepts_a_good_clip_and_names_each_problem():
    good = np.zeros((5, 64), np.float32)
    assert validate_latents(good, 64, 10, 50.0) is not None
    cases = [
        (None, "no LATENTS"),
        (good.astype(np.float16), "float16; this model takes FP32"),
        (np.zeros((5, 64, 1), np.float32), "this model takes one clip as \\[frames, 64\\]"),
        (np.zeros((5, 32), np.float32), "LATENTS has 32 channels per frame; this model decodes 64"),
        (np.zeros((0, 64), np.float32), "zero frames"),
        (np.zeros((11, 64), np.float32), "11 frames, more than this model's max_frames of 10"),
    ]
    for array, message in cases:
        with pytest.raises(RequestError, match=message):
            validate_latents(array, 64, 10, 50.0)
    bad = good.copy()
    bad[2, 1], bad[4, 0] = np.nan, np.inf
    with pytest.raises(RequestError, match="1 NaN and 1 infinite values \\(the first in frame 2\\)"):
        validate_latents(bad, 64, 10, 50.0)


def test_the_finiteness_check_can_be_left_for_later_and_then_names_the_same_values():
    bad = np.zeros((5, 64), np.float32)
    bad[2, 1], bad[4, 0] = np.nan, np.inf
    assert validate_latents(bad, 64, 10, 50.0, check_finite=False) is not None
    with pytest.raises(RequestError, match="1 NaN and 1 infinite values \\(the first in frame 2\\)"):
        require_finite(bad)
    require_finite(np.zeros((5, 64), np.float32))


def test_a_run_asks_whether_a_client_is_gone_at_most_once_per_interval_after_its_execute_began():
    now = [10.0]
    asked = []

    def is_cancelled():
        asked.append(now[0])
        return now[0] >= 10.3

    check = throttled_check(is_cancelled, since=10.0, interval=0.1, clock=lambda: now[0])
    answers = []
    for t in (10.0, 10.05, 10.12, 10.15, 10.21, 10.25, 10.36):  # before sampling, then between steps
        now[0] = t
        answers.append(check())
    assert asked == [10.12, 10.25, 10.36], "asked once the interval had passed, each time"
    assert answers == [False, False, False, False, False, False, True]
    late = throttled_check(lambda: True, since=10.0, interval=0.1, clock=lambda: 10.2)
    assert late(), "a run that waited behind others asks before sampling"
