"""CUDA-graph replay of the DiT's velocity step, one graph per run shape.

One velocity call launches over a thousand small kernels (30 blocks); at the
released dims their launch cost, not the math, sets the step time.
A graph captured for a shape (rows, target frames, text tokens, reference frames,
guided or not, padded or not) replays every step of every run of that shape.

Every step of a graphed run replays the graph, the first one included (a new
shape is warmed up and captured before its first step), so a request's latents
do not depend on whether its graph was already cached. The inputs the graph
reads are static buffers: the state x, the time t, and every tensor of the
context (text and reference embeddings, masks, attention biases, rotary tables),
which a run of a cached shape copies in. A padded batch's masks differ from run
to run while its shape stays, so they are inputs like the embeddings.

Every row count is a shape of its own: a batch of 5 replays a 5-row graph, since
a step's time grows about linearly with its rows past a few. All graphs
capture into one private memory pool: they replay one at a time on one stream
and each output is read before the next replay, so the pool holds about the
largest graph's memory, not the sum, and a budget of one graph per batch size
costs little.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import fields

import torch

from ..cuda_graph import capture
from .transformer import AuKTransformer, DiTContext

log = logging.getLogger(__name__)


def _static_tensors(ctx: DiTContext) -> list[torch.Tensor]:
    """Every tensor of a context (None fields skipped), in a fixed order."""
    tensors = []
    for field in fields(ctx):
        value = getattr(ctx, field.name)
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, tuple):
            tensors.extend(value)
    return tensors


def graph_key(ctx: DiTContext, x_shape) -> tuple:
    """The cache key of a context: equal keys have tensors of equal shapes, field by field."""
    shapes = tuple(None if getattr(ctx, f.name) is None else f.name for f in fields(ctx))
    return tuple(x_shape), ctx.copies, ctx.c.dtype, shapes, tuple(tuple(t.shape) for t in _static_tensors(ctx))


class _GraphedStep:
    def __init__(self, model: AuKTransformer, ctx: DiTContext, x_shape, autocast, pool):
        device = ctx.c.device
        self.ctx = ctx  # its tensors become the graph's static inputs
        self.x = torch.zeros(x_shape, dtype=torch.float32, device=device)
        self.t = torch.zeros((), dtype=torch.float32, device=device)

        def step():
            with autocast():
                return model.step(self.x, self.t, ctx)

        self.graph, self.out = capture(step, pool=pool, warmups=1)

    def load(self, ctx: DiTContext) -> None:
        """Copy a run's own context tensors into the graph's (same shapes, by the key)."""
        for static, own in zip(_static_tensors(self.ctx), _static_tensors(ctx)):
            static.copy_(own)

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The velocity, in a static buffer that the next replay overwrites: use it at once."""
        self.x.copy_(x)
        self.t.copy_(t)
        self.graph.replay()
        return self.out


class DiTGraphCache:
    """Captured velocity steps for the last `max_graphs` run shapes (least recently used goes first)."""

    def __init__(self, model: AuKTransformer, autocast, max_graphs: int):
        self.model, self.autocast, self.max_graphs = model, autocast, max_graphs
        self._graphs: OrderedDict[tuple, _GraphedStep] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if max_graphs > 0 else None
        self.captures = 0

    def velocity(self, ctx: DiTContext, x_shape):
        """A graphed velocity function for this context, or None to run eagerly."""
        key = graph_key(ctx, x_shape)
        if self.max_graphs < 1:
            return None
        step = self._graphs.pop(key, None)
        if step is None:
            while len(self._graphs) >= self.max_graphs:
                self._graphs.popitem(last=False)
            try:
                step = _GraphedStep(self.model, ctx, x_shape, self.autocast, self._pool)
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
