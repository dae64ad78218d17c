"""The AuK flow-matching transformer ("DiT"): one velocity evaluation, checkpoint-compatible.

Parameter names and shapes follow the released `auk.safetensors` (with its
`transformer.` prefix stripped), so the checkpoint loads with
`load_state_dict(strict=True)`. Sizes always come from `config.json` -> `dit`;
the model is built as `AuKTransformer(latent_dim=vae.latent_dim, **config["dit"])`.

Layout of one velocity call:

    temb  = TimeMLP(sincos(1000 t))
    c     = RMSNorm(Linear(text))                 text stream, width D
    a     = [AudioEmbed(ref) | AudioEmbed(x)]     embedded separately, then joined
    Ld double blocks: joint attention over [a | c], each stream its own weights
    Ls single blocks over h = [c | a]
    velocity = proj_out(FinalAdaLN(h[:, -n:], temb))

The per-request parts (text projection, reference embedding, masks, rotary
tables) are built once by `prepare()`; `step()` is one velocity evaluation
against them, and `forward()` is the two together. The AdaLN modulation depends
on the time alone: a run computes it once per grid time (`modulation_table`)
and `step()` looks it up; `velocity()` is the step given its modulation, the
part a CUDA graph captures and `torch.compile` compiles block by block.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import padded_attention
from .padded_attention import ValidFirst, attend_valid_keys, gather_tokens, key_bias, key_layout, valid_first
from .two_streams import side_by_side

log = logging.getLogger(__name__)

WEIGHTS_FILE = "auk.safetensors"
CONFIG_FILE = "config.json"
CHECKPOINT_PREFIX = "transformer."
# Encoder-stage layer-fusion weights stored next to the DiT: not ours, skipped silently.
ENCODER_FUSION_KEYS = ("layer_weights", "layer_scale")

TIME_FEATURES = 256
TIME_SCALE = 1000.0
CONV_POS_KERNEL = 31
CONV_POS_GROUPS = 16
LN_EPS = 1e-6
ROPE_BASE = 10000.0


# --------------------------------------------------------------------------- embeddings


def timestep_features(t: torch.Tensor) -> torch.Tensor:
    """[B] times -> [B, 256] fp32 features: sin of 128 angles, then their cos.

    The frequency vector is built exactly as the reference does (fp32 index
    vector times the Python-float step, then exp): other orderings move some
    frequencies by one ULP.
    """
    half = TIME_FEATURES // 2
    decay = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * -decay)
    angles = TIME_SCALE * t.float()[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FEATURES, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        features = timestep_features(t).to(self.time_mlp[0].weight.dtype)
        return self.time_mlp(features)


class ConvPositionEmbedding(nn.Module):
    """h plus two grouped convs of it with Mish, re-zeroing padded frames after each conv."""

    def __init__(self, dim: int):
        super().__init__()
        conv = dict(kernel_size=CONV_POS_KERNEL, padding=CONV_POS_KERNEL // 2, groups=CONV_POS_GROUPS)
        self.conv1d = nn.Sequential(
            nn.Conv1d(dim, dim, **conv), nn.Mish(), nn.Conv1d(dim, dim, **conv), nn.Mish()
        )

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None, kernels: bool = False) -> torch.Tensor:
        """With `kernels`, on a GPU, each conv with its masks and Mish is one kernel over the
        channels-last tokens (position_conv_kernel.py), and h is added by the second."""
        if kernels and _position_conv_kernel_fits(h):
            from .position_conv_kernel import position_conv

            conv1, conv2 = self.conv1d[0], self.conv1d[2]
            y = position_conv(h, mask, conv1.weight.permute(2, 1, 0), conv1.bias, None, conv1.groups)
            return position_conv(y, mask, conv2.weight.permute(2, 1, 0), conv2.bias, h, conv2.groups)
        return h + self._convs(h, mask)

    def lay_weights_taps_first(self) -> None:
        """Keep each conv's weight [D, D / groups, K] in memory taps first, as [K, D / groups, D]
        (the same values and shape, other strides): the layout the kernel reads, so its calls copy
        nothing. The eager convolutions take either."""
        for conv in (self.conv1d[0], self.conv1d[2]):
            taps_first = conv.weight.detach().permute(2, 1, 0).contiguous()
            conv.weight = nn.Parameter(taps_first.permute(2, 1, 0), requires_grad=False)

    def _convs(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        keep = None if mask is None else mask[:, None, :]  # [B, 1, N]
        y = h.transpose(1, 2)  # channels first [B, D, N]
        if keep is not None:
            y = y.masked_fill(~keep, 0.0)
        for conv, act in ((self.conv1d[0], self.conv1d[1]), (self.conv1d[2], self.conv1d[3])):
            y = conv(y)
            if keep is not None:
                y = y.masked_fill(~keep, 0.0)
            y = act(y)
        return y.transpose(1, 2)


class AudioEmbedding(nn.Module):
    """Latents [B, N, C] -> [B, N, D]: h + conv_stack(h) with h = Linear(z)."""

    def __init__(self, latent_dim: int, dim: int):
        super().__init__()
        self.linear = nn.Linear(latent_dim, dim)
        self.conv_pos_embed = ConvPositionEmbedding(dim)

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None, kernels: bool = False) -> torch.Tensor:
        return self.conv_pos_embed(self.linear(z), mask, kernels)


class RotaryEmbedding(nn.Module):
    """GPT-J-style (adjacent pairs) rotary tables over the full head width, in fp32."""

    def __init__(self, dim_head: int):
        super().__init__()
        self.dim_head = dim_head
        self.register_buffer("inv_freq", self._formula(None), persistent=True)

    def _formula(self, device) -> torch.Tensor:
        exponent = torch.arange(0, self.dim_head, 2, device=device, dtype=torch.float32) / self.dim_head
        return 1.0 / (ROPE_BASE**exponent)

    def fp32_inv_freq(self) -> torch.Tensor:
        # A copy cast below fp32 (the bf16 pipeline casts every stored tensor) is never used.
        if self.inv_freq.dtype == torch.float32:
            return self.inv_freq
        return self._formula(self.inv_freq.device)

    def tables(self, length: int, mask: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [L, Dh] without a mask or [B, L, Dh] with one."""
        if mask is None:
            positions = torch.arange(length, device=device)
        else:
            # Squeeze padding out: valid tokens are numbered consecutively.
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        angles = positions.float()[..., None] * self.fp32_inv_freq().to(device)[None, :]
        angles = angles.repeat_interleave(2, dim=-1)
        return angles.cos(), angles.sin()


