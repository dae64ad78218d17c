"""The AMP blocks' causal dilated convolution as a Triton kernel, residual add fused.

On the narrow stages of a channels-last decode (48 and 24 channels at 120k and
250k samples per 512 frames) cuDNN's convolutions run several times above their
memory floor: they are tiny GEMMs (K = 24 or 48 channels per tap) over very long
signals, and each is followed by a residual add that is a pass of its own. This
kernel computes the causal convolution as an implicit GEMM over the taps:

    y[b, o, t] = residual[b, o, t] + bias[o]
                 + sum_k sum_i W[o, i, k] * x[b, i, t - (K - 1 - k) * dilation]

with x zero for t < 0 (the causal left padding). Each program owns BLOCK_T
output samples of BLOCK_CO output channels; for every block of input channels
and every tap it loads the weight slice W[:, :, k] and the input window shifted
by the tap's offset (the K windows overlap, so after the first they come from
cache) and accumulates their product on the tensor cores. The output is written
once, bias and residual added in registers.

Layout. On a channels-last signal (what `AuKVAE.use_channels_last` keeps) both
operands have the reduction axis (input channels) innermost in memory, the
K-major form Hopper's tensor-core instructions take for 32-bit operands, and a
window of BLOCK_T samples of all channels is one contiguous block. A
channels-first signal works too (any strides) but is not what it is for. The
output takes x's layout.

Numerics. The products run as three TF32 products per fp32 product
(`tf32x3`: the operands split into a high and a low TF32 part, the low x low
term dropped), close to full fp32 accuracy: on these memory-bound shapes the
extra tensor-core work is free, and plain TF32 products in this kernel landed
2.6x further from a float64 reference than cuDNN's TF32. With
`torch.backends.cudnn.allow_tf32` off they run in full fp32 (`ieee`). The sum
order differs from cuDNN's.

The op is registered with `torch.library.triton_op`, so compiled buckets trace
it (no graph break) and CUDA graphs capture it. `AuKVAE.use_fused_conv` routes
the convolutions of at most `max_channels` channels here; cuDNN keeps the wide
stages, where it runs close to the tensor cores' rate.
"""

import torch
import triton
import triton.language as tl

from .fused_activation import _interpreting, empty_like_layout

# Block sizes by the widest of in/out channels: (max channels, BLOCK_CO, BLOCK_CI, BLOCK_T, warps, stages).
# The first row whose channel limit covers the convolution is used; the benchmark sweeps them.
LAUNCH = [
    (32, 32, 32, 128, 4, 3),
    (64, 64, 64, 128, 4, 3),
    (128, 128, 32, 128, 8, 3),
    (1 << 30, 128, 32, 128, 8, 3),
]


@triton.jit
def _causal_conv1d_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    y_ptr,
    C_IN,
    C_OUT,
    L,
    DILATION,
    stride_xb,
    stride_xc,
    stride_xl,
    stride_wo,
    stride_wi,
    stride_wk,
    stride_rb,
    stride_rc,
    stride_rl,
    stride_yb,
    stride_yc,
    stride_yl,
    KERNEL: tl.constexpr,
    BLOCK_CO: tl.constexpr,
    BLOCK_CI: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (BLOCK_T samples, BLOCK_CO output channels, batch): acc[t, o]."""
    pid_t = tl.program_id(0)
    pid_co = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    co = pid_co * BLOCK_CO + tl.arange(0, BLOCK_CO)
    co_ok = co < C_OUT
    x_batch = x_ptr + b * stride_xb

    acc = tl.zeros((BLOCK_T, BLOCK_CO), dtype=tl.float32)
    # One loop over (input-channel block, tap), so that the software pipeline keeps
    # NUM_STAGES operand buffers in shared memory rather than one per tap.
    for step in tl.range(0, tl.cdiv(C_IN, BLOCK_CI) * KERNEL, num_stages=NUM_STAGES):
        k = step % KERNEL
        ci = (step // KERNEL) * BLOCK_CI + tl.arange(0, BLOCK_CI)
        ci_ok = ci < C_IN
        src = t - (KERNEL - 1 - k) * DILATION  # negative: the causal zero padding
        x = tl.load(
            x_batch + src[:, None] * stride_xl + ci[None, :] * stride_xc,
            mask=((src >= 0) & (src < L))[:, None] & ci_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + ci[:, None] * stride_wi + co[None, :] * stride_wo + k * stride_wk,
            mask=ci_ok[:, None] & co_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(x, w, acc, input_precision=PRECISION)

    # As eager adds: (conv + bias) + residual.
    if HAS_BIAS:
        acc += tl.load(bias_ptr + co, mask=co_ok, other=0.0)[None, :]
    out_ok = (t < L)[:, None] & co_ok[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(res_ptr + b * stride_rb + t[:, None] * stride_rl + co[None, :] * stride_rc, mask=out_ok)
    tl.store(y_ptr + b * stride_yb + t[:, None] * stride_yl + co[None, :] * stride_yc, acc, mask=out_ok)


def launch_config(c_in: int, c_out: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_CO, BLOCK_CI, BLOCK_T, warps, stages) for a convolution of these widths."""
    widest = max(c_in, c_out)
    for limit, block_co, block_ci, block_t, warps, stages in LAUNCH:
        if widest <= limit:
            return block_co, block_ci, block_t, warps, stages
    raise AssertionError("LAUNCH's last row covers every width")


