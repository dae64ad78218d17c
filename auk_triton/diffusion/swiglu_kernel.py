"""The feed-forward's first product with its SwiGLU gate, as one Triton kernel.

`FeedForward` is `linear_out(SiLU(gate) * up)` with `[gate | up] = linear_in(x)`. Through
cuBLAS, linear_in writes its [tokens, 2F] product and a second kernel reads it all back
to gate it, at memory bandwidth (benchmarks/studies/dit-step-kernels.md). Here a program
computes a tile of gate and the same tile of up from one pass over x's rows, and stores
only `SiLU(gate) * up`: the product's 2F columns never reach memory.

Numerics are the eager feed-forward's under bf16 autocast: each product accumulates in
fp32 over K in order and is rounded to the output dtype (what cuBLAS writes), SiLU is
computed in fp32 as torch computes it, `x / (1 + exp(-x))`, and rounded, and the gate's
product is rounded once more, as the eager `F.silu(gate) * up` rounds each op.

The kernel loads its tiles through Hopper's tensor memory accelerator (TMA descriptors)
on a persistent grid, one program per SM; other GPUs keep the eager feed-forward
(`fits`). A torch custom op with a fake implementation, opaque to Inductor as the
other block kernels are; under `TRITON_INTERPRET=1` it runs in Triton's interpreter.

Past a few hundred tokens the op hands its rows to swiglu_gemm.py where that serves: the same
fusion and roundings on quack's CuTe-DSL GEMM, whose main loop runs at cuBLAS's rate where this
kernel's does not. This kernel stays the reference it is checked against, and serves small
token counts, fp16, and GPUs or drivers quack does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .checked_kernel import check_once

# torch's dtypes -> Triton's, for the epilogue's roundings.
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
# TMA reads and writes rows whose strides and starts are multiples of 16 bytes.
_TMA_ALIGNMENT = 16


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int


# Chosen by measurement on an H100 at the released width (benchmarks/studies/dit-step-kernels.md):
# large token counts fill the GPU with 128 x (2 x 128) tiles; a few rows (a batch-1 text stream)
# spread over more programs with smaller ones.
LARGE_TILES = TileConfig(128, 128, 64, stages=3, warps=8)
SMALL_TILES = TileConfig(64, 64, 64, stages=4, warps=4)
SMALL_TOKENS = 256  # at most this many tokens take SMALL_TILES
GROUP_M = 8  # tiles of this many row blocks run together, so their weight columns stay in L2


@triton.jit
def _tile_of(tile, num_m, num_n, GROUP: tl.constexpr):
    """A persistent program's tile index -> (row block, column block), GROUP row blocks at a time."""
    per_group = GROUP * num_n
    first_m = (tile // per_group) * GROUP
    size = tl.minimum(num_m - first_m, GROUP)
    return first_m + (tile % per_group) % size, (tile % per_group) // size


@triton.jit
def _swiglu_product_kernel(x_desc, gate_desc, up_desc, out_desc, M, F, K,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                           PROGRAMS: tl.constexpr, OUT_DTYPE: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(F, BN)
    for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS):
        pid_m, pid_n = _tile_of(tile, num_m, num_n, GROUP)
        gate = tl.zeros((BM, BN), tl.float32)
        up = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            rows = x_desc.load([pid_m * BM, k])
            gate = tl.dot(rows, gate_desc.load([pid_n * BN, k]).T, gate)
            up = tl.dot(rows, up_desc.load([pid_n * BN, k]).T, up)
        # Rounded as the eager ops round: the product, SiLU, then the gate's product.
        gate = gate.to(OUT_DTYPE).to(tl.float32)
        up = up.to(OUT_DTYPE).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE).to(tl.float32)
        out_desc.store([pid_m * BM, pid_n * BN], (silu * up).to(OUT_DTYPE))


