"""The fused anti-aliased activation (auk_triton/codec/activation_kernel.py) against the eager module.

Every case draws fresh random inputs, SnakeBeta parameters (and, in some cases,
FIR taps, as a checkpoint may store them), computes the eager `Activation1d`
and the Triton kernel, and requires a relative L2 error of at most 1e-5 over
the whole output and over each clip edge (where the replicate padding acts).
The same holds for an fp16 signal (and bias) read by the kernel, which computes in
fp32: written as fp32 it must match the eager module's fp32 result on the widened
input within 1e-5, and written as fp16 each sample must be that result rounded, within
half an fp16 ulp. The kernel writes into a NaN-poisoned output, which must come back finite, and
the traceable op's own output must equal it bit for bit. Every case must be one
the kernel supports: otherwise `fused_activation` falls back to the eager module
and would match it trivially. That fallback is checked on its own (unsupported
inputs give the eager result and launch nothing), and the whole-decode tests
count the kernel's launches.

Where the kernel runs:
- With CUDA: on the GPU, at the real shapes (channels 24..768, lengths up to
  100k), plus torch.compile (fullgraph, Inductor) of the op, `opcheck`, and a
  whole decode of the small synthetic codec through a compiled bucket.
- Without CUDA but with `triton` importable: in Triton's CPU interpreter, on
  small shapes. TRITON_INTERPRET=1 must be set before triton is imported, so the
  cases run in a subprocess (this file as a script) and the rest of the test
  session is unaffected. The interpreter costs ~15 ms per program, hence few
  channels and short lengths there.
- Without either: skipped, with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from contextlib import contextmanager

import pytest
import torch
from triton_interpreter import interpreter_results as interpreter_run

TOLERANCE = 1e-5
# An fp16 output sample is the kernel's fp32 result rounded: at most half an ulp, 2^-11 of its magnitude.
FP16_ROUNDING = 2.0**-11
DECODE_TOLERANCE = 1e-3
EDGE = 24  # output samples checked separately at each clip edge

HAS_CUDA = torch.cuda.is_available()

# (batch, channels, length, layout, causal, logscale, random_taps, bias)
# bias: a per-channel bias added to the input (the preceding conv's), folded into the kernel's loads.
# layout: "contiguous"; "transposed" (a [B, L, C] tensor viewed as [B, C, L]);
# "strided" (every other sample of a longer row); "channels" (every other channel).
INTERPRETER_CASES = [
    (1, 24, 1, "contiguous", True, True, False, False),
    (1, 24, 2, "contiguous", True, True, False, False),
    (2, 24, 7, "contiguous", True, True, False, False),
    (1, 24, 11, "transposed", True, True, False, False),
    (1, 32, 57, "contiguous", True, True, True, True),
    (1, 8, 1016, "contiguous", True, True, False, False),
    (1, 8, 1017, "strided", True, True, False, True),
    (1, 4, 3001, "contiguous", True, True, True, False),
    (2, 48, 333, "channels", True, True, False, True),
    (1, 96, 97, "transposed", True, True, False, False),
    (1, 2, 20001, "contiguous", True, True, False, False),
    (1, 40, 3, "contiguous", True, True, False, False),  # many channels, each its own program
    (1, 24, 1, "contiguous", False, True, False, False),
    (1, 24, 13, "contiguous", False, True, False, True),
    (1, 8, 2047, "strided", False, True, True, False),
    (1, 24, 129, "contiguous", True, False, False, False),
    (1, 24, 300, "transposed", True, True, False, True),
    (1, 12, 77, "transposed", False, True, True, False),
    # Long enough that whole programs of the channels-last kernel lie inside the row (its loop without edges).
    (1, 8, 600, "transposed", False, True, False, True),
    (2, 16, 1001, "transposed", True, True, True, False),
]

# fp16 signals (the decoder in fp16), with the output in either dtype.
INTERPRETER_FP16_CASES = [
    ((1, 24, 57, "contiguous", True, True, False, True), ("float16", "float16")),
    ((1, 16, 600, "transposed", True, True, False, True), ("float16", "float16")),
    ((1, 16, 600, "transposed", True, True, False, False), ("float16", "float32")),
]

GPU_CASES = [
    (1, 768, 2560, "contiguous", True, True, False, False),
    (1, 384, 10240, "contiguous", True, True, False, False),
    (1, 192, 30720, "contiguous", True, True, False, True),
    (1, 96, 61440, "contiguous", True, True, False, False),
    (1, 48, 100000, "contiguous", True, True, False, False),
    (1, 24, 100001, "contiguous", True, True, True, True),
    (2, 64, 1, "contiguous", True, True, False, False),
    (1, 512, 2, "contiguous", True, True, False, False),
    (1, 200, 7, "transposed", True, True, False, False),
    (3, 100, 12345, "transposed", True, True, False, True),
    (2, 256, 4097, "strided", True, True, True, False),
    (2, 384, 999, "channels", True, True, False, True),
    (1, 24, 33333, "contiguous", False, True, False, False),
    (1, 96, 5001, "contiguous", False, False, True, True),
    (1, 31, 1017, "contiguous", True, False, False, False),
    (4, 24, 50001, "contiguous", True, True, False, False),
    (1, 768, 2560, "transposed", True, True, False, True),
    (1, 96, 61440, "transposed", True, True, False, True),
    (1, 24, 100001, "transposed", True, True, True, False),
    (1, 48, 4097, "transposed", False, True, False, True),
    (2, 31, 999, "transposed", True, False, False, True),
    (1, 384, 10240, "transposed", True, True, False, True),
    (1, 192, 30720, "transposed", True, True, False, False),
    (1, 64, 1, "transposed", True, True, False, False),
    (1, 24, 3, "transposed", False, True, True, False),
]


def _case_id(case) -> str:
    batch, channels, length, layout, causal, logscale, taps, bias = case
    return (
        f"{batch}x{channels}x{length}-{layout}-{'causal' if causal else 'centered'}"
        f"{'' if logscale else '-linear'}{'-taps' if taps else ''}{'-bias' if bias else ''}"
    )


def _fp16_case_id(case_and_io) -> str:
    case, io = case_and_io
    return f"{_case_id(case)}-{io[0]}-to-{io[1]}"


def _input(batch, channels, length, layout, generator, device):
    def randn(*shape):
        return (torch.randn(*shape, generator=generator) * 1.5).to(device)

    if layout == "contiguous":
        return randn(batch, channels, length)
    if layout == "transposed":
        return randn(batch, length, channels).transpose(1, 2)
    if layout == "strided":
        return randn(batch, channels, 2 * length)[..., ::2]
    if layout == "channels":
        return randn(batch, 2 * channels, length)[:, ::2]
    raise ValueError(layout)


def _rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def run_case(case, device: str, seed: int, kernel=None, io=("float32", "float32")) -> dict:
    """Eager vs fused for one case (`kernel`: an ActivationKernel, None for the defaults; `io`:
    the signal's and the output's dtype); returns the errors (and whether the poisoned output
    came back finite)."""
    from auk_triton.codec.activation import Activation1d, ActivationKernel
    from auk_triton.codec.activation_kernel import empty_like_layout, fused_activation, supports

    batch, channels, length, layout, causal, logscale, random_taps, with_bias = case
    generator = torch.Generator().manual_seed(seed)
    act = Activation1d(channels, logscale, causal).requires_grad_(False)
    with torch.no_grad():
        if logscale:
            act.act.alpha.copy_(torch.randn(channels, generator=generator) * 0.5)
            act.act.beta.copy_(torch.randn(channels, generator=generator) * 0.5)
        else:
            act.act.alpha.copy_(0.2 + torch.rand(channels, generator=generator) * 2)
            act.act.beta.copy_(0.2 + torch.rand(channels, generator=generator) * 2)
        if random_taps:  # a checkpoint's stored taps must win over the computed ones
            act.upsample.filter.copy_(torch.randn(1, 1, 12, generator=generator) / 4)
            act.downsample.lowpass.filter.copy_(torch.randn(1, 1, 12, generator=generator) / 4)
    act = act.to(device)
    in_dtype, out_dtype = (getattr(torch, name) for name in io)
    x = _input(batch, channels, length, layout, generator, device).to(in_dtype)
    bias = (torch.randn(channels, generator=generator) * 0.3).to(device, in_dtype) if with_bias else None
    # Unsupported, fused_activation would fall back to the eager module and match it trivially.
    assert supports(x, act, bias), f"{_case_id(case)}: the kernel does not support this case"

    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # the reference in plain fp32
    try:
        with torch.no_grad():
            expected = act.eager(x, bias=bias, out_dtype=torch.float32)  # fp32 on the widened input
    finally:
        torch.backends.cudnn.allow_tf32 = tf32

    poisoned = empty_like_layout(x, out_dtype).fill_(float("nan"))
    with torch.no_grad():
        kernel = kernel or ActivationKernel()
        written = fused_activation(x, act, out=poisoned, bias=bias, kernel=kernel)
        op_out = fused_activation(x, act, bias=bias, kernel=kernel, out_dtype=out_dtype)
        in_fp32 = fused_activation(x, act, bias=bias, kernel=kernel, out_dtype=torch.float32)
    edge = min(EDGE, length)
    # An fp16 store past the rounding of the kernel's fp32 result (0 or less when every sample
    # is within it). That result comes from the fp32-output build of the kernel, whose fused
    # multiply-adds may differ from the fp16 build's: the absolute term allows for that (1e-6 of
    # the signal's scale, measured 2e-7 on the H200), and for fp16's subnormals. An fp16
    # intermediate would be off by up to 2^-11 of each value, hundreds of times more.
    bound = in_fp32.double().abs() * FP16_ROUNDING * 1.01 + 1e-6 * in_fp32.double().abs().max() + 1e-7
    return {
        "id": _case_id(case) + ("" if io == ("float32", "float32") else f"-{io[0]}-to-{io[1]}"),
        "out_dtype": str(written.dtype),
        "rounding_excess": ((written.double() - in_fp32.double()).abs() - bound).max().item(),
        "fp32_rel_l2": _rel_l2(in_fp32, expected),
        "finite": bool(torch.isfinite(written).all()),
        "op_equal": bool(torch.equal(op_out, written)),
        "rel_l2": _rel_l2(written, expected),
        "rel_l2_left_edge": _rel_l2(written[..., :edge], expected[..., :edge]),
        "rel_l2_right_edge": _rel_l2(written[..., -edge:], expected[..., -edge:]),
        "max_abs": (written.double() - expected.double()).abs().max().item(),
    }


@contextmanager
def _counting_launches():
    """Count the fused kernel's launches while inside (each launch still runs)."""
    from auk_triton.codec import activation_kernel as fa

    launches = []
    launch = fa._launch

    def counting(*args, **kwargs):
        launches.append(args[1].shape)
        return launch(*args, **kwargs)

    fa._launch = counting
    try:
        yield launches
    finally:
        fa._launch = launch


