"""CUDA-graph replay of the DiT's velocity step, one graph per request shape.

One velocity call launches over a thousand small kernels (30 blocks); at the
released dims their launch cost, not the math, sets the step time.
A graph captured for a shape (target frames, text tokens, reference frames,
guided or not) replays every step of every request of that shape.

Every step of a graphed request replays the graph, the first one included
(a new shape is warmed up and captured before its first step), so a request's
latents do not depend on whether its graph was already cached. The inputs the
graph reads are static buffers: the state x, the time t, and the context's text
and reference embeddings and its text mask, which a request of a cached shape
copies in. Contexts with audio padding masks (batched requests) run eagerly.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from ..cuda_graph import capture
from .transformer import AuKTransformer, DiTContext

log = logging.getLogger(__name__)


def graph_key(ctx: DiTContext, x_shape) -> tuple | None:
    """The cache key of a context, or None when it cannot be graphed (padding masks)."""
    if any(m is not None for m in (ctx.target_mask, ctx.audio_mask, ctx.joint_bias, ctx.single_bias)):
        return None
    prompt = None if ctx.prompt is None else tuple(ctx.prompt.shape)
    return tuple(x_shape), tuple(ctx.c.shape), prompt, ctx.copies, ctx.c.dtype


class _GraphedStep:
    def __init__(self, model: AuKTransformer, ctx: DiTContext, x_shape, autocast):
        device = ctx.c.device
        self.ctx = ctx  # its tensors become the graph's static inputs
        self.x = torch.zeros(x_shape, dtype=torch.float32, device=device)
        self.t = torch.zeros((), dtype=torch.float32, device=device)

        def step():
            with autocast():
                return model.step(self.x, self.t, ctx)

        self.graph, self.out = capture(step, warmups=1)

    def load(self, ctx: DiTContext) -> None:
        """Copy a request's own context tensors into the graph's (same shapes, by the key)."""
        self.ctx.c.copy_(ctx.c)
        self.ctx.c_mask.copy_(ctx.c_mask)
        for static, own in zip(self.ctx.rope_text, ctx.rope_text):  # squeezed by the text mask
            static.copy_(own)
        if ctx.prompt is not None:
            self.ctx.prompt.copy_(ctx.prompt)

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The velocity, in a static buffer that the next replay overwrites: use it at once."""
        self.x.copy_(x)
        self.t.copy_(t)
        self.graph.replay()
        return self.out


class DiTGraphCache:
    """Captured velocity steps for the last `max_graphs` shapes (least recently used goes first)."""

    def __init__(self, model: AuKTransformer, autocast, max_graphs: int = 4):
        self.model, self.autocast, self.max_graphs = model, autocast, max_graphs
        self._graphs: OrderedDict[tuple, _GraphedStep] = OrderedDict()
        self.captures = 0

    def velocity(self, ctx: DiTContext, x_shape):
        """A graphed velocity function for this context, or None to run eagerly."""
        key = graph_key(ctx, x_shape)
        if key is None or self.max_graphs < 1:
            return None
        step = self._graphs.pop(key, None)
        if step is None:
            while len(self._graphs) >= self.max_graphs:
                self._graphs.popitem(last=False)
            try:
                step = _GraphedStep(self.model, ctx, x_shape, self.autocast)
            except Exception as err:  # out of memory, an op that cannot be captured: serve eagerly
                log.warning("CUDA graph capture failed for shape %s, running eagerly: %s: %s",
                            key[:3], type(err).__name__, err)
                return None
            self.captures += 1
        else:
            step.load(ctx)
        self._graphs[key] = step
        return step

    def clear(self) -> None:
        self._graphs.clear()