@lru_cache(maxsize=None)
def _programs(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _aligned(tensor: torch.Tensor) -> bool:
    return (tensor.data_ptr() % _TMA_ALIGNMENT == 0
            and all(stride * tensor.element_size() % _TMA_ALIGNMENT == 0 for stride in tensor.stride()[:-1]))


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel computes this feed-forward's product and gate: on a Hopper GPU, x and the
    weight both bf16 or fp16 (autocast's cast already made), rows TMA can read. Dynamo folds the
    device query to a constant where a compiled block calls this."""
    return (x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dim() == 2 and weight.shape[0] % 2 == 0
            and x.shape[-1] * x.element_size() % _TMA_ALIGNMENT == 0
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


_quack: bool | None = None  # whether quack's GEMM (swiglu_gemm.py) serves this process's GPU; None: not looked yet
_quack_refused = ""  # why not, where its package is installed


def quack_gemm_registered() -> bool:
    """Whether swiglu_gemm.py's GEMM serves this process's GPU: its package there, a GPU it was tuned
    for, and its output checked once against this module's kernel on a small case (its kernels want
    a CUDA 13 driver). Called before compiling (compiled.py), not while a CUDA graph captures."""
    global _quack, _quack_refused
    if _quack is None:
        _quack, _quack_refused = check_once(f"{__package__}.swiglu_gemm", "quack",
                                            lambda: _quack_matches_the_triton_kernel(),
                                            "the Triton kernel", "not tuned for this GPU")
    return _quack


def _quack_matches_the_triton_kernel() -> bool:
    """Both of swiglu_gemm.py's tile configurations, at token counts ending mid-tile, against
    `_triton_product`: the same products, roundings and order, so nearly every value equal."""
    from .swiglu_gemm import LARGE_TILES_PAST, product_and_gate

    generator = torch.Generator("cuda").manual_seed(0)
    weight = (torch.randn(768, 256, device="cuda", generator=generator) / 16).to(torch.bfloat16)
    for tokens in (300, LARGE_TILES_PAST + 100):
        rows = torch.randn(tokens, 256, device="cuda", generator=generator).to(torch.bfloat16)
        got, want = (rows.new_empty(tokens, 384) for _ in range(2))
        with torch.inference_mode():
            product_and_gate(rows, weight, got)
            _triton_product(rows, weight, want)
        if float((got == want).float().mean()) < 0.99:
            return False
    return True


def product_kernel(device: torch.device) -> str:
    """What computes a batch's feed-forward products past SMALL_TOKENS on `device`, for the log."""
    if torch.device(device).type != "cuda":
        return "the eager ops (the kernels are for GPUs)"
    if quack_gemm_registered():
        return "quack's Hopper GEMM, the gate in its epilogue"
    refused = f" (quack's GEMM: {_quack_refused})" if _quack_refused else ""
    return f"the Triton kernel{refused}"


def _quack_serves(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether quack's GEMM takes these rows: past SMALL_TOKENS (this kernel's small tiles spread a
    few rows over more SMs), where it passed its check and fits."""
    if rows.shape[0] <= SMALL_TOKENS or not rows.is_cuda:
        return False
    if _quack is None and torch.cuda.is_current_stream_capturing():
        return False  # its check runs kernels: never inside a capture
    if not quack_gemm_registered():
        return False
    from .swiglu_gemm import fits as quack_fits

    return quack_fits(rows, weight)


@torch.library.custom_op("auk::swiglu_product", mutates_args=())
def swiglu_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K], linear_in's weight [2F, K] (gate rows first, no bias) -> SiLU(x @ gate^T) * (x @ up^T),
    [..., F] in x's dtype: past SMALL_TOKENS through quack's GEMM where it serves, else this
    module's kernel."""
    width = weight.shape[0] // 2
    out = x.new_empty(*x.shape[:-1], width)
    if out.numel() == 0:
        return out
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} channels, the weight takes {weight.shape[1]}")
    rows, weight, flat = x.reshape(-1, x.shape[-1]), weight.contiguous(), out.view(-1, width)
    if _quack_serves(rows, weight):
        from .swiglu_gemm import product_and_gate

        product_and_gate(rows, weight, flat)
    else:
        _triton_product(rows, weight, flat)
    return out


def _triton_product(rows: torch.Tensor, weight: torch.Tensor, flat: torch.Tensor) -> None:
    """rows [M, K], weight [2F, K] (contiguous) -> flat [M, F], through _swiglu_product_kernel."""
    width = weight.shape[0] // 2
    gate, up = weight[:width], weight[width:]
    if not all(map(_aligned, (rows, gate, up, flat))):
        raise ValueError("the SwiGLU kernel reads rows whose starts and strides are multiples of 16 bytes")
    tokens, channels = rows.shape
    tiles = SMALL_TILES if tokens <= SMALL_TOKENS else LARGE_TILES
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    count = triton.cdiv(tokens, bm) * triton.cdiv(width, bn)
    programs = min(count, _programs(rows.device.index) if rows.is_cuda else 4)
    _swiglu_product_kernel[(programs,)](
        TensorDescriptor.from_tensor(rows, [bm, bk]), TensorDescriptor.from_tensor(gate, [bn, bk]),
        TensorDescriptor.from_tensor(up, [bn, bk]), TensorDescriptor.from_tensor(flat, [bm, bn]),
        tokens, width, channels, BM=bm, BN=bn, BK=bk, GROUP=GROUP_M, PROGRAMS=programs,
        OUT_DTYPE=_TL_DTYPES[rows.dtype], num_stages=tiles.stages, num_warps=tiles.warps,
    )


@swiglu_product.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)