def _check(result: dict) -> None:
    assert result["finite"], f"{result['id']}: some output elements were not written (NaN poison survived)"
    assert result["op_equal"], f"{result['id']}: the custom op's output differs from the direct launch"
    if result["out_dtype"] == "torch.float16":
        assert result["rounding_excess"] <= 0, (
            f"{result['id']}: a sample is {result['rounding_excess']:.3g} past the fp16 rounding of the kernel's "
            f"fp32 result: {result}")
        assert result["fp32_rel_l2"] <= TOLERANCE, f"{result['id']}: the fp32 result is off eager: {result}"
        return
    for key in ("rel_l2", "rel_l2_left_edge", "rel_l2_right_edge"):
        assert result[key] <= TOLERANCE, f"{result['id']}: {key} {result[key]:.3g} > {TOLERANCE}: {result}"


# ---- CPU: Triton's interpreter, in a subprocess ---------------------------------------------


@pytest.fixture(scope="module")
def interpreter_results():
    count = 2 + len(INTERPRETER_CASES) + len(INTERPRETER_FP16_CASES)  # _interpreter_main's lines
    return {result["id"]: result for result in interpreter_run(__file__, count, timeout_s=1800)}


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=_case_id)
def test_interpreted_kernel_matches_eager(interpreter_results, case):
    result = interpreter_results.get(_case_id(case))
    assert result is not None, f"no result for {_case_id(case)}"
    if "error" in result:
        pytest.fail(f"{result['id']} raised: {result['error']}")
    _check(result)


