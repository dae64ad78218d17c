"""An optional kernel package that serves only where it loads, fits the GPU and passes a check.

FlashAttention 4 (flash4_attention.py) and quack's GEMM (swiglu_gemm.py) are CuTe-DSL kernels
from packages a deployment may lack, built for some GPUs and for CUDA 13 drivers. Each serves
a process only after one small case through it matches the kernel it replaces; otherwise that
kernel serves, and the log says why.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Callable

import torch

# Puts its `cutlass` package on the path with a .pth file, which Python reads in site-packages only.
CUTLASS_DSL = "nvidia_cutlass_dsl"


def check_once(module: str, package: str, check: Callable[[], bool], reference: str,
               unfit: str) -> tuple[bool, str]:
    """Import `module` (which registers its op; `package`: the package it takes the kernel from) and,
    where its ARCHITECTURES hold this GPU's compute capability major, run `check` -> (whether its
    kernel serves, why not: empty where it serves or `package` is not installed). `reference`
    names what `check` compares against, `unfit` the reason for a GPU outside ARCHITECTURES."""
    loaded, why_not = import_kernel(module, package)
    if loaded is None:
        return False, why_not
    architectures = loaded.ARCHITECTURES
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in architectures:
        return False, unfit
    try:
        passed = bool(check())
    except Exception as error:  # a driver too old for its code, say
        return False, f"its check failed: {type(error).__name__}: {error}"
    return passed, "" if passed else f"its check against {reference} failed"


def import_kernel(module: str, package: str) -> tuple[ModuleType | None, str]:
    """Import `module` -> (it, "") or (None, why not): empty where `package` is not installed (the
    deployment chose not to), else the error, for the log: an operator who installed the package
    needs to see that it, or a library it needs, cannot load (a missing dependency, a library for
    another CUDA)."""
    if importlib.util.find_spec(package) is None:
        return None, ""
    try:
        return importlib.import_module(module), ""
    except Exception as error:
        why_not = f"it did not load: {type(error).__name__}: {error}"
        if (isinstance(error, ModuleNotFoundError) and error.name == "cutlass"
                and importlib.util.find_spec(CUTLASS_DSL) is not None):
            why_not += (f" ({CUTLASS_DSL} is on the path but its .pth file was not read, as in a "
                        "PYTHONPATH folder: install it, or put its dsl_packages folder on PYTHONPATH too)")
        return None, why_not
