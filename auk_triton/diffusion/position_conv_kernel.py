"""The audio embedding's grouped position convolutions, each with its mask and Mish, as one Triton kernel.

The target's tokens get a position signal from two grouped convolutions over frames
(ConvPositionEmbedding: kernel 31, 16 groups, Mish after each, padded frames zeroed). Run
through cuDNN, the tokens [B, N, D] lie channels last while the convolution takes them
channels first: each call re-lays its input and output around the kernel, which cost more
than the convolution itself, and at one row cuDNN ran one kernel per group
(benchmarks/studies/dit-step-kernels.md). Here one program computes a tile of frames for one
group's output channels straight from the channels-last rows, as an implicit GEMM: for each
of the 31 taps, the window of input frames shifted by it times that tap's [in, out] weights.
Padded frames read as zeros and are written as zeros; frames past either end are the
convolution's zero padding.

Numerics are the eager ops' under bf16 autocast: the products accumulated in fp32 and
rounded to the activation dtype (cuDNN's output), the bias added and rounded again (torch
adds it as an op of its own), then Mish in fp32 rounded once at the store; the second
convolution adds its result to the embedding's residual, h + round(mish(.)), as the eager
sum does. Only the summation order over the 31 x 96 products differs.

A custom op with a fake implementation, opaque to Inductor (as adaln_kernel.py's); under
`TRITON_INTERPRET=1` it runs in Triton's interpreter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .adaln_kernel import rounded_to

BLOCK_K = 32  # input channels per product step: the released groups' 96 in three steps
MISH_LINEAR_ABOVE = tl.constexpr(20.0)  # where torch's softplus (so Mish) returns its input


@triton.jit
def _mish(x):
    """x * tanh(softplus(x)) in fp32, with tanh(log1p(n)) written as n(n + 2) / (n(n + 2) + 2), n = e^x."""
    n = tl.exp(tl.minimum(x, MISH_LINEAR_ABOVE))
    m = n * (n + 2.0)
    return tl.where(x > MISH_LINEAR_ABOVE, x, x * m / (m + 2.0))


@triton.jit
def _position_conv_kernel(out, x, keep, weight, bias, residual, frames, channels, group_width,
                          TAPS: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tiles = tl.cdiv(frames, BLOCK_M)
    row = tl.program_id(0) // tiles
    group = tl.program_id(1)
    rows_m = (tl.program_id(0) % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)  # output frames
    lanes_n = tl.arange(0, BLOCK_N)  # output channels within the group
    lanes_k = tl.arange(0, BLOCK_K)
    inside_n = lanes_n < group_width
    first_channel = group * group_width
    x_row = x + row.to(tl.int64) * frames * channels + first_channel
    chunks = tl.cdiv(group_width, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One loop over (tap, input chunk), so Triton pipelines all TAPS * chunks steps.
    for step in range(0, TAPS * chunks):
        tap = step // chunks
        k = (step % chunks) * BLOCK_K + lanes_k
        source = rows_m + tap - TAPS // 2
        valid = (source >= 0) & (source < frames)
        if HAS_KEEP:
            valid &= tl.load(keep + row * frames + source, mask=valid, other=0) != 0
        a = tl.load(x_row + source[:, None] * channels + k[None, :],
                    mask=valid[:, None] & (k[None, :] < group_width), other=0.0)
        # weight laid out [TAPS, group_width (in), channels (out)]
        w = tl.load(weight + (tap * group_width + k[:, None]) * channels + first_channel + lanes_n[None, :],
                    mask=(k[:, None] < group_width) & inside_n[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
    dtype = out.dtype.element_ty
    b = tl.load(bias + first_channel + lanes_n, mask=inside_n, other=0.0).to(tl.float32)
    y = rounded_to(rounded_to(acc, dtype) + b[None, :], dtype)
    inside_m = rows_m < frames
    if HAS_KEEP:
        kept = tl.load(keep + row * frames + rows_m, mask=inside_m, other=0) != 0
        y = tl.where(kept[:, None], y, 0.0)
    y = _mish(y)
    at = (row.to(tl.int64) * frames + rows_m[:, None]) * channels + first_channel + lanes_n[None, :]
    stored = inside_m[:, None] & inside_n[None, :]
    if HAS_RESIDUAL:
        y = tl.load(residual + at, mask=stored, other=0.0).to(tl.float32) + rounded_to(y, dtype)
    tl.store(out + at, y.to(dtype), mask=stored)


class Tile(NamedTuple):
    block_m: int  # frames a program
    warps: int


def _tile(x: torch.Tensor, groups: int) -> Tile:
    """128 frames a program (4 warps), or 64 (8 warps) where 128 would leave most of the GPU's SMs
    idle (a single row): the faster of each on an H100 (benchmarks/studies/dit-step-kernels.md).
    No more than a power of two past the frames."""
    rows, frames, _ = x.shape
    block = min(128, max(16, triton.next_power_of_2(frames)))
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        if rows * triton.cdiv(frames, block) * groups < sms:
            block = min(block, 64)
    return Tile(block, 4 if block == 128 else 8)


@torch.library.custom_op("auk::position_conv", mutates_args=())
def position_conv(x: torch.Tensor, keep: torch.Tensor | None, weight_taps_first: torch.Tensor, bias: torch.Tensor,
                  residual: torch.Tensor | None, groups: int) -> torch.Tensor:
    """Mish(grouped conv1d over the frames of x [B, N, D]) with padded frames zeroed, channels last:
    [B, N, D] in x's dtype; plus `residual` [B, N, D] where given. `keep` [B, N] (True: a real
    frame) zeroes padded frames in the input and the output. `weight_taps_first` [K, D / groups, D]
    is nn.Conv1d's weight permuted (2, 1, 0), read without a copy where it is laid out so
    (ConvPositionEmbedding.lay_weights_taps_first); bias [D]; padding K // 2."""
    rows, frames, channels = x.shape
    taps, group_width, out_channels = weight_taps_first.shape
    if out_channels != channels or group_width * groups != channels or bias.shape != (channels,):
        raise ValueError(f"a conv of {channels} channels in {groups} groups takes weight [K, "
                         f"{channels // groups}, {channels}] (taps first) and bias [{channels}]; got "
                         f"{list(weight_taps_first.shape)} and {list(bias.shape)}")
    if taps % 2 != 1:
        raise ValueError(f"the kernel's width must be odd (same-length padding), got {taps}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out
    x = x.contiguous()
    keep = None if keep is None else keep.contiguous()
    residual = None if residual is None else residual.contiguous()
    tile = _tile(x, groups)
    _position_conv_kernel[(rows * triton.cdiv(frames, tile.block_m), groups)](
        out, x, x if keep is None else keep, weight_taps_first.contiguous(), bias,
        x if residual is None else residual, frames, channels, group_width,
        TAPS=taps, HAS_KEEP=keep is not None, HAS_RESIDUAL=residual is not None,
        BLOCK_M=tile.block_m, BLOCK_N=max(16, triton.next_power_of_2(group_width)), BLOCK_K=BLOCK_K,
        num_warps=tile.warps, num_stages=3,
    )
    return out


@position_conv.register_fake
def _(x, keep, weight_taps_first, bias, residual, groups):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def fits(x: torch.Tensor) -> bool:
    """Whether the kernel serves x on this device: a CUDA tensor in bf16 or fp16 (in fp32 Triton's
    products would round their inputs to tf32, where the eager convolution does not)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
