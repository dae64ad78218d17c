"""benchmarks/queue_model.py: the model of the GPU's queue gives what its costs imply, alone,
at saturation, and between two requests that share the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from auk_triton.serving.scheduler import YIELD_SLACK_S  # noqa: E402
from queue_model import POLICIES, Costs, arrivals_ms, capacity, percentile, serve  # noqa: E402

COSTS = Costs()


def test_a_request_alone_takes_its_steps_its_first_window_and_the_fixed_delay():
    first_audio, finished, late = serve(COSTS, "decode first", arrivals=[0.0, 500.0, 1000.0])
    steps_ms = COSTS.steps * COSTS.step_1_ms
    assert first_audio == pytest.approx([steps_ms + COSTS.first_window_ms + COSTS.fixed_ms] * 3)
    assert COSTS.alone_ms() == pytest.approx(first_audio[0])
    whole = steps_ms + COSTS.first_window_ms + COSTS.rest_of_clip_ms
    assert finished == pytest.approx([whole, 500 + whole, 1000 + whole]) and late == 0


def test_a_step_costs_the_straight_line_through_the_measured_batches():
    assert COSTS.step_ms(1) == pytest.approx(COSTS.step_1_ms)
    assert COSTS.step_ms(16) == pytest.approx(COSTS.step_16_ms)
    assert COSTS.step_ms(8) == pytest.approx((COSTS.step_1_ms * 8 + COSTS.step_16_ms * 7) / 15)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_closed_loop_saturates_near_the_gpu_work_per_request(policy):
    """Between the GPU's bound with first windows free and with each its own replay."""
    per_row_ms = COSTS.steps * COSTS.step_16_ms / COSTS.max_rows + COSTS.rest_of_clip_ms
    served = capacity(COSTS, policy)
    assert 1e3 / (per_row_ms + COSTS.first_window_ms) * 0.9 <= served <= 1e3 / per_row_ms


def test_with_decode_first_a_clip_s_rest_goes_ahead_of_a_step_and_after_the_dit_it_waits():
    """B arrives as A's first window ends: A's rest decodes before B's steps, or after them."""
    b_arrives = COSTS.steps * COSTS.step_1_ms + COSTS.first_window_ms + 0.01
    first, done, _ = serve(COSTS, "decode first", arrivals=[0.0, b_arrives])
    assert done[0] == pytest.approx(b_arrives - 0.01 + COSTS.rest_of_clip_ms)
    assert first[1] == pytest.approx(COSTS.alone_ms() + COSTS.rest_of_clip_ms - 0.01)
    first, done, _ = serve(COSTS, "rest after the DiT", arrivals=[0.0, b_arrives])
    assert done[0] == pytest.approx(b_arrives + COSTS.steps * COSTS.step_1_ms + COSTS.rest_of_clip_ms - 0.01)
    # B's first window waits for A's rest, the replay before it on the decoder's stream.
    assert first[1] == pytest.approx(COSTS.alone_ms() + COSTS.rest_of_clip_ms - 0.01)


def test_the_tail_grows_with_the_load():
    most = capacity(COSTS, "decode first")
    tails = [percentile(serve(COSTS, "decode first", arrivals=arrivals_ms(share * most, 60.0))[0], 99)
             for share in (0.2, 0.5, 0.8)]
    assert COSTS.alone_ms() < tails[0] < tails[1] < tails[2]


def test_the_script_prints_a_row_per_policy_and_load():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "queue_model.py"), "--loads", "0.5"],
                         capture_output=True, text=True, check=True, timeout=120, env=env).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and "(0.50)" in line]
    assert [row.split(" | ")[0] for row in rows] == [f"| {policy}" for policy in POLICIES]


def test_when_later_windows_yield_a_clip_s_rest_waits_for_a_new_request_s_steps():
    """B arrives while A's first window decodes: A's rest waits for B's steps and first window."""
    a_first_tile = COSTS.steps * COSTS.step_1_ms + COSTS.first_window_ms
    b_arrives = a_first_tile - 0.5
    first, done, _ = serve(COSTS, "decode first", arrivals=[0.0, b_arrives])
    yielded, done_yielded, late = serve(COSTS, "later windows yield", arrivals=[0.0, b_arrives])
    assert first[1] == pytest.approx(COSTS.alone_ms() + 0.5 + COSTS.rest_of_clip_ms)
    assert yielded[1] == pytest.approx(COSTS.alone_ms() + 0.5), "B's steps no longer wait for A's rest"
    assert done[0] == pytest.approx(a_first_tile + COSTS.rest_of_clip_ms)
    # A's rest after B's steps and first window, in one replay with B's rest.
    assert done_yielded[0] == pytest.approx(yielded[1] - COSTS.fixed_ms + b_arrives + 2 * COSTS.rest_of_clip_ms)
    assert late == 0


def test_when_later_windows_yield_a_rest_goes_once_its_audio_would_run_out_within_the_slack():
    """Requests every 5 ms keep the DiT busy: A's rest waits until YIELD_SLACK_S before its
    first tile's audio runs out."""
    arrivals = [0.0] + [5.0 * i for i in range(1, 200)]
    _, done, late = serve(COSTS, "later windows yield", arrivals=arrivals)
    a_first_tile = COSTS.steps * COSTS.step_1_ms + COSTS.first_window_ms
    waited_until = a_first_tile + COSTS.first_window_audio_ms - YIELD_SLACK_S * 1e3
    assert waited_until < done[0] <= waited_until + COSTS.step_16_ms + COSTS.rest_of_clip_ms
    assert late == 0


def test_with_a_step_queued_ahead_a_request_that_arrives_mid_step_joins_one_step_later():
    """A alone at 0, B during A's second step: B joins A's third step, or its fourth when each
    step's rows are fixed as the step before begins. Steps of 10 ms at any batch."""
    costs = replace(COSTS, step_1_ms=10.0, step_16_ms=10.0, first_window_ms=1.0, rest_of_clip_ms=0.001,
                    fixed_ms=0.0)
    joins_next, _, _ = serve(costs, "decode first", arrivals=[0.0, 15.0])
    queued_ahead, _, _ = serve(replace(costs, steps_queued_ahead=1), "decode first", arrivals=[0.0, 15.0])
    assert joins_next[0] == queued_ahead[0] == pytest.approx(41.0)
    # B's steps 3-6 end at 61.001 (A's first window and rest went ahead of its fifth), then its first window.
    assert joins_next[1] == pytest.approx(62.001 - 15.0)
    assert queued_ahead[1] == pytest.approx(joins_next[1] + 10.0)
