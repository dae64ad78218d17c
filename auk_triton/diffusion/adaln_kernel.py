"""The blocks' LayerNorm with its AdaLN modulation, and the gated residual before it, as one Triton kernel.

Each block normalises its residual stream twice, before the attention and before the
feed-forward, as `LN(x) * (1 + scale) + shift` with the step's modulation. Before each, an
update joins the stream, `h + gate * y`: before the second the attention's (its padded
tokens' y zeroed), before the first the previous block's feed-forward's, which the
kernels' path leaves pending (transformer.PendingStream; a stack's first block adds a zero
update). Compiled, Inductor ran the norms as looped reductions over the 1,536 channels
well below memory bandwidth, and the residuals as kernels of their own
(benchmarks/studies/dit-step-kernels.md). Here a program owns one token's row: it reads
the stream and the update once, keeps the new row in registers for the mean, the variance
and the output, and writes the new stream and the modulated row.

Numerics are the eager step's under bf16 autocast: the LayerNorm in fp32 (its output
fp32, as autocast runs it), `1 + scale` rounded to the modulation's dtype, the product
and the shift in fp32, rounded once at the store (the cast the next linear's autocast
makes); the gated residual as eager rounds each op, `h + round(gate * y)`, the product
rounded by its bits so the GPU build cannot fuse it into the sum (tests/diffusion/test_adaln_kernel.py).

A custom op with a fake implementation, opaque to Inductor (as norm_rope_kernel.py's);
under `TRITON_INTERPRET=1` it runs in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rounded_to(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE's values, kept in fp32. For bf16 by its bits (to nearest, ties to
    even): a cast there and back lets the GPU build fuse a product into the sum that follows,
    rounding once where eager rounds twice."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _modulated_norm(x, scale, shift, inside, width, eps, MOD_DTYPE: tl.constexpr):
    """x [BLOCK] fp32 (a row, zero past `width`) -> LN(x) * (1 + scale) + shift in fp32."""
    mean = tl.sum(x, axis=0) / width
    centred = tl.where(inside, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / width + eps)
    one_plus_scale = rounded_to(1.0 + scale, MOD_DTYPE)
    return centred * rstd * one_plus_scale + shift


@triton.jit
def _residual_ln_modulate_kernel(out, h_out, h, y, y_bias, gate, keep, scale, shift, h_row, y_row, mod_row, tokens,
                                 width, eps, HAS_Y_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    row = token // tokens
    lanes = tl.arange(0, BLOCK)
    inside = lanes < width
    stream = tl.load(h + token * h_row + lanes, mask=inside, other=0.0)
    update = tl.load(y + token * y_row + lanes, mask=inside, other=0.0)
    if HAS_Y_BIAS:  # a product's bias, added and rounded as its own op (Inductor's, after a bmm)
        b = rounded_to(tl.load(y_bias + lanes, mask=inside, other=0.0).to(tl.float32), y.dtype.element_ty)
        update = rounded_to(update.to(tl.float32) + b, y.dtype.element_ty)
    if HAS_KEEP:
        update = tl.where(tl.load(keep + token) != 0, update, 0.0)
    g = tl.load(gate + row * mod_row + lanes, mask=inside, other=0.0)
    # Eager's gate * y, rounded to y's dtype (both the modulation's), then the residual's sum in
    # the stream's (fp32 where the stream is: the text stream after autocast's RMSNorm).
    gated = rounded_to(g.to(tl.float32) * update.to(tl.float32), y.dtype.element_ty)
    new = (stream.to(tl.float32) + gated).to(stream.dtype)
    tl.store(h_out + token * width + lanes, new, mask=inside)
    s = tl.load(scale + row * mod_row + lanes, mask=inside, other=0.0).to(tl.float32)
    t = tl.load(shift + row * mod_row + lanes, mask=inside, other=0.0).to(tl.float32)
    normed = _modulated_norm(tl.where(inside, new.to(tl.float32), 0.0), s, t, inside, width, eps,
                             scale.dtype.element_ty)
    tl.store(out + token * width + lanes, normed.to(out.dtype.element_ty), mask=inside)


def _mod_row_stride(mod: torch.Tensor, rows: int) -> int:
    """A modulation view [R, 1, D]'s row stride: 0 when one row broadcasts over every row."""
    return 0 if mod.shape[0] == 1 and rows != 1 else mod.stride(0)


def _check_rows(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.stride(-1) != 1:
            raise ValueError("the AdaLN kernels read rows with unit last stride")


@torch.library.custom_op("auk::residual_ln_modulate", mutates_args=())
def residual_ln_modulate(h: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, keep: torch.Tensor | None,
                         scale: torch.Tensor, shift: torch.Tensor, eps: float,
                         out_dtype: torch.dtype,
                         y_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream h [B, N, D] after its gated update, h + gate * y (y zeroed where `keep` [B, N] is
    False), and that new stream's LayerNorm(.) * (1 + scale) + shift: (modulated [B, N, D] of
    `out_dtype`, new stream [B, N, D] in h's dtype). gate, scale and shift [B or 1, 1, D]; `y_bias`
    [D], where given, is added to y first (y a product whose bias is left to this kernel)."""
    rows, tokens, width = h.shape
    out, new = h.new_empty(h.shape, dtype=out_dtype), h.new_empty(h.shape)
    if h.numel() == 0:
        return out, new
    _check_rows(h, y, gate, scale, shift)
    if not (gate.stride(0) == scale.stride(0) == shift.stride(0)):
        raise ValueError("gate, scale and shift must be views of one modulation")
    if h.stride(0) != tokens * h.stride(1) or y.stride(0) != tokens * y.stride(1):
        raise ValueError("the AdaLN kernels read the stream's tokens as one run of rows")
    if y_bias is not None and y_bias.shape != (width,):
        raise ValueError(f"y's bias must be [{width}], got {list(y_bias.shape)}")
    keep = None if keep is None else keep.contiguous()
    _residual_ln_modulate_kernel[(rows * tokens,)](
        out, new, h, y, y if y_bias is None else y_bias.contiguous(), gate, h if keep is None else keep, scale,
        shift, h.stride(1), y.stride(1), _mod_row_stride(gate, rows), tokens, width, eps,
        HAS_Y_BIAS=y_bias is not None, HAS_KEEP=keep is not None, BLOCK=triton.next_power_of_2(width), num_warps=4,
    )
    return out, new


@residual_ln_modulate.register_fake
def _(h, y, gate, keep, scale, shift, eps, out_dtype, y_bias=None):
    return h.new_empty(h.shape, dtype=out_dtype), h.new_empty(h.shape)
