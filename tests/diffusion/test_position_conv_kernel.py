"""The audio embedding's position convolutions as Triton kernels (auk_triton/diffusion/position_conv_kernel.py)
against the eager convolutions.

Without CUDA but with `triton` importable the kernel runs in Triton's CPU interpreter (a
subprocess: TRITON_INTERPRET=1 must be set before triton is imported), in fp32, through
ConvPositionEmbedding's kernels' path: frames that end mid-tile, group widths below and across
the kernel's input chunk, padded frames and none. The interpreter runs a program step by step,
so most checks use narrower convolutions than the released 31 taps in 16 groups, which one
small check keeps. With CUDA, bf16 at the released width against eager bf16.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from auk_triton.diffusion import transformer
from triton_interpreter import interpreter_results as interpreter_run
from triton_interpreter import run_checks

HAS_CUDA = torch.cuda.is_available()
FP32_TOLERANCE = 1e-5


def _rel(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def compare(rows: int, frames: int, dim: int, device, dtype, padded: bool = True, conv: tuple[int, int] | None = None,
            opcheck: bool = False, seed: int = 0) -> dict:
    """h [rows, frames, dim] through ConvPositionEmbedding, its kernels' path against its eager one; with
    `padded`, the last row's last third of frames is padding; `conv` (taps, groups) replaces the released
    convolutions."""
    torch.manual_seed(seed)
    pos = transformer.ConvPositionEmbedding(dim)
    if conv is not None:
        taps, groups = conv
        for i in (0, 2):
            pos.conv1d[i] = nn.Conv1d(dim, dim, taps, padding=taps // 2, groups=groups)
    pos = pos.to(device, dtype).eval()
    pos.lay_weights_taps_first()  # as the loaders do on a GPU; the eager path takes either layout
    h = torch.randn(rows, frames, dim, device=device, dtype=dtype)
    mask = None
    if padded:
        mask = torch.ones(rows, frames, dtype=torch.bool, device=device)
        mask[-1, frames - frames // 3:] = False
    with torch.inference_mode():
        want, got = pos(h, mask), pos(h, mask, kernels=True)
    if opcheck:  # the fake implementation (what torch.compile traces with) gives the real output's shape and dtype
        from auk_triton.diffusion.position_conv_kernel import position_conv

        conv1 = pos.conv1d[0]
        torch.library.opcheck(position_conv, (h, mask, conv1.weight.permute(2, 1, 0), conv1.bias, h, conv1.groups),
                              test_utils=("test_schema", "test_faketensor"))
    padding_is_h = True if mask is None else bool((got - h)[~mask].eq(0).all())
    return {"id": f"{rows}x{frames}x{dim} conv {conv} padded {padded} {str(dtype).split('.')[-1]}",
            "rel_l2": _rel(got, want), "padding_is_h": padding_is_h,
            "shape_matches": got.shape == want.shape and got.dtype == want.dtype}


def wrong_weight() -> dict:
    from auk_triton.diffusion.position_conv_kernel import position_conv

    try:
        position_conv(torch.zeros(1, 8, 64), None, torch.zeros(31, 8, 64), torch.zeros(64), None, 16)
    except ValueError as err:
        return {"id": "wrong weight", "error_text": str(err)}
    return {"id": "wrong weight", "error_text": None}


def _interpreter_main() -> int:
    transformer._position_conv_kernel_fits = lambda h: True  # the GPU's path, here in the interpreter
    return run_checks([lambda: compare(2, 150, 16, "cpu", torch.float32, conv=(5, 2), opcheck=True),  # two frame tiles
                       lambda: compare(1, 20, 80, "cpu", torch.float32, conv=(7, 2)),  # 40 a group: two input chunks
                       lambda: compare(2, 9, 32, "cpu", torch.float32, padded=False, conv=(3, 1)),
                       lambda: compare(1, 12, 64, "cpu", torch.float32),  # the released 31 taps, 16 groups
                       wrong_weight])


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreter_run(__file__, count=5)


def test_the_kernels_give_the_eager_convolutions_in_fp32_with_padded_frames_and_without(interpreter_results):
    for result in interpreter_results[:4]:
        assert "error" not in result, result
        assert result["shape_matches"] and result["padding_is_h"], result
        assert result["rel_l2"] <= FP32_TOLERANCE, result


def test_a_weight_for_other_groups_is_refused_by_name(interpreter_results):
    result = interpreter_results[4]
    assert result["error_text"] == ("a conv of 64 channels in 16 groups takes weight [K, 4, 64] (taps first) and "
                                    "bias [64]; got [31, 8, 64] and [64]"), result


def test_weights_laid_out_taps_first_give_the_eager_convolutions_the_same_values():
    torch.manual_seed(0)
    pos = transformer.ConvPositionEmbedding(64).eval()
    h = torch.randn(2, 40, 64)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 30:] = False
    with torch.inference_mode():
        want = pos(h, mask)
        pos.lay_weights_taps_first()
        got = pos(h, mask)
    assert all(pos.conv1d[i].weight.permute(2, 1, 0).is_contiguous() for i in (0, 2))
    assert _rel(got, want) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [16, 1])  # batch 16 and 1 of a 10 s bucket
def test_the_kernels_stay_within_bf16_rounding_of_the_eager_convolutions_on_a_gpu(rows):
    result = compare(rows, 500, 1536, "cuda", torch.bfloat16, opcheck=True)
    # The same products summed in another order, each output rounded where eager rounds it: a few
    # values one bf16 step apart (unit roundoff 3.9e-3).
    assert result["shape_matches"] and result["padding_is_h"] and result["rel_l2"] < 2e-3, result


if __name__ == "__main__" and "--interpreter" in sys.argv:
    sys.exit(_interpreter_main())
