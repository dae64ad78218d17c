"""The feed-forward's product and SwiGLU gate as one kernel (auk_triton/diffusion/swiglu_kernel.py)
against the eager feed-forward.

Without CUDA but with `triton` importable the kernel runs in Triton's CPU interpreter (a
subprocess: TRITON_INTERPRET=1 must be set before triton is imported), in fp32, at shapes that
end mid-tile in every dimension and with both tile sizes. With CUDA, bf16 at the released
width against eager bf16, on the GPUs the kernel serves (Hopper).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import interpreter_results as interpreter_run
from triton_interpreter import run_checks

HAS_CUDA = torch.cuda.is_available()
FP32_TOLERANCE = 1e-5


def _rel(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def compare(shape: tuple[int, ...], hidden: int, device, dtype, seed: int = 0) -> dict:
    """x of `shape` [..., K] through a linear_in of 2 * hidden outputs and the gate, kernel against eager."""
    from auk_triton.diffusion.swiglu_kernel import swiglu_product

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(device, dtype)
    weight = (torch.randn(2 * hidden, shape[-1], generator=g) * shape[-1] ** -0.5).to(device, dtype)
    with torch.inference_mode():
        gate, up = F.linear(x, weight).chunk(2, dim=-1)
        want = F.silu(gate) * up
        got = swiglu_product(x, weight)
    # The fake implementation (what torch.compile traces with) gives the real output's shape and dtype.
    torch.library.opcheck(swiglu_product, (x, weight), test_utils=("test_schema", "test_faketensor"))
    return {"id": f"{'x'.join(map(str, shape))} -> {hidden} {str(dtype).split('.')[-1]}", "rel_l2": _rel(got, want),
            "equal": float((got == want).float().mean()), "shape_matches": got.shape == want.shape,
            "dtype_matches": got.dtype == want.dtype}


def mismatched_channels() -> dict:
    from auk_triton.diffusion.swiglu_kernel import swiglu_product

    try:
        swiglu_product(torch.zeros(4, 32), torch.zeros(16, 48))
    except ValueError as err:
        return {"id": "mismatched channels", "error_text": str(err)}
    return {"id": "mismatched channels", "error_text": None}


def _interpreter_main() -> int:
    return run_checks([lambda: compare((70, 64), 96, "cpu", torch.float32),  # small tiles, rows and columns mid-tile
                       lambda: compare((2, 150, 80), 64, "cpu", torch.float32),  # large tiles, K mid-tile, [B, N, K]
                       lambda: compare((5, 48), 40, "cpu", torch.float32),
                       mismatched_channels])


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreter_run(__file__, count=4)


def test_the_kernel_gives_the_eager_gated_product_in_fp32_at_shapes_ending_mid_tile(interpreter_results):
    for result in interpreter_results[:3]:
        assert "error" not in result, result
        assert result["shape_matches"] and result["dtype_matches"], result
        assert result["rel_l2"] <= FP32_TOLERANCE, result


def test_a_weight_for_other_channels_is_refused_by_name(interpreter_results):
    result = interpreter_results[3]
    assert result["error_text"] == "x has 32 channels, the weight takes 48", result


def _failing_check():
    raise RuntimeError("no kernel image is available for execution on the device")


@pytest.mark.parametrize("capability, check, reason", [
    ((8, 0), lambda: True, "not tuned for this GPU"),
    ((9, 0), lambda: False, "its check against the Triton kernel failed"),
    ((9, 0), _failing_check, "RuntimeError: no kernel image"),
])
def test_quacks_gemm_refused_on_a_gpu_leaves_the_triton_kernel_and_the_log_says_why(
        monkeypatch, capability, check, reason):
    swiglu_kernel = pytest.importorskip("auk_triton.diffusion.swiglu_kernel")  # imports triton
    stand_in = types.ModuleType("auk_triton.diffusion.swiglu_gemm")  # its package installed
    stand_in.ARCHITECTURES = (9,)
    monkeypatch.setitem(sys.modules, stand_in.__name__, stand_in)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)
    monkeypatch.setattr(swiglu_kernel, "_quack_matches_the_triton_kernel", check)
    monkeypatch.setattr(swiglu_kernel, "_quack", None)
    monkeypatch.setattr(swiglu_kernel, "_quack_refused", "")
    assert not swiglu_kernel.quack_gemm_registered()
    log = swiglu_kernel.product_kernel(torch.device("cuda"))
    assert log.startswith("the Triton kernel (quack's GEMM: ") and reason in log
    assert "for GPUs" in swiglu_kernel.product_kernel(torch.device("cpu"))


def _quack_serves_here() -> bool:
    if not HAS_CUDA:
        return False
    from auk_triton.diffusion.swiglu_kernel import quack_gemm_registered

    return quack_gemm_registered()


KERNELS = {"quack": _quack_serves_here(), "triton": HAS_CUDA}  # each kernel, and whether it can run here


@pytest.fixture(params=list(KERNELS))
def kernel(request, monkeypatch):
    """Each kernel in turn, the other switched off, skipped where its package or a GPU is missing."""
    if not KERNELS[request.param]:
        pytest.skip(f"needs a CUDA GPU and the {request.param} kernel's package")
    from auk_triton.diffusion import swiglu_kernel

    if request.param == "triton":
        monkeypatch.setattr(swiglu_kernel, "_quack", False)
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16 * 564, 564, 64])  # batch 16 and 1 of a 10 s bucket; a text stream
def test_each_kernel_rounds_bf16_as_the_eager_feed_forward_does_on_a_gpu(kernel, tokens):
    from auk_triton.diffusion.swiglu_kernel import _quack_serves, fits

    x = torch.zeros(tokens, 1536, device="cuda", dtype=torch.bfloat16)
    weight = torch.zeros(6144, 1536, device="cuda", dtype=torch.bfloat16)
    if not fits(x, weight):
        pytest.skip("the kernels serve Hopper GPUs (TMA)")
    # quack's GEMM takes the larger token counts; a text stream's few stay with the Triton kernel.
    assert _quack_serves(x, weight) == (kernel == "quack" and tokens > 256)
    result = compare((tokens, 1536), 3072, "cuda", torch.bfloat16)
    # The same products in the same order: all but a few values equal (cuBLAS may split K differently).
    assert result["shape_matches"] and result["rel_l2"] < 1e-3 and result["equal"] > 0.99, result


if __name__ == "__main__" and "--interpreter" in sys.argv:
    sys.exit(_interpreter_main())
