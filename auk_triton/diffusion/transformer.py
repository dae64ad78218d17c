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

The per-request parts (text projection, reference embedding, masks, attention
bias, rotary tables) are built once by `prepare()`; `step()` is one velocity
evaluation against them, and `forward()` is the two together.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

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
    """Two grouped convs with Mish, re-zeroing padded frames after each conv."""

    def __init__(self, dim: int):
        super().__init__()
        conv = dict(kernel_size=CONV_POS_KERNEL, padding=CONV_POS_KERNEL // 2, groups=CONV_POS_GROUPS)
        self.conv1d = nn.Sequential(
            nn.Conv1d(dim, dim, **conv), nn.Mish(), nn.Conv1d(dim, dim, **conv), nn.Mish()
        )

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
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

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.linear(z)
        return h + self.conv_pos_embed(h, mask)


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


def apply_rotary(u: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """u [B, H, L, Dh]; rope tables [L, Dh] or [B, L, Dh]. Computed in fp32, cast back."""
    cos, sin = rope
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    u32 = u.float()
    return (u32 * cos + _rotate_pairs(u32) * sin).to(u.dtype)


# --------------------------------------------------------------------------- blocks


class AdaLayerNormZero(nn.Module):
    """Linear(SiLU(temb)) -> shift/scale/gate for attention and for the feed-forward."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=LN_EPS)

    def forward(self, x: torch.Tensor, temb: torch.Tensor):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(F.silu(temb)).chunk(6, dim=-1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormFinal(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=LN_EPS)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=-1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]


class FeedForward(nn.Module):
    """SwiGLU without biases: linear_out(SiLU(gate) * up), gate = first half."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_in(x).chunk(2, dim=-1)
        return self.linear_out(F.silu(gate) * up)


def _split_heads(qkv: torch.Tensor, heads: int):
    """[B, N, 3I] -> q, k, v, each [B, H, N, Dh] (q, k, v in that order, head-major)."""
    return [t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1)]


def _attend(q, k, v, bias):
    if bias is not None and bias.dtype != q.dtype:
        bias = bias.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return out.transpose(1, 2).flatten(2)  # [B, N, I]


def _zero_padded_rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x.masked_fill(~mask[..., None], 0.0)


def _ff_update(x, ff, norm, shift, scale, gate):
    return x + gate[:, None] * ff(norm(x) * (1 + scale[:, None]) + shift[:, None])


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

    def forward(self, x, rope, bias, mask):
        q, k, v = _split_heads(self.to_qkv(x), self.heads)
        q = apply_rotary(self.q_norm(q), rope)
        k = apply_rotary(self.k_norm(k), rope)
        return _zero_padded_rows(self.to_out[0](_attend(q, k, v, bias)), mask)


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

    def forward(self, a, c, rope_a, rope_c, bias, audio_mask, c_mask):
        qa, ka, va = _split_heads(self.to_qkv(a), self.heads)
        qc, kc, vc = _split_heads(self.to_qkv_c(c), self.heads)
        qa, ka = apply_rotary(self.q_norm(qa), rope_a), apply_rotary(self.k_norm(ka), rope_a)
        qc, kc = apply_rotary(self.c_q_norm(qc), rope_c), apply_rotary(self.c_k_norm(kc), rope_c)
        q, k, v = (torch.cat(pair, dim=2) for pair in ((qa, qc), (ka, kc), (va, vc)))
        out = _attend(q, k, v, bias)
        na = a.shape[1]
        out_a = _zero_padded_rows(self.to_out[0](out[:, :na]), audio_mask)
        out_c = _zero_padded_rows(self.to_out_c(out[:, na:]), c_mask)
        return out_a, out_c


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

    def forward(self, a, c, temb, ctx: "DiTContext"):
        c_in, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.attn_norm_c(c, temb)
        a_in, a_gate_msa, a_shift_mlp, a_scale_mlp, a_gate_mlp = self.attn_norm_x(a, temb)
        da, dc = self.attn(a_in, c_in, ctx.rope_audio, ctx.rope_text, ctx.joint_bias, ctx.audio_mask, ctx.c_mask)
        c = c + c_gate_msa[:, None] * dc
        c = _ff_update(c, self.ff_c, self.ff_norm_c, c_shift_mlp, c_scale_mlp, c_gate_mlp)
        a = a + a_gate_msa[:, None] * da
        a = _ff_update(a, self.ff_x, self.ff_norm_x, a_shift_mlp, a_scale_mlp, a_gate_mlp)
        return a, c


class SingleStreamBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_hidden: int):
        super().__init__()
        self.attn_norm = AdaLayerNormZero(dim)
        self.attn = Attention(dim, heads, dim_head)
        self.ff_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=LN_EPS)
        self.ff = FeedForward(dim, ff_hidden)

    def forward(self, h, temb, ctx: "DiTContext"):
        h_in, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(h, temb)
        h = h + gate_msa[:, None] * self.attn(h_in, ctx.rope_single, ctx.single_bias, ctx.single_mask)
        return _ff_update(h, self.ff, self.ff_norm, shift_mlp, scale_mlp, gate_mlp)


# --------------------------------------------------------------------------- the model


