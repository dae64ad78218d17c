"""CUDA-graph replay of the DiT's velocity step: bucket graphs captured at start, others on demand.

One velocity call launches over a thousand small kernels (30 blocks); at the
released dims their launch cost, not the math, sets the eager step's time.
A graph captured for a shape (rows, target frames, text tokens, reference
frames, guided or not, padded or not) replays every step of every run of that
shape.

Two kinds of graphs:

- Bucket graphs (`warmup`, at service start): for each bucket (buckets.py), one
  graph per request count it holds, through the compiled blocks when the step is
  compiled. The graphs of one bucket read the front of one set of input buffers,
  sized for its most requests (`DiTContext.head`), so a bucket's inputs take the
  memory of its largest run once. They are kept for the life of the cache.
- Other shapes (past the largest bucket, or any shape without buckets): captured
  on their first run with the eager blocks (no compilation at request time), the
  last `max_graphs` kept, least recently used dropped first; with `max_graphs` 0
  such a run steps eagerly. Both count as fallbacks (`request_captures`,
  `eager_runs`): with buckets, a request that needs one is logged by the server.

Every step of a graphed run replays the graph, the first one included, so a
request's latents do not depend on whether its graph was already there. The
inputs a graph reads are static buffers: the state x, the step's modulation (a row
per model row: the row of the run's modulation table for its time, or each row's
own when rows at different times share a step (joined.py), copied in before each
replay), and every tensor of the context (text and reference embeddings, masks, rotary
tables), which a run copies in: all of them, but for those the graph loaded last when no
other graph of its bucket has written their shared buffers since (a lone request's kept
masks, or a run's own context from one step to the next).

All graphs capture into one private memory pool: they replay one at a time on
one stream and each output is read before the next replay, so the pool holds
about the largest graph's memory, not the sum.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field, fields, replace
from typing import Callable

import torch

from ..cuda_graph import capture
from .transformer import EAGER_BLOCKS, AuKTransformer, BlockRunners, DiTContext

log = logging.getLogger(__name__)


def _static_tensors(ctx: DiTContext) -> list[torch.Tensor]:
    """Every tensor of a context (None fields and the modulation table skipped), in a fixed order."""
    tensors = []
    for entry in fields(ctx):
        value = getattr(ctx, entry.name)
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, tuple):
            tensors.extend(value)
    return tensors


def _own_buffers(ctx: DiTContext) -> DiTContext:
    """A copy of a context whose tensors are its own: a graph's buffers, which every run it serves
    copies its context into, must not be a run's (the sampler shares runs' masks between runs;
    a warm-up's context is made for its graphs alone)."""
    changes = {}
    for entry in fields(ctx):
        value = getattr(ctx, entry.name)
        if isinstance(value, torch.Tensor):
            changes[entry.name] = value.clone()
        elif isinstance(value, tuple):  # a plain tuple or a NamedTuple (padded_attention.ValidFirst)
            clones = [t.clone() for t in value]
            changes[entry.name] = type(value)(*clones) if hasattr(value, "_fields") else tuple(clones)
    return replace(ctx, **changes)


def graph_key(ctx: DiTContext, x_shape) -> tuple:
    """The cache key of a context: equal keys have tensors of equal shapes, field by field."""
    present = tuple(f.name for f in fields(ctx) if isinstance(getattr(ctx, f.name), (torch.Tensor, tuple)))
    return tuple(x_shape), ctx.copies, ctx.c.dtype, present, tuple(tuple(t.shape) for t in _static_tensors(ctx))


@dataclass(eq=False)
class _LoadedInputs:
    """What a set of context buffers holds. A bucket's graphs read the front of one set, so a
    load by one of them changes what the others read: each graph checks it was the last."""

    graph: object = None  # the graph that loaded them last
    sources: list = field(default_factory=list)  # the tensor each buffer was copied from


