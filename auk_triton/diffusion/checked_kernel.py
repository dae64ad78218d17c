"""An optional kernel package that serves only where it loads, fits the GPU and passes a check.

FlashAttention 4 (flash4_attention.py) and quack's GEMM (swiglu_gemm.py) are CuTe-DSL kernels
from packages a deployment may lack, built for some GPUs and for CUDA 13 drivers. Each serves
a process only after one small case through it matches the kernel it replaces; otherwise that
kernel serves, and the log says why.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch


def check_once(module: str, check: Callable[[], bool], reference: str, unfit: str) -> tuple[bool, str]:
    """Import `module` (which registers its op) and, where its ARCHITECTURES hold this GPU's compute
    capability major, run `check` -> (whether its kernel serves, why not: empty where it serves or
    its package is not installed). `reference` names what `check` compares against, `unfit` the
    reason for a GPU outside ARCHITECTURES."""
    try:
        architectures = importlib.import_module(module).ARCHITECTURES
    except Exception:  # not installed, or its libraries cannot load
        return False, ""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in architectures:
        return False, unfit
    try:
        passed = bool(check())
    except Exception as error:  # a driver too old for its code, say
        return False, f"its check failed: {type(error).__name__}: {error}"
    return passed, "" if passed else f"its check against {reference} failed"
