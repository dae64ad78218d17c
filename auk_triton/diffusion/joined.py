"""Requests that join a sampler run between Euler steps, and leave it when done.

`AuKDiTSampler.generate_batch` samples whole requests: a run takes every step of
its grid, and a request that arrives meanwhile waits for all of them. Here each
request is a row with its own place on its own time grid. Before each step the
requests waiting join the run (as many as its bucket's graphs hold), and after it
the rows at the end of their grid leave with their latents; a row whose client is
gone leaves before its next step. One step serves rows at different times, even of
different grids: each row gets its own modulation (its grid's table at its time)
and its own step size. So a request waits one step for a run in progress, not the
run.

Rows share a run when they share a bucket (its CUDA graphs) and a guidance mode;
without buckets, a guidance mode alone, padded to the longest row as
`generate_batch` pads. Runs of different keys take turns, one step each.

A row's latents are those `generate` gives its request alone, to the rounding that
a batch of another size brings: padding is masked exactly, each row draws its
noise from its own seed, and its update `x + dt * v` is formed as a run's is (the
product in the velocity's dtype, added into fp32 x).

Queuing a step itself never waits for the GPU. Each request's prompt, reference and step
sizes go to the device once, when it is submitted, from pinned memory; a row that
leaves has its latents copied to pinned host memory behind its last step, and is
handed back by the next `step()`, which waits for that copy alone once its own step
is queued: the GPU computes the next step while the caller answers the row.

A lone request may leave on the GPU instead. With `keep_on_device` (a stage in the
same process reads the latents there, and says when it may take them so), a row that
leaves with no other request held is handed back by the very `step()` that queues its
last step, its latents on the GPU (`DeviceLatents`): that stage can queue its own work
behind the step before the step has run. Only then: under load, rows handed over before
their step has run held back the decoder's batching (benchmarks/studies/pipeline-first-audio.md).

Nor does the thread run ahead of the GPU: once it has queued a step, it waits until
the one before has run (STEPS_QUEUED_AHEAD). Queued further ahead, steps would take
their rows before a request that arrives meanwhile could join them: it would wait for
the whole queue, not for one step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable

import torch

from .sampler import AuKDiTSampler, NonFiniteLatents, Plan, SamplingStopped, cfg_combine
from .transformer import ModulationTable

# Steps queued behind the one the GPU runs when the thread queues the next: one keeps the GPU
# busy meanwhile, and a request that arrives waits for at most two steps to join.
STEPS_QUEUED_AHEAD = 1


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`. To a GPU through pinned memory, queued: a copy from pageable
    memory would wait for all the work queued before it."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A copy of a tensor in host memory, queued behind the work that makes it, and the event
    that marks it done (None: done already)."""
    if tensor.device.type != "cuda":
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


@dataclass(eq=False)
class DeviceLatents:
    """A row's latents [frames, C] fp32 left on its GPU, final once `ready` has passed: an event
    on the sampling stream behind the row's last step. A reader on another stream waits for it
    there, and records its stream on `latents` (they were made on the sampling stream's memory).
    `finite` is a pinned host flag, copied before `ready`."""

    latents: torch.Tensor
    ready: torch.cuda.Event
    finite: torch.Tensor

    @classmethod
    def behind(cls, latents: torch.Tensor) -> DeviceLatents:
        """`latents`, copied out of their run's state, and their flag, queued on the current stream."""
        finite = torch.empty((), dtype=torch.bool, pin_memory=True)
        finite.copy_(torch.isfinite(latents).all(), non_blocking=True)
        latents = latents.clone()
        ready = torch.cuda.Event()
        ready.record()
        return cls(latents, ready, finite)

    def check(self) -> None:
        """Raise NonFiniteLatents if they are not finite; only once `ready` has passed."""
        if not bool(self.finite):
            raise NonFiniteLatents()


@dataclass(eq=False)
class JoinedRow:
    """One request being sampled: where it is on its grid, and its state after its last step."""

    plan: Plan  # its text and reference on the sampler's device
    tag: object  # the caller's: returned with the row's result
    should_stop: Callable[[], bool] | None
    table: ModulationTable
    dts: torch.Tensor  # [steps] fp32 step sizes on the sampler's device, as `euler_integrate` forms them
    step: int = 0  # steps taken
    state: torch.Tensor | None = None  # [frames, C] fp32 once it has left a batch part-way; None: its noise

    @property
    def steps(self) -> int:
        return self.plan.schedule.steps

    def dt(self) -> torch.Tensor:
        """The next step's size, a 0-d fp32 CPU tensor as `euler_integrate` forms it."""
        grid = self.plan.schedule.grid
        return grid[self.step + 1] - grid[self.step]


