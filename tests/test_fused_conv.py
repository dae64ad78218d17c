"""The causal convolution kernel (auk_triton/fused_conv.py) against a float64 reference.

Every case draws a fresh random input, weight, and (where the case says so)
bias and residual, and compares the kernel's `residual + conv(x) + bias` with
the same causal convolution computed in float64 (F.conv1d on a left-padded
copy). With `torch.backends.cudnn.allow_tf32` off the kernel multiplies in full
fp32 and must be within 2e-5 relative L2; with it on (PyTorch's default, what
cuDNN does) within 2e-3, and no further from the reference than twice cuDNN's
own TF32 result plus 1e-4. The output is poisoned with NaN first and must come
back finite; the traceable op must give the direct launch's result bit for bit.

Where the kernel runs: on a CUDA GPU at the decoder's real shapes (plus
torch.compile, `opcheck`, and small-codec decodes eager, plain-graph and
compiled); without CUDA, in Triton's CPU interpreter (in a subprocess, as in
test_fused_activation.py) on small shapes; without triton, skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
FP32_TOLERANCE = 2e-5
TF32_TOLERANCE = 2e-3
DECODE_TOLERANCE = 1e-3

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

# (batch, in channels, out channels, length, kernel, dilation, layout, bias, residual)
# layout: "contiguous"; "transposed" (a [B, L, C] tensor viewed as [B, C, L]); "strided" (every other sample).
INTERPRETER_CASES = [
    (1, 24, 24, 1, 3, 1, "contiguous", True, True),
    (1, 24, 24, 300, 3, 1, "contiguous", True, True),
    (2, 24, 24, 77, 11, 5, "contiguous", False, True),
    (1, 40, 40, 129, 7, 3, "strided", True, False),
    (1, 24, 1, 50, 7, 1, "contiguous", False, False),
    (1, 3, 5, 2, 3, 1, "contiguous", True, True),
    (1, 70, 70, 40, 3, 3, "transposed", True, True),
    (1, 48, 48, 600, 11, 1, "contiguous", False, False),
]

GPU_CASES = [
    (1, 24, 24, 245760, 11, 5, "contiguous", False, False),
    (1, 24, 24, 100001, 7, 1, "contiguous", True, True),
    (1, 48, 48, 122880, 3, 3, "contiguous", True, True),
    (1, 96, 96, 61440, 11, 1, "contiguous", True, True),
    (1, 192, 192, 30720, 7, 5, "contiguous", False, False),
    (1, 384, 384, 10240, 3, 1, "contiguous", True, True),
    (1, 768, 768, 2560, 11, 3, "contiguous", True, True),
    (2, 64, 64, 1, 11, 5, "contiguous", True, True),
    (3, 100, 60, 4097, 7, 3, "transposed", True, True),
    (2, 96, 96, 999, 3, 1, "strided", False, True),
    (1, 24, 1, 5000, 7, 1, "contiguous", False, False),
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
    x64 = F.pad(x.double(), (left, 0))
    out = F.conv1d(x64, weight.double(), None if bias is None else bias.double(), dilation=dilation)
    return out if residual is None else residual.double() + out


def run_case(case, device: str, seed: int, tf32: bool) -> dict:
    """The kernel against the float64 reference (and cuDNN's own error, on the GPU)."""
    from auk_triton.fused_conv import causal_conv1d

    batch, c_in, c_out, length, kernel, dilation, layout, with_bias, with_residual = case
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    if layout == "transposed":
        x = randn(batch, length, c_in).transpose(1, 2)
    elif layout == "strided":
        x = randn(batch, c_in, 2 * length)[..., ::2]
    else:
        x = randn(batch, c_in, length)
    weight = randn(c_out, c_in, kernel) / (c_in * kernel) ** 0.5
    bias = randn(c_out) if with_bias else None
    residual = randn(batch, c_out, length) if with_residual else None

    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        poisoned = torch.full((batch, c_out, length), float("nan"), device=device)
        with torch.no_grad():
            written = causal_conv1d(x, weight, bias, residual, dilation, out=poisoned)
            op_out = causal_conv1d(x, weight, bias, residual, dilation)
            expected = reference(x, weight, bias, residual, dilation)
            cudnn_err = None
            if device == "cuda":
                left = dilation * (kernel - 1)
                cudnn = F.conv1d(x, weight, bias, 1, left, dilation)[..., :length]
                cudnn = cudnn if residual is None else residual + cudnn
                cudnn_err = _rel_l2(cudnn, expected)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    return {
        "id": _case_id(case),
        "finite": bool(torch.isfinite(written).all()),
        "op_equal": bool(torch.equal(op_out, written)),
        "rel_l2": _rel_l2(written, expected),
        "cudnn_rel_l2": cudnn_err,
    }


def _check(result: dict, tf32: bool) -> None:
    assert result["finite"], f"{result['id']}: some output elements were not written (NaN poison survived)"
    assert result["op_equal"], f"{result['id']}: the custom op's output differs from the direct launch"
    tolerance = TF32_TOLERANCE if tf32 else FP32_TOLERANCE
    assert result["rel_l2"] <= tolerance, f"{result['id']}: rel L2 {result['rel_l2']:.3g} > {tolerance}: {result}"
    if tf32 and result["cudnn_rel_l2"] is not None:
        assert result["rel_l2"] <= 2 * result["cudnn_rel_l2"] + 1e-4, f"{result['id']}: further off than cuDNN: {result}"


# ---- CPU: Triton's interpreter, in a subprocess ---------------------------------------------


@pytest.fixture(scope="module")
def interpreter_results():
    if HAS_CUDA:
        pytest.skip("CUDA is available: the kernel is tested on the GPU instead of the interpreter")
    if not HAS_TRITON:
        pytest.skip("triton is not installed (CPU torch wheels do not ship it): the kernel is untested here")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__, "--interpreter"], env=env, capture_output=True, text=True, timeout=1800
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result["id"]] = result
    if proc.returncode != 0 or not results:
        pytest.fail(f"interpreter run failed (status {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return results


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=_case_id)
def test_interpreted_kernel_matches_the_float64_convolution(interpreter_results, case):
    result = interpreter_results.get(_case_id(case))
    assert result is not None, f"no result for {_case_id(case)}"
    if "error" in result:
        pytest.fail(f"{result['id']} raised: {result['error']}")
    _check(result, tf32=False)