class _GraphedStep:
    """One captured velocity step and the static buffers it reads."""

    def __init__(self, model: AuKTransformer, ctx: DiTContext, x: torch.Tensor, mod: torch.Tensor,
                 autocast, pool, blocks: BlockRunners, beside_serving: bool = False,
                 inputs: _LoadedInputs | None = None):
        self.model, self.autocast = model, autocast
        self.ctx, self.x, self.mod = ctx, x, mod  # the graph's inputs
        self.table = ctx.modulation
        self._inputs = _LoadedInputs() if inputs is None else inputs  # shared with the graphs of its bucket

        def step():
            with autocast():
                return model.velocity(self.x, self.mod, ctx, blocks)

        self.graph, self.out = capture(step, pool=pool, warmups=1, beside_serving=beside_serving)

    def load(self, ctx: DiTContext) -> None:
        """Copy a run's own context tensors into the graph's (same shapes, by the key), but for
        those this graph loaded last, if no other graph of its buffers has loaded since: that
        context's, or a kept tensor (the sampler's kept masks, never written once made)."""
        held = self._inputs
        sources = _static_tensors(ctx)
        last = held.sources if held.graph is self else [None] * len(sources)
        for static, own, before in zip(_static_tensors(self.ctx), sources, last):
            if own is not before:
                static.copy_(own)
        held.graph, held.sources = self, sources
        self.table = ctx.modulation

    def __call__(self, x: torch.Tensor, t) -> torch.Tensor:
        """The velocity, in a static buffer that the next replay overwrites: use it at once.

        `t` should be a time of the run's grid, as a number or a CPU tensor: its row of the
        modulation table is copied in. Any other time is computed eagerly first."""
        mod = None if self.table is None else self.table.lookup(t)
        if mod is None:
            with self.autocast():
                mod = self.model.modulation_at(torch.as_tensor(t, device=self.x.device))
        return self.replay(x, mod)

    def replay(self, x: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        """The velocity given the modulation: one row that every model row shares, or a row
        each [rows, total]. In a static buffer, as `__call__`'s."""
        self.x.copy_(x)
        self.mod.copy_(mod)  # one row broadcasts
        self.graph.replay()
        return self.out


class DiTGraphCache:
    """Bucket graphs captured by `warmup`, and the last `max_graphs` other run shapes."""

    def __init__(self, model: AuKTransformer, autocast, max_graphs: int, blocks: BlockRunners = EAGER_BLOCKS):
        self.model, self.autocast, self.max_graphs, self.blocks = model, autocast, max_graphs, blocks
        self._buckets: dict[tuple, _GraphedStep] = {}
        self._bucket_inputs: dict[int, _LoadedInputs] = {}  # by where a bucket's buffers start
        self._graphs: OrderedDict[tuple, _GraphedStep] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle()
        # The modulation every graph reads the front of, a row per model row: one step's at a time.
        self._mod: torch.Tensor | None = None
        self.captures = 0  # every graph captured
        self.request_captures = 0  # captured on a run's first step (not by warmup)
        self.eager_runs = 0  # runs stepped eagerly: no graph for their shape
        self.compile_failures = 0  # buckets whose compiled capture failed (a plain graph serves them)

    def _modulation_buffer(self, device, rows: int) -> torch.Tensor:
        """The front `rows` rows of the shared modulation buffer, grown when too short (the
        graphs captured before keep the old one, and still copy their own rows in)."""
        if self._mod is None or self._mod.shape[0] < rows:
            with self.autocast():  # its dtype is the steps' (bf16 under autocast)
                like = self.model.modulation_at(torch.zeros((), device=device))
            self._mod = like.new_zeros(rows, like.shape[1])
        return self._mod[:rows]

    def reserve_modulation(self, rows: int, device) -> None:
        """Size the shared modulation buffer for graphs of up to `rows` model rows at once."""
        self._modulation_buffer(device, rows)

    def warmup(self, ctx: DiTContext, x: torch.Tensor) -> int:
        """Capture the step for 1 to B requests of this context's bucket (x [B, n, C] and ctx hold
        B requests' rows: the largest run, whose buffers the smaller ones' graphs share), and
        serve them from now on. Returns the graphs captured."""
        steps = self.bucket_graphs(ctx, x)
        self.install(steps)
        return len(steps)

    def bucket_graphs(self, ctx: DiTContext, x: torch.Tensor, requests: range | None = None,
                      beside_serving: bool = False, stopping: Callable[[], bool] = lambda: False) -> dict:
        """The graphs `warmup` captures (for every request count up to x's rows, or those of
        `requests`), not yet served (`install`): a graph built after the service is ready
        (`beside_serving`, see cuda_graph.capture) is handed to the serving thread first, and
        ends early once `stopping()` (the model is unloading). A failed compiled capture falls
        back to a plain graph."""
        steps = {}
        mod = self._modulation_buffer(x.device, x.shape[0] * ctx.copies)
        inputs = self._bucket_inputs.setdefault(ctx.c.data_ptr(), _LoadedInputs())
        for requests in range(1, x.shape[0] + 1) if requests is None else requests:
            if stopping():
                break
            view, x_view = ctx.head(requests * ctx.copies), x[:requests]
            key = graph_key(view, x_view.shape)
            if key in self._buckets:
                continue
            try:
                step = _GraphedStep(self.model, view, x_view, mod[: requests * ctx.copies], self.autocast,
                                    self._pool, self.blocks, beside_serving, inputs)
            except Exception as err:
                if self.blocks is EAGER_BLOCKS:
                    log.warning("CUDA graph capture failed for shape %s: %s: %s", key[:3], type(err).__name__, err)
                    continue
                self.compile_failures += 1
                log.warning("compiled step failed for shape %s, a plain graph serves it: %s: %s",
                            key[:3], type(err).__name__, err)
                step = _GraphedStep(self.model, view, x_view, mod[: requests * ctx.copies], self.autocast,
                                    self._pool, EAGER_BLOCKS, beside_serving, inputs)
            steps[key] = step
        return steps

    def install(self, steps: dict) -> None:
        """Serve these bucket graphs (`bucket_graphs`) from now on."""
        self._buckets.update(steps)
        self.captures += len(steps)

    def velocity(self, ctx: DiTContext, x_shape):
        """A graphed velocity function for this context, or None to run eagerly."""
        key = graph_key(ctx, x_shape)
        step = self._buckets.get(key)
        if step is not None:
            step.load(ctx)
            return step
        step = self._graphs.pop(key, None) if self.max_graphs > 0 else None
        if step is None and self.max_graphs > 0:
            while len(self._graphs) >= self.max_graphs:
                self._graphs.popitem(last=False)
            try:
                x = torch.zeros(x_shape, dtype=torch.float32, device=ctx.c.device)
                step = _GraphedStep(self.model, _own_buffers(ctx), x,
                                    self._modulation_buffer(x.device, x_shape[0] * ctx.copies),
                                    self.autocast, self._pool, EAGER_BLOCKS)
            except Exception as err:  # out of memory, an op that cannot be captured: serve eagerly
                log.warning("CUDA graph capture failed for shape %s, running eagerly: %s: %s",
                            key[:3], type(err).__name__, err)
                step = None
            else:
                self.captures += 1
                self.request_captures += 1
        if step is None:
            self.eager_runs += 1
            return None
        step.load(ctx)
        self._graphs[key] = step
        return step

    def clear(self) -> None:
        self._graphs.clear()
        self._buckets.clear()
        self._bucket_inputs.clear()