@dataclass(eq=False)
class _Batch:
    """A run's rows laid out for its velocity calls, rebuilt whenever a row joins or leaves."""

    ctx: object  # DiTContext
    x: torch.Tensor  # [B, n, C] fp32
    mask: torch.Tensor | None  # [B, n]
    cfg: float | torch.Tensor
    graph: object | None  # the CUDA graph that replays the step, or None: eager


@dataclass(eq=False)
class _Run:
    guided: bool
    shape: object  # the rows' own bucket (RunShape), None without buckets or past the largest
    rows: list[JoinedRow] = field(default_factory=list)
    waiting: deque = field(default_factory=deque)
    batch: _Batch | None = None  # None: rows changed since it was built


class JoinedRuns:
    """The requests being sampled, in runs that rows join and leave between steps.

    Not thread-safe: one thread submits and steps (a server's sampling thread)."""

    def __init__(self, sampler: AuKDiTSampler, max_requests: int,
                 keep_on_device: Callable[[], bool] | None = None):
        self.sampler, self.max_requests = sampler, max(1, max_requests)
        self._on_gpu = torch.device(sampler.device).type == "cuda"
        # Asked as a lone request leaves: whether its latents may stay on the GPU (None: never).
        self.keep_on_device = keep_on_device if self._on_gpu else None
        self._runs: OrderedDict[Hashable, _Run] = OrderedDict()
        self._alone = 0  # keys of requests past the largest bucket: each runs alone
        self._leaving: list[tuple[object, torch.Tensor, torch.cuda.Event | None]] = []  # copies under way
        self._queued: deque[torch.cuda.Event] = deque()  # the end of each step queued on a GPU
        self.steps = 0  # velocity calls made
        self.stepped_rows = 0  # requests summed over them: / steps, the requests a step serves

    def __len__(self) -> int:
        """Requests held: sampling, waiting to join, or left with their latents on the way to the host."""
        return len(self._leaving) + sum(len(run.rows) + len(run.waiting) for run in self._runs.values())

    def submit(self, plan: Plan, tag: object = None, should_stop: Callable[[], bool] | None = None) -> None:
        """Queue a checked plan (`AuKDiTSampler.plan`): it joins its run before that run's next step."""
        sampler, guided = self.sampler, plan.schedule.guided
        shape = sampler.own_bucket(plan)
        key: Hashable = (shape, guided)
        if sampler.buckets is not None and shape is None:
            self._alone += 1
            key = ("alone", self._alone)
        table = sampler.modulation_table(plan.schedule.grid)
        device, grid = torch.device(sampler.device), plan.schedule.grid
        plan = replace(plan, text=to_device(plan.text, device),
                       ref=None if plan.ref is None else to_device(plan.ref, device))
        run = self._runs.setdefault(key, _Run(guided, shape))
        run.waiting.append(JoinedRow(plan, tag, should_stop, table, to_device(grid[1:] - grid[:-1], device)))
        if shape is not None:
            sampler.ask_for_graphs([(shape, guided)] * (len(run.rows) + len(run.waiting)))

    def step(self) -> list[tuple[object, torch.Tensor | Exception]]:
        """Queue one step of the next run (runs take turns), and return (tag, result) of each row
        that has left: its latents [frames, C] fp32 on the host, or the exception that ended it
        (SamplingStopped, NonFiniteLatents, or the run's own error, which ends all its rows).
        Rows that finish with this step come back from the next call, or from this one when no
        run is left to step; a lone request kept on the device, from this one, as DeviceLatents."""
        leaving, self._leaving = self._leaving, []
        done: list[tuple[object, torch.Tensor | Exception]] = []
        if self._runs:
            key, run = next(iter(self._runs.items()))
            self._runs.move_to_end(key)
            alone = not leaving and len(self._runs) == 1 and len(run.rows) + len(run.waiting) == 1
            try:
                with torch.inference_mode():  # as generate_batch: the graphs' buffers are inference tensors
                    self._step(run, done, alone)
            except Exception as err:  # the step itself failed (out of memory): every row of the run
                done += [(row.tag, err) for row in run.rows]
                run.rows.clear()
                run.batch = None
            if not run.rows and not run.waiting:
                del self._runs[key]
            self._pace()
        if not self._runs:
            leaving, self._leaving = leaving + self._leaving, []
        return done + [(tag, _finished(latents, copied)) for tag, latents, copied in leaving]

    def drain(self) -> list[object]:
        """Every request held, dropped (the model is unloading): their tags."""
        tags = [tag for tag, _, _ in self._leaving]
        tags += [row.tag for run in self._runs.values() for row in (*run.rows, *run.waiting)]
        self._runs.clear()
        self._leaving = []
        return tags

    # ------------------------------------------------------------------ one step

    def _step(self, run: _Run, done: list, alone: bool) -> None:
        """`alone`: the run's one row is the only request held."""
        sampler = self.sampler
        sampler.take_built_graphs()
        for row in list(run.rows):
            if row.should_stop is not None and row.should_stop():
                self._leave(run, row)
                done.append((row.tag, SamplingStopped(f"before step {row.step + 1} of {row.steps}")))
        limit = sampler.run_limit(run.shape, run.guided, self.max_requests)
        while run.waiting and len(run.rows) < limit:
            row = run.waiting.popleft()
            if row.should_stop is not None and row.should_stop():
                done.append((row.tag, SamplingStopped("before sampling")))
                continue
            self._unbatch(run)
            run.rows.append(row)
        if not run.rows:
            return
        if run.batch is None:
            run.batch = self._build(run)
        batch, rows = run.batch, run.rows
        v = self._velocity(batch, rows)
        if run.guided:
            v_cond, v_uncond = v.chunk(2, dim=0)
            v = cfg_combine(v_cond, v_uncond, batch.cfg)
        if batch.mask is not None:
            v = v.masked_fill(~batch.mask[..., None], 0.0)
        batch.x = batch.x + self._scaled(v, rows)
        self.steps += 1
        self.stepped_rows += len(rows)
        for i, row in reversed(list(enumerate(rows))):
            row.step += 1
            if row.step == row.steps:
                latents = batch.x[i, : row.plan.frames]
                if alone and self.keep_on_device is not None and self.keep_on_device():
                    done.append((row.tag, DeviceLatents.behind(latents)))
                else:
                    self._leaving.append((row.tag, *to_host(latents)))
                self._leave(run, row)

    def _pace(self) -> None:
        """Mark the end of the step just queued, and wait until at most STEPS_QUEUED_AHEAD steps, it
        included, are left to run: the requests that arrive meanwhile join the next one."""
        if not self._on_gpu:
            return
        self._queued.append(torch.cuda.Event())
        self._queued[-1].record()
        while len(self._queued) > STEPS_QUEUED_AHEAD:
            self._queued.popleft().synchronize()

    @staticmethod
    def _unbatch(run: _Run) -> None:
        """Drop the run's batch, each row keeping its state for the next one."""
        if run.batch is not None:
            for i, row in enumerate(run.rows):
                row.state = run.batch.x[i, : row.plan.frames]
            run.batch = None

    def _leave(self, run: _Run, row: JoinedRow) -> None:
        self._unbatch(run)
        run.rows.remove(row)

    def _build(self, run: _Run) -> _Batch:
        sampler, rows = self.sampler, run.rows
        plans = [row.plan for row in rows]
        ctx, x, mask = sampler._batch_context(plans, run.guided, states=[row.state for row in rows])
        cfg = plans[0].schedule.cfg
        if run.guided and len(plans) > 1:
            cfg = torch.tensor([p.schedule.cfg for p in plans], dtype=torch.float32)
            cfg = to_device(cfg, torch.device(sampler.device))[:, None, None]
        graph = None if sampler.graphs is None else sampler.graphs.velocity(ctx, x.shape)
        return _Batch(ctx, x, mask, cfg, graph)

    def _velocity(self, batch: _Batch, rows: list[JoinedRow]) -> torch.Tensor:
        """The rows' velocity [B * copies, n, C], each row at its own time."""
        sampler = self.sampler
        first = rows[0]
        if all(row.table is first.table and row.step == first.step for row in rows):
            mod = first.table.values[first.step : first.step + 1]  # one row for all, as a run's step
        else:
            mod = torch.cat([row.table.values[row.step : row.step + 1] for row in rows])
            if batch.ctx.copies > 1:
                mod = torch.cat([mod] * batch.ctx.copies)
        if batch.graph is not None:
            batch.graph.load(batch.ctx)  # another run's batch may have used this graph since
            return batch.graph.replay(batch.x, mod)
        with sampler._autocast():
            return sampler.model.velocity(batch.x, mod, batch.ctx)

    @staticmethod
    def _scaled(v: torch.Tensor, rows: list[JoinedRow]) -> torch.Tensor:
        """dt * v for each row, in the velocity's dtype: the product of v (as fp32) and an fp32
        dt, rounded once, as `euler_integrate`'s 0-d dt gives it."""
        dts = [float(row.dt()) for row in rows]
        if all(dt == dts[0] for dt in dts):
            return rows[0].dt() * v  # a CPU scalar: the product in fp32, as euler_integrate's
        dt = torch.cat([row.dts[row.step : row.step + 1] for row in rows])[:, None, None]
        return (dt * v.float()).to(v.dtype)


def _finished(latents: torch.Tensor, copied: torch.cuda.Event | None) -> torch.Tensor | Exception:
    """A row's latents once on the host, or the error that they are not finite."""
    if copied is not None:
        copied.synchronize()  # this row's copy alone, not the steps queued after it
    if not bool(torch.isfinite(latents).all()):
        return NonFiniteLatents()
    return latents
