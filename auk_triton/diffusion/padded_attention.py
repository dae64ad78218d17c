"""Masked attention with a row's valid keys laid out first, for cuDNN's padding mask.

A padded run masks its padded keys. Given as an additive bias [B, 1, 1, K], the mask keeps
cuDNN's SDPA off its fastest kernels (benchmarks/studies/dit-step-kernels.md). cuDNN's own
padding mask (a key count per row, applied inside the kernel) runs as fast as no mask, but
it masks the end of each row's keys, and ours lie between segments: [audio | text] in the
double blocks, [text | reference | target] in the single ones.

So the step writes each row's keys and values in the order `key_slots` gives them, the valid
ones first in their own order, the padded ones after, while the queries keep theirs. Attention
sums over its keys in any order: the output is the masked attention's, to the rounding of
another summation order. The q/k norm and RoPE kernel writes k and v where their slots say
(norm_rope_kernel.py), so the order costs a copy of v in the single blocks and nothing in the
double blocks, whose v the kernel copies already.

cuDNN's padding mask is reached through the `cudnn` package (NVIDIA's cuDNN frontend), whose
op is traced by torch.compile and captured in CUDA graphs, and whose plans are built on the
first call of each shape, at warm-up. Without it, or off a GPU, `attend_valid_keys` masks
with a bias made from the counts: the same result, used by the CPU tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


_registered: bool | None = None  # whether torch.ops.cudnn.sdpa_fwd is there; None: not looked yet


def cudnn_sdpa_registered() -> bool:
    """Whether the cudnn package's SDPA op is there, registered (imported) by the first call: make
    it before a saved trace that calls the op is loaded, and before compiling (a compiled block
    then reads the answer, a plain global)."""
    global _registered
    if _registered is None:
        try:
            import cudnn.sdpa.fwd.torch_op  # noqa: F401  (registers torch.ops.cudnn.sdpa_fwd)

            _registered = hasattr(torch.ops.cudnn, "sdpa_fwd")
        except Exception:  # not installed, or no cuDNN it can load
            _registered = False
    return _registered


def available(device: torch.device) -> bool:
    """Whether cuDNN's padding mask serves attention on `device`: a GPU and the cudnn package."""
    return torch.device(device).type == "cuda" and cudnn_sdpa_registered()


def attend_valid_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor,
                      queries: torch.Tensor) -> torch.Tensor:
    """q [B, N, H, Dh]; k, v [B, N, H, Dh] with row b's valid keys at its first counts[b] places;
    queries [B], all N -> [B, N, H * Dh], attending to those keys alone (scale 1/sqrt(Dh))."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if q.is_cuda and cudnn_sdpa_registered():
        out, _ = torch.ops.cudnn.sdpa_fwd(qt, kt, vt, q.shape[-1] ** -0.5, seq_len_q=queries, seq_len_kv=counts,
                                          return_lse=False)
    else:
        keep = torch.arange(k.shape[1], device=k.device) < counts[:, None]
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias[:, None, None, :])
    return out.transpose(1, 2).flatten(2)
