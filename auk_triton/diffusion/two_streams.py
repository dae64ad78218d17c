"""Two pieces of work side by side on one GPU: the double blocks' text stream beside their audio stream.

A double block's text stream (64 tokens a row) and audio stream (500) have weights of their
own, so each product, norm and feed-forward is a kernel per stream. The text stream's are too
small to fill the GPU, and the audio stream's leave SMs idle in their last wave. Here the
text stream's work runs on a second CUDA stream forked from the current one and joined back
before its results are used; a CUDA graph captures the two as parallel branches.

The second stream is the calling thread's own (cuda_graph.side_stream), at the current
stream's priority, which a graph's kernels keep (cuda_graph.capture). The caching allocator
keeps tensors per stream: work on the second stream always begins after a fork (it waits for
everything queued on the current stream), and the current stream reads its results only after
the join, so a block freed by either stream is reused in order.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from ..cuda_graph import side_stream

A = TypeVar("A")
B = TypeVar("B")


def side_by_side(main: Callable[[], A], side: Callable[[], B], device: torch.device) -> tuple[A, B]:
    """(main(), side()). On a GPU `side` is queued on a second stream beside the current one, and
    the current stream waits for it before this returns; elsewhere they run one after the other."""
    if device.type != "cuda":
        return main(), side()
    with torch.cuda.device(device):
        current = torch.cuda.current_stream()
        second = side_stream(current.priority)
    second.wait_stream(current)
    first_out = main()  # queued first: the larger kernels take the GPU, the smaller fill their tails
    with torch.cuda.stream(second):
        second_out = side()
    current.wait_stream(second)
    return first_out, second_out