@pytest.mark.parametrize("case_and_io", INTERPRETER_FP16_CASES, ids=_fp16_case_id)
def test_an_interpreted_fp16_signal_is_computed_in_fp32_and_rounded_once(interpreter_results, case_and_io):
    result = interpreter_results.get(_fp16_case_id(case_and_io))
    assert result is not None, f"no result for {_fp16_case_id(case_and_io)}"
    if "error" in result:
        pytest.fail(f"{result['id']} raised: {result['error']}")
    _check(result)


def test_interpreted_unsupported_inputs_run_the_eager_module_without_a_launch(interpreter_results):
    result = interpreter_results.get(FALLBACK_ID)
    assert result is not None, "no result for the fallback"
    assert "error" not in result, result.get("error")
    assert result["control_supported"] and result["control_launches"] == 1, (
        "the same input with a contiguous bias should run the kernel (once)"
    )
    assert [case["name"] for case in result["cases"]] == ["float64", "strided bias", "float64, out="]
    for case in result["cases"]:
        assert not case["supported"], f"{case['name']}: supports() accepted it"
        assert case["launches"] == 0, f"{case['name']}: the kernel ran"
        assert case["equal"], f"{case['name']}: the fallback differs from the eager module"


def test_interpreted_op_passes_opcheck_and_traces_to_the_same_result(interpreter_results):
    result = interpreter_results.get(OP_ID)
    assert result is not None, "no result for the op"
    assert "error" not in result, result.get("error")
    assert result["equal"], "the traced call differs from the direct call"
    assert result["channels_last"], "the traced call's output lost the input's channels-last layout"


