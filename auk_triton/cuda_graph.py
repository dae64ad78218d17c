"""Capturing a CUDA graph, shared by the codec's and the diffusion model's graph wrappers."""

from typing import Callable, TypeVar

import torch

Output = TypeVar("Output")


def capture(run: Callable[[], Output], pool=None, warmups: int = 2,
            beside_serving: bool = False) -> tuple[torch.cuda.CUDAGraph, Output]:
    """Capture one call of `run` (on the current device) as a CUDA graph; return the graph and
    the call's output, the static buffer each replay rewrites.

    `run` is first called `warmups` times on a side stream: compilation, autotuning
    and library handles are created lazily and must not happen inside the capture.
    `pool` is a graph memory pool to share (None: the graph gets its own).

    `beside_serving`: another thread keeps launching work meanwhile (a graph built after
    the model is ready). The capture then runs on a stream of its own, not torch's one
    shared capture stream, and in CUDA's thread-local mode, which forbids unsafe calls
    (an allocation, a synchronisation) on this thread only, not on the serving one.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    own = dict(stream=torch.cuda.Stream(), capture_error_mode="thread_local") if beside_serving else {}
    with torch.cuda.graph(graph, pool=pool, **own):
        output = run()
    return graph, output
