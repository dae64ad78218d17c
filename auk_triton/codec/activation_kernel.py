"""The anti-aliased SnakeBeta activation (`activation.Activation1d`) as one Triton kernel.

The eager module moves a signal at twice its rate through memory in three
depthwise ops; these kernels read each input sample once, keep the oversampled
signal in registers and write each output once. With f the 12 upsampling taps,
g the 12 low-pass taps and clamp(i) = min(max(i, 0), L - 1) (the upsampler's
replicate padding):

- Upsampler, polyphase: the stride-2 transposed convolution after a replicate
  pad of 5 and a crop of 15 is, for q in [0, L),
      u[2q]     = 2 * sum_i f[2i+1] * x[clamp(q + 2 - i)]     (i = 0..5)
      u[2q + 1] = 2 * sum_i f[2i]   * x[clamp(q + 3 - i)]
  so E[q] = snake(u[2q]) and O[q - 1] = snake(u[2q - 1]) read the same six samples.
- SnakeBeta: s = u + (1 / (exp(beta) + 1e-9)) * sin(u * exp(alpha))^2, the eager
  expression; exp and the division are the precise libdevice functions, as torch's.
  sin^2 is evaluated as `ActivationKernel.sine` says.
- Causal low-pass (replicate pad 11 on the left, stride 2):
      y[t] = sum_i g[2i+1] * E[t - 5 + i] + g[2i] * O[t - 6 + i]
  where a negative oversampled index means s[0] = E[0] (replicate of the activated
  signal, not of x). The non-causal variant (pad 5 left, 6 right) is
  y[t] = sum_i g[2i+1] E[t-2+i] + g[2i] O[t-3+i], clamped to O[L-1] on the right.

Every product is the fp32 product eager forms; only the order of the tap sums
differs (and the compiler may fuse a multiply and an add). A per-channel bias
can be added to x as it is loaded (`bias`: the AMP block's convs1 leaves its bias
to the activation after it), the same fp32 add eager does, without a biased copy
of the signal in memory.

An fp16 signal (the decoder in fp16) is widened to fp32 as it is loaded, and so is
an fp16 bias; everything above is computed in fp32 as for an fp32 signal, and the
store rounds once to the output's dtype (fp16, or fp32 where the next layer wants
it). The oversampled signal never leaves registers, so it is never rounded to fp16.

Two kernels, one per signal layout. Channels-first rows go to a time-tiled
kernel: a program owns BLOCK - 8 outputs of one row, lane p holds
A[p] = E[t0+p-5] and B[p] = O[t0+p-6], and the low-pass is five lane shifts
(`tl.gather`). Channels-last signals go to a sliding kernel: lanes run across
channels, so a warp's loads and stores are contiguous, and each lane slides
along a chunk of outputs of its channel with the six-sample window and the
six-pair history in registers that the unrolled loop renames.

Inputs are read through their strides (a transposed or sliced view is not
copied); the output is a new tensor in x's layout. The op is a torch custom op
with a fake implementation, so `torch.compile` traces through it without a graph
break and CUDA graphs capture it. It is opaque to Inductor on purpose: through
`triton_op`, Inductor specialised the kernel at each call site and a bucket
built several times slower (benchmarks/studies/).

Under `TRITON_INTERPRET=1` (tests on a CPU) the kernels run in Triton's
interpreter, where libdevice has no implementation: rounding, sin, exp and the
division use triton.language's there.
"""

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .activation import FILTER_TAPS, SINE_METHODS, ActivationKernel, is_channels_last

# Output samples per program = BLOCK - HALO_LANES; lanes past that only feed the shifts.
HALO_LANES = 8
# Signal and bias dtypes the kernels read and write; the arithmetic is float32 either way.
SIGNAL_DTYPES = (torch.float32, torch.float16)

def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None) if knobs is not None else None
    if runtime is not None and hasattr(runtime, "interpret"):
        return bool(runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _sin_squared(t, SINE: tl.constexpr, PRECISE: tl.constexpr):
    """sin(t)^2 by method SINE, an index into SINE_METHODS (see ActivationKernel.sine)."""
    if SINE == 1:
        # Quadrant reduction: t = k pi/2 + r with |r| <= pi/4 (pi/2 in two parts, exact
        # to |k| ~ 1e5), then sin^2(t) is sin^2(r) for even k and 1 - sin^2(r) for odd k.
        if PRECISE:
            k = libdevice.rint(t * 0.6366197723675814)
        else:
            k = tl.floor(t * 0.6366197723675814 + 0.5)
        r = tl.fma(-k, 1.5707963705062866, t)
        r = tl.fma(-k, -4.371139006309477e-08, r)
        w = r * r
        # sin^2(r) = sum_n (-1)^(n+1) 2^(2n-1) r^(2n) / (2n)!, n = 1..6: the first term left
        # out is below 4e-9 at |r| = pi/4, under half an ulp of the result.
        p = -4.275559831115387e-06
        p = tl.fma(p, w, 0.00014109347442680775)
        p = tl.fma(p, w, -0.0031746031746031746)
        p = tl.fma(p, w, 0.044444444444444446)
        p = tl.fma(p, w, -0.3333333333333333)
        p = tl.fma(p, w, 1.0)
        p = p * w
        return tl.where((k.to(tl.int32) & 1) != 0, 1.0 - p, p)
    elif SINE == 2 and PRECISE:
        # The hardware's sine (MUFU) on t reduced to [-pi, pi], where its absolute
        # error is about 2^-21.
        k = libdevice.rint(t * 0.15915494309189535)
        r = tl.fma(-k, 6.2831854820251465, t)
        r = tl.fma(-k, -1.7484556025237907e-07, r)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1)
        return s * s
    else:
        if PRECISE:
            s = libdevice.sin(t)
        else:
            s = tl.sin(t)
        return s * s


@triton.jit
def _snake(u, alpha, inv_beta, SINE: tl.constexpr, PRECISE: tl.constexpr):
    return u + inv_beta * _sin_squared(u * alpha, SINE, PRECISE)


@triton.jit
def _snake_params(alpha_ptr, beta_ptr, c, LOGSCALE: tl.constexpr, PRECISE: tl.constexpr):
    """exp(alpha) and 1 / (exp(beta) + 1e-9) of channel c, as eager computes them."""
    alpha = tl.load(alpha_ptr + c)
    beta = tl.load(beta_ptr + c)
    if LOGSCALE:
        if PRECISE:
            alpha = libdevice.exp(alpha)
            beta = libdevice.exp(beta)
        else:
            alpha = tl.exp(alpha)
            beta = tl.exp(beta)
    return alpha, tl.math.div_rn(1.0, beta + 1e-9)


@triton.jit
def _upsample_taps(up_ptr):
    """The upsampler's taps f[0..11] times its gain of 2 (exact: a power of two)."""
    return (
        tl.load(up_ptr + 0) * 2.0, tl.load(up_ptr + 1) * 2.0, tl.load(up_ptr + 2) * 2.0, tl.load(up_ptr + 3) * 2.0,
        tl.load(up_ptr + 4) * 2.0, tl.load(up_ptr + 5) * 2.0, tl.load(up_ptr + 6) * 2.0, tl.load(up_ptr + 7) * 2.0,
        tl.load(up_ptr + 8) * 2.0, tl.load(up_ptr + 9) * 2.0, tl.load(up_ptr + 10) * 2.0, tl.load(up_ptr + 11) * 2.0,
    )


@triton.jit
def _lowpass_taps(down_ptr):
    """The low-pass taps g[0..11]."""
    return (
        tl.load(down_ptr + 0), tl.load(down_ptr + 1), tl.load(down_ptr + 2), tl.load(down_ptr + 3),
        tl.load(down_ptr + 4), tl.load(down_ptr + 5), tl.load(down_ptr + 6), tl.load(down_ptr + 7),
        tl.load(down_ptr + 8), tl.load(down_ptr + 9), tl.load(down_ptr + 10), tl.load(down_ptr + 11),
    )


