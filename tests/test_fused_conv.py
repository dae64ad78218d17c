"""The causal convolution kernel (auk_triton/fused_conv.py) against a float64 reference.

Every case draws a fresh input, weight and (where the case says so) bias and
residual, and compares the kernel's `residual + conv(x) + bias` with the same
causal convolution in float64 (F.conv1d on a left-padded copy): within 2e-5
relative L2, in full fp32 (TF32 off) and in the kernel's default three-TF32
products alike. The output is poisoned with NaN first and must come back
finite, in x's layout; the traceable op must give the direct launch's result
bit for bit.

Where the kernel runs: on a CUDA GPU at the decoder's narrow shapes, plus
compiled channels-last decodes of the small codec; without CUDA, in Triton's CPU
interpreter (in a subprocess, as in test_fused_activation.py) on small shapes;
without triton, skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import run_in_triton_interpreter

TOLERANCE = 2e-5
DECODE_TOLERANCE = 1e-3

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

# (batch, in channels, out channels, length, kernel, dilation, layout, bias, residual)
# layout: "channels-last" (a [B, L, C] tensor viewed as [B, C, L]) or "contiguous".
INTERPRETER_CASES = [
    (1, 24, 24, 1, 3, 1, "channels-last", True, True),
    (1, 24, 24, 300, 11, 5, "channels-last", True, True),
    (2, 24, 24, 77, 7, 3, "channels-last", False, True),
    (1, 48, 48, 200, 3, 1, "channels-last", True, False),
    (1, 3, 5, 2, 3, 1, "channels-last", True, True),
    (1, 40, 40, 129, 7, 3, "contiguous", True, True),
    (1, 24, 1, 50, 7, 1, "contiguous", False, False),
]

GPU_CASES = [
    (1, 24, 24, 245760, 11, 5, "channels-last", False, True),
    (1, 24, 24, 100001, 7, 1, "channels-last", True, True),
    (1, 48, 48, 122880, 3, 3, "channels-last", True, True),
    (1, 48, 48, 122880, 11, 1, "channels-last", False, False),
    (1, 96, 96, 61440, 7, 5, "channels-last", True, True),
    (2, 64, 64, 1, 11, 5, "channels-last", True, True),
    (3, 40, 24, 4097, 7, 3, "channels-last", True, False),
    (1, 48, 48, 9999, 11, 3, "contiguous", True, True),
]


def _case_id(case) -> str:
    batch, c_in, c_out, length, kernel, dilation, layout, bias, residual = case
    return (
        f"{batch}x{c_in}->{c_out}x{length}-k{kernel}d{dilation}-{layout}"
        f"{'-bias' if bias else ''}{'-residual' if residual else ''}"
    )


def _rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def reference(x, weight, bias, residual, dilation):
    """The causal convolution in float64: a left zero-padded copy, then F.conv1d."""
    left = dilation * (weight.shape[2] - 1)
    out = F.conv1d(F.pad(x.double(), (left, 0)), weight.double(), None if bias is None else bias.double(),
                   dilation=dilation)
    return out if residual is None else residual.double() + out


def run_case(case, device: str, seed: int, tf32: bool) -> dict:
    from auk_triton.fused_activation import empty_like_layout, layout_strides
    from auk_triton.fused_conv import causal_conv1d

    batch, c_in, c_out, length, kernel, dilation, layout, with_bias, with_residual = case
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    channels_last = layout == "channels-last"
    x = randn(batch, length, c_in).transpose(1, 2) if channels_last else randn(batch, c_in, length)
    weight = randn(c_out, c_in, kernel) / (c_in * kernel) ** 0.5
    if channels_last:  # as AuKVAE.use_channels_last stores it
        weight = weight.transpose(1, 2).contiguous().transpose(1, 2)
    bias = randn(c_out) if with_bias else None
    residual = None
    if with_residual:
        residual = randn(batch, length, c_out).transpose(1, 2) if channels_last else randn(batch, c_out, length)

    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        poisoned = empty_like_layout(x, c_out).fill_(float("nan"))
        with torch.no_grad():
            written = causal_conv1d(x, weight, bias, residual, dilation, out=poisoned)
            op_out = causal_conv1d(x, weight, bias, residual, dilation)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    return {
        "id": _case_id(case) + ("-tf32x3" if tf32 else "-fp32"),
        "finite": bool(torch.isfinite(written).all()),
        "op_equal": bool(torch.equal(op_out, written)),
        "layout_kept": op_out.stride() == layout_strides(x, c_out),
        "rel_l2": _rel_l2(written, reference(x, weight, bias, residual, dilation)),
    }


def _check(result: dict) -> None:
    assert result["finite"], f"{result['id']}: some output elements were not written (NaN poison survived)"
    assert result["op_equal"], f"{result['id']}: the custom op's output differs from the direct launch"
    assert result["layout_kept"], f"{result['id']}: the op's output is not in x's layout"
    assert result["rel_l2"] <= TOLERANCE, f"{result['id']}: rel L2 {result['rel_l2']:.3g} > {TOLERANCE}"


# ---- CPU: Triton's interpreter, in a subprocess ---------------------------------------------


@pytest.fixture(scope="module")
def interpreter_results():
    if HAS_CUDA:
        pytest.skip("CUDA is available: the kernel is tested on the GPU instead of the interpreter")
    if not HAS_TRITON:
        pytest.skip("triton is not installed (CPU torch wheels do not ship it): the kernel is untested here")
    return run_in_triton_interpreter(__file__)


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=_case_id)
def test_interpreted_kernel_matches_the_float64_convolution(interpreter_results, case):
    result = interpreter_results.get(_case_id(case) + "-fp32")
    assert result is not None, f"no result for {_case_id(case)}"
    if "error" in result:
        pytest.fail(f"{result['id']} raised: {result['error']}")
    _check(result)


# ---- CUDA ---------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "tf32x3"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_kernel_matches_the_float64_convolution_on_the_gpu(case, tf32):
    _check(run_case(case, "cuda", seed=case[3], tf32=tf32))


@gpu
def test_a_compiled_channels_last_bucket_with_the_conv_kernel_is_close_to_eager(tmp_path):
    from auk_triton.decode_graph import AuKVAEDecodeGraph
    from auk_triton.synthetic import write_synthetic_checkpoint
    from auk_triton.vae import AuKVAE

    checkpoint = write_synthetic_checkpoint(tmp_path, "small")
    reference = AuKVAE.from_pretrained(checkpoint, device="cuda")
    fused = AuKVAE.from_pretrained(checkpoint, device="cuda").use_fused_activation(True)
    fused.use_channels_last(True).use_fused_conv(True, max_channels=64)
    assert any(conv.fused for block in fused.resblocks for conv in block.convs2)
    clip = torch.randn(1, 128, 64, generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        expected = reference.decode(clip)
        assert _rel_l2(fused.decode(clip), expected) < DECODE_TOLERANCE
    graph = AuKVAEDecodeGraph(fused, compile_shapes=(128,))
    graph.warmup("cuda")
    assert graph.compiled_bucket(128) == 128, "the compiled bucket failed to build (see the warning log)"
    out = graph(clip)
    assert graph.last_mode == "compiled"
    assert _rel_l2(out, expected) < DECODE_TOLERANCE


# ---- the subprocess body --------------------------------------------------------------------------


def _interpreter_main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    failures = 0
    for seed, case in enumerate(INTERPRETER_CASES):
        try:
            result = run_case(case, "cpu", seed, tf32=False)
        except Exception as err:  # reported per case by the parent test
            result = {"id": _case_id(case) + "-fp32", "error": f"{type(err).__name__}: {err}"}
            failures += 1
        print(json.dumps(result), flush=True)
    return 0 if failures < len(INTERPRETER_CASES) else 1


if __name__ == "__main__" and "--interpreter" in sys.argv:
    sys.exit(_interpreter_main())
