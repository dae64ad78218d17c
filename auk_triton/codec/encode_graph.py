"""The AuK codec's encode as served: eager, or the encoder replayed as CUDA graphs.

The encoder is a fixed chain of about 190 convolutions, activations and adds
whatever the clip's length, so on a GPU a short clip is bound by launch overhead.
A graph replays that chain without it, but only for the exact sample count it was
captured for: the encoder is not causal and every convolution zero-pads its own
input, so a clip right-padded to a bucket would change its last frames (the
decoder's buckets have no such problem). A graph therefore pays only where the
same length comes back, and a new length costs warm-up runs and a capture first
(`benchmarks/bench_edit.py` measures both).

The posterior sample (`seed`) follows the reference pipeline (the AuK DiT spec, editing): its
own generator, seeded with (request seed + 0x5EED0A0C) mod 2^63, so the diffusion
noise of the same request stays that of an unsampled run.

Not thread-safe: the graphs' static buffers are shared by all calls (one caller at a
time, as a Triton model instance's `execute`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from ..cuda_graph import capture
from .vae import AuKVAE

POSTERIOR_SEED_OFFSET = 0x5EED0A0C  # 1,592,592,908


def posterior_seed(seed: int) -> int:
    """The seed of the posterior sample's generator for a request seeded `seed`."""
    return (int(seed) + POSTERIOR_SEED_OFFSET) % 2**63


class _Graph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor  # [1, samples]
    static_out: torch.Tensor  # the encoder head's output [1, 2 * latent_dim, frames]


class AuKVAEEncoder:
    """`AuKVAE.encode` on the module's device, eager or with the encoder replayed as a CUDA graph
    captured per sample count (the last `max_graphs` kept, least recently used dropped first).

    Eager off CUDA, with `cuda_graphs=False`, and where a capture fails (that length then
    runs eager). A graph replays the eager kernels, so its latents are eager's.
    """

    def __init__(self, vae: AuKVAE, cuda_graphs: bool = False, max_graphs: int = 8):
        self.vae = vae
        self.device = vae.global_mean.device
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.max_graphs = max(1, int(max_graphs))
        self._graphs: OrderedDict[int, _Graph | None] = OrderedDict()  # None: that capture failed
        self.last_mode: str | None = None  # "graph" or "eager", for logs and tests

    @property
    def hop_size(self) -> int:
        return self.vae.hop_size

    def encode(self, wav: torch.Tensor, seed: int | None = None) -> torch.Tensor:
        """Mono [1, samples] float32 on the module's device -> normalized latents [1, samples //
        hop, latent_dim]: the posterior mean, or with `seed` a sample from the posterior."""
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(posterior_seed(seed))
        with torch.no_grad():
            entry = self._graph(wav) if self.cuda_graphs else None
            if entry is None:
                self.last_mode = "eager"
                return self.vae.encode(wav, generator)
            entry.static_in.copy_(wav)
            entry.graph.replay()
            self.last_mode = "graph"
            # New tensors from here on: nothing returned aliases the graph's buffer.
            return self.vae.posterior_latents(entry.static_out, wav.shape[1] // self.hop_size, generator)

    def _graph(self, wav: torch.Tensor) -> _Graph | None:
        """The graph for wav's length, captured on first use; None where it cannot be captured."""
        self.vae.check_wav(wav)
        samples = wav.shape[1]
        if samples in self._graphs:
            self._graphs.move_to_end(samples)
            return self._graphs[samples]
        static_in = torch.zeros(1, samples, device=self.device)
        try:
            graph, static_out = capture(lambda: self.vae.audio_encoder(static_in.unsqueeze(1)))
            entry = _Graph(graph, static_in, static_out)
        except RuntimeError:  # out of memory, or an op that cannot be captured: eager for this length
            torch.cuda.synchronize(self.device)
            entry = None
        self._graphs[samples] = entry
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry
