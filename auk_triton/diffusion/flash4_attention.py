"""FlashAttention 4's forward over each row's valid keys laid first, as a torch op.

FlashAttention 4 (the flash-attn-4 package, kernels in NVIDIA's CuTe DSL, for Hopper and
Blackwell) masks each row's keys past a count of its own (`seqused_k`) inside the kernel, so it
takes padded_attention's valid-keys-first layout and the [B, N, H, Dh] heads as they lie. For
heads of 64 on Hopper it tiles queries by 192 rows, which fill the DiT's 564 tokens at 98%.

Its kernels are compiled on their first call, at warm-up; `use_compile_cache` keeps them on
disk beside Inductor's. Importing this module without the package raises ImportError.
"""

from __future__ import annotations

import torch
from flash_attn.cute import flash_attn_varlen_func

ARCHITECTURES = (9, 10)  # compute capability majors its forward kernels are built for


@torch.library.custom_op("auk::flash4_valid_keys", mutates_args=())
def flash4_valid_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """q, k, v [B, N, H, Dh]; row b attends to its first counts[b] keys (int32 [B]) -> [B, N, H, Dh]."""
    out = flash_attn_varlen_func(q, k, v, seqused_k=counts, softmax_scale=q.shape[-1] ** -0.5)
    return out[0] if isinstance(out, tuple) else out


@flash4_valid_keys.register_fake
def _(q, k, v, counts):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as the kernel writes it
