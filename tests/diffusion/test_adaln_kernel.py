"""The AdaLN kernel (auk_triton/diffusion/adaln_kernel.py) against the eager ops, and the blocks
that call it against the eager blocks.

Without CUDA but with `triton` importable they run in Triton's CPU interpreter (a subprocess:
TRITON_INTERPRET=1 must be set before triton is imported), in fp32 at the small preset's
sizes, with padded rows and a modulation row broadcast over the batch. The blocks' test runs
the kernels' path on the CPU (it is the GPU's path otherwise: these kernels, the q/k norms'
and the feed-forward's) and requires the eager block's outputs. With CUDA, bf16 at the released width.
"""

from __future__ import annotations

import sys

import pytest
import torch

from auk_triton.diffusion import transformer
from auk_triton.diffusion.synthetic import PRESETS
from triton_interpreter import interpreter_results as interpreter_run
from triton_interpreter import run_checks

HAS_CUDA = torch.cuda.is_available()
FP32_TOLERANCE = 1e-5


def _rel(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def compare_ops(rows: int, tokens: int, width: int, device, dtype, seed: int = 0) -> dict:
    """The kernel against the eager ops: a feed-forward's update joining the stream before the first
    norm (no tokens masked), the attention's before the second (a padded row's tokens masked, its
    projection's bias added by the kernel, as the double blocks leave it)."""
    from auk_triton.diffusion.adaln_kernel import residual_ln_modulate

    g = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    h, y_ff, y = draw(rows, tokens, width), draw(rows, tokens, width), draw(rows, tokens, width)
    y_bias = draw(width)
    mod = draw(1, 6 * width) * 0.1  # one row broadcast over the batch, as a table's lookup
    shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = mod[:, None].chunk(6, dim=-1)
    keep = torch.ones(rows, tokens, dtype=torch.bool, device=device)
    keep[-1, tokens - 2:] = False
    norm = torch.nn.LayerNorm(width, elementwise_affine=False, eps=transformer.LN_EPS)
    with torch.inference_mode():
        want_h = h + gate_mlp * y_ff
        want_in = (norm(want_h.float()) * (1 + scale).float() + shift.float()).to(dtype)
        got_in, got_h = residual_ln_modulate(h, y_ff, gate_mlp, None, scale, shift, transformer.LN_EPS, dtype)
        want_h2 = want_h + gate * (y + y_bias).masked_fill(~keep[..., None], 0.0)
        want_ff = (norm(want_h2.float()) * (1 + scale_mlp).float() + shift_mlp.float()).to(dtype)
        got_ff, got_h2 = residual_ln_modulate(got_h, y, gate, keep, scale_mlp, shift_mlp, transformer.LN_EPS, dtype,
                                              y_bias)
    # The fake implementation (what torch.compile traces with) gives the real outputs' shapes and dtypes.
    for bias in (None, y_bias):
        torch.library.opcheck(residual_ln_modulate,
                              (h, y, gate, keep, scale_mlp, shift_mlp, transformer.LN_EPS, dtype, bias),
                              test_utils=("test_schema", "test_faketensor"))
    return {"id": f"{rows}x{tokens}x{width} {str(dtype).split('.')[-1]}",
            "stream_rel_l2": max(_rel(got_h, want_h), _rel(got_h2, want_h2)),
            "norm_rel_l2": max(_rel(got_in, want_in), _rel(got_ff, want_ff)),
            "stream_unequal": int((got_h != want_h).sum() + (got_h2 != want_h2).sum()),
            "shapes_match": got_in.shape == got_ff.shape == got_h2.shape == h.shape}


def bf16_rounding(device) -> dict:
    """The kernels' bf16 rounding by bits (adaln_kernel.rounded_to) against torch's cast, on values
    that round every way: ties to even from either side, both signs, subnormals, overflow to inf."""
    from rounding_kernel import rounded_to_bf16

    g = torch.Generator().manual_seed(0)
    spread = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    bits = torch.randint(0x00800000, 0x7F000000, (4096,), generator=g, dtype=torch.int32)
    ties = ((bits & ~0xFFFF) | 0x8000).view(torch.float32)  # exactly halfway between two bf16 values
    edges = torch.tensor([0.0, -0.0, 1e-40, -3e-39, 3.3e38, 3.39e38])
    x = torch.cat([spread, ties, -ties, edges]).to(device)
    got, want = rounded_to_bf16(x), x.to(torch.bfloat16).float()
    return {"id": "bf16 rounding by bits", "values": x.numel(),
            "unequal": int((got.view(torch.int32) != want.view(torch.int32)).sum())}


def compare_blocks(device, dtype, valid_keys_first: bool = False) -> dict:
    """The small preset's blocks through the kernels' path against their eager path: a padded batch.
    `valid_keys_first`: the attentions lay each row's valid keys first, the single blocks' whole
    stream so (padded_attention.py), as a GPU with the cudnn package does."""
    torch.manual_seed(0)
    model = transformer.AuKTransformer(latent_dim=64, **PRESETS["small"]).to(device, dtype).eval()
    rows, frames, tokens = 2, 12, 6
    mask = torch.ones(rows, frames, dtype=torch.bool, device=device)
    mask[1, -3:] = False
    c_mask = torch.ones(rows, tokens, dtype=torch.bool, device=device)
    c_mask[0, -2:] = False
    with torch.inference_mode():
        ctx = model.prepare(torch.randn(rows, tokens, 2048, device=device, dtype=dtype), frames, mask=mask,
                            c_mask=c_mask)
        x = torch.randn(rows, frames, 64, device=device, dtype=dtype)
        mod = model.modulation_at(torch.tensor(0.4))
        eager = model.velocity(x, mod, ctx)
        kernels = transformer.BlockRunners(double=transformer.run_double_block_kernels,
                                           single=transformer.run_single_block_kernels, kernels=True)
        layout = transformer._valid_keys_first
        if valid_keys_first:
            transformer._valid_keys_first = lambda keys, qkv: keys is not None
        try:
            got = model.velocity(x, mod, ctx, kernels)
        finally:
            transformer._valid_keys_first = layout
    return {"id": f"blocks, valid keys first: {valid_keys_first}", "rel_l2": _rel(got, eager),
            "finite": bool(torch.isfinite(got).all())}


def compiled_kernels_path() -> dict:
    """The small DiT's kernels' path through Dynamo (its eager backend: the trace and its guards) at two
    times of a run's table: whether any block kind was compiled a second time."""
    from torch._dynamo.utils import counters

    from auk_triton.diffusion.compiled import CompileOptions, compiled_blocks

    torch.manual_seed(0)
    model = transformer.AuKTransformer(latent_dim=64, **PRESETS["small"]).eval()
    blocks = compiled_blocks(CompileOptions(backend="eager"))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, -3:] = False
    errors = []
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        ctx = model.prepare(torch.randn(2, 6, 2048), 12, mask=mask)
        table = model.modulation_table([0.4, 0.7])
        x = torch.randn(2, 12, 64)
        for time in table.rows:  # the grid's times, as the steps look them up
            mod = table.lookup(time)
            errors.append(_rel(model.velocity(x, mod, ctx, blocks), model.velocity(x, mod, ctx)))
    return {"id": "compiled kernels' path", "rel_l2": max(errors), "graphs": counters["stats"]["unique_graphs"]}