def _rotate_pairs(u: torch.Tensor) -> torch.Tensor:
    pairs = u.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def rotate(u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on u with (cos, sin) tables that broadcast against it: computed in fp32, cast back."""
    u32 = u.float()
    return (u32 * cos + _rotate_pairs(u32) * sin).to(u.dtype)


def apply_rotary(u: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """u [B, H, L, Dh] (the spec's layout); rope tables [L, Dh] or [B, L, Dh].

    The model keeps heads as [B, L, H, Dh] and calls `rotate` with tables shaped for that."""
    cos, sin = rope
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return rotate(u, cos, sin)


# --------------------------------------------------------------------------- blocks
#
# AdaLN modulation depends on the time alone, so it is computed apart from the blocks:
# `modulation(temb)` is the linear, and `modulate(x, mod)` applies it. A run computes
# every AdaLN's modulation once per grid time (AuKTransformer.modulation_table) and its
# steps look it up; `forward(x, temb)` is the two together, the per-block reference. A
# modulation has one row per model row, or one row that broadcasts over them all.


class AdaLayerNormZero(nn.Module):
    """Linear(SiLU(temb)) -> shift/scale/gate for attention and for the feed-forward."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=LN_EPS)

    def modulation(self, temb: torch.Tensor) -> torch.Tensor:
        return self.linear(F.silu(temb))  # [R, 6D]

    @staticmethod
    def parts(mod: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A modulation [R, 6D] as the checkpoint lays it out: shift_msa, scale_msa, gate_msa,
        shift_mlp, scale_mlp, gate_mlp, each a view [R, 1, D]."""
        return mod[:, None].chunk(6, dim=-1)

    def modulate(self, x: torch.Tensor, mod: torch.Tensor):
        """LN(x)(1 + scale_msa) + shift_msa, then gate_msa, shift_mlp, scale_mlp, gate_mlp, each [R, 1, D]."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.parts(mod)
        return self.norm(x) * (1 + scale_msa) + shift_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp

    def forward(self, x: torch.Tensor, temb: torch.Tensor):
        return self.modulate(x, self.modulation(temb))


class AdaLayerNormFinal(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=LN_EPS)

    def modulation(self, temb: torch.Tensor) -> torch.Tensor:
        return self.linear(F.silu(temb))  # [R, 2D]: scale, then shift

    def modulate(self, x: torch.Tensor, mod: torch.Tensor) -> torch.Tensor:
        scale, shift = mod[:, None].chunk(2, dim=-1)
        return self.norm(x) * (1 + scale) + shift

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        return self.modulate(x, self.modulation(temb))


class FeedForward(nn.Module):
    """SwiGLU without biases: linear_out(SiLU(gate) * up), gate = first half."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, kernels: bool = False) -> torch.Tensor:
        """With `kernels`, where swiglu_kernel.py fits (a Hopper GPU, a plain bf16 linear_in), the
        product and its gate are one kernel; a single row's are left to cuBLAS and Inductor, faster
        at its size (benchmarks/studies/dit-step-kernels.md)."""
        if (kernels and x.shape[0] > 1 and type(self.linear_in) is nn.Linear
                and _swiglu_kernel_fits(x, self.linear_in.weight)):
            from .swiglu_kernel import swiglu_product

            return self.linear_out(swiglu_product(x, self.linear_in.weight))
        gate, up = self.linear_in(x).chunk(2, dim=-1)
        return self.linear_out(F.silu(gate) * up)


def _heads(qkv: torch.Tensor, heads: int):
    """[B, N, 3I] -> q, k, v, each a [B, N, H, Dh] view (q, k, v in that order, head-major).

    Heads stay where the projection put them: the norms and RoPE work on the last
    axis whatever the layout, and the attention kernels take [B, H, N, Dh] as a
    transposed view of this, so no copy re-lays them out."""
    return qkv.unflatten(-1, (3, heads, -1)).unbind(2)


def _attend(q, k, v, key_bias):
    """q, k, v [B, N, H, Dh] -> [B, N, H * Dh]; `key_bias` [B, 1, 1, K] additive (0: attend,
    -inf: a padded key) in q's dtype, or None.

    The bias is made once per run (`key_bias`): a boolean mask would be turned into it at
    every call, and an fp32 bias cast at every call."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=key_bias)
    return out.transpose(1, 2).flatten(2)


def _norm_eps(norm: nn.RMSNorm) -> float:
    """An RMSNorm's epsilon as torch applies it: None is float32's (the computation dtype of
    bf16, fp16 and fp32 inputs alike)."""
    return norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps


def _norm_rope_kernel_fits(qkv: torch.Tensor, norm: nn.RMSNorm) -> bool:
    """Whether norm_rope_kernel.py runs for these heads: on a GPU, heads of a power-of-two width
    (a Triton block's); other heads take the eager ops."""
    width = norm.normalized_shape[0]
    return qkv.is_cuda and width & (width - 1) == 0


def _swiglu_kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether swiglu_kernel.py computes a feed-forward's first product and gate (a GPU only: the
    module imports triton)."""
    if not x.is_cuda:
        return False
    from .swiglu_kernel import fits

    return fits(x, weight)


def _position_conv_kernel_fits(h: torch.Tensor) -> bool:
    """Whether position_conv_kernel.py runs the audio embedding's convolutions (a GPU only: the
    module imports triton)."""
    if not h.is_cuda:
        return False
    from .position_conv_kernel import fits

    return fits(h)


def _valid_keys_first(layout, x: torch.Tensor) -> bool:
    """Whether the kernels' path lays a masked attention's valid keys first and masks through
    cuDNN's padding mask (padded_attention.py): with a layout for them in the context, where the
    package serves this device."""
    return layout is not None and padded_attention.available(x.device)


def _adaln_kernels_run(kernels: bool, x: torch.Tensor) -> bool:
    """Whether a block runs its norms, modulations and attention residual in adaln_kernel.py: with
    `kernels`, on a GPU."""
    return kernels and x.is_cuda


def _activation_dtype(x: torch.Tensor) -> torch.dtype:
    """What the block's linears compute in: autocast's dtype under it (the kernels write what its
    cast would give them), else x's."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _bias_left(linear: nn.Module) -> torch.Tensor | None:
    """The bias that `_product` leaves to the AdaLN kernel reading its output: a plain nn.Linear's;
    None for another module (an FP8 linear), which adds its own."""
    return linear.bias if type(linear) is nn.Linear else None


def _product(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x) less the bias `_bias_left` gives."""
    return F.linear(x, linear.weight) if type(linear) is nn.Linear else linear(x)


def _zero_padded_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x.masked_fill(~mask[..., None], 0.0)


def _ff_update(x, ff, norm, shift, scale, gate):
    return x + gate * ff(norm(x) * (1 + scale) + shift)


class PendingStream(NamedTuple):
    """A residual stream with its last feed-forward update not yet added: the stream is
    `h + gate_mlp * update`, gate_mlp from `mod`, the [R, 6D] modulation of the block that made
    the update.

    On the kernels' path each block leaves its feed-forward's update to the next block's first
    LayerNorm kernel, which adds it as it reads the row (adaln_kernel.residual_ln_modulate):
    one pass over the stream where a separate residual kernel made two. A stack's first block
    gets a zero update under a zero modulation (`starting`), so every block of a kind is called
    with arguments of one form and one compilation serves them all."""

    h: torch.Tensor
    update: torch.Tensor
    mod: torch.Tensor

    @staticmethod
    def starting(h: torch.Tensor, zero_mod: torch.Tensor, dtype: torch.dtype) -> "PendingStream":
        """h with nothing pending: a zero update in the feed-forward's output dtype; `zero_mod`, zeros
        laid out as a block's modulation is (a view of an [R, total] row, as `split_modulation` makes)."""
        return PendingStream(h, torch.zeros(h.shape, dtype=dtype, device=h.device), zero_mod)

    def gate(self) -> torch.Tensor:
        return AdaLayerNormZero.parts(self.mod)[5]

    def settled(self) -> torch.Tensor:
        return self.h + self.gate() * self.update

    def gathered(self, places: torch.Tensor) -> "PendingStream":
        return PendingStream(gather_tokens(self.h, places), gather_tokens(self.update, places), self.mod)

    def last(self, n: int) -> "PendingStream":
        return PendingStream(self.h[:, -n:], self.update[:, -n:], self.mod)


class Attention(nn.Module):
    """Self-attention of the single-stream blocks."""

    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * inner)
        self.q_norm = nn.RMSNorm(dim_head)
        self.k_norm = nn.RMSNorm(dim_head)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x, rope, key_bias, mask, kernels: bool = False, valid_first=None):
        """With `kernels` on a GPU the output's padded rows are left for the caller's residual
        kernel to zero (adaln_kernel.py); otherwise they are zeroed here. `valid_first` (the
        kernels' path: a stream laid out with its valid tokens first, padded_attention.py)
        masks through cuDNN's padding mask instead of `key_bias`."""
        qkv = self.to_qkv(x)
        if kernels and _norm_rope_kernel_fits(qkv, self.q_norm):
            from .norm_rope_kernel import norm_rope_qk

            q, k = norm_rope_qk(qkv, self.q_norm.weight, self.k_norm.weight, *rope,
                                _norm_eps(self.q_norm), _norm_eps(self.k_norm), self.heads)
            v = _heads(qkv, self.heads)[2]
        else:
            q, k, v = _heads(qkv, self.heads)
            q, k = rotate(self.q_norm(q), *rope), rotate(self.k_norm(k), *rope)
        if valid_first is not None:
            attended = attend_valid_keys(q, k, v, valid_first.counts, valid_first.queries)
        else:
            attended = _attend(q, k, v, key_bias)
        out = self.to_out[0](attended)
        return out if _adaln_kernels_run(kernels, out) else _zero_padded_rows(out, mask)