@dataclass
class DiTContext:
    """What the velocity calls of one request share. Rows are [cond; uncond] under CFG."""

    n: int  # target frames
    copies: int  # 2 under CFG (rows duplicated), else 1
    c: torch.Tensor  # [B', nt, D] projected text; zeros for unconditional rows
    prompt: torch.Tensor | None  # [B', np, D] embedded reference, or None
    target_mask: torch.Tensor | None  # [B, n]: x is embedded before its rows are copied
    c_mask: torch.Tensor | None  # [B', nt]
    audio_mask: torch.Tensor | None  # [B', np + n]
    single_mask: torch.Tensor | None  # [B', nt + np + n]
    joint_bias: torch.Tensor | None  # [B', 1, 1, np + n + nt]
    single_bias: torch.Tensor | None  # [B', 1, 1, nt + np + n]
    rope_audio: tuple[torch.Tensor, torch.Tensor]
    rope_text: tuple[torch.Tensor, torch.Tensor]
    rope_single: tuple[torch.Tensor, torch.Tensor]


def _key_bias(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Key mask [B, K] -> additive bias [B, 1, 1, K]: 0 for valid keys, -inf for padding."""
    if mask is None:
        return None
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return bias.masked_fill(~mask, float("-inf"))[:, None, None, :]


def _repeat_rows(t: torch.Tensor | None, copies: int) -> torch.Tensor | None:
    return t if t is None or copies == 1 else torch.cat([t] * copies, dim=0)


def _repeat_rope(tables: tuple[torch.Tensor, torch.Tensor], copies: int):
    # Unbatched tables [L, Dh] broadcast over every row; per-row ones [B, L, Dh] are copied.
    return tables if tables[0].dim() == 2 else tuple(_repeat_rows(t, copies) for t in tables)


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
    ) -> DiTContext:
        """One request's conditioning for targets of n frames.

        text [B, nt, T]; ref [B, np, C]; masks are boolean, true = valid. `cfg_infer`
        builds [cond; uncond] rows together; `drop_text` / `drop_audio_cond` make a
        single unconditional branch instead.
        """
        B, nt, _ = text.shape
        device = text.device
        if mask is not None and mask.shape != (B, n):
            raise ValueError(f"target mask must be [{B}, {n}], got {list(mask.shape)}")
        if c_mask is None:
            c_mask = text.ne(0).any(dim=-1)  # padding rows are exactly zero
        if ref is not None and ref.shape[1] == 0:
            ref, ref_mask = None, None
        np_ = 0 if ref is None else ref.shape[1]

        c = self.txt_norm(self.txt_proj(text))
        if drop_text:
            c = torch.zeros_like(c)
        prompt = None
        if ref is not None:
            # The unconditional prompt embeds zeros: it still carries the linear and conv biases.
            cond = None if drop_audio_cond else self.audio_embed(ref, ref_mask)
            uncond = self.audio_embed(torch.zeros_like(ref), ref_mask) if cfg_infer or drop_audio_cond else None
            prompt = torch.cat([cond, uncond], dim=0) if cfg_infer else (cond if cond is not None else uncond)
        copies = 2 if cfg_infer else 1
        if cfg_infer:
            c = torch.cat([c, torch.zeros_like(c)], dim=0)

        # Masks exist only where padding can (spec section 4.5).
        if ref is None:
            audio_mask = mask
        elif ref_mask is None and mask is None:
            audio_mask = None
        else:
            ones = lambda length: torch.ones(B, length, dtype=torch.bool, device=device)  # noqa: E731
            audio_mask = torch.cat([ref_mask if ref_mask is not None else ones(np_),
                                    mask if mask is not None else ones(n)], dim=1)
        single_mask = None if audio_mask is None else torch.cat([c_mask, audio_mask], dim=1)
        joint_bias = single_bias = None
        if self.attn_mask_enabled and audio_mask is not None:
            joint_bias = _key_bias(torch.cat([audio_mask, c_mask], dim=1))
            single_bias = _key_bias(single_mask)

        rope = self.rotary_embed.tables
        return DiTContext(
            n=n,
            copies=copies,
            c=c,
            prompt=prompt,
            target_mask=mask,
            c_mask=_repeat_rows(c_mask, copies),
            audio_mask=_repeat_rows(audio_mask, copies),
            single_mask=_repeat_rows(single_mask, copies),
            joint_bias=_repeat_rows(joint_bias, copies),
            single_bias=_repeat_rows(single_bias, copies),
            rope_audio=_repeat_rope(rope(np_ + n, audio_mask, device), copies),
            rope_text=_repeat_rope(rope(nt, c_mask, device), copies),
            rope_single=_repeat_rope(rope(nt + np_ + n, single_mask, device), copies),
        )

    def step(self, x: torch.Tensor, time, ctx: DiTContext) -> torch.Tensor:
        """One velocity evaluation: x [B, n, C], time scalar or [B] -> [B * ctx.copies, n, C]."""
        B, n, _ = x.shape
        if n != ctx.n:
            raise ValueError(f"context was prepared for {ctx.n} target frames, x has {n}")
        time = torch.as_tensor(time, dtype=torch.float32, device=x.device)
        if time.dim() == 0:
            time = time.repeat(B)
        temb = _repeat_rows(self.time_embed(time), ctx.copies)
        a = _repeat_rows(self.audio_embed(x, ctx.target_mask), ctx.copies)
        if ctx.prompt is not None:
            a = torch.cat([ctx.prompt, a], dim=1)
        c = ctx.c
        for block in self.transformer_blocks:
            a, c = block(a, c, temb, ctx)
        h = torch.cat([c, a], dim=1)
        for block in self.single_transformer_blocks:
            h = block(h, temb, ctx)
        return self.proj_out(self.norm_out(h[:, -n:], temb))

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
    return model.eval().requires_grad_(False)
