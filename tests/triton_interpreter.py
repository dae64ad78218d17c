"""Kernel tests on a CPU: a test module's checks run in Triton's interpreter, in a subprocess
(TRITON_INTERPRET=1 must be set before triton is imported), each printing one JSON line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_checks(checks: list[Callable[[], dict]]) -> int:
    """The subprocess's side: each check's result (or its error) as one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for check in checks:
        try:
            result = check()
        except Exception as err:
            result = {"id": "?", "error": f"{type(err).__name__}: {err}"}
        print(json.dumps(result), flush=True)
    return 0


def interpreter_results(test_file: str, count: int, timeout_s: float = 900) -> list[dict]:
    """Run `test_file --interpreter` under the interpreter: its `count` results. Skipped where CUDA
    is available (the kernels are tested on the GPU instead) or triton is not installed."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the kernels are tested on the GPU instead of the interpreter")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (CPU torch wheels do not ship it): the kernels are untested here")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), str(REPO_ROOT / "tests"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, test_file, "--interpreter"], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(results) != count:
        pytest.fail(f"interpreter run failed (status {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return results
