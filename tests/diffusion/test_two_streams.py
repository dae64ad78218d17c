"""side_by_side (auk_triton/diffusion/two_streams.py): the double blocks' text stream beside their audio
stream. On the CPU the two pieces of work run in order; on a GPU (skipped without one) the second runs
on the calling thread's own second stream at the current stream's priority, joined before it returns."""

from __future__ import annotations

import threading

import pytest
import torch

from auk_triton.cuda_graph import capture, priority_stream
from auk_triton.diffusion.two_streams import side_by_side

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_on_the_cpu_the_main_work_runs_then_the_side_work_and_both_results_come_back():
    order = []
    first, second = side_by_side(lambda: order.append("main") or 1, lambda: order.append("side") or 2,
                                 torch.device("cpu"))
    assert (first, second) == (1, 2) and order == ["main", "side"]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("high", [False, True], ids=["default priority", "high priority"])
def test_the_side_work_runs_on_this_threads_own_second_stream_at_the_current_streams_priority(high):
    device = torch.device("cuda")
    stream = priority_stream(device, first=high)
    seen = {}

    def record(name):
        current = torch.cuda.current_stream()
        seen[name] = (current.cuda_stream, current.priority)

    with torch.cuda.stream(stream):
        side_by_side(lambda: record("main"), lambda: record("side"), device)
        side_by_side(lambda: None, lambda: record("again"), device)
    other = {}
    thread = threading.Thread(target=lambda: side_by_side(lambda: None, lambda: other.update(
        side=torch.cuda.current_stream().cuda_stream), device))
    thread.start()
    thread.join()
    assert seen["main"] == (stream.cuda_stream, stream.priority)
    assert seen["side"][0] != stream.cuda_stream and seen["side"][1] == stream.priority
    assert seen["again"] == seen["side"], "one second stream per thread and priority, kept"
    assert other["side"] not in (seen["side"][0], stream.cuda_stream), "another thread gets its own"


@pytest.mark.gpu
@needs_gpu
def test_a_graph_of_the_two_streams_gives_what_they_give_one_after_the_other():
    device = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    a, c = (torch.randn(512, 512, device=device, generator=g) for _ in range(2))

    def run():
        big, small = side_by_side(lambda: torch.relu(a @ a), lambda: torch.tanh(c[:64] @ c), device)
        return big.sum(dim=0) + small.sum(dim=0)

    graph, out = capture(run, warmups=1)
    graph.replay()
    torch.cuda.synchronize()
    want = torch.relu(a @ a).sum(dim=0) + torch.tanh(c[:64] @ c).sum(dim=0)
    torch.testing.assert_close(out, want)