def _interpreter_main() -> int:
    # On the CPU the kernels' path is otherwise never taken: take it here, as a GPU does.
    transformer._adaln_kernels_run = lambda kernels, x: kernels
    transformer._norm_rope_kernel_fits = lambda qkv, norm: True
    transformer._swiglu_kernel_fits = lambda x, weight: True
    return run_checks([lambda: compare_ops(2, 5, 64, "cpu", torch.float32),
                       lambda: compare_ops(1, 3, 40, "cpu", torch.float32),
                       lambda: compare_blocks("cpu", torch.float32),
                       lambda: compare_blocks("cpu", torch.float32, valid_keys_first=True),
                       compiled_kernels_path,
                       lambda: bf16_rounding("cpu")])


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreter_run(__file__, count=6)


def test_the_kernel_adds_each_update_then_normalises_and_modulates_as_eager_does_in_fp32(interpreter_results):
    for result in interpreter_results[:2]:
        assert "error" not in result, result
        assert result["shapes_match"] and max(result["stream_rel_l2"], result["norm_rel_l2"]) <= FP32_TOLERANCE, result


def test_the_blocks_through_the_kernels_give_the_eager_blocks_velocity(interpreter_results):
    result = interpreter_results[2]
    assert "error" not in result, result
    assert result["finite"] and result["rel_l2"] <= FP32_TOLERANCE, result


def test_the_blocks_attending_to_valid_keys_laid_first_give_the_eager_blocks_velocity(interpreter_results):
    result = interpreter_results[3]
    assert "error" not in result, result
    assert result["finite"] and result["rel_l2"] <= FP32_TOLERANCE, result


def test_one_compilation_serves_every_block_of_a_kind_with_its_update_pending(interpreter_results):
    # A stack's first block gets a zero update under zero modulations laid out as the others'
    # (transformer.PendingStream): three graphs, the single blocks and the two edges, none compiled
    # twice (the kernels' path runs the double blocks uncompiled: compiled.py).
    result = interpreter_results[4]
    assert "error" not in result, result
    assert result["graphs"] == 3 and result["rel_l2"] <= FP32_TOLERANCE, result


def test_the_kernels_round_to_bf16_by_bits_as_torchs_cast_does(interpreter_results):
    result = interpreter_results[5]
    assert "error" not in result, result
    assert result["values"] > 12_000 and result["unequal"] == 0, result


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_the_kernels_round_to_bf16_by_bits_as_torchs_cast_does_on_a_gpu():
    result = bf16_rounding("cuda")
    assert result["unequal"] == 0, result


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_the_kernel_gives_eagers_stream_and_its_norms_within_bf16_rounding_on_a_gpu():
    result = compare_ops(4, 576, 1536, "cuda", torch.bfloat16)
    # The new stream is eager's value for value: the gate's product rounded, then the sum. The
    # norms sum in another order than torch's, which moves a few outputs by one bf16 step
    # (unit roundoff 3.9e-3).
    assert result["shapes_match"] and result["stream_unequal"] == 0, result
    assert result["norm_rel_l2"] < 2e-3, result


if __name__ == "__main__" and "--interpreter" in sys.argv:
    sys.exit(_interpreter_main())
