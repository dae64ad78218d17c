"""Model settings and request checks for the Triton decode model.

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
        raw = {
            key: str(value.get("string_value", "")).strip()
            for key, value in (model_config.get("parameters") or {}).items()
        }
        model_dir = Path(model_dir)

        def path_param(name: str) -> str:
            value = raw.get(name, "")
            return str(model_dir / value) if value and not os.path.isabs(value) else value

        def int_param(name: str, default: int | None, minimum: int) -> int | None:
            value = raw.get(name, "")
            if value == "":
                return default
            try:
                number = int(value)
            except ValueError:
                raise ValueError(f"config parameter {name} is {value!r}; it must be an integer") from None
            if number < minimum:
                raise ValueError(f"config parameter {name} is {number}; it must be at least {minimum}")
            return number

        shapes_text = raw.get("compile_shapes", "")
        try:
            compile_shapes = tuple(int(s) for s in shapes_text.replace(" ", "").split(",") if s)
        except ValueError:
            raise ValueError(
                f"config parameter compile_shapes is {shapes_text!r}; "
                "it must be a comma-separated list of frame counts such as \"128,256,512\""
            ) from None
        if any(s <= 0 for s in compile_shapes):
            raise ValueError(f"config parameter compile_shapes is {shapes_text!r}; frame counts must be positive")

        def bool_param(name: str, default: bool) -> bool:
            text = raw.get(name, "").lower()
            if text == "":
                return default
            if text not in _TRUE | _FALSE:
                raise ValueError(f"config parameter {name} is {text!r}; use true or false")
            return text in _TRUE

        cache_dir = path_param("cache_dir") or environ.get("AUK_CACHE_DIR") or str(Path.home() / ".cache" / "auk_triton")
        return cls(
            checkpoint=environ.get("AUK_CHECKPOINT") or path_param("checkpoint"),
            compile_shapes=compile_shapes,
            tile_frames=int_param("tile_frames", None, 0),
            first_tile_frames=int_param("first_tile_frames", None, 0),
            max_graphs=int_param("max_graphs", 32, 1),
            frame_alignment=int_param("frame_alignment", 1, 1),
            enable_cuda_graphs=bool_param("enable_cuda_graphs", True),
            fused_activation=bool_param("fused_activation", True),
            channels_last=bool_param("channels_last", True),
            max_frames=int_param("max_frames", DEFAULT_MAX_FRAMES, 1),
            cache_dir=Path(cache_dir).absolute(),
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


def validate_latents(array: np.ndarray | None, latent_dim: int, max_frames: int, frame_rate: float) -> np.ndarray:
    """Check one request's LATENTS; return it as a C-contiguous float32 [frames, latent_dim] array."""
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
    finite = np.isfinite(array)
    if not finite.all():
        bad_frame = int(np.argmin(finite.all(axis=1)))
        nans = int(np.isnan(array).sum())
        infs = int(np.isinf(array).sum())
        raise RequestError(
            f"LATENTS holds {nans} NaN and {infs} infinite values (the first in frame {bad_frame}); "
            "every value must be finite"
        )
    return np.ascontiguousarray(array)
