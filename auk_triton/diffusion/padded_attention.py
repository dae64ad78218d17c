"""Masked attention with a row's valid keys laid out first, for cuDNN's padding mask.

A padded run masks its padded keys. Given as an additive bias [B, 1, 1, K], the mask keeps
cuDNN's SDPA off its fastest kernels (benchmarks/studies/dit-step-kernels.md). cuDNN's own
padding mask (a key count per row, applied inside the kernel) runs as fast as no mask, but
it masks the end of each row's keys, and ours lie between segments: [audio | text] in the
double blocks, [text | reference | target] in the single ones.

So each row's valid keys are laid first, in their own order, the padded ones after. Attention
sums over its keys in any order: the output is the masked attention's, to the rounding of
another summation order.

- The double blocks: the q/k norm and RoPE kernel, which copies v already, writes each
  token's k and v at the slot `key_slots` gives it (norm_rope_kernel.py); the queries keep
  their order, so the blocks' outputs do too.
- The single blocks: the whole stream is laid out so (`ValidFirst`), gathered once as the
  double blocks' two streams are joined, its target gathered back before the output. Every
  other op of a single block works token by token, so in that layout the blocks' v needs
  no copy, and the valid tokens' squeezed rotary positions are their places: 0, 1, 2...

Two kernels take a key count per row: FlashAttention 4's `seqused_k` (flash4_attention.py),
preferred where its package is installed and the GPU is one it is built for, and cuDNN's
padding mask, reached through the `cudnn` package (NVIDIA's cuDNN frontend). Both are torch
ops, traced by torch.compile and captured in CUDA graphs, their kernels or plans made on the
first call of each shape, at warm-up. Without either, or off a GPU, `attend_valid_keys` masks
with a bias made from the counts: the same result, used by the CPU tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .checked_kernel import check_once, import_kernel


def key_bias(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Valid keys, bool [B, K] -> the attention's additive bias [B, 1, 1, K] in `dtype`: 0 where a
    key is valid, -inf where it is padding (exactly a boolean mask's effect)."""
    bias = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(~valid, float("-inf"))
    return bias[:, None, None, :]


def key_slots(valid: torch.Tensor) -> torch.Tensor:
    """Valid keys, bool [B, K] -> int32 [B, K]: where each key goes, its row's valid keys first in
    their order, then its padded keys in theirs (a permutation of 0..K-1 per row)."""
    valid = valid.bool()
    count = valid.sum(dim=1, keepdim=True)
    before_valid = valid.long().cumsum(dim=1) - 1
    before_padded = (~valid).long().cumsum(dim=1) - 1
    return torch.where(valid, before_valid, count + before_padded).to(torch.int32)


