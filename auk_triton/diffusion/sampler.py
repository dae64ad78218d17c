"""Rectified-flow sampling with the AuK DiT: time grid, Euler steps, guidance, request limits.

A request the sampler cannot run (a bad duration, grid, shape or value, past a
frame limit) raises ValueError naming the problem, before any work: `plan()`
makes every such check, so a server can validate a request with it and then
`generate()` the plan. `generate(plan, should_stop=...)` asks before any work and
between Euler steps whether to go on, and raises SamplingStopped once told to stop
(a server passes "has this request's client gone?").

`generate_batch(plans)` runs several plans as the rows of one sampler run: plans
with the same `run_key` (the same time grid, both guided or both not; guidance
scales may differ per row). Rows are padded to the longest prompt, reference and
target and masked (the spec's padding rules), each row draws its own noise from
its own seed, and each row gets its own result: its latents, or the exception
that ended it alone (non-finite output, a stop).

With shape buckets (buckets.py), a run's rows are padded up to its bucket
instead, masked alike, so runs of one bucket share a CUDA graph captured at
start (`warmup`); `runs()` groups plans by bucket too.

t = 0 is pure noise and the last grid point is the clean latent; the DiT's
velocity points from noise towards data, so each step is
`x <- x + (t[i+1] - t[i]) * v(x, t[i])`, integrating forward in t.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..cuda_graph import BuildReport, GraphBuilder
from .buckets import RunShape, ShapeBuckets
from .compiled import CompileOptions, compiled_blocks
from .deferred import DeferredBuckets, DeferredGraphs
from .fp8 import check_fp8_support, use_fp8_linears
from .gemm_workspace import without_gemm_workspace
from .step_graph import DiTGraphCache
from .transformer import (
    EAGER_BLOCKS,
    AuKTransformer,
    CheckpointError,
    ContextMasks,
    ModulationTable,
    load_transformer,
    read_config,
)

log = logging.getLogger(__name__)

# Reference + target frames together (about 1310.7 s at 50 Hz).
MAX_LATENT_FRAMES = 65536
# Guidance below this runs the conditional branch alone.
CFG_MIN = 1e-5
FLASH_STEPS = 4
# The released sampling defaults (steps, guidance, sway) where a checkpoint states none.
DEFAULTS = {"nfe": 32, "cfg": 2.0, "sway": -1.0}
# Modulation tables kept, one per time grid, the least recently used dropped first. A served
# recipe has one grid (a few for base requests that change their steps or sway): each run
# of it looks its table up instead of reading every AdaLN's weights again.
MODULATION_TABLES_KEPT = 8
# One-request runs' masks kept by padding: a lone request of a bucket and lengths seen before makes
# its prompt's projection and noise, not the 40-odd kernels of its masks, rotary tables and biases.
CONTEXT_MASKS_KEPT = 32


# --------------------------------------------------------------------------- schedule


def check_grid(grid) -> torch.Tensor:
    """A usable time grid as fp32: 1-D, at least 2 points, finite, strictly increasing."""
    grid = torch.as_tensor(grid, dtype=torch.float32)
    if grid.dim() != 1 or grid.numel() < 2:
        raise ValueError(f"the time grid must be 1-D with at least 2 points, got shape {list(grid.shape)}")
    if not bool(torch.isfinite(grid).all()):
        raise ValueError("the time grid must be finite")
    if not bool((grid[1:] > grid[:-1]).all()):
        raise ValueError(f"the time grid must strictly increase, got {grid.tolist()}")
    return grid


def time_grid(nfe: int, sway: float | None = None) -> torch.Tensor:
    """nfe + 1 points of linspace(0, 1) in fp32, bent by t + s * (cos(pi t / 2) - 1 + t).

    sway = -1 gives 1 - cos(pi t / 2): small steps near the noise end. None or 0 keeps
    the grid uniform. Endpoints stay 0 and 1 for any sway.
    """
    if nfe < 1:
        raise ValueError(f"the number of steps must be at least 1, got {nfe}")
    t = torch.linspace(0, 1, nfe + 1, dtype=torch.float32)
    if sway is not None:
        t = t + sway * (torch.cos(torch.pi / 2 * t) - 1 + t)
    return check_grid(t)


@dataclass(frozen=True)
class Schedule:
    grid: torch.Tensor  # fp32, on the CPU
    cfg: float

    @property
    def steps(self) -> int:
        return self.grid.numel() - 1

    @property
    def guided(self) -> bool:
        return self.cfg >= CFG_MIN


class SchedulePolicy:
    """Resolves a request's knobs against the checkpoint's variant and defaults."""

    def __init__(self, config: dict):
        self.variant = config.get("variant", "base")
        self.defaults = {**DEFAULTS, **(config.get("defaults") or {})}
        self.flash_grid = None
        self._warned = False
        if self.variant == "flash":
            grid = config.get("flash_t_grid")
            if grid is None or len(grid) != FLASH_STEPS + 1:
                raise CheckpointError(
                    f"a flash checkpoint needs a {FLASH_STEPS + 1}-point flash_t_grid in config.json, got {grid}"
                )
            self.flash_grid = check_grid(grid)  # the exact stored values: rounding changes the output

    def resolve(self, num_steps=None, guidance=None, sway=None, t_grid=None) -> Schedule:
        if self.variant == "flash":
            if not self._warned and any(k is not None for k in (num_steps, guidance, sway, t_grid)):
                log.warning("flash checkpoint: per-request steps/guidance/sway/grid are ignored (locked recipe)")
                self._warned = True
            return Schedule(self.flash_grid, 0.0)
        cfg = float(self.defaults["cfg"] if guidance is None else guidance)
        if not math.isfinite(cfg):
            raise ValueError(f"guidance must be finite, got {cfg}")
        if t_grid is not None and len(t_grid) > 0:
            return Schedule(check_grid(t_grid), cfg)
        nfe = int(self.defaults["nfe"] if num_steps is None else num_steps)
        sway = self.defaults["sway"] if sway is None else sway
        if sway is not None and not math.isfinite(sway):
            raise ValueError(f"sway must be finite, got {sway}")
        return Schedule(time_grid(nfe, sway), cfg)


# --------------------------------------------------------------------------- integration


def cfg_combine(v_cond: torch.Tensor, v_uncond: torch.Tensor, cfg) -> torch.Tensor:
    """v = v_c + cfg * (v_c - v_u): cfg = 2 weighs the conditional branch 3 and the unconditional -2.

    `cfg` is a number or an fp32 tensor of per-row scales [B, 1, 1]. The product is rounded
    to the velocity's dtype before the sum, as a number times a bf16 tensor is, so a row's
    scale as a tensor gives the same bits as the same scale as a number."""
    return v_cond + (cfg * (v_cond - v_uncond)).to(v_cond.dtype)


class SamplingStopped(RuntimeError):
    """`generate` stopped before its end because `should_stop` said so."""


class NonFiniteLatents(RuntimeError):
    """A request's latents came out with NaN or infinite values."""

    def __init__(self):
        super().__init__("the DiT produced non-finite latents")