@triton.jit
def _upsample_snake_lowpass(
    xm3, xm2, xm1, x0, xp1, xp2, qa, last, p, alpha, inv_beta, up_ptr, down_ptr,
    BLOCK: tl.constexpr, CAUSAL: tl.constexpr, SINE: tl.constexpr, PRECISE: tl.constexpr,
):
    """The activation of one tile from x[qa - 3 .. qa + 2] (index-clamped) at every lane p;
    valid for lanes p < BLOCK - 8 (the rest only feed the shifts)."""
    f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11 = _upsample_taps(up_ptr)
    g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11 = _lowpass_taps(down_ptr)

    # Polyphase upsampler, then SnakeBeta.
    ue = f1 * xp2 + f3 * xp1 + f5 * x0 + f7 * xm1 + f9 * xm2 + f11 * xm3
    uo = f0 * xp2 + f2 * xp1 + f4 * x0 + f6 * xm1 + f8 * xm2 + f10 * xm3
    a = _snake(ue, alpha, inv_beta, SINE, PRECISE)
    bo = _snake(uo, alpha, inv_beta, SINE, PRECISE)
    # Replicate padding of the activated signal: s[negative] = s[0] = E[0] (this lane's A).
    bo = tl.where(qa < 1, a, bo)
    if not CAUSAL:
        # s[past 2L-1] = s[2L-1] = O[L-1] (this lane's B).
        a = tl.where(qa > last, bo, a)

    # Low-pass and decimate: y[j] = sum_i F_i[j + i].
    acc = tl.gather(g11 * a + g10 * bo, tl.minimum(p + 5, BLOCK - 1), 0)
    acc += tl.gather(g9 * a + g8 * bo, tl.minimum(p + 4, BLOCK - 1), 0)
    acc += tl.gather(g7 * a + g6 * bo, tl.minimum(p + 3, BLOCK - 1), 0)
    acc += tl.gather(g5 * a + g4 * bo, tl.minimum(p + 2, BLOCK - 1), 0)
    acc += tl.gather(g3 * a + g2 * bo, tl.minimum(p + 1, BLOCK - 1), 0)
    acc += g1 * a + g0 * bo
    return acc


@triton.jit
def _fused_activation_kernel(
    x_ptr,
    y_ptr,
    bias_ptr,
    alpha_ptr,
    beta_ptr,
    up_ptr,
    down_ptr,
    L,
    stride_xb,
    stride_xc,
    stride_xl,
    stride_yb,
    stride_yc,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CAUSAL: tl.constexpr,
    LOGSCALE: tl.constexpr,
    SINE: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """One program per (BLOCK - 8 output samples, channel, batch)."""
    BT: tl.constexpr = BLOCK - 8  # output samples of this program
    pid_t = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2)
    t0 = pid_t * BT
    x_row = x_ptr + b.to(tl.int64) * stride_xb + c.to(tl.int64) * stride_xc
    y_row = y_ptr + b.to(tl.int64) * stride_yb + c.to(tl.int64) * stride_yc
    alpha, inv_beta = _snake_params(alpha_ptr, beta_ptr, c, LOGSCALE, PRECISE)

    p = tl.arange(0, BLOCK)
    # Lane p holds A = E[qa] and B = O[qa - 1].
    if CAUSAL:
        qa = t0 + p - 5
    else:
        qa = t0 + p - 2
    # Clamping qa to [0, L] makes A = E[0] left of the clip, and B = O[L-1] at and past
    # its right end; A past the end is either unused (causal) or replaced by B.
    last = L - 1
    if (t0 >= 8) & (t0 + BLOCK <= L):
        # Tile interior: every index qa - 3 .. qa + 2 lies in [0, L), no clamping.
        xs = x_row + qa * stride_xl
        xm3 = tl.load(xs - 3 * stride_xl).to(tl.float32)
        xm2 = tl.load(xs - 2 * stride_xl).to(tl.float32)
        xm1 = tl.load(xs - stride_xl).to(tl.float32)
        x0 = tl.load(xs).to(tl.float32)
        xp1 = tl.load(xs + stride_xl).to(tl.float32)
        xp2 = tl.load(xs + 2 * stride_xl).to(tl.float32)
    else:
        qc = tl.minimum(tl.maximum(qa, 0), L)
        xm3 = tl.load(x_row + tl.minimum(tl.maximum(qc - 3, 0), last) * stride_xl).to(tl.float32)
        xm2 = tl.load(x_row + tl.minimum(tl.maximum(qc - 2, 0), last) * stride_xl).to(tl.float32)
        xm1 = tl.load(x_row + tl.minimum(tl.maximum(qc - 1, 0), last) * stride_xl).to(tl.float32)
        x0 = tl.load(x_row + tl.minimum(qc, last) * stride_xl).to(tl.float32)
        xp1 = tl.load(x_row + tl.minimum(qc + 1, last) * stride_xl).to(tl.float32)
        xp2 = tl.load(x_row + tl.minimum(qc + 2, last) * stride_xl).to(tl.float32)
    if HAS_BIAS:
        # The preceding convolution's bias, added to every sample as eager adds it.
        bias = tl.load(bias_ptr + c).to(tl.float32)
        xm3 += bias
        xm2 += bias
        xm1 += bias
        x0 += bias
        xp1 += bias
        xp2 += bias

    acc = _upsample_snake_lowpass(
        xm3, xm2, xm1, x0, xp1, xp2, qa, last, p, alpha, inv_beta, up_ptr, down_ptr, BLOCK, CAUSAL, SINE, PRECISE
    )
    t = t0 + p
    tl.store(y_row + t, acc, mask=(p < BT) & (t < L))


