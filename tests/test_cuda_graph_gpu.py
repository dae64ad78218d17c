"""Graph capture on a CUDA GPU: the priority each kernel of a graph runs at. Skipped without CUDA.

PyTorch instantiates its graphs with CUDA's cudaGraphInstantiateFlagUseNodePriority: a replay
runs each kernel at the priority recorded when it was captured, not at the priority of the
stream that launches it. These tests read that record back through the driver API."""

import ctypes

import pytest
import torch

from auk_triton.cuda_graph import capture, priority_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
PRIORITY_ATTRIBUTE = 8  # CU_LAUNCH_ATTRIBUTE_PRIORITY


def kernel_priorities(graph: torch.cuda.CUDAGraph) -> list[int]:
    """The priority recorded in each kernel node of `graph` (one built with keep_graph=True)."""
    driver = ctypes.CDLL("libcuda.so.1")

    def check(result: int) -> None:
        assert result == 0, f"CUDA driver call failed: CUresult {result}"

    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t()
    check(driver.cuGraphGetNodes(handle, None, ctypes.byref(count)))
    nodes = (ctypes.c_void_p * count.value)()
    check(driver.cuGraphGetNodes(handle, nodes, ctypes.byref(count)))
    priorities = []
    for node in nodes:
        kind = ctypes.c_int()
        check(driver.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)))
        if kind.value == KERNEL_NODE:
            value = (ctypes.c_int * 64)()  # CUlaunchAttributeValue, a union of 64 bytes; priority first
            check(driver.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), PRIORITY_ATTRIBUTE, value))
            priorities.append(value[0])
    return priorities


@pytest.fixture
def kept_graphs(monkeypatch):
    """`capture` makes graphs that keep their CUDA graph after capture, to be read back."""
    make = torch.cuda.CUDAGraph
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: make(keep_graph=True))


@pytest.mark.parametrize("beside_serving", [False, True], ids=["alone", "beside a serving thread"])
def test_a_graph_captured_for_a_high_priority_stream_runs_every_kernel_at_that_priority(kept_graphs, beside_serving):
    stream = priority_stream(torch.device("cuda"), first=True)
    assert stream.priority < 0, "the device offers no priority above the default"
    x = torch.randn(256, 256, device="cuda")

    def run():
        return torch.relu(x @ x) + 1  # a matrix product and elementwise kernels

    graph, out = capture(run, warmups=1, beside_serving=beside_serving, priority=stream.priority)
    plain, _ = capture(run, warmups=1, beside_serving=beside_serving)
    assert kernel_priorities(graph) and set(kernel_priorities(graph)) == {stream.priority}
    assert set(kernel_priorities(plain)) == {0}, "without a priority a graph runs at the default, on any stream"
    with torch.cuda.stream(stream):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, run())


def test_no_capture_nor_its_warm_up_runs_on_a_serving_thread_s_stream_though_torch_hands_it_out_again():
    serving = priority_stream(torch.device("cuda"), first=False)  # torch's pool: 32 streams of a priority
    x = torch.ones(8, device="cuda")
    streams = set()

    def run():
        streams.add(torch.cuda.current_stream().cuda_stream)
        return x + 1

    for beside_serving in (False, True) * 20:
        graph, out = capture(run, warmups=1, beside_serving=beside_serving)
    graph.replay()  # a capture records its kernels without running them
    torch.cuda.synchronize()
    assert serving.cuda_stream not in streams and len(streams) > 2
    assert out.tolist() == [2.0] * 8
