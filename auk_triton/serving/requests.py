"""Checking one request's inputs at the serving edge: a bad request gets its own error.

A `RequestError` is the client's mistake: its message goes back to that client and
the model keeps serving. A `RequestCancelled` stops the work of a request whose
client is gone; a `ServerStopping` ends one the model cannot finish before it goes
away. Nothing here needs the Triton stub.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from auk_triton.diffusion import AuKDiTSampler, Plan, Request


class RequestError(ValueError):
    """A request the model refuses; its message goes back to the client."""


class RequestCancelled(Exception):
    """The request's client is gone (it cancelled, or timed out): the model stops its work."""


class ServerStopping(RuntimeError):
    """The model goes away (the server stops, or unloads it) before the request's end: the
    client may send it again, to another server."""


# ---- the decoders ---------------------------------------------------------------------------


def validate_latents(
    array: np.ndarray | None, latent_dim: int, max_frames: int, frame_rate: float, check_finite: bool = True
) -> np.ndarray:
    """Check one request's LATENTS; return it as a C-contiguous float32 [frames, latent_dim] array.

    `check_finite=False` leaves `require_finite` to the caller, who may run it
    while the GPU decodes."""
    if array is None:
        raise RequestError("the request has no LATENTS input")
    if array.dtype != np.float32:
        raise RequestError(f"LATENTS is {array.dtype.name}; this model takes FP32 (float32) latents")
    if array.ndim != 2:
        raise RequestError(
            f"LATENTS has shape {list(array.shape)}; this model takes one clip as [frames, {latent_dim}]"
        )
    frames, width = array.shape
    if width != latent_dim:
        raise RequestError(f"LATENTS has {width} channels per frame; this model decodes {latent_dim}")
    if frames < 1:
        raise RequestError("LATENTS has zero frames; send at least one frame")
    if frames > max_frames:
        raise RequestError(
            f"LATENTS has {frames} frames, more than this model's max_frames of {max_frames} "
            f"({max_frames / frame_rate:.0f} s of audio); split the clip"
        )
    if check_finite:
        require_finite(array)
    return np.ascontiguousarray(array)


def require_finite(array: np.ndarray) -> None:
    """Raise RequestError naming LATENTS' NaN and infinite values, if it has any."""
    finite = np.isfinite(array)
    if not finite.all():
        bad_frame = int(np.argmin(finite.all(axis=1)))
        nans = int(np.isnan(array).sum())
        infs = int(np.isinf(array).sum())
        raise RequestError(
            f"LATENTS holds {nans} NaN and {infs} infinite values (the first in frame {bad_frame}); "
            "every value must be finite"
        )


# ---- the diffusion model --------------------------------------------------------------------


def _typed(read: Callable[[str], np.ndarray | None], name: str, dtype, rank: int | None, required: bool = True):
    """Input `name` as an array of `dtype` and `rank` dimensions (None: one value); None when
    it is optional and absent."""
    array = read(name)
    if array is None:
        if required:
            raise RequestError(f"the request has no {name} input")
        return None
    if array.dtype != dtype:
        raise RequestError(f"{name} is {array.dtype.name}; this model takes {np.dtype(dtype).name}")
    if rank is None:
        if array.size != 1:
            raise RequestError(f"{name} must hold one value, got shape {list(array.shape)}")
        return array.reshape(-1)[0]
    if array.ndim != rank:
        raise RequestError(f"{name} must have {rank} dimensions, got shape {list(array.shape)}")
    return array


def _seconds(value: np.float32) -> float:
    # The FP32 a client sent for "0.1" is 0.100000001...; read it back as the decimal it
    # stands for, so that 0.1 s is 5 frames and not ceil(5.0000001) = 6.
    return float(str(np.float32(value)))


def dit_plan(
    sampler: AuKDiTSampler, read: Callable[[str], np.ndarray | None], max_steps: int,
    max_prompt_tokens: int | None = None,
) -> Plan:
    """Check an `auk_dit` request (`read(name)`: the input's array, or None) and plan it."""
    text = _typed(read, "PROMPT_EMBEDS", np.float32, 2)
    if max_prompt_tokens is not None and text.shape[0] > max_prompt_tokens:
        raise RequestError(
            f"PROMPT_EMBEDS has {text.shape[0]} tokens; this model takes at most {max_prompt_tokens} (max_prompt_tokens)"
        )
    seconds = _typed(read, "GEN_SECONDS", np.float32, None)
    seed = _typed(read, "SEED", np.int64, None)
    steps = _typed(read, "NUM_STEPS", np.int32, None, required=False)
    guidance = _typed(read, "GUIDANCE", np.float32, None, required=False)
    sway = _typed(read, "SWAY", np.float32, None, required=False)
    ref = _typed(read, "REF_LATENTS", np.float32, 2, required=False)
    # A flash checkpoint runs its fixed recipe whatever NUM_STEPS says: no step count to limit.
    if steps is not None and steps > max_steps and sampler.variant != "flash":
        raise RequestError(f"NUM_STEPS is {int(steps)}; this model runs at most {max_steps} (max_steps)")
    request = Request(
        prompt_embeds=torch.from_numpy(np.ascontiguousarray(text)),
        gen_seconds=_seconds(seconds),
        seed=int(seed),
        num_steps=None if steps is None else int(steps),
        guidance=None if guidance is None else float(guidance),
        sway=None if sway is None else float(sway),
        ref_latents=None if ref is None else torch.from_numpy(np.ascontiguousarray(ref)),
    )
    try:
        return sampler.plan(request)
    except ValueError as err:  # the sampler's own limits: planning does no work, so it is the request
        raise RequestError(str(err)) from None