# Sizes and strides are not specialized on (divisibility, equality to 1): the unrolled
# kernel is slow to compile, and per lane its loads are single words either way.
@triton.jit(do_not_specialize=["L", "C", "lanes_per_row", "stride_xb", "stride_xc", "stride_xl",
                               "stride_yb", "stride_yc", "stride_yl"])
def _fused_activation_channels_last_kernel(
    x_ptr,
    y_ptr,
    bias_ptr,
    alpha_ptr,
    beta_ptr,
    up_ptr,
    down_ptr,
    L,
    C,
    lanes_per_row,
    stride_xb,
    stride_xc,
    stride_xl,
    stride_yb,
    stride_yc,
    stride_yl,
    LANES: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CAUSAL: tl.constexpr,
    LOGSCALE: tl.constexpr,
    SINE: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """One lane per (channel, chunk of CHUNK output samples); LANES lanes per program.

    Lane i of a row owns channel i % C and outputs [t0, t0 + CHUNK) with
    t0 = (i // C) * CHUNK, so neighbouring lanes read neighbouring channels: on a
    channels-last signal every load and store of a warp is one contiguous run.
    Each lane slides along time: per step it loads one new input sample, computes
    one pair (A[q], B[q]) = (E[q], O[q - 1]) and emits y[q - D] from the last six
    pairs (D = 0 causal, 3 centred). The window and the pair history are
    registers renamed by the unrolled loop, so nothing is shifted through shared
    memory; the price is recomputing five pairs of the previous chunk per chunk.
    """
    pid = tl.program_id(0)
    b = tl.program_id(1)
    lane = pid * LANES + tl.arange(0, LANES)
    live = lane < lanes_per_row
    c = lane % C
    t0 = (lane // C) * CHUNK
    x_row = x_ptr + b.to(tl.int64) * stride_xb + c.to(tl.int64) * stride_xc
    y_row = y_ptr + b.to(tl.int64) * stride_yb + c.to(tl.int64) * stride_yc
    alpha, inv_beta = _snake_params(alpha_ptr, beta_ptr, c, LOGSCALE, PRECISE)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c).to(tl.float32)
    else:
        bias = 0.0
    last = L - 1

    f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11 = _upsample_taps(up_ptr)
    g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11 = _lowpass_taps(down_ptr)

    # The activated signal's replicate padding: s[negative] = E[0], and (centred) s[past 2L-1] = O[L-1].
    x_first = tl.load(x_row, mask=live, other=0.0).to(tl.float32) + bias
    x_1 = tl.load(x_row + tl.minimum(1, last) * stride_xl, mask=live, other=0.0).to(tl.float32) + bias
    x_2 = tl.load(x_row + tl.minimum(2, last) * stride_xl, mask=live, other=0.0).to(tl.float32) + bias
    e_first = _snake(
        f1 * x_2 + f3 * x_1 + f5 * x_first + f7 * x_first + f9 * x_first + f11 * x_first,
        alpha, inv_beta, SINE, PRECISE,
    )
    if not CAUSAL:
        x_last = tl.load(x_row + last * stride_xl, mask=live, other=0.0).to(tl.float32) + bias
        x_l1 = tl.load(x_row + tl.maximum(last - 1, 0) * stride_xl, mask=live, other=0.0).to(tl.float32) + bias
        x_l2 = tl.load(x_row + tl.maximum(last - 2, 0) * stride_xl, mask=live, other=0.0).to(tl.float32) + bias
        o_last = _snake(
            f0 * x_last + f2 * x_last + f4 * x_last + f6 * x_last + f8 * x_l1 + f10 * x_l2,
            alpha, inv_beta, SINE, PRECISE,
        )
    else:
        o_last = e_first  # never read

    # Step q computes the pair at q from x[q - 3 .. q + 2] and emits y[q - D].
    BACK: tl.constexpr = 5 if CAUSAL else 2
    q0 = t0 - BACK
    # A program whose lanes are all live and read only inside the row (most of them)
    # takes the loop without index clamps, edge selects or masks: fewer instructions
    # per output in an issue-bound kernel.
    first_lane = pid * LANES
    t0_first = (first_lane // C) * CHUNK
    t0_last = ((first_lane + LANES - 1) // C) * CHUNK
    inside = (first_lane + LANES <= lanes_per_row) & (t0_first - BACK - 3 >= 0)
    inside = inside & (t0_last - BACK + CHUNK + 6 <= last)
    if inside:
        _slide(x_row, y_row, q0, t0, stride_xl, stride_yl, live, last, L, bias, alpha, inv_beta, 0.0, 0.0,
               f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11,
               CHUNK, CAUSAL, SINE, PRECISE, False)
    else:
        _slide(x_row, y_row, q0, t0, stride_xl, stride_yl, live, last, L, bias, alpha, inv_beta, e_first, o_last,
               f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11,
               CHUNK, CAUSAL, SINE, PRECISE, True)


@triton.jit
def _slide(
    x_row, y_row, q0, t0, stride_xl, stride_yl, live, last, L, bias, alpha, inv_beta, e_first, o_last,
    f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11,
    CHUNK: tl.constexpr, CAUSAL: tl.constexpr, SINE: tl.constexpr, PRECISE: tl.constexpr, EDGES: tl.constexpr,
):
    """The sliding loop of the channels-last kernel: CHUNK + 5 steps from q0, emitting y[t0 ..].

    With EDGES, every index is clamped into the row, the activated signal's padding is
    applied (e_first, o_last) and loads and stores are masked to live lanes; without,
    the caller guarantees that all lanes are live and every index is inside the row.
    """
    if EDGES:
        xm3 = tl.load(x_row + tl.minimum(tl.maximum(q0 - 3, 0), last) * stride_xl, mask=live, other=0.0).to(tl.float32) + bias
        xm2 = tl.load(x_row + tl.minimum(tl.maximum(q0 - 2, 0), last) * stride_xl, mask=live, other=0.0).to(tl.float32) + bias
        xm1 = tl.load(x_row + tl.minimum(tl.maximum(q0 - 1, 0), last) * stride_xl, mask=live, other=0.0).to(tl.float32) + bias
        x0 = tl.load(x_row + tl.minimum(tl.maximum(q0, 0), last) * stride_xl, mask=live, other=0.0).to(tl.float32) + bias
        xp1 = tl.load(x_row + tl.minimum(tl.maximum(q0 + 1, 0), last) * stride_xl, mask=live, other=0.0).to(tl.float32) + bias
    else:
        x_at = x_row + (q0 - 3) * stride_xl
        xm3 = tl.load(x_at).to(tl.float32) + bias
        x_at += stride_xl
        xm2 = tl.load(x_at).to(tl.float32) + bias
        x_at += stride_xl
        xm1 = tl.load(x_at).to(tl.float32) + bias
        x_at += stride_xl
        x0 = tl.load(x_at).to(tl.float32) + bias
        x_at += stride_xl
        xp1 = tl.load(x_at).to(tl.float32) + bias
        y_at = y_row + t0 * stride_yl
    # The history before the first step is never emitted; any value will do.
    a0 = e_first
    a1 = e_first
    a2 = e_first
    a3 = e_first
    a4 = e_first
    b0 = e_first
    b1 = e_first
    b2 = e_first
    b3 = e_first
    b4 = e_first
    for step in tl.static_range(CHUNK + 5):
        q = q0 + step
        if EDGES:
            xp2 = tl.load(x_row + tl.minimum(tl.maximum(q + 2, 0), last) * stride_xl, mask=live, other=0.0).to(tl.float32) + bias
        else:
            x_at += stride_xl
            xp2 = tl.load(x_at).to(tl.float32) + bias
        a5 = _snake(f1 * xp2 + f3 * xp1 + f5 * x0 + f7 * xm1 + f9 * xm2 + f11 * xm3, alpha, inv_beta, SINE, PRECISE)
        b5 = _snake(f0 * xp2 + f2 * xp1 + f4 * x0 + f6 * xm1 + f8 * xm2 + f10 * xm3, alpha, inv_beta, SINE, PRECISE)
        if EDGES:
            a5 = tl.where(q < 0, e_first, a5)
            b5 = tl.where(q < 1, a5, b5)
            if not CAUSAL:
                a5 = tl.where(q > last, o_last, a5)
                b5 = tl.where(q > last, o_last, b5)
        if step >= 5:
            # One chain of fused multiply-adds (the order of the tap sums is free).
            acc = g0 * b0
            acc = tl.fma(g1, a0, acc)
            acc = tl.fma(g2, b1, acc)
            acc = tl.fma(g3, a1, acc)
            acc = tl.fma(g4, b2, acc)
            acc = tl.fma(g5, a2, acc)
            acc = tl.fma(g6, b3, acc)
            acc = tl.fma(g7, a3, acc)
            acc = tl.fma(g8, b4, acc)
            acc = tl.fma(g9, a4, acc)
            acc = tl.fma(g10, b5, acc)
            acc = tl.fma(g11, a5, acc)
            if EDGES:
                t = t0 + (step - 5)
                tl.store(y_row + t * stride_yl, acc, mask=live & (t < L))
            else:
                tl.store(y_at, acc)
                y_at += stride_yl
        # Slide: renamed registers once the loop is unrolled.
        xm3 = xm2
        xm2 = xm1
        xm1 = x0
        x0 = xp1
        xp1 = xp2
        a0 = a1
        a1 = a2
        a2 = a3
        a3 = a4
        a4 = a5
        b0 = b1
        b1 = b2
        b2 = b3
        b3 = b4
        b4 = b5


def _time_block(block: int, length: int) -> int:
    """`block` lanes, halved while a tile would be less than half used (short clips)."""
    while block > 32 and length <= (block // 2) - HALO_LANES:
        block //= 2
    return block


def layout_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """The strides of the kernels' output for x: channels-last where x is, else contiguous [B, C, L]."""
    batch, channels, length = x.shape
    if is_channels_last(x):
        return (length * channels, 1, channels)
    return (channels * length, length, 1)


def empty_like_layout(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new tensor of x's shape and `layout_strides(x)`."""
    return torch.empty_strided(tuple(x.shape), layout_strides(x), device=x.device, dtype=dtype)


def _launch(
    y: torch.Tensor, x: torch.Tensor, bias, alpha, beta, up_filter, down_filter, logscale: bool, causal: bool,
    kernel: ActivationKernel,
):
    """Write act(x + bias) into y (x's shape, contiguous or channels-last, float32 or float16); `bias`
    may be None. Loads are widened to float32 and all arithmetic is float32; the store rounds
    once to y's dtype.

    A channels-last x runs the sliding kernel (lanes across channels), any other
    layout the tiled kernel (lanes along time).
    """
    batch, channels, length = x.shape
    if batch == 0 or channels == 0 or length == 0:
        return
    interpreting = _interpreting()
    flags = dict(HAS_BIAS=bias is not None, CAUSAL=causal, LOGSCALE=logscale,
                 SINE=SINE_METHODS.index(kernel.sine), PRECISE=not interpreting)
    pointers = (x, y, alpha if bias is None else bias, alpha, beta, up_filter, down_filter)  # bias: never read if None
    if is_channels_last(x):
        lanes_per_row = triton.cdiv(length, kernel.chunk) * channels
        grid = (triton.cdiv(lanes_per_row, kernel.lanes), batch)
        _fused_activation_channels_last_kernel[grid](
            *pointers, length, channels, lanes_per_row,
            x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
            LANES=kernel.lanes, CHUNK=kernel.chunk, num_warps=kernel.channels_last_warps, **flags,
        )
        return
    if y.stride(2) != 1:
        raise ValueError("the tiled kernel writes rows with unit stride: y must not be channels-last here")
    block = _time_block(kernel.block, length)
    grid = (triton.cdiv(length, block - HALO_LANES), channels, batch)
    _fused_activation_kernel[grid](
        *pointers, length, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1),
        BLOCK=block, num_warps=kernel.num_warps, **flags,
    )


@torch.library.custom_op("auk::fused_activation", mutates_args=())
def fused_activation_op(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    up_filter: torch.Tensor,
    down_filter: torch.Tensor,
    logscale: bool,
    causal: bool,
    block: int,
    num_warps: int,
    lanes: int,
    chunk: int,
    channels_last_warps: int,
    sine: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Anti-aliased SnakeBeta of x + bias (x [B, C, L] float32 or float16, any strides; bias [C]
    or None) -> a new [B, C, L] of `out_dtype`, channels-last where x is, else contiguous.
    The six arguments before `out_dtype` are an ActivationKernel's fields (a custom op takes
    no dataclass)."""
    y = empty_like_layout(x, out_dtype)
    kernel = ActivationKernel(block, num_warps, lanes, chunk, channels_last_warps, sine)
    _launch(y, x, bias, alpha, beta, up_filter, down_filter, logscale, causal, kernel)
    return y


@fused_activation_op.register_fake
def _(x, bias, alpha, beta, up_filter, down_filter, logscale, causal, *kernel_fields_and_dtype):
    return empty_like_layout(x, kernel_fields_and_dtype[-1])


def supports(x: torch.Tensor, act, bias: torch.Tensor | None = None) -> bool:
    """Whether the fused kernel can compute `act(x + bias)`; otherwise callers use the eager module."""
    up, down = act.upsample.filter, act.downsample.lowpass.filter
    return (
        x.dim() == 3
        and (x.is_cuda or _interpreting())
        and x.dtype in SIGNAL_DTYPES
        and x.shape[1] == act.act.alpha.numel() == act.act.beta.numel()
        and act.act.alpha.device == x.device
        and act.act.alpha.dtype == act.act.beta.dtype == up.dtype == down.dtype == torch.float32
        and up.numel() == FILTER_TAPS
        and down.numel() == FILTER_TAPS
        and max(x.shape[2], 1) * max(abs(x.stride(2)), 1) < 2**31
        and (
            bias is None
            or (bias.shape == (x.shape[1],) and bias.dtype in SIGNAL_DTYPES and bias.is_contiguous()
                and bias.device == x.device)
        )
    )


def fused_activation(
    x: torch.Tensor,
    act,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    kernel: ActivationKernel = ActivationKernel(),
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`act(x + bias)` for an `Activation1d` `act`, in one Triton kernel (the eager module where
    unsupported), stored as `out_dtype` (default: x's dtype). `bias`, per channel, is optional.

    `out`, a tensor of x's shape and `layout_strides(x)`, receives the result directly in
    its own dtype (a plain launch, not the op: for tests that poison the output first).
    """
    out_dtype = out.dtype if out is not None else (out_dtype or x.dtype)
    if not supports(x, act, bias) or out_dtype not in SIGNAL_DTYPES:
        result = act.eager(x, bias, out_dtype)
        return result if out is None else out.copy_(result)
    up = act.upsample.filter
    down = act.downsample.lowpass.filter
    args = (
        x,
        bias,
        act.act.alpha,
        act.act.beta,
        up if up.is_contiguous() else up.contiguous(),
        down if down.is_contiguous() else down.contiguous(),
        bool(act.act.logscale),
        act.downsample.lowpass.pad_right == 0,
    )
    if out is None:
        return fused_activation_op(
            *args, kernel.block, kernel.num_warps, kernel.lanes, kernel.chunk, kernel.channels_last_warps, kernel.sine,
            out_dtype,
        )
    if (
        out.shape != x.shape or out.device != x.device
        or any(n > 1 and a != b for n, a, b in zip(x.shape, out.stride(), layout_strides(x)))
    ):
        raise ValueError(
            f"out must be a tensor of shape {list(x.shape)} on {x.device}, "
            f"{'channels-last' if is_channels_last(x) else 'contiguous'} like x"
        )
    _launch(out, *args, kernel)
    return out