# ---- CUDA ---------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "tf32"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_kernel_matches_the_float64_convolution_on_the_gpu(case, tf32):
    _check(run_case(case, "cuda", seed=len(_case_id(case)), tf32=tf32), tf32)


@gpu
def test_the_op_compiles_without_a_graph_break_and_passes_opcheck():
    from auk_triton.fused_conv import causal_conv1d_op
    from auk_triton.vae import CausalConv1d

    torch.manual_seed(7)
    conv = CausalConv1d(48, 48, 7, dilation=3).cuda().requires_grad_(False)
    x = torch.randn(1, 48, 3000, device="cuda")
    residual = torch.randn(1, 48, 3000, device="cuda")
    conv.fused = True
    compiled = torch.compile(lambda t, r: conv(t * 1.0, residual=r) + 1.0, fullgraph=True)
    with torch.no_grad():
        out = compiled(x, residual)
        conv.fused = False
        expected = conv(x, residual=residual) + 1.0
    assert _rel_l2(out, expected) <= TF32_TOLERANCE
    for bias, res in ((None, None), (conv.bias, residual)):
        torch.library.opcheck(
            causal_conv1d_op,
            (x, conv.weight, bias, res, 3),
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
        )


@pytest.fixture(scope="module")
def small_vaes(tmp_path_factory):
    from auk_triton.synthetic import write_synthetic_checkpoint
    from auk_triton.vae import AuKVAE

    checkpoint = write_synthetic_checkpoint(tmp_path_factory.mktemp("small-conv"), "small")
    reference_vae = AuKVAE.from_pretrained(checkpoint, device="cuda")
    kernels = AuKVAE.from_pretrained(checkpoint, device="cuda").use_fused_activation(True)
    kernels.use_fused_conv(True, max_channels=1 << 30)
    return reference_vae, kernels


def _latents(frames: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, frames, 64, generator=generator).cuda()


def test_use_fused_conv_routes_only_the_narrow_convolutions():
    from auk_triton.vae import AuKVAE

    vae = AuKVAE().use_fused_conv(True, max_channels=96)
    widths = {conv.in_channels: conv.fused for block in vae.resblocks for conv in (*block.convs1, *block.convs2)}
    assert widths == {768: False, 384: False, 192: False, 96: True, 48: True, 24: True}
    assert not vae.conv_post.fused
    vae.use_fused_conv(False)
    assert not any(conv.fused for block in vae.resblocks for conv in block.convs1)


@gpu
@pytest.mark.parametrize("frames", [1, 37, 300])
def test_an_eager_decode_with_both_kernels_matches_eager(small_vaes, frames):
    reference_vae, kernels = small_vaes
    clip = _latents(frames, frames)
    with torch.no_grad():
        assert _rel_l2(kernels.decode(clip), reference_vae.decode(clip)) < DECODE_TOLERANCE


@gpu
def test_a_compiled_bucket_with_both_kernels_is_close_to_eager(small_vaes):
    from auk_triton.decode_graph import AuKVAEDecodeGraph

    reference_vae, kernels = small_vaes
    graph = AuKVAEDecodeGraph(kernels, compile_shapes=(128,))
    graph.warmup("cuda")
    assert graph.compiled_bucket(128) == 128, "the compiled bucket failed to build (see the warning log)"
    clip = _latents(128, 0)
    out = graph(clip)
    assert graph.last_mode == "compiled"
    with torch.no_grad():
        assert _rel_l2(out, reference_vae.decode(clip)) < DECODE_TOLERANCE
    plain = AuKVAEDecodeGraph(kernels, compile_shapes=())
    clip = _latents(77, 2)
    out = plain(clip)
    assert plain.last_mode == "graph"
    with torch.no_grad():
        assert torch.equal(out, kernels.decode(clip))


# ---- the subprocess body --------------------------------------------------------------------------


def _interpreter_main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    failures = 0
    for seed, case in enumerate(INTERPRETER_CASES):
        try:
            result = run_case(case, "cpu", seed, tf32=False)
        except Exception as err:  # reported per case by the parent test
            result = {"id": _case_id(case), "error": f"{type(err).__name__}: {err}"}
            failures += 1
        print(json.dumps(result), flush=True)
    return 0 if failures < len(INTERPRETER_CASES) else 1


if __name__ == "__main__" and "--interpreter" in sys.argv:
    sys.exit(_interpreter_main())