# ---- CUDA ---------------------------------------------------------------------------------------


def gpu(test):
    """Marked `gpu` (selected by `-m gpu`) and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")(test))


@pytest.fixture
def kernel_launches():
    with _counting_launches() as launches:
        yield launches


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_kernel_matches_eager_on_the_gpu(case):
    for seed in (0, 1):
        _check(run_case(case, "cuda", seed))


@gpu
@pytest.mark.parametrize("out_dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_an_fp16_signal_is_computed_in_fp32_and_rounded_once_on_the_gpu(case, out_dtype):
    for seed in (0, 1):
        _check(run_case(case, "cuda", seed, io=("float16", out_dtype)))


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_the_fp16_decoder_s_launch_with_the_hardware_sine_matches_eager_and_rounds_once_on_the_gpu(case):
    from auk_triton.codec.activation import activation_kernel_for

    kernel = activation_kernel_for(torch.float16)
    assert kernel.sine == "approx"
    for seed in (0, 1):
        _check(run_case(case, "cuda", seed, kernel, io=("float16", "float16")))


SINE_CASES = [
    (1, 96, 4099, "contiguous", True, True, False, True),
    (1, 48, 20011, "transposed", True, True, False, True),
    (2, 24, 1001, "transposed", False, False, True, False),
]


@gpu
@pytest.mark.parametrize("method", ["libdevice", "polynomial", "approx"])
@pytest.mark.parametrize("case", SINE_CASES, ids=_case_id)
def test_every_way_of_evaluating_the_sine_matches_eager_on_the_gpu(case, method):
    from auk_triton.codec.activation import ActivationKernel

    _check(run_case(case, "cuda", 0, ActivationKernel(sine=method)))


@gpu
def test_the_op_compiles_without_a_graph_break_and_passes_opcheck():
    from auk_triton.codec import activation_kernel as fa
    from auk_triton.codec.activation import Activation1d, ActivationKernel

    torch.manual_seed(5)
    act = Activation1d(64).requires_grad_(False).cuda()
    act.act.alpha.normal_(0, 0.5)
    act.act.beta.normal_(0, 0.5)
    act.kernel, act.fused = ActivationKernel(), fa.fused_activation
    x = torch.randn(1, 64, 3000, device="cuda")
    compiled = torch.compile(lambda t: act(t * 1.0) + 1.0, fullgraph=True)
    with torch.no_grad():
        out = compiled(x)
        act.kernel = None
        expected = act(x) + 1.0
    assert _rel_l2(out, expected) <= TOLERANCE
    filters = (act.upsample.filter, act.downsample.lowpass.filter)
    for bias in (None, torch.randn(64, device="cuda")):
        args = (x, bias, act.act.alpha, act.act.beta, *filters, True, True, *dataclasses.astuple(ActivationKernel()),
                torch.float32)
        torch.library.opcheck(
            fa.fused_activation_op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
        )


@pytest.fixture(scope="module")
def small_vaes(tmp_path_factory):
    from auk_triton.codec.activation import ActivationKernel
    from auk_triton.codec.synthetic import write_synthetic_checkpoint
    from auk_triton.codec.vae import AuKVAE

    checkpoint = write_synthetic_checkpoint(tmp_path_factory.mktemp("small-fused"), "small")
    reference = AuKVAE.from_pretrained(checkpoint, device="cuda")
    kernel = ActivationKernel()
    fused = AuKVAE.from_pretrained(checkpoint, device="cuda", activation_kernel=kernel)
    channels_last = AuKVAE.from_pretrained(checkpoint, device="cuda", activation_kernel=kernel, channels_last=True)
    return reference, fused, channels_last


def _latents(frames: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, frames, 64, generator=generator).cuda()


@gpu
@pytest.mark.parametrize("layout", ["channels-first", "channels-last"])
@pytest.mark.parametrize("frames", [1, 37, 300])
def test_an_eager_decode_with_the_kernel_matches_eager(small_vaes, kernel_launches, frames, layout):
    reference, fused, channels_last = small_vaes
    decoder = channels_last if layout == "channels-last" else fused
    clip = _latents(frames, frames)
    with torch.no_grad():
        out = decoder.decode(clip)
        assert kernel_launches, "the decode never launched the fused kernel"
        assert _rel_l2(out, reference.decode(clip)) < DECODE_TOLERANCE


@gpu
def test_a_compiled_bucket_with_the_kernel_is_close_to_eager(small_vaes, kernel_launches):
    from auk_triton.codec.decode_graph import AuKVAEDecodeGraph

    reference, fused, channels_last = small_vaes
    graph = AuKVAEDecodeGraph(fused, compile_shapes=(128,))
    graph.warmup("cuda")
    assert graph.compiled_bucket(128) == 128, "the compiled bucket failed to build (see the warning log)"
    # Replays skip Python: the launches are counted while the bucket is compiled and captured.
    assert kernel_launches, "the compiled bucket does not launch the fused kernel"
    for frames, seed in ((128, 0), (100, 1)):
        clip = _latents(frames, seed)
        out = graph(clip)
        assert graph.last_mode == "compiled"
        with torch.no_grad():
            expected = reference.decode(clip)
        settled = (frames - fused.decode_context_frames()[1] - 1) * fused.hop_size
        assert _rel_l2(out[:, :settled], expected[:, :settled]) < DECODE_TOLERANCE
    # The channels-last decode (the sliding kernel and NHWC convolutions) in a compiled bucket.
    kernel_launches.clear()
    graph = AuKVAEDecodeGraph(channels_last, compile_shapes=(128,))
    graph.warmup("cuda")
    assert graph.compiled_bucket(128) == 128, "the channels-last compiled bucket failed to build"
    assert kernel_launches, "the channels-last compiled bucket does not launch the fused kernel"
    clip = _latents(128, 3)
    out = graph(clip)
    assert graph.last_mode == "compiled"
    with torch.no_grad():
        assert _rel_l2(out, reference.decode(clip)) < DECODE_TOLERANCE
    # A plain graph (eager kernels replayed) with the fused kernel captured in it.
    kernel_launches.clear()
    plain = AuKVAEDecodeGraph(fused, compile_shapes=())
    clip = _latents(77, 2)
    out = plain(clip)
    assert plain.last_mode == "graph"
    assert kernel_launches, "the captured graph does not launch the fused kernel"
    with torch.no_grad():
        assert torch.equal(out, fused.decode(clip))
        assert _rel_l2(out, reference.decode(clip)) < DECODE_TOLERANCE


# ---- the subprocess body --------------------------------------------------------------------------


OP_ID = "the op: opcheck and a traced call"


def check_op() -> dict:
    """The custom op passes opcheck on a channels-last input and, traced by torch.compile
    (AOT, no code generation), equals the direct call. (Its
    selection by `fused_activation` is traced on the GPU test: here `supports` reads
    Triton's interpreter setting, which Dynamo cannot trace.)"""
    from auk_triton.codec import activation_kernel as fa
    from auk_triton.codec.activation import Activation1d, ActivationKernel

    torch.manual_seed(3)
    act = Activation1d(8).requires_grad_(False)
    act.act.alpha.normal_(0, 0.5)
    act.act.beta.normal_(0, 0.5)
    x = torch.randn(1, 40, 8).transpose(1, 2)
    bias = torch.randn(8)
    filters = (act.upsample.filter.contiguous(), act.downsample.lowpass.filter.contiguous())
    args = (x, bias, act.act.alpha, act.act.beta, *filters, True, True, *dataclasses.astuple(ActivationKernel()),
                torch.float32)
    torch.library.opcheck(
        fa.fused_activation_op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
    )
    with torch.no_grad():
        traced = torch.compile(lambda t: fa.fused_activation_op(t, *args[1:]) * 1.0, backend="aot_eager",
                               fullgraph=True)(x)
        direct = fa.fused_activation_op(*args)
    return {"id": OP_ID, "equal": bool(torch.equal(traced, direct)),
            "channels_last": bool(fa.is_channels_last(traced))}


FALLBACK_ID = "unsupported inputs: the eager module"


def check_fallback() -> dict:
    """Inputs the kernel does not take run the eager module instead, and launch nothing.

    Under the interpreter a float32 CPU signal is supported (the control case), so
    in each case only the named property turns the kernel down: float64 signal and
    parameters (returned, or written into `out`), or a bias that is not contiguous.
    """
    from auk_triton.codec import activation_kernel as fa
    from auk_triton.codec.activation import Activation1d

    torch.manual_seed(4)
    act = Activation1d(8).requires_grad_(False)
    act.act.alpha.normal_(0, 0.5)
    act.act.beta.normal_(0, 0.5)
    act64 = Activation1d(8).requires_grad_(False).double()
    act64.load_state_dict(act.state_dict())
    x = torch.randn(1, 8, 50)
    x64 = x.double()
    strided_bias = torch.randn(16)[::2]

    with _counting_launches() as launches, torch.no_grad():
        fa.fused_activation(x, act, bias=strided_bias.contiguous())
        result = {"id": FALLBACK_ID, "control_supported": fa.supports(x, act, strided_bias.contiguous()),
                  "control_launches": len(launches), "cases": []}
        poisoned = torch.full_like(x64, float("nan"))
        for name, args, call, expected in (
            ("float64", (x64, act64, None), lambda: fa.fused_activation(x64, act64), act64(x64)),
            ("strided bias", (x, act, strided_bias), lambda: fa.fused_activation(x, act, bias=strided_bias),
             act(x, bias=strided_bias)),
            ("float64, out=", (x64, act64, None), lambda: fa.fused_activation(x64, act64, out=poisoned),
             act64(x64)),
        ):
            launches.clear()
            out = call()  # with out=, the poisoned tensor itself
            result["cases"].append({
                "name": name, "supported": fa.supports(*args), "launches": len(launches),
                "equal": bool(out.dtype == expected.dtype and torch.equal(out, expected)),
            })
    return result


def _interpreter_main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for check, check_id in ((check_op, OP_ID), (check_fallback, FALLBACK_ID)):
        try:
            print(json.dumps(check()), flush=True)
        except Exception as err:
            print(json.dumps({"id": check_id, "error": f"{type(err).__name__}: {err}"}), flush=True)
    failures = 0
    for seed, case in enumerate(INTERPRETER_CASES):
        try:
            result = run_case(case, "cpu", seed)
        except Exception as err:  # reported per case by the parent test
            result = {"id": _case_id(case), "error": f"{type(err).__name__}: {err}"}
            failures += 1
        print(json.dumps(result), flush=True)
    for seed, (case, io) in enumerate(INTERPRETER_FP16_CASES):
        try:
            result = run_case(case, "cpu", seed, io=io)
        except Exception as err:
            result = {"id": _fp16_case_id((case, io)), "error": f"{type(err).__name__}: {err}"}
        print(json.dumps(result), flush=True)
    return 0 if failures < len(INTERPRETER_CASES) else 1


if __name__ == "__main__" and "--interpreter" in sys.argv:
    sys.exit(_interpreter_main())