class JointAttention(Attention):
    """Double-block attention: audio and text keep their own weights, attend over [audio | text].

    The audio side's weights are Attention's; the text side's carry a `c` suffix."""

    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__(dim, heads, dim_head)
        inner = heads * dim_head
        self.to_qkv_c = nn.Linear(dim, 3 * inner)
        self.c_q_norm = nn.RMSNorm(dim_head)
        self.c_k_norm = nn.RMSNorm(dim_head)
        self.to_out_c = nn.Linear(inner, dim)

    def forward(self, a, c, rope_a, rope_c, key_bias, audio_mask, c_mask, kernels: bool = False, keys=None):
        out = self.attend(self.to_qkv(a), self.to_qkv_c(c), rope_a, rope_c, key_bias, kernels, keys)
        na = a.shape[1]
        out_a, out_c = self.to_out[0](out[:, :na]), self.to_out_c(out[:, na:])
        if _adaln_kernels_run(kernels, out_a):
            return out_a, out_c
        return _zero_padded_rows(out_a, audio_mask), _zero_padded_rows(out_c, c_mask)

    def attend(self, qkv_a, qkv_c, rope_a, rope_c, key_bias, kernels: bool = False, keys=None):
        """Each stream's q/k/v projection [B, Na or Nc, 3I] -> the joint attention's output
        [B, Na + Nc, I], before the output projections."""
        if kernels and _norm_rope_kernel_fits(qkv_a, self.q_norm):
            from .norm_rope_kernel import joint_norm_rope_qkv

            keyed = _valid_keys_first(keys, qkv_a)  # keys: the context's joint_keys
            q, k, v = joint_norm_rope_qkv(qkv_a, qkv_c, self.q_norm.weight, self.k_norm.weight,
                                          self.c_q_norm.weight, self.c_k_norm.weight, *rope_a, *rope_c,
                                          _norm_eps(self.q_norm), _norm_eps(self.k_norm), self.heads,
                                          keys[0] if keyed else None)
            if keyed:
                out = attend_valid_keys(q, k, v, keys[1], keys[2])
            else:
                out = _attend(q, k, v, key_bias)
        else:
            qa, ka, va = _heads(qkv_a, self.heads)
            qc, kc, vc = _heads(qkv_c, self.heads)
            # Joined along the sequence axis of [B, N, H, Dh]: one copy each, already in the kernel's layout.
            q = torch.cat([rotate(self.q_norm(qa), *rope_a), rotate(self.c_q_norm(qc), *rope_c)], dim=1)
            k = torch.cat([rotate(self.k_norm(ka), *rope_a), rotate(self.c_k_norm(kc), *rope_c)], dim=1)
            v = torch.cat([va, vc], dim=1)
            out = _attend(q, k, v, key_bias)
        return out


class DoubleStreamBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_hidden: int):
        super().__init__()
        self.attn_norm_c = AdaLayerNormZero(dim)
        self.attn_norm_x = AdaLayerNormZero(dim)
        self.attn = JointAttention(dim, heads, dim_head)
        self.ff_norm_c = nn.LayerNorm(dim, elementwise_affine=False, eps=LN_EPS)
        self.ff_c = FeedForward(dim, ff_hidden)
        self.ff_norm_x = nn.LayerNorm(dim, elementwise_affine=False, eps=LN_EPS)
        self.ff_x = FeedForward(dim, ff_hidden)

    def forward(self, a, c, mod_c, mod_x, ctx: "DiTContext", kernels: bool = False):
        """mod_c, mod_x: attn_norm_c's and attn_norm_x's modulations at this step's time. Streams
        with their updates pending (the kernels' path, AuKTransformer.velocity) go through the kernels."""
        if isinstance(a, PendingStream):
            return self._forward_kernels(a, c, mod_c, mod_x, ctx)
        c_in, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.attn_norm_c.modulate(c, mod_c)
        a_in, a_gate_msa, a_shift_mlp, a_scale_mlp, a_gate_mlp = self.attn_norm_x.modulate(a, mod_x)
        da, dc = self.attn(a_in, c_in, ctx.rope_audio, ctx.rope_text, ctx.joint_bias, ctx.audio_mask, ctx.c_mask,
                           kernels)
        c = c + c_gate_msa * dc
        c = _ff_update(c, self.ff_c, self.ff_norm_c, c_shift_mlp, c_scale_mlp, c_gate_mlp)
        a = a + a_gate_msa * da
        a = _ff_update(a, self.ff_x, self.ff_norm_x, a_shift_mlp, a_scale_mlp, a_gate_mlp)
        return a, c

    def _forward_kernels(self, a: PendingStream, c: PendingStream, mod_c, mod_x, ctx: "DiTContext"):
        """forward() with each stream's norms, modulations and residuals in the AdaLN kernels (and
        the attention's q/k in norm_rope_kernel.py, the feed-forwards' gates in swiglu_kernel.py):
        the previous block's feed-forward updates added as the first norms read the streams, this
        block's left pending. On a GPU the text stream's work runs beside the audio stream's, on a
        second CUDA stream (two_streams.py), up to the joint attention and after it."""
        from .adaln_kernel import residual_ln_modulate

        dtype, attn = _activation_dtype(a.h), self.attn
        c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, _ = AdaLayerNormZero.parts(mod_c)  # gate_mlp: pending
        a_shift, a_scale, a_gate, a_shift_mlp, a_scale_mlp, _ = AdaLayerNormZero.parts(mod_x)

        def audio_in():
            x, h = residual_ln_modulate(a.h, a.update, a.gate(), None, a_scale, a_shift, self.attn_norm_x.norm.eps,
                                        dtype)
            return attn.to_qkv(x), h

        def text_in():
            x, h = residual_ln_modulate(c.h, c.update, c.gate(), None, c_scale, c_shift, self.attn_norm_c.norm.eps,
                                        dtype)
            return attn.to_qkv_c(x), h

        (qkv_a, a_h), (qkv_c, c_h) = side_by_side(audio_in, text_in, a.h.device)
        out = attn.attend(qkv_a, qkv_c, ctx.rope_audio, ctx.rope_text, ctx.joint_bias, True, ctx.joint_keys)
        na = qkv_a.shape[1]

        # The output projections' biases are left to the AdaLN kernels: on these strided halves of
        # the joint output a linear runs as a bmm, its bias as a kernel of its own.
        def audio_out():
            y = _product(attn.to_out[0], out[:, :na])
            ff_in, h = residual_ln_modulate(a_h, y, a_gate, ctx.audio_mask, a_scale_mlp, a_shift_mlp,
                                            self.ff_norm_x.eps, dtype, _bias_left(attn.to_out[0]))
            return PendingStream(h, self.ff_x(ff_in, True), mod_x)

        def text_out():
            y = _product(attn.to_out_c, out[:, na:])
            ff_in, h = residual_ln_modulate(c_h, y, c_gate, ctx.c_mask, c_scale_mlp, c_shift_mlp,
                                            self.ff_norm_c.eps, dtype, _bias_left(attn.to_out_c))
            return PendingStream(h, self.ff_c(ff_in, True), mod_c)

        return side_by_side(audio_out, text_out, a.h.device)


class SingleStreamBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_hidden: int):
        super().__init__()
        self.attn_norm = AdaLayerNormZero(dim)
        self.attn = Attention(dim, heads, dim_head)
        self.ff_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=LN_EPS)
        self.ff = FeedForward(dim, ff_hidden)

    def forward(self, h, mod, ctx: "DiTContext", kernels: bool = False):
        if isinstance(h, PendingStream):  # the kernels' path (AuKTransformer.velocity)
            return self._forward_kernels(h, mod, ctx)
        h_in, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm.modulate(h, mod)
        h = h + gate_msa * self.attn(h_in, ctx.rope_single, ctx.single_bias, ctx.single_mask, kernels)
        return _ff_update(h, self.ff, self.ff_norm, shift_mlp, scale_mlp, gate_mlp)

    def _forward_kernels(self, h: PendingStream, mod, ctx: "DiTContext"):
        """forward() as DoubleStreamBlock._forward_kernels runs each of its streams."""
        from .adaln_kernel import residual_ln_modulate

        dtype = _activation_dtype(h.h)
        shift, scale, gate, shift_mlp, scale_mlp, _ = AdaLayerNormZero.parts(mod)
        h_in, stream = residual_ln_modulate(h.h, h.update, h.gate(), None, scale, shift, self.attn_norm.norm.eps,
                                            dtype)
        # With it, the stream comes laid out with its valid tokens first (AuKTransformer.velocity).
        y = self.attn(h_in, ctx.rope_single, ctx.single_bias, ctx.single_mask, True, ctx.single_valid_first)
        ff_in, stream = residual_ln_modulate(stream, y, gate, ctx.single_mask, scale_mlp, shift_mlp,
                                             self.ff_norm.eps, dtype)
        return PendingStream(stream, self.ff(ff_in, True), mod)


def run_double_block(block: DoubleStreamBlock, a, c, mod_c, mod_x, ctx):
    return block(a, c, mod_c, mod_x, ctx)


def run_single_block(block: SingleStreamBlock, h, mod, ctx):
    return block(h, mod, ctx)


# The same with the attention's q/k norms and RoPE (and the joint join) in one Triton kernel
# per block on a GPU (norm_rope_kernel.py): what the compiled blocks run there.
def run_double_block_kernels(block: DoubleStreamBlock, a, c, mod_c, mod_x, ctx):
    return block(a, c, mod_c, mod_x, ctx, kernels=True)


def run_single_block_kernels(block: SingleStreamBlock, h, mod, ctx):
    return block(h, mod, ctx, kernels=True)


def run_audio_embedding(embed: "AudioEmbedding", x, target_mask):
    """The target's audio tokens: x embedded, its padded frames re-zeroed in the convolutions."""
    return embed(x, target_mask)


def run_audio_embedding_kernels(embed: "AudioEmbedding", x, target_mask):
    """The same with each convolution one Triton kernel on a GPU (position_conv_kernel.py)."""
    return embed(x, target_mask, kernels=True)


def run_output(norm_out: AdaLayerNormFinal, proj_out: nn.Linear, h, mod, n: int, places=None):
    """The velocity of the target's n tokens from the single stream's output (a tensor, or a
    PendingStream: its update added here): its last n, or those at `places` (int64 [B, n]) of a
    stream laid out with its valid tokens first."""
    if places is not None:
        h = h.gathered(places) if isinstance(h, PendingStream) else gather_tokens(h, places)
    target = h.last(n).settled() if isinstance(h, PendingStream) else h[:, -n:]
    return proj_out(norm_out.modulate(target, mod))


@dataclass(frozen=True)
class BlockRunners:
    """How `velocity` calls its blocks and the parts around them: as they are, or compiled (see
    compiled.py). Every block of a kind runs through the same function, so one compilation
    serves all of them. `kernels`: the blocks run the kernels' path, which on a GPU takes a padded
    single stream laid out with its valid tokens first (padded_attention.py) where it can, and
    streams with their feed-forward updates pending (PendingStream)."""

    double: Callable = run_double_block
    single: Callable = run_single_block
    audio_embedding: Callable = run_audio_embedding
    output: Callable = run_output
    kernels: bool = False


EAGER_BLOCKS = BlockRunners()


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModulationTable:
    """Every AdaLN's modulation at each time of a run's grid, computed once for the grid
    (the sampler keeps it for that grid's later runs).

    The step looks its time up instead of running the 61 AdaLN linears (1.1 GB of
    bf16 weights at the released dims) again at every step. Rows hold exactly what
    the per-block computation gives (the same linears on the same time embedding),
    one row per time that broadcasts over every row of the batch."""

    rows: dict  # a grid time, as a Python float -> its row in `values`
    values: torch.Tensor  # [times, total]

    def lookup(self, time) -> torch.Tensor | None:
        """The modulation [1, total] at `time` (a number or a 0-d tensor; one on a GPU is read
        back, so pass the CPU grid's), or None when the time is not in the table."""
        if torch.is_tensor(time) and time.dim() != 0:
            return None
        index = self.rows.get(float(time))
        return None if index is None else self.values[index : index + 1]


