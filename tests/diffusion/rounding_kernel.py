"""A test-only Triton kernel that runs adaln_kernel.rounded_to alone over a tensor (imported only
where triton is: a jit function finds its helpers among its module's globals)."""

import triton
import triton.language as tl

from auk_triton.diffusion.adaln_kernel import rounded_to


@triton.jit
def _round_kernel(x, out, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    tl.store(out + offsets, rounded_to(tl.load(x + offsets, mask=inside), DTYPE), mask=inside)


def rounded_to_bf16(x):
    """fp32 x [n] -> its values rounded to bf16's, in fp32, through the kernels' helper."""
    out = x.new_empty(x.shape)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), DTYPE=tl.bfloat16, BLOCK=1024)
    return out
