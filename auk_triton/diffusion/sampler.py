"""Rectified-flow sampling with the AuK DiT: time grid, Euler steps, guidance, request limits.

A request the sampler cannot run (a bad duration, grid, shape or value, past a
frame limit) raises ValueError naming the problem, before any work: `plan()`
makes every such check, so a server can validate a request with it and then
`generate()` the plan. `generate(plan, should_stop=...)` asks before any work and
between Euler steps whether to go on, and raises SamplingStopped once told to stop
(a server passes "has this request's client gone?").

t = 0 is pure noise and the last grid point is the clean latent; the DiT's
velocity points from noise towards data, so each step is
`x <- x + (t[i+1] - t[i]) * v(x, t[i])`, integrating forward in t.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .step_graph import DiTGraphCache
from .transformer import AuKTransformer, CheckpointError, load_transformer, read_config

log = logging.getLogger(__name__)

# Reference + target frames together (about 1310.7 s at 50 Hz).
MAX_LATENT_FRAMES = 65536
# Guidance below this runs the conditional branch alone.
CFG_MIN = 1e-5
FLASH_STEPS = 4
# The released sampling defaults (steps, guidance, sway) where a checkpoint states none.
DEFAULTS = {"nfe": 32, "cfg": 2.0, "sway": -1.0}


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


def cfg_combine(v_cond: torch.Tensor, v_uncond: torch.Tensor, cfg: float) -> torch.Tensor:
    """v = v_c + cfg * (v_c - v_u): cfg = 2 weighs the conditional branch 3 and the unconditional -2."""
    return v_cond + cfg * (v_cond - v_uncond)


class SamplingStopped(RuntimeError):
    """`generate` stopped before its end because `should_stop` said so."""


def euler_integrate(
    velocity, x: torch.Tensor, grid: torch.Tensor, cfg: float, should_stop: Callable[[], bool] | None = None
) -> torch.Tensor:
    """Explicit Euler over the grid. velocity(x, t) returns [cond; uncond] rows when guided.

    x is the fp32 accumulator. As in the reference revisions, the guidance combination
    and dt * v are formed in the velocity's dtype (bf16 under autocast) and then added
    into fp32 x. `should_stop`, when given, is asked before every step but the first;
    once it answers True, SamplingStopped names the step.
    """
    grid = grid.to(device=x.device, dtype=torch.float32)
    guided = cfg >= CFG_MIN
    steps = grid.numel() - 1
    for i in range(steps):
        if i and should_stop is not None and should_stop():
            raise SamplingStopped(f"before step {i + 1} of {steps}")
        v = velocity(x, grid[i])
        if guided:
            v_cond, v_uncond = v.chunk(2, dim=0)
            v = cfg_combine(v_cond, v_uncond, cfg)
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
    ):
        self.model = transformer
        self.max_frames = max_frames  # a serving limit on reference + target, below MAX_LATENT_FRAMES
        self.device = torch.device(device)
        self.dtype = dtype
        # CUDA graphs of the velocity step, per request shape (CUDA only; 0 = eager).
        self.graphs = None
        if max_graphs and self.device.type == "cuda":
            self.graphs = DiTGraphCache(transformer, self._autocast, max_graphs)
        self.policy = SchedulePolicy(config)
        vae = config["vae"]
        self.sample_rate = int(vae.get("target_sample_rate", 24000))
        self.hop = int(vae.get("downsample_rate", 480))
        self.frame_rate = self.sample_rate / self.hop
        self.latent_dim = transformer.latent_dim
        self.text_dim = transformer.text_hidden_dim

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

    @torch.inference_mode()
    def generate(self, req: "Request | Plan", should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Normalized latents [n, C] in fp32. The same request and seed give the same latents.

        `should_stop`, when given, is asked before any work and between Euler steps; once
        it answers True, generate raises SamplingStopped.
        """
        plan = req if isinstance(req, Plan) else self.plan(req)
        if should_stop is not None and should_stop():
            raise SamplingStopped("before sampling")
        text, ref, frames, schedule = plan.text, plan.ref, plan.frames, plan.schedule
        device = self.device
        text = text.to(device=device, dtype=self.dtype)[None]
        if ref is not None:
            ref = ref.to(device=device, dtype=torch.float32)[None]
        c_mask = torch.ones(text.shape[:2], dtype=torch.bool, device=device)
        with self._autocast():
            ctx = self.model.prepare(text, frames, c_mask=c_mask, ref=ref, cfg_infer=schedule.guided)
        noise = initial_noise(frames, self.latent_dim, plan.seed, device)

        def eager(x, t):
            with self._autocast():
                return self.model.step(x, t, ctx)

        graphed = None if self.graphs is None else self.graphs.velocity(ctx, noise.shape)
        velocity = eager if graphed is None else graphed
        latents = euler_integrate(velocity, noise, schedule.grid, schedule.cfg, should_stop).float()[0]
        if not bool(torch.isfinite(latents).all()):
            raise RuntimeError("the DiT produced non-finite latents")
        return latents


def load_sampler(checkpoint_dir, device="cpu", dtype=None, **kwargs) -> AuKDiTSampler:
    """The sampler for a checkpoint directory; bf16 weights on CUDA and fp32 on the CPU unless told.

    kwargs go to AuKDiTSampler (max_frames, max_graphs).
    """
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return AuKDiTSampler.from_checkpoint(Path(checkpoint_dir), device, dtype, **kwargs)