@dataclass
class DiTContext:
    """What the velocity calls of one request share. Rows are [cond; uncond] under CFG.

    Per-row tensors lead with the model rows (B' = B * copies), or with one row that
    broadcasts over them (rotary tables without a mask)."""

    n: int  # target frames
    copies: int  # 2 under CFG (rows duplicated), else 1
    c: torch.Tensor  # [B', nt, D] projected text; zeros for unconditional rows
    prompt: torch.Tensor | None  # [B', np, D] embedded reference, or None
    target_mask: torch.Tensor | None  # [B, n]: x is embedded before its rows are copied
    c_mask: torch.Tensor | None  # [B', nt]
    audio_mask: torch.Tensor | None  # [B', np + n]
    single_mask: torch.Tensor | None  # [B', nt + np + n]
    # The attention's additive key bias (key_bias), in its inputs' dtype: [B', 1, 1, np + n + nt]
    # for the joint attention, [B', 1, 1, nt + np + n] for the single blocks'.
    joint_bias: torch.Tensor | None
    single_bias: torch.Tensor | None
    # (cos, sin), each [B' or 1, L, 1, Dh]: shaped for heads laid out [B, L, H, Dh]
    rope_audio: tuple[torch.Tensor, torch.Tensor]
    rope_text: tuple[torch.Tensor, torch.Tensor]
    rope_single: tuple[torch.Tensor, torch.Tensor]
    # The run's modulation table (not a tensor of the step's own: a graph copies its row in).
    modulation: ModulationTable | None = None
    # With masks, for cuDNN's padding mask (padded_attention.py): the joint attention's key layout
    # (key_layout: key slots [B', K], valid keys [B'], queries [B']), and the single stream laid
    # out with its valid tokens first (valid_first).
    joint_keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    single_valid_first: ValidFirst | None = None

    def head(self, rows: int) -> "DiTContext":
        """Views of the first `rows` model rows: a graph of fewer rows reads the front of the
        buffers of a context with more, so one set of buffers serves every row count."""
        cut = lambda t: None if t is None else t[:rows]  # noqa: E731  (a one-row table stays one row)
        return replace(
            self,
            c=cut(self.c), prompt=cut(self.prompt), c_mask=cut(self.c_mask), audio_mask=cut(self.audio_mask),
            single_mask=cut(self.single_mask), joint_bias=cut(self.joint_bias), single_bias=cut(self.single_bias),
            target_mask=None if self.target_mask is None else self.target_mask[: rows // self.copies],
            rope_audio=tuple(map(cut, self.rope_audio)), rope_text=tuple(map(cut, self.rope_text)),
            rope_single=tuple(map(cut, self.rope_single)),
            joint_keys=None if self.joint_keys is None else tuple(map(cut, self.joint_keys)),
            single_valid_first=(None if self.single_valid_first is None
                                else ValidFirst(*map(cut, self.single_valid_first))),
        )


@dataclass(frozen=True)
class ContextMasks:
    """The part of a DiTContext that its padding alone decides (`AuKTransformer.context_masks`):
    equal rows' lengths give equal tensors, whatever the prompt. Fields as DiTContext's, with
    `ref_mask` [B, np] (None: no reference, or one unmasked) for the prompt's embedding."""

    copies: int
    ref_mask: torch.Tensor | None
    target_mask: torch.Tensor | None
    c_mask: torch.Tensor
    audio_mask: torch.Tensor | None
    single_mask: torch.Tensor | None
    joint_bias: torch.Tensor | None
    single_bias: torch.Tensor | None
    rope_audio: tuple[torch.Tensor, torch.Tensor]
    rope_text: tuple[torch.Tensor, torch.Tensor]
    rope_single: tuple[torch.Tensor, torch.Tensor]
    joint_keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    single_valid_first: ValidFirst | None = None


def _repeat_rows(t: torch.Tensor | None, copies: int) -> torch.Tensor | None:
    return t if t is None or copies == 1 else torch.cat([t] * copies, dim=0)


def _rope_for_heads(tables: tuple[torch.Tensor, torch.Tensor], copies: int):
    """Tables [L, Dh] or [B, L, Dh] -> [1 or B', L, 1, Dh], broadcasting over heads in [B, L, H, Dh]."""
    if tables[0].dim() == 2:
        return tuple(t[None, :, None] for t in tables)
    return tuple(_repeat_rows(t, copies)[:, :, None] for t in tables)


class AuKTransformer(nn.Module):
    """The AuK DiT. Constructor arguments are exactly the `dit` config keys plus `latent_dim`."""

    def __init__(
        self,
        dim: int = 1536,
        heads: int = 24,
        dim_head: int | None = None,
        ff_mult: float = 2,
        text_hidden_dim: int = 2048,
        num_layers: int = 10,
        num_single_layers: int = 20,
        latent_dim: int = 64,
        attn_mask_enabled: bool = True,
    ):
        super().__init__()
        dim_head = dim // heads if dim_head is None else dim_head
        if dim_head % 2:
            raise ValueError(f"dim_head must be even for rotary embeddings, got {dim_head}")
        ff_hidden = int(dim * ff_mult)
        self.dim, self.heads, self.dim_head = dim, heads, dim_head
        self.latent_dim, self.text_hidden_dim = latent_dim, text_hidden_dim
        self.attn_mask_enabled = bool(attn_mask_enabled)

        self.time_embed = TimestepEmbedding(dim)
        self.txt_proj = nn.Linear(text_hidden_dim, dim)
        self.txt_norm = nn.RMSNorm(dim)
        self.audio_embed = AudioEmbedding(latent_dim, dim)
        self.rotary_embed = RotaryEmbedding(dim_head)
        self.transformer_blocks = nn.ModuleList(
            DoubleStreamBlock(dim, heads, dim_head, ff_hidden) for _ in range(num_layers)
        )
        self.single_transformer_blocks = nn.ModuleList(
            SingleStreamBlock(dim, heads, dim_head, ff_hidden) for _ in range(num_single_layers)
        )
        self.norm_out = AdaLayerNormFinal(dim)
        self.proj_out = nn.Linear(dim, latent_dim)

    def prepare(
        self,
        text: torch.Tensor,
        n: int,
        *,
        c_mask: torch.Tensor | None = None,
        ref: torch.Tensor | None = None,
        ref_mask: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cfg_infer: bool = False,
        drop_text: bool = False,
        drop_audio_cond: bool = False,
        masks: "ContextMasks | None" = None,
    ) -> DiTContext:
        """One request's conditioning for targets of n frames.

        text [B, nt, T]; ref [B, np, C]; masks are boolean, true = valid. `cfg_infer`
        builds [cond; uncond] rows together; `drop_text` / `drop_audio_cond` make a
        single unconditional branch instead. `masks` (from `context_masks`, for these
        shapes, padding and `cfg_infer`) stands for c_mask, ref_mask and mask: a caller that
        keeps them per padding skips their kernels.
        """
        B, nt, _ = text.shape
        if ref is not None and ref.shape[1] == 0:
            ref, ref_mask = None, None
        if masks is None:
            if c_mask is None:
                c_mask = text.ne(0).any(dim=-1)  # padding rows are exactly zero
            masks = self.context_masks(c_mask, n, 0 if ref is None else ref.shape[1], ref_mask=ref_mask,
                                       mask=mask, cfg_infer=cfg_infer)

        c = self.txt_norm(self.txt_proj(text))
        if drop_text:
            c = torch.zeros_like(c)
        prompt = None
        if ref is not None:
            # The unconditional prompt embeds zeros: it still carries the linear and conv biases.
            cond = None if drop_audio_cond else self.audio_embed(ref, masks.ref_mask)
            uncond = (self.audio_embed(torch.zeros_like(ref), masks.ref_mask) if cfg_infer or drop_audio_cond
                      else None)
            prompt = torch.cat([cond, uncond], dim=0) if cfg_infer else (cond if cond is not None else uncond)
        if cfg_infer:
            c = torch.cat([c, torch.zeros_like(c)], dim=0)
        return DiTContext(n=n, copies=masks.copies, c=c, prompt=prompt, target_mask=masks.target_mask,
                          c_mask=masks.c_mask, audio_mask=masks.audio_mask, single_mask=masks.single_mask,
                          joint_bias=masks.joint_bias, single_bias=masks.single_bias, rope_audio=masks.rope_audio,
                          rope_text=masks.rope_text, rope_single=masks.rope_single,
                          joint_keys=masks.joint_keys, single_valid_first=masks.single_valid_first)

    def context_masks(self, c_mask: torch.Tensor, n: int, np_: int = 0, *, ref_mask: torch.Tensor | None = None,
                      mask: torch.Tensor | None = None, cfg_infer: bool = False) -> "ContextMasks":
        """What a context's padding gives it (spec section 4.5): c_mask [B, nt]; a reference of
        np_ frames (0: none) with its ref_mask; the target mask [B, n]. Under autocast, as the
        steps run: the key biases are in the attention's dtype."""
        B = c_mask.shape[0]
        device = c_mask.device
        if mask is not None and mask.shape != (B, n):
            raise ValueError(f"target mask must be [{B}, {n}], got {list(mask.shape)}")
        if np_ == 0:
            ref_mask = None
        copies = 2 if cfg_infer else 1

        # Masks exist only where padding can (spec section 4.5).
        if np_ == 0:
            audio_mask = mask
        elif ref_mask is None and mask is None:
            audio_mask = None
        else:
            ones = lambda length: torch.ones(B, length, dtype=torch.bool, device=device)  # noqa: E731
            audio_mask = torch.cat([ref_mask if ref_mask is not None else ones(np_),
                                    mask if mask is not None else ones(n)], dim=1)
        single_mask = None if audio_mask is None else torch.cat([c_mask, audio_mask], dim=1)
        rope = self.rotary_embed.tables
        nt = c_mask.shape[1]
        joint_bias = single_bias = joint_keys = single_valid_first = None
        if self.attn_mask_enabled and audio_mask is not None:
            # In the dtype the attention will see: autocast's where prepare runs under it, as the steps do.
            dtype = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
                     else self.proj_out.weight.dtype)
            joint_valid = torch.cat([audio_mask, c_mask], dim=1)
            joint_bias, single_bias = key_bias(joint_valid, dtype), key_bias(single_mask, dtype)
            joint_keys = tuple(_repeat_rows(t, copies) for t in key_layout(joint_valid))
            first = valid_first(single_mask, n, _rope_for_heads(rope(nt + np_ + n, None, device), 1))
            single_valid_first = ValidFirst(*(_repeat_rows(t, copies) for t in first[:-2]), *first[-2:])
        return ContextMasks(
            copies=copies,
            ref_mask=ref_mask,
            target_mask=mask,
            c_mask=_repeat_rows(c_mask, copies),
            audio_mask=_repeat_rows(audio_mask, copies),
            single_mask=_repeat_rows(single_mask, copies),
            joint_bias=_repeat_rows(joint_bias, copies),
            single_bias=_repeat_rows(single_bias, copies),
            rope_audio=_rope_for_heads(rope(np_ + n, audio_mask, device), copies),
            rope_text=_rope_for_heads(rope(nt, c_mask, device), copies),
            rope_single=_rope_for_heads(rope(nt + np_ + n, single_mask, device), copies),
            joint_keys=joint_keys,
            single_valid_first=single_valid_first,
        )

    # ---- modulation: a function of the time alone

    def adaln_norms(self) -> list[nn.Module]:
        """Every AdaLN, in the order of a modulation's columns: each double block's text then
        audio norm, each single block's, the final one."""
        norms: list[nn.Module] = []
        for block in self.transformer_blocks:
            norms += [block.attn_norm_c, block.attn_norm_x]
        norms += [block.attn_norm for block in self.single_transformer_blocks]
        return norms + [self.norm_out]

    def modulation(self, temb: torch.Tensor) -> torch.Tensor:
        """Every AdaLN's modulation for time embeddings [R, D] -> [R, total], side by side."""
        return torch.cat([norm.modulation(temb) for norm in self.adaln_norms()], dim=-1)

    def modulation_at(self, time, copies: int = 1) -> torch.Tensor:
        """The modulation at `time`: one row for a scalar (it broadcasts over the batch), else a
        row per time, copied for the CFG rows."""
        time = torch.as_tensor(time, dtype=torch.float32, device=self.proj_out.weight.device)
        if time.dim() == 0:
            return self.modulation(self.time_embed(time[None]))
        return _repeat_rows(self.modulation(self.time_embed(time)), copies)

    def modulation_table(self, times) -> ModulationTable:
        """The modulation at each of `times` (a run's grid, on the CPU), for its steps to look up.
        Run it under the steps' autocast: it holds what they would compute."""
        times = torch.as_tensor(times, dtype=torch.float32).cpu().flatten()
        values = self.modulation(self.time_embed(times.to(self.proj_out.weight.device)))
        return ModulationTable({t: i for i, t in enumerate(times.tolist())}, values)

    def split_modulation(self, mod: torch.Tensor):
        """A modulation [R, total] -> an iterator of each AdaLN's columns (views), in `adaln_norms` order."""
        widths = [norm.linear.out_features for norm in self.adaln_norms()]
        return iter(mod.split(widths, dim=-1))

    # ---- one velocity evaluation

    def step(self, x: torch.Tensor, time, ctx: DiTContext) -> torch.Tensor:
        """One velocity evaluation: x [B, n, C], time scalar or [B] -> [B * ctx.copies, n, C].

        A time in the context's modulation table is looked up; any other is computed."""
        if x.shape[1] != ctx.n:
            raise ValueError(f"context was prepared for {ctx.n} target frames, x has {x.shape[1]}")
        mod = None if ctx.modulation is None else ctx.modulation.lookup(time)
        if mod is None:
            if torch.is_tensor(time):
                time = time.to(x.device)
            mod = self.modulation_at(time, ctx.copies)
        return self.velocity(x, mod, ctx)

    def velocity(self, x: torch.Tensor, mod: torch.Tensor, ctx: DiTContext,
                 blocks: BlockRunners = EAGER_BLOCKS) -> torch.Tensor:
        """The step given its modulation [1 or B', total]: what a CUDA graph captures."""
        n = x.shape[1]
        mods = self.split_modulation(mod)
        a = _repeat_rows(blocks.audio_embedding(self.audio_embed, x, ctx.target_mask), ctx.copies)
        if ctx.prompt is not None:
            a = torch.cat([ctx.prompt, a], dim=1)
        c = ctx.c
        pending = blocks.kernels and _adaln_kernels_run(True, a)
        if pending:  # the feed-forwards' updates left to the next block's norm kernel (PendingStream)
            dtype = _activation_dtype(a)
            # Zero modulations laid out as `mods`, one per stream: a block's guards tell its arguments apart.
            zeros = self.split_modulation(torch.zeros_like(mod))
            zero_c, zero_x = next(zeros), next(zeros)
            a, c = PendingStream.starting(a, zero_x, dtype), PendingStream.starting(c, zero_c, dtype)
        for block in self.transformer_blocks:
            a, c = blocks.double(block, a, c, next(mods), next(mods), ctx)
        if pending:
            a, c = a.settled(), c.settled()
        h = torch.cat([c, a], dim=1)
        first = ctx.single_valid_first
        if first is not None and blocks.kernels and _valid_keys_first(first, h):
            # The single blocks' stream laid out with its valid tokens first (padded_attention.py).
            h = gather_tokens(h, first.order)
            ctx = replace(ctx, rope_single=(first.cos, first.sin), single_mask=first.mask, single_bias=None)
        elif first is not None:
            ctx = replace(ctx, single_valid_first=None)
        if pending:
            h = PendingStream.starting(h, next(zeros), dtype)
        for block in self.single_transformer_blocks:
            h = blocks.single(block, h, next(mods), ctx)
        places = None if ctx.single_valid_first is None else first.target
        return blocks.output(self.norm_out, self.proj_out, h, next(mods), n, places)

    def forward(self, x: torch.Tensor, text: torch.Tensor, time, **prepare_kwargs) -> torch.Tensor:
        """prepare() and step() together: one velocity evaluation from scratch."""
        return self.step(x, time, self.prepare(text, x.shape[1], **prepare_kwargs))