def _launch(y, x, weight, bias, residual, dilation: int, config=None, traceable: bool = True) -> None:
    """Write the causal convolution of x (+ bias, + residual) into y ([B, C_out, L], any strides)."""
    batch, c_in, length = x.shape
    c_out, _, kernel = weight.shape
    if batch == 0 or c_out == 0 or length == 0:
        return
    block_co, block_ci, block_t, warps, stages = config or launch_config(c_in, c_out)
    grid = (triton.cdiv(length, block_t), triton.cdiv(c_out, block_co), batch)
    launcher = _causal_conv1d_kernel
    if traceable and not _interpreting():
        launcher = torch.library.wrap_triton(launcher)
    res = residual if residual is not None else y  # any tensor: never read without a residual
    launcher[grid](
        x, weight, bias if bias is not None else weight, res, y,  # bias: any pointer when there is none
        c_in, c_out, length, dilation,
        *x.stride(), *weight.stride(), *res.stride(), *y.stride(),
        KERNEL=kernel, BLOCK_CO=block_co, BLOCK_CI=block_ci, BLOCK_T=block_t, NUM_STAGES=stages,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        PRECISION="tf32x3" if torch.backends.cudnn.allow_tf32 else "ieee",
        num_warps=warps,
    )


@torch.library.triton_op("auk::causal_conv1d", mutates_args=())
def causal_conv1d_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    dilation: int,
) -> torch.Tensor:
    """Causal Conv1d of x [B, C_in, L] (any strides) with weight [C_out, C_in, K], plus bias
    [C_out] and residual [B, C_out, L] where given -> a new [B, C_out, L] in x's layout."""
    y = empty_like_layout(x, weight.shape[0])
    _launch(y, x, weight, bias, residual, dilation)
    return y


def supports(x: torch.Tensor, weight: torch.Tensor, bias, residual) -> bool:
    """Whether the kernel can run this convolution; otherwise callers use F.conv1d."""
    c_out = weight.shape[0]

    def fits(t):
        return t.dtype == torch.float32 and t.device == x.device

    return (
        x.dim() == 3
        and (x.is_cuda or _interpreting())
        and fits(x)
        and fits(weight)
        and weight.dim() == 3
        and weight.shape[1] == x.shape[1]
        and x.numel() < 2**31
        and c_out * x.shape[0] * x.shape[2] < 2**31
        and (bias is None or (fits(bias) and bias.shape == (c_out,)))
        and (residual is None or (fits(residual) and residual.shape == (x.shape[0], c_out, x.shape[2])))
    )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    dilation: int = 1,
    out: torch.Tensor | None = None,
    config=None,
) -> torch.Tensor:
    """`residual + conv(x) + bias`, the causal convolution (left zero padding of
    dilation * (K - 1)), with the kernel; bias and residual are optional.

    `out`, a float32 [B, C_out, L] tensor, receives the result directly, and
    `config` overrides the launch configuration: both bypass the traceable op (for
    tests that poison the output first, and for the benchmark's sweep).
    """
    if out is None and config is None:
        return causal_conv1d_op(x, weight, bias, residual, int(dilation))
    shape = (x.shape[0], weight.shape[0], x.shape[2])
    if out is None:
        out = empty_like_layout(x, weight.shape[0])
    elif tuple(out.shape) != shape or out.dtype != torch.float32:
        raise ValueError(f"out must be a float32 tensor of shape {list(shape)}")
    _launch(out, x, weight, bias, residual, int(dilation), config=config, traceable=False)
    return out