def key_layout(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Valid keys, bool [B, K] -> what a step's attention reads of them, made once per run:
    (`key_slots`, each row's valid keys int32 [B], each row's queries int32 [B] (all K of them))."""
    rows, keys = valid.shape
    return (key_slots(valid), valid.sum(dim=1, dtype=torch.int32),
            torch.full((rows,), keys, dtype=torch.int32, device=valid.device))


class ValidFirst(NamedTuple):
    """A padded single stream laid out with each row's valid tokens first (`valid_first`)."""

    order: torch.Tensor  # int64 [B, L]: the token at each place, by its place in the stream's own order
    target: torch.Tensor  # int64 [B, n]: the places of the target's tokens (the stream's last n)
    mask: torch.Tensor  # bool [B, L]: each row's first `counts` places
    counts: torch.Tensor  # int32 [B]: valid tokens, the keys cuDNN attends to
    queries: torch.Tensor  # int32 [B]: L, every place
    cos: torch.Tensor  # [1, L, 1, Dh] rotary tables of positions 0..L-1
    sin: torch.Tensor


def valid_first(valid: torch.Tensor, n: int, rope: tuple[torch.Tensor, torch.Tensor]) -> ValidFirst:
    """The layout of a stream whose valid tokens are `valid` (bool [B, L]) and whose last n tokens
    are the target; `rope`, the unmasked rotary tables of L tokens ([1, L, 1, Dh])."""
    rows, length = valid.shape
    slots, counts, queries = key_layout(valid)
    slots = slots.long()
    places = torch.arange(length, device=valid.device)
    order = torch.empty_like(slots).scatter_(1, slots, places.expand(rows, length))
    return ValidFirst(order, slots[:, length - n:].contiguous(), places < counts[:, None], counts, queries, *rope)


def gather_tokens(x: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
    """x [B, L, D] -> [B, places' length, D]: row b's tokens at places[b] (int64)."""
    return x.gather(1, places[..., None].expand(-1, -1, x.shape[-1]))


_registered: bool | None = None  # whether torch.ops.cudnn.sdpa_fwd is there; None: not looked yet
_cudnn_refused = ""  # why not, where its package is installed


def cudnn_sdpa_registered() -> bool:
    """Whether the cudnn package's SDPA op is there, registered (imported) by the first call: make
    it before a saved trace that calls the op is loaded, and before compiling (a compiled block
    then reads the answer, a plain global)."""
    global _registered, _cudnn_refused
    if _registered is None:
        loaded, _cudnn_refused = import_kernel("cudnn.sdpa.fwd.torch_op", "cudnn")  # registers the op
        _registered = loaded is not None and hasattr(torch.ops.cudnn, "sdpa_fwd")
    return _registered


_flash4: bool | None = None  # whether FlashAttention 4 serves this process's GPU; None: not looked yet
_flash4_refused = ""  # why not, where its package is installed


def flash4_registered() -> bool:
    """Whether FlashAttention 4's op (flash4_attention.py) serves this process's GPU: registered by
    the first call, as `cudnn_sdpa_registered`, and checked there once against the masked attention
    on a small case (its kernels are built for CUDA 13 drivers and Hopper or Blackwell; anything
    else leaves cuDNN's padding mask serving). A plain global for compiled code."""
    global _flash4, _flash4_refused
    if _flash4 is None:  # the module registers torch.ops.auk.flash4_valid_keys
        _flash4, _flash4_refused = check_once(f"{__package__}.flash4_attention", "flash_attn",
                                              lambda: _flash4_matches_the_masked_attention(),
                                              "the masked attention", "not built for this GPU")
    return _flash4


def _flash4_matches_the_masked_attention() -> bool:
    """One small bf16 case through FlashAttention 4 against torch's SDPA with the key bias."""
    generator = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 160, 2, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
               for _ in range(3))
    counts = torch.tensor([160, 97], dtype=torch.int32, device="cuda")
    with torch.inference_mode():
        got = torch.ops.auk.flash4_valid_keys(q, k, v, counts).float()
        want = _key_bias_attention(*(t.float().transpose(1, 2) for t in (q, k, v)), counts).transpose(1, 2)
    return bool((got - want).abs().max() <= 2 ** -6)  # bf16's rounding of values of order 1


def available(device: torch.device) -> bool:
    """Whether a kernel with a key count per row serves attention on `device`: a GPU and the
    flash-attn-4 or the cudnn package."""
    return attention_kernel(device) != "key_bias"


def attention_kernel(device: torch.device) -> str:
    """Which kernel masks a padded run's attention on `device`: "flash4", "cudnn" or "key_bias".
    Compiled code calls the one chosen when it was traced: a saved trace is keyed by it."""
    if torch.device(device).type != "cuda":
        return "key_bias"
    if flash4_registered():
        return "flash4"
    return "cudnn" if cudnn_sdpa_registered() else "key_bias"


def masked_attention(device: torch.device) -> str:
    """How the compiled step masks a padded run's attention on `device`, for the log."""
    kernel = attention_kernel(device)
    refused = f"; FlashAttention 4: {_flash4_refused}" if _flash4_refused else ""
    if kernel == "flash4":
        return "FlashAttention 4's key counts, each row's valid keys first"
    if kernel == "cudnn":
        return f"cuDNN's padding mask, each row's valid keys first{refused}"
    if torch.device(device).type != "cuda":
        return "additive key biases (the kernels taking key counts are for GPUs)"
    refused += f"; cudnn: {_cudnn_refused}" if _cudnn_refused else ""
    return f"additive key biases (neither flash-attn-4 nor cudnn serves: requirements-gpu.txt brings them{refused})"


def attend_valid_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor,
                      queries: torch.Tensor) -> torch.Tensor:
    """q [B, N, H, Dh]; k, v [B, N, H, Dh] with row b's valid keys at its first counts[b] places
    (int32 [B]); queries int32 [B], all N -> [B, N, H * Dh], attending to those keys alone (scale
    1/sqrt(Dh))."""
    if q.is_cuda and flash4_registered():
        return torch.ops.auk.flash4_valid_keys(q, k, v, counts).flatten(2)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if q.is_cuda and cudnn_sdpa_registered():
        out, _ = torch.ops.cudnn.sdpa_fwd(qt, kt, vt, q.shape[-1] ** -0.5, seq_len_q=queries, seq_len_kv=counts,
                                          return_lse=False)
    else:
        out = _key_bias_attention(qt, kt, vt, counts)
    return out.transpose(1, 2).flatten(2)


def _key_bias_attention(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The same attention on heads first ([B, H, N, Dh]) through torch's SDPA, masked with a bias
    made from the counts: the fallback, and the reference FlashAttention 4 is checked against."""
    keep = torch.arange(kt.shape[2], device=kt.device) < counts[:, None]
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=key_bias(keep, qt.dtype))
