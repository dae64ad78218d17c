"""Anti-aliased SnakeBeta activation of the AuK decoder: the eager reference.

A periodic activation applied at the signal's own rate would fold its harmonics
back below Nyquist, so the decoder runs it at twice the rate: upsample by 2
with a Kaiser-windowed sinc, apply SnakeBeta, low-pass and decimate by 2.

Numerics that matter for checkpoint compatibility:

- The FIR taps are persistent buffers: a checkpoint's stored taps win over the
  ones computed here, which only seed a freshly built module.
- The upsampler replicate-pads by 5 input samples on each side and is never
  causal; edge replication (not zeros) keeps a DC signal flat at the clip edge.
- The causal low-pass pads 11 samples on the left by replication and none on
  the right, so an output sample never sees the future at the oversampled rate.
- SnakeBeta's log-scale parameters are exponentiated on every call rather than
  cached, so a forward pass reads nothing a load could leave stale.

`activation_kernel.py` computes the same function in one Triton kernel; an
`Activation1d` runs it on CUDA once `AuKVAE.configure_decoder` hands it an
`ActivationKernel`, and this module's ops everywhere else.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FILTER_TAPS = 12
RATIO = 2
SINE_METHODS = ("libdevice", "polynomial", "approx")


@dataclass(frozen=True)
class ActivationKernel:
    """Launch settings of the fused activation kernel (`activation_kernel.py`).

    `block`, `num_warps`: the time-tiled kernel (channels-first signals): lanes per
    program (BLOCK - 8 outputs each) and warps. `lanes`, `chunk`, `channels_last_warps`:
    the sliding kernel (channels-last signals): lanes per program, outputs per lane
    (longer chunks recompute less but unroll past the instruction cache) and warps.
    `sine`: how sin(t)^2 is evaluated: "polynomial" (a quadrant reduction and an even
    polynomial, as close to sin^2 as the precise sinf squared, with no slow path),
    "libdevice" (the precise sinf, as eager) or "approx" (the hardware sine, about
    1e-6 absolute; GPU only).
    """

    block: int = 1024
    num_warps: int = 4
    lanes: int = 128
    chunk: int = 16
    channels_last_warps: int = 4
    sine: str = "polynomial"

    def __post_init__(self):
        if self.sine not in SINE_METHODS:
            raise ValueError(f"sine is {self.sine!r}; use one of {SINE_METHODS}")


def activation_kernel_for(dtype: torch.dtype) -> ActivationKernel:
    """The fused kernel's launch for a decoder whose signals are `dtype`. An fp16 decoder
    rounds each activation's output to fp16 (2^-11 relative), far coarser than the hardware
    sine's 1e-6 absolute error, so it takes that sine, the fastest; float32 keeps the
    polynomial, as close to eager as the precise sinf (benchmarks/studies/fp16-decoder.md)."""
    return ActivationKernel(sine="approx") if dtype == torch.float16 else ActivationKernel()


def is_channels_last(x: torch.Tensor) -> bool:
    """A [N, C, L] signal whose channels are adjacent in memory ([N, L, C] storage)."""
    return x.dim() == 3 and x.shape[1] > 1 and x.stride(1) == 1


def kaiser_sinc_taps(cutoff: float, half_width: float, taps: int) -> torch.Tensor:
    """Kaiser-windowed sinc low-pass taps, normalised to unit DC gain, shaped [1, 1, taps]."""
    half = taps // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(taps, beta=beta, periodic=False)
    if taps % 2 == 0:
        t = torch.arange(-half, half) + 0.5
    else:
        t = torch.arange(taps) - half
    filt = 2 * cutoff * window * torch.sinc(2 * cutoff * t)
    filt = filt / filt.sum()
    return filt.view(1, 1, taps)


class SnakeBeta(nn.Module):
    """y = x + 1 / (exp(beta) + 1e-9) * sin(x * exp(alpha))^2, per channel."""

    def __init__(self, channels: int, logscale: bool = True):
        super().__init__()
        self.logscale = logscale
        init = torch.zeros(channels) if logscale else torch.ones(channels)
        self.alpha = nn.Parameter(init.clone())
        self.beta = nn.Parameter(init.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.view(1, -1, 1)
        beta = self.beta.view(1, -1, 1)
        if self.logscale:
            alpha = torch.exp(alpha)
            beta = torch.exp(beta)
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class UpSample1d(nn.Module):
    """Upsample by 2: replicate pad, polyphase transposed conv with the sinc taps, crop."""

    def __init__(self):
        super().__init__()
        self.pad = FILTER_TAPS // RATIO - 1
        self.pad_left = self.pad * RATIO + (FILTER_TAPS - RATIO) // 2
        self.pad_right = self.pad * RATIO + (FILTER_TAPS - RATIO + 1) // 2
        self.register_buffer("filter", kaiser_sinc_taps(0.5 / RATIO, 0.6 / RATIO, FILTER_TAPS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        x = RATIO * F.conv_transpose1d(
            x, self.filter.expand(channels, -1, -1), stride=RATIO, groups=channels
        )
        return x[..., self.pad_left : -self.pad_right]


class LowPassFilter1d(nn.Module):
    """Low-pass with the sinc taps and decimation by 2 (causal: all padding on the left)."""

    def __init__(self, causal: bool = True):
        super().__init__()
        if causal:
            self.pad_left, self.pad_right = FILTER_TAPS - 1, 0
        else:
            self.pad_left, self.pad_right = FILTER_TAPS // 2 - 1, FILTER_TAPS // 2
        self.register_buffer("filter", kaiser_sinc_taps(0.5 / RATIO, 0.6 / RATIO, FILTER_TAPS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        x = F.pad(x, (self.pad_left, self.pad_right), mode="replicate")
        return F.conv1d(x, self.filter.expand(channels, -1, -1), stride=RATIO, groups=channels)


class DownSample1d(nn.Module):
    def __init__(self, causal: bool = True):
        super().__init__()
        self.lowpass = LowPassFilter1d(causal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lowpass(x)


class Activation1d(nn.Module):
    """Upsample x2 -> SnakeBeta -> low-pass and decimate x2; length in equals length out."""

    def __init__(self, channels: int, logscale: bool = True, causal: bool = True):
        super().__init__()
        self.act = SnakeBeta(channels, logscale)
        self.upsample = UpSample1d()
        self.downsample = DownSample1d(causal)
        # The fused kernel's settings and the kernel itself (activation_kernel.fused_activation),
        # both set by AuKVAE.configure_decoder, or None for the eager ops. Handed in rather than
        # imported here: the kernel's module imports this one.
        self.kernel: ActivationKernel | None = None
        self.fused = None

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """act(x), or act(x + bias) with a per-channel `bias` (the preceding conv's), stored as
        `out_dtype` (default: x's dtype)."""
        if self.kernel is not None and x.is_cuda:
            return self.fused(x, self, bias=bias, kernel=self.kernel, out_dtype=out_dtype)
        return self.eager(x, bias, out_dtype)

    def eager(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The reference: three depthwise ops, whatever the device. They compute in at least
        float32 (an fp16 signal is widened first, as the fused kernel widens its loads), and
        the result is rounded once to `out_dtype` (default: x's dtype)."""
        out_dtype = out_dtype or x.dtype
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        if bias is not None:
            x = x + bias.to(x.dtype).view(1, -1, 1)
        y = self.downsample(self.act(self.upsample(x)))
        return y if y.dtype == out_dtype else y.to(out_dtype)

    @staticmethod
    def context_samples(causal: bool) -> tuple[float, float]:
        """Reach (left, right) in input samples: the upsampler's 12 / (2 * 2) each side,
        plus the low-pass padding, counted at the oversampled rate and halved."""
        up = FILTER_TAPS / (RATIO * 2)
        if causal:
            return up + (FILTER_TAPS - 1) / RATIO, up
        return up + (FILTER_TAPS // 2 - 1) / RATIO, up + (FILTER_TAPS // 2) / RATIO
