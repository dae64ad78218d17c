"""The capture helpers shared by the codec's and the diffusion model's graph wrappers, on the CPU."""

import sys
import threading
import time
from types import SimpleNamespace

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


class PooledStreams:
    """torch's CUDA stream pool as it hands streams out: `size` per priority, in turn."""

    def __init__(self, size: int):
        self.size, self.drawn = size, {}

    def __call__(self, priority: int = 0):
        index = self.drawn.get(priority, 0)
        self.drawn[priority] = index + 1
        return SimpleNamespace(cuda_stream=(priority, index % self.size))


@pytest.fixture
def pool(monkeypatch):
    import auk_triton.cuda_graph as cuda_graph

    streams = PooledStreams(4)
    monkeypatch.setattr(cuda_graph.torch.cuda, "Stream", streams)
    monkeypatch.setattr(cuda_graph, "STREAMS_PER_PRIORITY", streams.size)
    monkeypatch.setattr(cuda_graph, "_HELD", set())
    return cuda_graph


def test_a_stream_held_for_serving_is_never_drawn_again_though_the_pool_hands_it_out_again(pool):
    serving = pool._take_stream(0)
    for _ in range(10):  # well past the pool's turn
        with pool._stream_for_now(0) as side, pool._stream_for_now(0) as capturing:
            assert len({serving.cuda_stream, side.cuda_stream, capturing.cuda_stream}) == 3
    assert pool._take_stream(-1).cuda_stream == (-1, 0), "each priority has a pool of its own"


def test_a_stream_held_for_now_comes_back_and_a_priority_whose_streams_are_all_held_is_refused(pool):
    with pool._stream_for_now(0) as first:
        pass
    held = [pool._take_stream(0) for _ in range(4)]
    assert first.cuda_stream in {stream.cuda_stream for stream in held}
    with pytest.raises(RuntimeError, match="every pooled CUDA stream of priority 0 is held"):
        pool._take_stream(0)
