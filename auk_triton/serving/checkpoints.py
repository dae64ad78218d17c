"""Which checkpoint a model loads: the configured one, else a synthetic one of AUK_PRESET.

Without a checkpoint the models serve seeded synthetic weights written in the
released layout under the cache folder, loaded through the same code path a real
checkpoint takes. Several model processes may start together: a file lock makes
one of them write the files while the others wait, then reuse them.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Mapping

from auk_triton.codec.synthetic import SYNTHETIC_WARNING, write_synthetic_checkpoint
from auk_triton.diffusion.synthetic import SYNTHETIC_DIT_WARNING, write_synthetic_dit_checkpoint

from .config import synthetic_preset

SYNTHETIC_SEED = 0


@contextmanager
def _locked(root: Path, preset: str):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{preset}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def synthetic_checkpoint(cache_dir: Path, preset: str, with_dit: bool = False) -> Path:
    """The synthetic codec checkpoint of `preset` under `cache_dir` (written once), with DiT
    weights of the same preset added when `with_dit`."""
    root = Path(cache_dir) / "synthetic"
    path = root / f"{preset}-seed{SYNTHETIC_SEED}"
    with _locked(root, preset):
        write_synthetic_checkpoint(path, preset=preset, seed=SYNTHETIC_SEED)
        if with_dit:
            write_synthetic_dit_checkpoint(path, preset=preset, seed=SYNTHETIC_SEED)
    return path


def resolve_checkpoint(
    configured: str,
    cache_dir: Path,
    warn: Callable[[str], None],
    with_dit: bool = False,
    environ: Mapping[str, str] = os.environ,
) -> Path:
    """`configured` (from DecodeSettings / DiTSettings), else the synthetic preset, said loudly."""
    if configured:
        return Path(configured)
    preset = synthetic_preset(environ)
    warn(f"no checkpoint configured (AUK_CHECKPOINT or the checkpoint parameter): serving the synthetic '{preset}' preset")
    warn(f"*** {SYNTHETIC_DIT_WARNING if with_dit else SYNTHETIC_WARNING} ***")
    return synthetic_checkpoint(cache_dir, preset, with_dit)
