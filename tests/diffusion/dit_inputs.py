"""Seeded stand-in inputs of the DiT tests, and how they compare rows."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VAE_SECTION = {"latent_dim": 64, "downsample_rate": 480, "target_sample_rate": 24000}


def small_checkpoint(path: Path) -> Path:
    """The small synthetic DiT (seed 0) in `path`, with the config.json sections the sampler reads."""
    from auk_triton.diffusion.synthetic import write_synthetic_dit_checkpoint

    (path / "config.json").write_text(json.dumps({"vae": VAE_SECTION}))
    return write_synthetic_dit_checkpoint(path, "small", seed=0)


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
