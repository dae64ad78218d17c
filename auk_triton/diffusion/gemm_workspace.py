"""cuBLAS without a workspace, so that its Hopper products schedule their tiles statically.

torch gives cuBLAS and cuBLASLt a workspace per handle and stream. With one, cuBLAS picks for
the DiT's large products kernels that hand out their tiles through a counter kept in it, and
zeroes the counter with a memset before each product: in a captured step, a graph node of its
own before each of its 120-odd products. Without one it picks the same tiles scheduled
statically, no memset, at the same speed or better (benchmarks/studies/dit-step-kernels.md).
The DiT's products are large enough that cuBLAS splits none of them over K, which is what a
workspace is otherwise for. torch reads both sizes from the environment once per process, at
its first product, so this is set before any; sizes the operator set are kept.
"""

from __future__ import annotations

import os

CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"  # cuBLAS's workspace, ":SIZE_KIB:COUNT"
CUBLASLT_WORKSPACE = "CUBLASLT_WORKSPACE_SIZE"  # cuBLASLt's (KiB), which torch uses for products with a bias
NO_WORKSPACE = {CUBLAS_WORKSPACE: ":0:0", CUBLASLT_WORKSPACE: "0"}


def without_gemm_workspace(environ=os.environ) -> dict[str, str]:
    """Ask for cuBLAS and cuBLASLt without a workspace, unless the operator set their sizes; call
    it before the process's first product. Returns the two settings in force."""
    for name, value in NO_WORKSPACE.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in NO_WORKSPACE}
