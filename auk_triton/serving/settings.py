"""Model settings and request checks for the Triton models.

Nothing here needs the Triton stub, so it can be imported and tested anywhere.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

DEFAULT_MAX_FRAMES = 30000  # ten minutes at 50 frames per second
DEFAULT_PRESET = "auk"
SYNTHETIC_SEED = 0
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class RequestError(ValueError):
    """A request the model refuses; its message goes back to the client."""


# ---- config parameters, shared by the models ----------------------------------------------


def config_parameters(model_config: Mapping) -> dict[str, str]:
    """The `parameters` of a Triton model config (the dict `args["model_config"]` holds), as text."""
    return {
        key: str(value.get("string_value", "")).strip()
        for key, value in (model_config.get("parameters") or {}).items()
    }


def int_parameter(params: Mapping[str, str], name: str, default: int | None, minimum: int) -> int | None:
    """Parameter `name` as an integer of at least `minimum`; `default` when it is empty."""
    value = params.get(name, "")
    if value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"config parameter {name} is {value!r}; it must be an integer") from None
    if number < minimum:
        raise ValueError(f"config parameter {name} is {number}; it must be at least {minimum}")
    return number


def bool_parameter(params: Mapping[str, str], name: str, default: bool) -> bool:
    """Parameter `name` as a boolean (1/true/yes/on or 0/false/no/off); `default` when it is empty."""
    value = params.get(name, "")
    if value == "":
        return default
    if value.lower() not in _TRUE | _FALSE:
        raise ValueError(f"config parameter {name} is {value!r}; use true or false")
    return value.lower() in _TRUE


def path_parameter(params: Mapping[str, str], name: str, model_dir: str | Path) -> str:
    """Parameter `name` as a path: a relative one is taken relative to the model's folder."""
    value = params.get(name, "")
    return str(Path(model_dir) / value) if value and not os.path.isabs(value) else value


def checkpoint_path(params: Mapping[str, str], model_dir: str | Path, environ: Mapping[str, str] = os.environ) -> str:
    """The checkpoint to load: AUK_CHECKPOINT, else the `checkpoint` parameter; "" when neither is set.

    AUK_CHECKPOINT is a path relative to the directory the server started in (the
    model process inherits it; the launcher also makes it absolute); only the
    parameter is relative to the model's folder.
    """
    configured = environ.get("AUK_CHECKPOINT", "").strip()
    if configured:
        return os.path.abspath(configured)
    return path_parameter(params, "checkpoint", model_dir)


def cache_dir_path(params: Mapping[str, str], model_dir: str | Path, environ: Mapping[str, str] = os.environ) -> Path:
    """Where synthetic checkpoints and compile caches go: the `cache_dir` parameter, else
    AUK_CACHE_DIR, else ~/.cache/auk_triton."""
    configured = path_parameter(params, "cache_dir", model_dir) or environ.get("AUK_CACHE_DIR")
    return Path(configured or Path.home() / ".cache" / "auk_triton").absolute()


@dataclass(frozen=True)
class DecodeSettings:
    """The model's config parameters, read once at load time."""

    checkpoint: str
    compile_shapes: tuple[int, ...]
    tile_frames: int | None
    first_tile_frames: int | None
    max_graphs: int
    frame_alignment: int
    enable_cuda_graphs: bool
    fused_activation: bool
    channels_last: bool
    max_frames: int
    cache_dir: Path

    @classmethod
    def from_model_config(
        cls, model_config: Mapping, model_dir: str | Path, environ: Mapping[str, str] = os.environ
    ) -> "DecodeSettings":
        """Parse `parameters` of a Triton model config (the dict `args["model_config"]` holds).

        Relative paths in parameters are taken relative to the model's directory.
        """
        params = config_parameters(model_config)
        return cls(
            checkpoint=checkpoint_path(params, model_dir, environ),
            compile_shapes=_compile_shapes(params.get("compile_shapes", "")),
            tile_frames=int_parameter(params, "tile_frames", None, 0),
            first_tile_frames=int_parameter(params, "first_tile_frames", None, 0),
            max_graphs=int_parameter(params, "max_graphs", 32, 1),
            frame_alignment=int_parameter(params, "frame_alignment", 1, 1),
            enable_cuda_graphs=bool_parameter(params, "enable_cuda_graphs", True),
            fused_activation=bool_parameter(params, "fused_activation", True),
            channels_last=bool_parameter(params, "channels_last", True),
            max_frames=int_parameter(params, "max_frames", DEFAULT_MAX_FRAMES, 1),
            cache_dir=cache_dir_path(params, model_dir, environ),
        )

    def first_window_frames(self) -> int | None:
        """The first decode window of a long clip: `first_tile_frames`, else the smallest
        compile shape (one small replay before the first audio); 0 turns it off."""
        if self.first_tile_frames is not None:
            return self.first_tile_frames or None
        return min(self.compile_shapes, default=None)

    def use_compile_cache(self, environ=os.environ) -> None:
        """Point Inductor's and Triton's compile caches into `cache_dir` unless already set."""
        environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.cache_dir / "inductor"))
        environ.setdefault("TRITON_CACHE_DIR", str(self.cache_dir / "triton"))


def _compile_shapes(text: str) -> tuple[int, ...]:
    try:
        shapes = tuple(int(s) for s in text.replace(" ", "").split(",") if s)
    except ValueError:
        raise ValueError(
            f"config parameter compile_shapes is {text!r}; "
            "it must be a comma-separated list of frame counts such as \"128,256,512\""
        ) from None
    if any(s <= 0 for s in shapes):
        raise ValueError(f"config parameter compile_shapes is {text!r}; frame counts must be positive")
    return shapes


def synthetic_checkpoint(cache_dir: Path, preset: str) -> Path:
    """Write (once) and return the synthetic checkpoint of `preset` under `cache_dir`.

    Several model processes may start together: a file lock makes one write it
    while the others wait and then reuse it.
    """
    from auk_triton.synthetic import write_synthetic_checkpoint

    root = Path(cache_dir) / "synthetic"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{preset}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return write_synthetic_checkpoint(root / f"{preset}-seed{SYNTHETIC_SEED}", preset=preset, seed=SYNTHETIC_SEED)


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
