"""The capture helpers shared by the codec's and the diffusion model's graph wrappers, on the CPU."""

import sys
import threading
import time

import pytest

from auk_triton.cuda_graph import BUILD_SWITCH_INTERVAL_S, BuildQueue, short_switch_interval, wait_for


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


def test_a_builder_waiting_to_begin_asks_until_its_condition_holds():
    answers = iter([False, False, True])
    asked = []
    condition = lambda: asked.append(1) or next(answers)  # noqa: E731
    assert wait_for(condition, threading.Event(), timeout_s=10, poll_s=0.001) is True
    assert len(asked) == 3


def test_a_builder_begins_anyway_once_it_has_waited_its_limit():
    began = time.monotonic()
    assert wait_for(lambda: False, threading.Event(), timeout_s=0.05, poll_s=0.01) is False
    assert 0.05 <= time.monotonic() - began < 5


def test_a_builder_stopped_while_it_waits_ends_without_beginning():
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    began = time.monotonic()
    assert wait_for(lambda: False, stop, timeout_s=60, poll_s=10) is None
    assert time.monotonic() - began < 5, "the stop ends the wait, not the poll interval"


def test_a_build_queue_builds_in_order_and_a_preferred_item_next():
    work = BuildQueue(["a", "b", "c", "d"])
    assert work.next() == "a"
    assert work.prefer("c") and work.prefer("d"), "a waiting item can be asked for"
    assert not work.prefer("a") and not work.prefer("z"), "one taken, or never queued, cannot"
    assert [work.next() for _ in range(4)] == ["d", "c", "b", None]
    assert work.preferred == 2 and len(work) == 0
