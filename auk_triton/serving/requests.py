"""Checking one request's inputs at the serving edge: a bad request gets its own error.

A `RequestError` (errors.py) is the client's mistake: its message goes back to that
client and the model keeps serving. Nothing here needs the Triton stub.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from auk_triton.diffusion import AuKDiTSampler, Plan, Request

from .errors import RequestError


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


# ---- the encoder -----------------------------------------------------------------------------


def validate_audio(array: np.ndarray | None, hop: int, max_frames: int, sample_rate: int) -> np.ndarray:
    """Check one request's AUDIO (mono samples at the codec's rate); return it cut to whole
    frames (the reference pipeline's truncation) as a C-contiguous float32 [samples] array."""
    if array is None:
        raise RequestError("the request has no AUDIO input")
    if array.dtype != np.float32:
        raise RequestError(f"AUDIO is {array.dtype.name}; this model takes FP32 (float32) samples")
    if array.ndim != 1:
        raise RequestError(
            f"AUDIO has shape {list(array.shape)}; this model takes one mono clip as [samples] "
            f"(mix the channels down first)"
        )
    samples = array.shape[0]
    if samples < hop:
        raise RequestError(
            f"AUDIO has {samples} samples, fewer than one frame of {hop} ({hop / sample_rate * 1e3:g} ms at "
            f"{sample_rate} Hz); send at least {hop}"
        )
    if samples > max_frames * hop:
        raise RequestError(
            f"AUDIO has {samples} samples ({samples / sample_rate:.1f} s), more than this model's max_frames "
            f"of {max_frames} ({max_frames * hop} samples, {max_frames * hop / sample_rate:.0f} s); split the clip"
        )
    finite = np.isfinite(array)
    if not finite.all():
        first = int(np.argmin(finite))
        raise RequestError(
            f"AUDIO holds {int(np.isnan(array).sum())} NaN and {int(np.isinf(array).sum())} infinite samples "
            f"(the first at sample {first}); every sample must be finite"
        )
    return np.ascontiguousarray(array[: samples - samples % hop])


def optional_seed(array: np.ndarray | None, name: str = "SEED") -> int | None:
    """An optional INT64 [1] seed input as an int; None when the request leaves it out."""
    return None if array is None else int(_typed(lambda _: array, name, np.int64, None))


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


def one_row(read: Callable[[str], np.ndarray | None]) -> Callable[[str], np.ndarray | None]:
    """A reader of a batching model's request (every input [1, ...]) that drops the batch axis.

    `auk_dit` batches requests with Triton's dynamic batcher, which gives each input a
    leading batch axis; a request carries one clip, so that axis must be 1."""

    def read_row(name: str) -> np.ndarray | None:
        array = read(name)
        if array is None:
            return None
        if array.ndim == 0 or array.shape[0] != 1:
            raise RequestError(
                f"{name} has shape {list(array.shape)}: a request carries one clip, with a batch axis of 1 "
                "(send more clips as more requests: the model batches them)"
            )
        return array[0]

    return read_row


def dit_plan(
    sampler: AuKDiTSampler, read: Callable[[str], np.ndarray | None], max_steps: int,
    max_prompt_tokens: int | None = None,
) -> Plan:
    """Check an `auk_dit` request (`read(name)`: the input's array without the batch axis, or
    None) and plan it."""
    text = _typed(read, "PROMPT_EMBEDS", np.float32, 2)
    if max_prompt_tokens is not None and text.shape[0] > max_prompt_tokens:
        raise RequestError(
            f"PROMPT_EMBEDS has {text.shape[0]} tokens; this model takes at most {max_prompt_tokens} (max_prompt_tokens)"
        )
    # Optional where a reference is given: the target is then as long as the reference.
    seconds = _typed(read, "GEN_SECONDS", np.float32, None, required=False)
    seed = _typed(read, "SEED", np.int64, None)
    steps = _typed(read, "NUM_STEPS", np.int32, None, required=False)
    guidance = _typed(read, "GUIDANCE", np.float32, None, required=False)
    sway = _typed(read, "SWAY", np.float32, None, required=False)
    ref = _typed(read, "REF_LATENTS", np.float32, 2, required=False)
    if seconds is None and ref is None:
        raise RequestError(
            "the request has no GEN_SECONDS input; only a request with REF_LATENTS may leave it out "
            "(its target is then as long as the reference)"
        )
    # A flash checkpoint runs its fixed recipe whatever NUM_STEPS says: no step count to limit.
    if steps is not None and steps > max_steps and sampler.variant != "flash":
        raise RequestError(f"NUM_STEPS is {int(steps)}; this model runs at most {max_steps} (max_steps)")
    request = Request(
        prompt_embeds=torch.from_numpy(np.ascontiguousarray(text)),
        gen_seconds=None if seconds is None else _seconds(seconds),
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


# Whether a request's client is gone is a round trip to the server that the sampling thread
# waits for. Asked of every row before every step, a base run of 16 guided requests made 512
# of them; a run asks each row at most this often instead, whatever its steps and rows.
CANCEL_CHECK_S = 0.05


def throttled_check(
    is_cancelled: Callable[[], bool], since: float, interval: float = CANCEL_CHECK_S,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[], bool]:
    """A `should_stop` for the sampler that asks `is_cancelled` only once `interval` has passed
    since `since` (when the request's `execute` began) and since its last ask; False between.

    A run that starts `interval` after its `execute` (it waited behind the runs before it)
    asks before sampling; a short run may finish without asking, and a client that left
    meanwhile has its response dropped by the server."""
    last = since

    def should_stop() -> bool:
        nonlocal last
        now = clock()
        if now - last < interval:
            return False
        last = now
        return is_cancelled()

    return should_stop
