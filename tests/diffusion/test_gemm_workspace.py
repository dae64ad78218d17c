"""cuBLAS without a workspace (auk_triton/diffusion/gemm_workspace.py): the settings it makes, and on a GPU
the products it gives: no memset before them, the same values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from auk_triton.diffusion.gemm_workspace import CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE, without_gemm_workspace

HAS_CUDA = torch.cuda.is_available()
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_both_workspaces_are_asked_for_empty_unless_the_operator_sized_them():
    environ = {}
    assert without_gemm_workspace(environ) == {CUBLAS_WORKSPACE: ":0:0", CUBLASLT_WORKSPACE: "0"} == environ
    environ = {CUBLASLT_WORKSPACE: "32768"}
    assert without_gemm_workspace(environ) == {CUBLAS_WORKSPACE: ":0:0", CUBLASLT_WORKSPACE: "32768"}


# A fresh process: torch reads the sizes at its first product.
_PRODUCTS = """
import json, torch, torch.nn.functional as F
from auk_triton.diffusion.gemm_workspace import without_gemm_workspace
without_gemm_workspace()
x = torch.randn(9024, 1536, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4608, 1536, device="cuda", dtype=torch.bfloat16) / 1536 ** 0.5
b = torch.randn(4608, device="cuda", dtype=torch.bfloat16)
F.linear(x, w, b); F.linear(x, w); torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    outs = [F.linear(x, w, b), F.linear(x, w)]
    torch.cuda.synchronize()
want = F.linear(x.float(), w.float(), b.float())
rel = [float((o.float() - r).norm() / r.norm()) for o, r in zip(outs, (want, want - b.float()))]
names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
print(json.dumps({"memsets": sum("emset" in n for n in names), "kernels": len(names), "rel": rel}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_the_dits_large_products_run_without_a_memset_and_give_the_same_values_on_a_gpu():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    for name in (CUBLAS_WORKSPACE, CUBLASLT_WORKSPACE):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", _PRODUCTS], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # bf16 products against fp32's: bf16's rounding of the outputs, nothing more.
    assert result["kernels"] >= 2 and result["memsets"] == 0 and max(result["rel"]) < 4e-3, result
