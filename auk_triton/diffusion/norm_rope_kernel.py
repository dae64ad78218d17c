"""The attention's q/k RMSNorm and RoPE, and the joint attention's join, as one Triton kernel.

Eager, each block turns its q/k/v projection [B, N, 3 * H * Dh] into the attention's
inputs in several passes: an RMSNorm per head of q and of k, RoPE on each in fp32,
and in the double blocks a concatenation of the audio and text streams' q, k and v
along the sequence. Compiled, Inductor fused these into kernels well below memory
bandwidth (benchmarks/studies/dit-step-kernels.md). Here a program owns one token:
it reads the token's q and k once, normalises and rotates every head in registers
and writes them where the attention reads them, [B, N, H, Dh] (the joint sequence
[first stream | second stream] in the double blocks, v copied there too). There, given key
slots (padded_attention.py), a token's k and v go to its slot instead: a padded row's valid
keys first, for cuDNN's padding mask.

Numerics are the eager step's, `rotate(q_norm(q), cos, sin)`: the RMSNorm in fp32
(x * rsqrt(mean(x^2) + eps) * weight), rounded once to the input's dtype as torch's
fused RMSNorm does; RoPE in fp32 on that rounded value, rounded once at the store.
Only the order of the fp32 sum of squares and the fused multiply-adds differ.

The rotary tables are the model's (`DiTContext.rope_*`): fp32, [B' or 1, L, 1, Dh]
with each angle repeated for its pair (GPT-J layout), read through their strides. The
op is a torch custom op with a fake implementation, opaque to Inductor (as the
decoder's activation kernel is), so `torch.compile` traces through it and CUDA graphs
capture it. Under `TRITON_INTERPRET=1` (tests on a CPU) it runs in
Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope(x, weight, cos, sin, eps, HP: tl.constexpr, DH: tl.constexpr, NORM_DTYPE: tl.constexpr):
    """x [HP, DH] fp32 (one token's heads) -> RMSNorm per head, rounded to NORM_DTYPE, then RoPE in fp32."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / DH + eps)
    y = (x * rstd[:, None] * weight).to(NORM_DTYPE).to(tl.float32)
    even, odd = tl.split(tl.reshape(y, (HP, DH // 2, 2)))
    rotated = tl.reshape(tl.join(-odd, even), (HP, DH))
    return y * cos + rotated * sin


@triton.jit
def _norm_rope_kernel(
    q_out, k_out, v_out,  # [B, N, H, DH] contiguous
    src_a, a_row, a_tok,  # the first stream's projection: [B, Na, 3 * H * DH], unit last stride
    src_c, c_row, c_tok,  # the second stream's (TWO): [B, N - Na, 3 * H * DH]
    qw_a, kw_a, qw_c, kw_c,  # RMSNorm weights [DH]
    cos_a, sin_a, ra_row, ra_tok,  # rotary tables read as [rows or 1, Na, DH] through strides
    cos_c, sin_c, rc_row, rc_tok,
    slots,  # int32 [B, N]: where each token's k and v go (KEYED), else unread
    n_first, n_tokens, eps_q, eps_k,
    H: tl.constexpr, HP: tl.constexpr, DH: tl.constexpr, TWO: tl.constexpr, WITH_V: tl.constexpr,
    KEYED: tl.constexpr,
):
    token = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    src = src_a + row * a_row + token * a_tok
    q_weight, k_weight = qw_a, kw_a
    cos_row = cos_a + row * ra_row + token * ra_tok
    sin_row = sin_a + row * ra_row + token * ra_tok
    if TWO:
        if token >= n_first:
            second = token - n_first
            src = src_c + row * c_row + second * c_tok
            q_weight, k_weight = qw_c, kw_c
            cos_row = cos_c + row * rc_row + second * rc_tok
            sin_row = sin_c + row * rc_row + second * rc_tok
    heads = tl.arange(0, HP)[:, None]
    lanes = tl.arange(0, DH)[None, :]
    inside = (heads < H) & (lanes < DH)
    offsets = heads * DH + lanes
    width = H * DH
    cos = tl.load(cos_row + lanes)
    sin = tl.load(sin_row + lanes)
    norm_dtype = src.dtype.element_ty
    q = tl.load(src + offsets, mask=inside, other=0.0).to(tl.float32)
    k = tl.load(src + width + offsets, mask=inside, other=0.0).to(tl.float32)
    out = (row * n_tokens + token) * width + offsets
    key_out = out
    if KEYED:
        key_out = (row * n_tokens + tl.load(slots + row * n_tokens + token)) * width + offsets
    q = _norm_rope(q, tl.load(q_weight + lanes).to(tl.float32), cos, sin, eps_q, HP, DH, norm_dtype)
    tl.store(q_out + out, q.to(q_out.dtype.element_ty), mask=inside)
    k = _norm_rope(k, tl.load(k_weight + lanes).to(tl.float32), cos, sin, eps_k, HP, DH, norm_dtype)
    tl.store(k_out + key_out, k.to(k_out.dtype.element_ty), mask=inside)
    if WITH_V:
        tl.store(v_out + key_out, tl.load(src + 2 * width + offsets, mask=inside), mask=inside)


def _table_strides(table: torch.Tensor) -> tuple[int, int]:
    """A rotary table [rows or 1, L, 1, DH]'s row and token strides (0 for a broadcast row)."""
    return (0 if table.shape[0] == 1 else table.stride(0)), table.stride(1)


def _launch(q, k, v, qkv_a, qkv_c, weights, rope_a, rope_c, eps_q, eps_k, heads, slots=None):
    rows, n_first = qkv_a.shape[:2]
    if slots is not None and (slots.dtype != torch.int32 or slots.shape != q.shape[:2] or not slots.is_contiguous()):
        raise ValueError(f"key slots must be contiguous int32 {list(q.shape[:2])}, got {slots.dtype} "
                         f"{list(slots.shape)}")
    for tensor in (qkv_a, qkv_c, *rope_a, *(rope_c or ())):
        if tensor is not None and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
            raise ValueError("the norm and RoPE kernel reads projections and rotary tables with unit last stride")
    n_tokens = q.shape[1]
    if rows == 0 or n_tokens == 0:
        return
    dim_head = q.shape[-1]
    two = qkv_c is not None
    second, rope_second = (qkv_c, rope_c) if two else (qkv_a, rope_a)
    qw_a, kw_a, qw_c, kw_c = weights
    _norm_rope_kernel[(n_tokens, rows)](
        q, k, q if v is None else v,
        qkv_a, qkv_a.stride(0), qkv_a.stride(1), second, second.stride(0), second.stride(1),
        qw_a, kw_a, qw_c, kw_c,
        rope_a[0], rope_a[1], *_table_strides(rope_a[0]),
        rope_second[0], rope_second[1], *_table_strides(rope_second[0]),
        q if slots is None else slots,
        n_first, n_tokens, eps_q, eps_k,
        H=heads, HP=triton.next_power_of_2(heads), DH=dim_head, TWO=two, WITH_V=v is not None,
        KEYED=slots is not None, num_warps=4,
    )


def _outputs(qkv: torch.Tensor, tokens: int, heads: int, with_v: bool):
    shape = (qkv.shape[0], tokens, heads, qkv.shape[-1] // (3 * heads))
    q, k = qkv.new_empty(shape), qkv.new_empty(shape)
    return q, k, (qkv.new_empty(shape) if with_v else None)


@torch.library.custom_op("auk::norm_rope_qk", mutates_args=())
def norm_rope_qk(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    eps_q: float, eps_k: float, heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One stream: qkv [B, N, 3 * H * Dh] -> (q, k), each a new [B, N, H, Dh], normalised and rotated.
    v is left where it is (a view of qkv)."""
    q, k, _ = _outputs(qkv, qkv.shape[1], heads, with_v=False)
    _launch(q, k, None, qkv, None, (q_weight, k_weight, q_weight, k_weight), (cos, sin), None, eps_q, eps_k, heads)
    return q, k


@norm_rope_qk.register_fake
def _(qkv, q_weight, k_weight, cos, sin, eps_q, eps_k, heads):
    q, k, _ = _outputs(qkv, qkv.shape[1], heads, with_v=False)
    return q, k


@torch.library.custom_op("auk::joint_norm_rope_qkv", mutates_args=())
def joint_norm_rope_qkv(
    qkv_a: torch.Tensor, qkv_c: torch.Tensor,
    q_weight_a: torch.Tensor, k_weight_a: torch.Tensor, q_weight_c: torch.Tensor, k_weight_c: torch.Tensor,
    cos_a: torch.Tensor, sin_a: torch.Tensor, cos_c: torch.Tensor, sin_c: torch.Tensor,
    eps_q: float, eps_k: float, heads: int, key_slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two streams joined along the sequence: (q, k, v), each a new [B, Na + Nc, H, Dh], the first
    stream's tokens first; q and k normalised and rotated with each stream's own weights and tables.
    The two streams share eps (a block's norms are built alike). With `key_slots` (int32
    [B, Na + Nc]) each joint token's k and v go to its slot."""
    q, k, v = _outputs(qkv_a, qkv_a.shape[1] + qkv_c.shape[1], heads, with_v=True)
    _launch(q, k, v, qkv_a, qkv_c, (q_weight_a, k_weight_a, q_weight_c, k_weight_c),
            (cos_a, sin_a), (cos_c, sin_c), eps_q, eps_k, heads, key_slots)
    return q, k, v


@joint_norm_rope_qkv.register_fake
def _(qkv_a, qkv_c, q_weight_a, k_weight_a, q_weight_c, k_weight_c, cos_a, sin_a, cos_c, sin_c, eps_q, eps_k,
      heads, key_slots=None):
    return _outputs(qkv_a, qkv_a.shape[1] + qkv_c.shape[1], heads, with_v=True)