# --------------------------------------------------------------------------- checkpoint


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot give this model its weights."""


def read_config(checkpoint_dir) -> dict:
    path = Path(checkpoint_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"missing {path}: the DiT reads its sizes from config.json")
    config = json.loads(path.read_text())
    for section in ("dit", "vae"):
        if section not in config:
            raise CheckpointError(f"{path} has no '{section}' section, which the DiT needs")
    return config


def build_transformer(config: dict, device="cpu") -> AuKTransformer:
    """The module for a config.json, with its parameters on `device` (use "meta" to allocate nothing)."""
    with torch.device(device):
        return AuKTransformer(latent_dim=int(config["vae"]["latent_dim"]), **config["dit"])


def dit_keys(checkpoint_keys) -> list[str]:
    """The DiT tensors among a released checkpoint's keys, with the `transformer.` prefix stripped.

    The encoder stage's fusion weights are skipped; any other key outside the prefix
    draws a warning and is ignored. Keys inside the prefix all go to a strict load,
    so a stray one there is an error.
    """
    names, ignored = [], []
    for key in checkpoint_keys:
        if key.startswith(CHECKPOINT_PREFIX):
            names.append(key[len(CHECKPOINT_PREFIX):])
        elif key not in ENCODER_FUSION_KEYS:
            ignored.append(key)
    if ignored:
        log.warning("ignoring %d checkpoint key(s) that are not DiT weights: %s", len(ignored), ignored[:8])
    return names


def load_transformer(checkpoint_dir, device="cpu", dtype: torch.dtype = torch.float32) -> AuKTransformer:
    """Build the DiT from `config.json` and load `auk.safetensors` strictly, cast to `dtype`.

    The module is built on the meta device and takes the checkpoint's tensors as
    they are read (cast on the target device), so no random initialisation runs.
    """
    from safetensors import safe_open

    checkpoint_dir = Path(checkpoint_dir)
    config = read_config(checkpoint_dir)
    weights = checkpoint_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"missing {weights}: the DiT weights file (auk.safetensors) is not there")
    model = build_transformer(config, device="meta")
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        # One tensor at a time, cast on the target device as it is read.
        state = {
            name: f.get_tensor(CHECKPOINT_PREFIX + name).to(device=device, dtype=dtype) for name in dit_keys(f.keys())
        }
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise CheckpointError(f"{weights} does not match the DiT built from {CONFIG_FILE}: {err}") from None
    return ready_for_inference(model)


def ready_for_inference(model: AuKTransformer) -> AuKTransformer:
    """A loaded DiT in eval mode without gradients; on a GPU, its position convolutions' weights laid
    out for the kernels' path (ConvPositionEmbedding.lay_weights_taps_first)."""
    if model.proj_out.weight.is_cuda:
        model.audio_embed.conv_pos_embed.lay_weights_taps_first()
    return model.eval().requires_grad_(False)
