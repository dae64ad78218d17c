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