def run_key(schedule: Schedule) -> tuple:
    """Plans whose schedules have equal keys can share a sampler run: one grid, one guidance mode."""
    return tuple(schedule.grid.tolist()), schedule.guided


def sampler_runs(schedules: list[Schedule], max_rows: int, shapes: list | None = None,
                 limits: list[int] | None = None) -> list[list[int]]:
    """Indices of the schedules grouped into runs: those of one `run_key`, in order, at most
    `max_rows` a run; runs ordered by their first index (the oldest request's run goes first).

    With `shapes` (each plan's bucket), only plans of one bucket share a run, at most
    `limits[i]` of them (what the bucket holds)."""
    groups: dict[tuple, list[list[int]]] = {}
    runs: list[list[int]] = []
    for index, schedule in enumerate(schedules):
        key = run_key(schedule) if shapes is None else (run_key(schedule), shapes[index])
        limit = max_rows if limits is None else min(max_rows, limits[index])
        chunks = groups.setdefault(key, [])
        if not chunks or len(chunks[-1]) >= limit:
            chunks.append([])
            runs.append(chunks[-1])
        chunks[-1].append(index)
    return runs


def euler_integrate(
    velocity,
    x: torch.Tensor,
    grid: torch.Tensor,
    cfg,
    should_stop: Callable[[], bool] | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Explicit Euler over the grid. velocity(x, t) returns [cond; uncond] rows when guided.

    x is the fp32 accumulator. As in the reference revisions, the guidance combination
    and dt * v are formed in the velocity's dtype (bf16 under autocast) and then added
    into fp32 x. `cfg` is a number or per-row scales [B, 1, 1]. `mask` [B, n], when
    given, marks a batch's valid frames: the padded ones stay zero. `should_stop`, when
    given, is asked before every step but the first; once it answers True,
    SamplingStopped names the step.

    The grid stays on the CPU: velocity() gets its times as CPU scalars (a graphed step
    looks its modulation up by them without reading the GPU back), and dt, a 0-d CPU fp32
    tensor, multiplies a GPU velocity exactly as a 0-d GPU tensor would.
    """
    grid = grid.to(device="cpu", dtype=torch.float32)
    guided = bool((torch.as_tensor(cfg) >= CFG_MIN).all())
    steps = grid.numel() - 1
    for i in range(steps):
        if i and should_stop is not None and should_stop():
            raise SamplingStopped(f"before step {i + 1} of {steps}")
        v = velocity(x, grid[i])
        if guided:
            v_cond, v_uncond = v.chunk(2, dim=0)
            v = cfg_combine(v_cond, v_uncond, cfg)
        if mask is not None:
            v = v.masked_fill(~mask[..., None], 0.0)
        x = x + (grid[i + 1] - grid[i]) * v
    return x


def initial_noise(frames: int, channels: int, seed: int | None, device) -> torch.Tensor:
    """[1, frames, channels] standard normal in fp32, from a generator on `device` seeded with `seed`."""
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(int(seed))
    return torch.randn(frames, channels, generator=generator, device=device, dtype=torch.float32)[None]


# --------------------------------------------------------------------------- the sampler


@dataclass(frozen=True)
class Request:
    """One generation request, already parsed. Tensors may live on any device."""

    prompt_embeds: torch.Tensor  # [nt, T] (a leading batch axis of 1 is dropped)
    gen_seconds: float | None
    seed: int | None
    num_steps: int | None = None
    guidance: float | None = None
    sway: float | None = None
    ref_latents: torch.Tensor | None = None  # [np, C], normalized
    t_grid: tuple | None = None


@dataclass(frozen=True)
class Plan:
    """A checked request (`AuKDiTSampler.plan`): what `generate` runs."""

    text: torch.Tensor  # [nt, T]
    ref: torch.Tensor | None  # [np, C], or None
    frames: int  # target frames
    schedule: Schedule
    seed: int | None


class AuKDiTSampler:
    """The DiT plus its sampler: text condition (+ optional reference) -> normalized latents [n, C]."""

    def __init__(
        self,
        transformer: AuKTransformer,
        config: dict,
        device="cpu",
        dtype=torch.float32,
        max_frames: int | None = None,
        max_graphs: int = 0,
        buckets: ShapeBuckets | None = None,
        compile: CompileOptions | None = None,
        fp8_linears: bool = False,
    ):
        # The blocks' token linears in FP8 (fp8.py), in place: an option, off by default.
        if fp8_linears:
            check_fp8_support(device, dtype)
        self.fp8_linear_count = use_fp8_linears(transformer, dtype) if fp8_linears else 0
        self.model = transformer
        self.max_frames = max_frames  # a serving limit on reference + target, below MAX_LATENT_FRAMES
        self.device = torch.device(device)
        self.dtype = dtype
        # Runs padded up to these shapes (any device); None: to their longest row.
        self.buckets = buckets
        # CUDA graphs of the velocity step (CUDA only): the buckets' from `warmup`, through the
        # compiled blocks when `compile` is given, and the last `max_graphs` other shapes
        # (0: those step eagerly). Neither: every step eager.
        self.graphs = None
        if self.device.type == "cuda" and (max_graphs or buckets is not None):
            blocks = EAGER_BLOCKS if compile is None else compiled_blocks(compile)
            self.graphs = DiTGraphCache(transformer, self._autocast, max_graphs, blocks)
        self.policy = SchedulePolicy(config)
        vae = config["vae"]
        self.sample_rate = int(vae.get("target_sample_rate", 24000))
        self.hop = int(vae.get("downsample_rate", 480))
        self.frame_rate = self.sample_rate / self.hop
        self.latent_dim = transformer.latent_dim
        self.text_dim = transformer.text_hidden_dim
        self._tables: OrderedDict[tuple[float, ...], ModulationTable] = OrderedDict()
        # Runs' masks, rotary tables and key biases by their rows' padding (_batch_context).
        self._masks: OrderedDict[tuple, ContextMasks] = OrderedDict()
        # Buckets whose graphs are built after the service is ready, the thread that builds
        # them, and what is served meanwhile: runs on a larger bucket, and runs beyond those
        # the same requests would take with every graph built (a bucket's batched graphs not
        # built yet splits its requests into runs of one).
        self._deferred = DeferredBuckets(buckets) if buckets is not None else None
        self._builder = GraphBuilder("auk-dit-graph-builder")
        self.pending_runs = 0
        self.split_runs = 0

    @classmethod
    def from_checkpoint(cls, checkpoint_dir, device="cpu", dtype=torch.float32, **kwargs) -> "AuKDiTSampler":
        config = read_config(checkpoint_dir)
        SchedulePolicy(config)  # refuse a bad flash config before reading 3-6 GB of weights
        return cls(load_transformer(checkpoint_dir, device, dtype), config, device, dtype, **kwargs)

    @property
    def variant(self) -> str:
        return self.policy.variant

    def _autocast(self):
        if self.dtype in (torch.bfloat16, torch.float16):
            # No cast cache: the weights already are in this dtype, and graph capture forbids it.
            return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=False)
        return contextlib.nullcontext()

    def target_frames(self, gen_seconds: float | None, ref_frames: int) -> int:
        if gen_seconds is None:
            if ref_frames == 0:
                raise ValueError("a request without a reference clip needs a duration")
            frames = ref_frames
        else:
            if not math.isfinite(gen_seconds) or gen_seconds <= 0:
                raise ValueError(f"the duration must be a positive number of seconds, got {gen_seconds}")
            frames = max(1, math.ceil(gen_seconds * self.sample_rate / self.hop))
        budget = MAX_LATENT_FRAMES - ref_frames
        if budget < 1:
            raise ValueError(
                f"the reference has {ref_frames} frames: no room for a target under MAX_LATENT_FRAMES={MAX_LATENT_FRAMES}"
            )
        if self.max_frames is not None and ref_frames + frames > self.max_frames:
            raise ValueError(
                f"{ref_frames} reference + {frames} target frames exceed this model's max_frames of "
                f"{self.max_frames} ({self.max_frames / self.frame_rate:.0f} s of audio)"
            )
        if frames > budget:
            log.warning("target of %d frames clamped to %d (MAX_LATENT_FRAMES=%d)", frames, budget, MAX_LATENT_FRAMES)
            frames = budget
        return frames

    def _check_inputs(self, req: Request) -> tuple[torch.Tensor, torch.Tensor | None]:
        text = req.prompt_embeds
        if text.dim() == 3 and text.shape[0] == 1:
            text = text[0]
        if text.dim() != 2 or text.shape[1] != self.text_dim or text.shape[0] < 1:
            raise ValueError(f"prompt embeddings must be [tokens >= 1, {self.text_dim}], got {list(text.shape)}")
        if not bool(torch.isfinite(text).all()):
            raise ValueError("prompt embeddings must be finite")
        ref = req.ref_latents
        if ref is not None:
            if ref.dim() == 3 and ref.shape[0] == 1:
                ref = ref[0]
            if ref.dim() != 2 or ref.shape[1] != self.latent_dim:
                raise ValueError(f"reference latents must be [frames, {self.latent_dim}], got {list(ref.shape)}")
            if not bool(torch.isfinite(ref).all()):
                raise ValueError("reference latents must be finite")
            if ref.shape[0] == 0:
                ref = None
        return text, ref

    def plan(self, req: Request) -> "Plan":
        """Check a request without running it; ValueError names what is wrong."""
        text, ref = self._check_inputs(req)
        frames = self.target_frames(req.gen_seconds, 0 if ref is None else ref.shape[0])
        schedule = self.policy.resolve(req.num_steps, req.guidance, req.sway, req.t_grid)
        return Plan(text, ref, frames, schedule, req.seed)

    def own_bucket(self, plan: Plan) -> RunShape | None:
        """The bucket a plan fits; None without buckets or past the largest."""
        if self.buckets is None:
            return None
        return self.buckets.shape(plan.text.shape[0], plan.frames, 0 if plan.ref is None else plan.ref.shape[0])

    def bucket(self, plan: Plan) -> RunShape | None:
        """The bucket a plan's run is padded up to: its own, or while that one's graphs are
        still being built (`start_deferred`), the smallest built bucket that holds it."""
        shape = self.own_bucket(plan)
        return shape if self._deferred is None else self._deferred.served_shape(shape, plan.schedule.guided)

    def runs(self, plans: list[Plan], max_requests: int) -> list[list[int]]:
        """Indices of the plans grouped into sampler runs, oldest request's run first: one
        `run_key` a run, at most `max_requests` plans. With buckets, one bucket a run, as many
        as its built graphs take; a plan past the largest bucket runs alone. The builder is
        asked first for the graphs these plans' own buckets lack (`DeferredBuckets.wanted`)."""
        schedules = [plan.schedule for plan in plans]
        if self.buckets is None:
            return sampler_runs(schedules, max_requests)
        self.take_built_graphs()
        own = [self.own_bucket(plan) for plan in plans]
        guided = [plan.schedule.guided for plan in plans]

        def limits(shapes, built):
            return [self._limit(shape, g, built) for shape, g in zip(shapes, guided)]

        whole = sampler_runs(schedules, max_requests, own, limits(own, built=False))
        if not len(self._deferred):
            return whole
        self.ask_for_graphs(zip(own, guided))
        shapes = [self.bucket(plan) for plan in plans]
        runs = sampler_runs(schedules, max_requests, shapes, limits(shapes, built=True))
        self.split_runs += max(0, len(runs) - len(whole))
        return runs

    def run_limit(self, shape: RunShape | None, guided: bool, max_requests: int) -> int:
        """The most requests of bucket `shape` that one velocity call takes now (joined.py), at
        most `max_requests`: all the bucket holds, or while its graphs are built after READY, as
        many as those built take (at least one: a larger bucket serves it meanwhile); one past
        the largest bucket."""
        if self.buckets is None:
            return max_requests
        return min(max_requests, self._limit(shape, guided, built=True))

    def ask_for_graphs(self, requests: Iterable[tuple[RunShape | None, bool]]) -> None:
        """Ask the builder first for what these requests' own buckets (and guidance modes), one
        entry a request, lack (`DeferredBuckets.wanted`)."""
        if self._deferred is not None and len(self._deferred):
            for item in self._deferred.wanted(requests):
                self._builder.prefer(item)

    def _limit(self, shape: RunShape | None, guided: bool, built: bool) -> int:
        """The most requests a run of this bucket takes: all it holds, or (`built`) as many as
        its graphs built so far take; one past the largest bucket."""
        if shape is None:
            return 1
        most = self.buckets.requests(shape, guided)
        return max(1, min(most, self._deferred.holds(shape, guided))) if built else most

    def generate(self, req: "Request | Plan", should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Normalized latents [n, C] in fp32. The same request and seed give the same latents.

        `should_stop`, when given, is asked before any work and between Euler steps; once
        it answers True, generate raises SamplingStopped.
        """
        plan = req if isinstance(req, Plan) else self.plan(req)
        result = self.generate_batch([plan], [should_stop])[0]
        if isinstance(result, Exception):
            raise result
        return result

    @torch.inference_mode()
    def generate_batch(
        self, plans: list[Plan], should_stop: list[Callable[[], bool] | None] | None = None
    ) -> list[torch.Tensor | Exception]:
        """One sampler run over several plans of one `run_key`: per plan, its latents [n, C]
        (fp32) or the exception that ended that row (SamplingStopped, or RuntimeError for
        non-finite latents). An error of the run itself (out of memory) is raised.

        `should_stop[i]` is asked for row i before any work and between Euler steps; a
        stopped row stays in the run (its shape is the graph's) and its result is
        SamplingStopped; the run ends early once every row has stopped.
        """
        if not plans:
            return []
        keys = {run_key(plan.schedule) for plan in plans}
        if len(keys) != 1:
            raise ValueError("plans with different time grids or guidance modes cannot share a sampler run")
        schedule = plans[0].schedule
        checks = list(should_stop or [None] * len(plans))
        stopped: list[Exception | None] = [None] * len(plans)

        def ask(where: str) -> bool:
            """Ask the rows still running; True once every row has stopped."""
            for i, check in enumerate(checks):
                if stopped[i] is None and check is not None and check():
                    stopped[i] = SamplingStopped(where)
            return all(s is not None for s in stopped)

        if ask("before sampling"):
            return list(stopped)
        self.take_built_graphs()
        ctx, noise, mask = self._batch_context(plans, schedule.guided)
        ctx.modulation = self.modulation_table(schedule.grid)

        def eager(x, t):
            with self._autocast():
                return self.model.step(x, t, ctx)

        graphed = None if self.graphs is None else self.graphs.velocity(ctx, noise.shape)
        velocity = eager if graphed is None else graphed
        cfg = schedule.cfg
        if schedule.guided and len(plans) > 1:
            cfg = torch.tensor([p.schedule.cfg for p in plans], dtype=torch.float32, device=self.device)[:, None, None]
        steps = schedule.steps
        asked = itertools.count(2)  # euler_integrate asks before steps 2, 3, ...
        try:
            x = euler_integrate(velocity, noise, schedule.grid, cfg,
                                lambda: ask(f"before step {next(asked)} of {steps}"), mask)
        except SamplingStopped:  # every row has stopped
            return list(stopped)
        results: list[torch.Tensor | Exception] = []
        for plan, row, stop in zip(plans, x.float(), stopped):
            latents = row[: plan.frames]
            if stop is not None:
                results.append(stop)
            elif not bool(torch.isfinite(latents).all()):
                results.append(NonFiniteLatents())
            else:
                results.append(latents)
        return results

    def _batch_context(self, plans: list[Plan], guided: bool, shape: RunShape | None = None,
                       states: list[torch.Tensor | None] | None = None):
        """The run's DiT context (without its grid's modulation table: `modulation_table`),
        its initial noise [B, n, C] and its target mask [B, n] (None when nothing is padded).

        Every row is padded at its end to the longest prompt, reference and target (with
        buckets, to the run's bucket), and masked (key masks, squeezed rotary positions,
        re-zeroed conv padding): no padded frame or token reaches a valid one. Unpadded rows
        (and a run of one without buckets) take no masks, exactly as a request alone; a
        bucketed run is always masked, so that every run of a bucket has one graph's
        structure. A row without a reference among rows with one gets a reference of masked
        frames, which no valid position sees either. `shape` pads to that bucket (a warm-up's),
        not to the one that serves the run now. `states[i]`, when given, is row i's state [frames,
        C] part-way through its grid (joined.py), in place of its initial noise. The masks, rotary
        tables and key biases of a run of one request (not a warm-up's) are kept by its padding and
        shared by the runs that have it: read only (a graph copies them into buffers of its own)."""
        device, B = self.device, len(plans)
        nt = max(p.text.shape[0] for p in plans)
        n = max(p.frames for p in plans)
        refs = [p.ref for p in plans]
        np_ = max((r.shape[0] for r in refs if r is not None), default=0)
        padded = any(p.text.shape[0] != nt or p.frames != n for p in plans) or (
            np_ > 0 and any(r is None or r.shape[0] != np_ for r in refs)
        )
        # Kept for a run of one request (a lone request's first step waits on its context); not
        # for a warm-up, whose context (`shape`) becomes its graphs' buffers.
        shared = shape is None and B == 1
        if shape is None and self.buckets is not None:
            natural = self.buckets.shape(nt, n, np_)
            shape = self._deferred.served_shape(natural, guided, B)
            self.pending_runs += shape != natural
        if shape is not None:
            nt, n, np_, padded = shape.text, shape.frames, shape.ref, True
        lengths = tuple((p.text.shape[0], p.frames, None if p.ref is None else p.ref.shape[0]) for p in plans)
        key = (guided, nt, n, np_, padded, lengths)
        masks = self._masks.get(key) if shared else None
        text = torch.zeros(B, nt, self.text_dim, dtype=self.dtype, device=device)
        noise = torch.zeros(B, n, self.latent_dim, dtype=torch.float32, device=device)
        ref = torch.zeros(B, np_, self.latent_dim, dtype=torch.float32, device=device) if np_ else None
        for i, plan in enumerate(plans):
            text[i, : plan.text.shape[0]] = plan.text.to(device=device, dtype=self.dtype)
            # Each row's own noise from its own seed, zero-padded: independent of the batch.
            state = None if states is None else states[i]
            if state is None:
                state = initial_noise(plan.frames, self.latent_dim, plan.seed, device)[0]
            noise[i, : plan.frames] = state
            if plan.ref is not None:
                ref[i, : plan.ref.shape[0]] = plan.ref.to(device=device, dtype=torch.float32)
        with self._autocast():
            if masks is None:
                masks = self._context_masks(plans, guided, nt, n, np_, padded)
                if shared:
                    self._masks[key] = masks
                    while len(self._masks) > CONTEXT_MASKS_KEPT:
                        self._masks.popitem(last=False)
            else:
                self._masks.move_to_end(key)
            ctx = self.model.prepare(text, n, ref=ref, cfg_infer=guided, masks=masks)
        return ctx, noise, masks.target_mask

    def _context_masks(self, plans: list[Plan], guided: bool, nt: int, n: int, np_: int, padded: bool):
        """The masks, rotary tables and key biases of a run whose rows are padded to these shapes
        (`_batch_context`): each row valid up to its own lengths."""
        B, device = len(plans), self.device
        c_mask = torch.zeros(B, nt, dtype=torch.bool, device=device)
        mask = torch.zeros(B, n, dtype=torch.bool, device=device) if padded else None
        ref_mask = torch.zeros(B, np_, dtype=torch.bool, device=device) if np_ and padded else None
        for i, plan in enumerate(plans):
            c_mask[i, : plan.text.shape[0]] = True
            if mask is not None:
                mask[i, : plan.frames] = True
            if ref_mask is not None and plan.ref is not None:
                ref_mask[i, : plan.ref.shape[0]] = True
        return self.model.context_masks(c_mask, n, np_, ref_mask=ref_mask, mask=mask, cfg_infer=guided)

    def modulation_table(self, grid: torch.Tensor) -> ModulationTable:
        """The modulation of every step of a time grid (CPU), computed on its first run and kept
        (MODULATION_TABLES_KEPT): it depends on the grid and the weights alone."""
        key = tuple(grid.tolist())
        table = self._tables.get(key)
        if table is None:
            with self._autocast():
                # The grid's last point is never a step's time.
                table = self._tables[key] = self.model.modulation_table(grid[:-1])
            while len(self._tables) > MODULATION_TABLES_KEPT:
                self._tables.popitem(last=False)
        self._tables.move_to_end(key)
        return table

    @torch.inference_mode()
    def warmup(self, on_bucket: Callable[[RunShape, bool, int, float], None] | None = None,
               defer: bool = False) -> list[DeferredGraphs]:
        """Capture the step of every bucket for each request count it holds, guided and not (a
        flash checkpoint never guides), compiling it first when the step is compiled. With
        `defer`, only the `ready_buckets`, and return the rest's graphs in the order
        `start_deferred` builds them (`DeferredBuckets.build_order`).

        Meant for service start: afterwards a run of a bucket replays a graph, and nothing is
        captured or compiled at request time. `on_bucket(shape, guided, graphs, seconds)` is
        told about each bucket and guidance mode as it finishes. CUDA with buckets only."""
        if self.graphs is None or self.buckets is None:
            return []
        now = self.ready_buckets() if defer else None
        self.graphs.reserve_modulation(max(self.buckets.requests(shape, guided) * (2 if guided else 1)
                                           for shape in self.buckets.shapes() for guided in self._guided_modes()),
                                       self.device)
        pending = []
        for shape in self.buckets.shapes():
            for guided in self._guided_modes():
                if now is not None and (shape, guided) not in now:
                    pending.append((shape, guided))
                    continue
                began = time.perf_counter()
                captured = self.graphs.warmup(*self._warmup_inputs(shape, guided))
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                if on_bucket is not None:
                    on_bucket(shape, guided, captured, time.perf_counter() - began)
        # From now on their runs take a larger bucket, never a capture.
        return self._deferred.build_order(pending)

    def ready_buckets(self) -> set[tuple[RunShape, bool]]:
        """The buckets a deferred warm-up builds before the service is ready: for each guidance
        mode, the largest prompt and target with no reference and with each reference size,
        so that every request in the buckets has a built bucket that holds it."""
        if self.buckets is None:
            return set()
        text, frames = self.buckets.text[-1], self.buckets.frames[-1]
        return {(RunShape(text, frames, ref), guided)
                for ref in (0, *self.buckets.ref) for guided in self._guided_modes()}

    def start_deferred(self, pending: list[DeferredGraphs],
                       on_done: Callable[[BuildReport], None] | None = None,
                       begin_when: Callable[[], bool] | None = None) -> None:
        """Build `pending` (what `warmup(defer=True)` left) on a thread of its own, beside the
        serving thread, which takes each item's graphs over at its next run; with
        `begin_when`, once it holds. A run that lacks its own graphs asks for them first
        (`runs`). `on_done(report)` is called on the builder's thread at the end (not when
        stopped)."""
        inputs = {}  # a bucket's graphs all read the front of one set of buffers, its largest run's

        def build(item: DeferredGraphs):
            key = (item.shape, item.guided)
            with torch.inference_mode():  # as warmup and the runs: their buffers are inference tensors
                if key not in inputs:
                    inputs[key] = self._warmup_inputs(item.shape, item.guided)
                steps = self.graphs.bucket_graphs(*inputs[key], requests=item.requests, beside_serving=True,
                                                  stopping=lambda: self._builder.stopping)
            if item.requests[-1] == self.buckets.requests(item.shape, item.guided):  # the bucket's last part
                del inputs[key]
            return steps

        self._builder.start(pending, build, self.device, on_done=on_done, begin_when=begin_when, count=len,
                            describe=lambda item: f"the graphs of bucket {item.shape} for {item.requests} requests "
                                                  f"({'' if item.guided else 'un'}guided)")

    def stop_deferred(self, timeout_s: float = 30.0) -> None:
        """Stop building deferred graphs after the part in progress, and wait for that."""
        self._builder.stop(timeout_s)

    @property
    def deferred_pending(self) -> int:
        """Buckets (and guidance modes) whose graphs the serving thread has not all taken over yet."""
        return 0 if self._deferred is None else len(self._deferred)

    def take_built_graphs(self) -> None:
        """Serve the graphs built since the last run (on the serving thread, the only one that
        reads or changes the graph tables). Graphs that failed stay pending: their runs keep a
        larger bucket, or runs of fewer requests."""
        for item, steps in self._builder.take():
            if steps is not None:
                self.graphs.install(steps)
                self._deferred.serve(item, (step.x.shape[0] for step in steps.values()))

    def _guided_modes(self) -> tuple[bool, ...]:
        return (False,) if self.variant == "flash" else (False, True)

    def _warmup_inputs(self, shape: RunShape, guided: bool):
        """A warm-up's context and state: the bucket filled with as many placeholder requests as it holds."""
        plan = self._placeholder_plan(shape, guided)
        ctx, noise, _ = self._batch_context([plan] * self.buckets.requests(shape, guided), guided, shape)
        return ctx, noise

    def _placeholder_plan(self, shape: RunShape, guided: bool) -> Plan:
        """A plan that fills a bucket exactly: what warmup captures with (its values do not matter)."""
        ref = torch.zeros(shape.ref, self.latent_dim) if shape.ref else None
        schedule = Schedule(time_grid(1), DEFAULTS["cfg"] if guided else 0.0)
        return Plan(torch.zeros(shape.text, self.text_dim), ref, shape.frames, schedule, seed=0)


def load_sampler(checkpoint_dir, device="cpu", dtype=None, **kwargs) -> AuKDiTSampler:
    """The sampler for a checkpoint directory; bf16 weights on CUDA and fp32 on the CPU unless told.

    kwargs go to AuKDiTSampler (max_frames, max_graphs, buckets, compile, fp8_linears).
    """
    device = torch.device(device)
    if device.type == "cuda":
        without_gemm_workspace()  # before the process's first product (gemm_workspace.py)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return AuKDiTSampler.from_checkpoint(Path(checkpoint_dir), device, dtype, **kwargs)
