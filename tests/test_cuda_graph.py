"""The capture helpers shared by the codec's and the diffusion model's graph wrappers, on the CPU."""

import sys

import pytest

from auk_triton.cuda_graph import BUILD_SWITCH_INTERVAL_S, short_switch_interval


def test_a_short_switch_interval_holds_inside_and_the_old_one_comes_back_even_after_an_error():
    before = sys.getswitchinterval()
    assert before > BUILD_SWITCH_INTERVAL_S  # the interpreter's default, 5 ms
    with pytest.raises(RuntimeError):
        with short_switch_interval():
            assert sys.getswitchinterval() == pytest.approx(BUILD_SWITCH_INTERVAL_S)
            raise RuntimeError("a load that failed")
    assert sys.getswitchinterval() == before


def test_a_shorter_interval_already_set_is_kept():
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(BUILD_SWITCH_INTERVAL_S / 2)
        with short_switch_interval():
            assert sys.getswitchinterval() == pytest.approx(BUILD_SWITCH_INTERVAL_S / 2)
    finally:
        sys.setswitchinterval(before)
