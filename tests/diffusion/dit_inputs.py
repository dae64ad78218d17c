"""Seeded stand-in inputs of the DiT tests, and how they compare rows."""

from __future__ import annotations

import torch


def prompt(tokens: int, seed: int) -> torch.Tensor:
    """Stand-in prompt embeddings [tokens, 2048]."""
    return torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(seed))


def reference(frames: int, seed: int) -> torch.Tensor:
    """Stand-in reference latents [frames, 64]."""
    return torch.randn(frames, 64, generator=torch.Generator().manual_seed(1000 + seed))


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, relative to b's largest value."""
    return float((a - b).abs().max() / b.abs().max())


class StandInGraph:
    """A CUDA graph's contract on the CPU: replay() runs the captured step again on the same
    static buffers and writes the same output tensor."""

    def __init__(self, run):
        self.run, self.captured = run, run()

    def replay(self):
        self.captured.copy_(self.run())


def stand_in_graphs(monkeypatch) -> None:
    """The DiT's step graphs captured as StandInGraph, so that their bookkeeping runs on the CPU."""
    from auk_triton.diffusion import step_graph

    monkeypatch.setattr(step_graph, "capture",
                        lambda run, pool, warmups, beside_serving=False: (graph := StandInGraph(run), graph.captured))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
