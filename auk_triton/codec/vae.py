"""The AuK VAE: a causal BigVGAN-style decoder (and its encoder), checkpoint-compatible.

Parameter names follow the released `vae.safetensors` exactly, so a state dict
maps onto this module key for key. Convolutions are stored there in the legacy
weight-norm form (`weight_g`, `weight_v`); this module holds plain `weight`
tensors and folds weight = g * v / ||v|| when loading, on the module's own
device, because a CPU fold lands up to one ULP away from the GPU's and the
encoder amplifies that.

Causality lives in the padding: every decoder convolution after `conv_pre`
pads only on the left, and each causal transposed convolution drops its last
`rate` outputs, so the output grows exactly `rate`-fold. Only `conv_pre` and
the anti-aliasing upsamplers look ahead, which is why the right decode context
is a few frames and the left one tens of frames.
"""

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from .activation import Activation1d, ActivationKernel, is_channels_last

DEFAULT_INIT_KWARGS = {
    "upsample_rates": (5, 4, 3, 2, 2, 2),
    "upsample_kernel_sizes": (10, 8, 6, 4, 4, 4),
    "upsample_initial_channel": 1536,
    "resblock_kernel_sizes": (3, 7, 11),
    "resblock_dilation_sizes": ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
    "downsample_rates": (2, 2, 2, 3, 4, 5),
    "downsample_channels": (12, 24, 48, 96, 192, 384, 768),
    "snake_logscale": True,
    "latent_dim": 64,
    "use_vae": True,
    "causal": True,
    "act_causal": True,
    "sample_rate": 24000,
}


# A channels-last decode runs its causal convolutions narrower than FOLD_BELOW channels
# time-folded to FOLD_TO channels (CausalConv1d.build_fold): below 96 channels cuDNN
# falls back to NCHW kernels with layout conversions, at 96 to 192 it runs NHWC
# implicit GEMMs (benchmarks/studies/).
FOLD_BELOW, FOLD_TO = 96, 192

# The decoder's weight and signal dtypes (configure_decoder).
DECODER_DTYPES = (torch.float32, torch.float16)

# A channels-last signal goes through the 4-D convolution ops ([N, C, 1, L]): aten's 3-D
# convolution first makes its input contiguous (channels-first), a full copy of the
# signal per convolution, while the 4-D op hands it to cuDNN's NHWC kernels as it is.


class CausalConv1d(nn.Conv1d):
    """Conv1d that zero-pads dilation * (kernel - 1) samples on the left only.

    The convolution pads itself (zeros on both sides, inside the kernel) and the
    first L outputs are kept: exactly the left-padded causal convolution, without
    writing a padded copy of the input to memory first. The last `left` outputs
    are wasted work, a few percent of a tile. The result is a view (row stride
    L + left); its consumers read strided rows.

    `bias=False` leaves the bias out, for a consumer that adds it itself (the
    fused activation folds it into its input loads).

    Time folding (`build_fold`, called by AuKVAE.configure_decoder for narrow
    convolutions). cuDNN runs 24- and 48-channel convolutions far above their
    memory floor (NCHW kernels plus layout conversions), while at 96 to 192
    channels it runs NHWC implicit GEMMs. A channels-last signal's memory [L][C]
    is also the memory of [L / F][F * C]: F consecutive samples side by side as
    one wider sample. On that view the causal convolution is another one, of F * C
    channels, dilation 1 and kernel ceil(dilation * (kernel - 1) / F) + 1, whose
    weight puts W[:, :, j] in the block (output phase p, input phase r, tap) where
    sample F*s + p meets sample F*(s - q) + r, and zeros elsewhere. Its output's
    memory is again the unfolded output's: no copies, the same products (plus
    exact zeros), summed in another order.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fold = 1
        # Derived from `weight` and `bias` by build_fold; not part of the checkpoint.
        self.register_buffer("folded_weight", None, persistent=False)
        self.register_buffer("folded_bias", None, persistent=False)

    def build_fold(self, fold: int) -> None:
        """folded_weight [F*C_out, F*C_in, 1, K'] (channels-last) and folded_bias (the bias
        repeated F times) for folding time by F = `fold`, from this layer's current weights."""
        if fold <= 1:
            self.drop_fold()
            return
        weight = self.weight.detach()
        c_out, c_in, kernel = weight.shape
        dilation = self.dilation[0]
        taps = -(-dilation * (kernel - 1) // fold) + 1
        folded = weight.new_zeros(fold, c_out, fold, c_in, taps)
        for j in range(kernel):
            back = dilation * (kernel - 1 - j)  # W[:, :, j] multiplies x[t - back]
            for p in range(fold):
                q = -((p - back) // fold)  # x[F*s + p - back] = x[F*(s - q) + r]
                folded[p, :, p - back + fold * q, :, taps - 1 - q] = weight[:, :, j]
        folded = folded.reshape(fold * c_out, fold * c_in, 1, taps)
        self.folded_weight = folded.contiguous(memory_format=torch.channels_last)
        self.folded_bias = None if self.bias is None else self.bias.detach().repeat(fold)
        self.fold = fold

    def drop_fold(self) -> None:
        self.folded_weight = self.folded_bias = None
        self.fold = 1

    def _folded(self, x: torch.Tensor, bias: bool) -> torch.Tensor:
        """The convolution on the folded view of x (channels-last rows, length divisible by F)."""
        batch, channels, length = x.shape
        fold, taps = self.fold, self.folded_weight.shape[-1]
        wide = x.transpose(1, 2).reshape(batch, length // fold, fold * channels).transpose(1, 2)
        out = F.conv2d(wide.unsqueeze(2), self.folded_weight, self.folded_bias if bias else None, 1, (0, taps - 1))
        out = out.squeeze(2)[..., : length // fold]
        return out.transpose(1, 2).reshape(batch, length, self.out_channels).transpose(1, 2)

    def forward(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        channels_last = is_channels_last(x)
        # Folding needs rows of exactly C values (the [L/F][F*C] view) and F dividing L.
        if channels_last and self.fold > 1 and x.stride(2) == x.shape[1] and x.shape[2] % self.fold == 0:
            return self._folded(x, bias)
        left = self.dilation[0] * (self.kernel_size[0] - 1)
        bias_term = self.bias if bias else None
        if channels_last:
            out = F.conv2d(x.unsqueeze(2), self.weight.unsqueeze(2), bias_term, 1, (0, left), (1, self.dilation[0]))
            out = out.squeeze(2)
        else:
            out = F.conv1d(x, self.weight, bias_term, 1, left, self.dilation[0])
        return out[..., : x.shape[-1]] if left else out


class CausalConvTranspose1d(nn.ConvTranspose1d):
    """ConvTranspose1d(kernel 2r, stride r) that drops its last r outputs: length grows r-fold.

    On a channels-last signal the upsampler can run in its polyphase form
    (`build_polyphase`, called by AuKVAE.configure_decoder): output sample r*t + p is
    W[:, :, p]^T x[t] + W[:, :, r + p]^T x[t - 1], so one ordinary convolution of
    kernel 2 from C_in to r * C_out channels computes all r phases of frame t, and
    its channels-last output [t][p][c] already is the upsampled signal's memory
    [r*t + p][c]: a view, no shuffle. cuDNN runs that convolution as an NHWC
    implicit GEMM; the transposed convolution goes through a slower dgrad kernel.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Derived from `weight` and `bias` by build_polyphase; not part of the checkpoint.
        self.register_buffer("polyphase_weight", None, persistent=False)
        self.register_buffer("polyphase_bias", None, persistent=False)

    def build_polyphase(self) -> None:
        """polyphase_weight [r*C_out, C_in, 1, 2] (channels-last) and polyphase_bias (the bias
        repeated r times) from this layer's current weights."""
        rate = self.stride[0]
        c_in, c_out, _ = self.weight.shape
        # weight[i, o, m*r + p] -> polyphase_weight[p*C_out + o, i, 0, 1 - m] (tap 0 multiplies x[t - 1]).
        taps = self.weight.detach().reshape(c_in, c_out, 2, rate).permute(3, 1, 0, 2).flip(-1)
        self.polyphase_weight = taps.reshape(rate * c_out, c_in, 1, 2).contiguous(memory_format=torch.channels_last)
        self.polyphase_bias = None if self.bias is None else self.bias.detach().repeat(rate)

    def drop_polyphase(self) -> None:
        self.polyphase_weight = self.polyphase_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rate = self.stride[0]
        if is_channels_last(x):
            if self.polyphase_weight is not None:
                batch, _, length = x.shape
                phases = F.conv2d(x.unsqueeze(2), self.polyphase_weight, self.polyphase_bias, 1, (0, 1))
                phases = phases.squeeze(2)[..., :length]
                frames = phases.permute(0, 2, 1).reshape(batch, length * rate, self.out_channels)
                return frames.permute(0, 2, 1)
            out = F.conv_transpose2d(x.unsqueeze(2), self.weight.unsqueeze(2), self.bias, (1, rate))
            return out.squeeze(2)[..., :-rate]
        return super().forward(x)[..., :-rate]


class AMPBlock(nn.Module):
    """Three residual units: x += convs2[n](act(convs1[n](act(x)))), causal, dilated."""

    def __init__(self, channels, kernel, dilations, logscale, act_causal):
        super().__init__()
        self.convs1 = nn.ModuleList(CausalConv1d(channels, channels, kernel, dilation=d) for d in dilations)
        self.convs2 = nn.ModuleList(CausalConv1d(channels, channels, kernel) for _ in dilations)
        self.activations = nn.ModuleList(
            Activation1d(channels, logscale, act_causal) for _ in range(2 * len(dilations))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for n, (c1, c2) in enumerate(zip(self.convs1, self.convs2)):
            # convs1's bias is added by the activation after it (the same fp32 add), so
            # the fused kernel can fold it into its loads instead of a pass of its own.
            h = c1(self.activations[2 * n](x), bias=False)
            x = x + c2(self.activations[2 * n + 1](h, bias=c1.bias))
        return x


class WNConv(nn.Module):
    """Holds a conv under `.layer`, as the released encoder names its strided convs."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.layer = nn.Conv1d(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class EncoderResidualStack(nn.Module):
    def __init__(self, channels: int, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.LeakyReLU(0.01),
                nn.Conv1d(channels, channels, 3, dilation=2**n, padding=2**n),
                nn.LeakyReLU(0.01),
                nn.Conv1d(channels, channels, 3, padding=1),
            )
            for n in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


class AudioEncoder(nn.Module):
    """Waveform [B, 1, T] -> [B, 2 * latent_dim, T / hop] (mean and log-std)."""

    def __init__(self, rates, channels, latent_dim):
        super().__init__()
        modules = [WNConv(1, channels[0], 3, padding=1), nn.LeakyReLU(0.2)]
        for s, f in enumerate(rates):
            modules += [
                WNConv(channels[s], channels[s + 1], 2 * f, stride=f, padding=(2 * f - 1) // 2),
                EncoderResidualStack(channels[s + 1]),
                nn.LeakyReLU(0.2),
            ]
        modules.append(WNConv(channels[-1], 2 * latent_dim, 3, padding=1))
        self.generator = nn.Sequential(*modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.generator(x)


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """x ([N, C, L]) with the channel axis innermost in memory; x itself if it already is."""
    if x.shape[1] == 1 or x.stride(1) == 1 and x.stride(2) == x.shape[1]:
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


class AuKVAE(nn.Module):
    def __init__(
        self,
        upsample_rates=DEFAULT_INIT_KWARGS["upsample_rates"],
        upsample_kernel_sizes=DEFAULT_INIT_KWARGS["upsample_kernel_sizes"],
        upsample_initial_channel=DEFAULT_INIT_KWARGS["upsample_initial_channel"],
        resblock_kernel_sizes=DEFAULT_INIT_KWARGS["resblock_kernel_sizes"],
        resblock_dilation_sizes=DEFAULT_INIT_KWARGS["resblock_dilation_sizes"],
        downsample_rates=DEFAULT_INIT_KWARGS["downsample_rates"],
        downsample_channels=DEFAULT_INIT_KWARGS["downsample_channels"],
        snake_logscale=True,
        latent_dim=64,
        use_vae=True,
        causal=True,
        act_causal=True,
        sample_rate=24000,
    ):
        super().__init__()
        if not use_vae:
            raise ValueError("use_vae=False is not supported: the AuK encoder head emits mean and log-std")
        if not causal:
            raise ValueError("causal=False is not supported: the released AuK decoder is causal")
        if len(upsample_rates) != len(upsample_kernel_sizes):
            raise ValueError(
                f"upsample_rates {list(upsample_rates)} and upsample_kernel_sizes {list(upsample_kernel_sizes)} "
                "must have one entry per upsampling stage"
            )
        if len(resblock_kernel_sizes) != len(resblock_dilation_sizes):
            raise ValueError(
                f"resblock_kernel_sizes {list(resblock_kernel_sizes)} and resblock_dilation_sizes "
                f"{list(resblock_dilation_sizes)} must have one entry per residual block"
            )
        for rate, kernel in zip(upsample_rates, upsample_kernel_sizes):
            if kernel != 2 * rate:
                raise ValueError(f"upsample kernel {kernel} must be twice its rate {rate}")
        self.upsample_rates = tuple(int(r) for r in upsample_rates)
        self.resblock_kernel_sizes = tuple(int(k) for k in resblock_kernel_sizes)
        self.resblock_dilation_sizes = tuple(tuple(int(d) for d in ds) for ds in resblock_dilation_sizes)
        self.act_causal = bool(act_causal)
        self.latent_dim = int(latent_dim)
        self.sample_rate = int(sample_rate)
        self.hop_size = math.prod(self.upsample_rates)
        if math.prod(downsample_rates) != self.hop_size:
            raise ValueError(f"encoder hop {math.prod(downsample_rates)} != decoder hop {self.hop_size}")

        self.register_buffer("global_mean", torch.zeros(latent_dim))
        self.register_buffer("global_log_std", torch.ones(latent_dim))

        c0 = int(upsample_initial_channel)
        self.conv_pre = nn.Conv1d(latent_dim, c0, 7, padding=3)
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (rate, kernel) in enumerate(zip(upsample_rates, upsample_kernel_sizes)):
            c_in, c_out = c0 // 2**i, c0 // 2 ** (i + 1)
            self.ups.append(nn.ModuleList([CausalConvTranspose1d(c_in, c_out, kernel, stride=rate)]))
            for k, dilations in zip(self.resblock_kernel_sizes, self.resblock_dilation_sizes):
                self.resblocks.append(AMPBlock(c_out, k, dilations, snake_logscale, act_causal))
        c_last = c0 // 2 ** len(upsample_rates)
        self.activation_post = Activation1d(c_last, snake_logscale, act_causal)
        self.conv_post = CausalConv1d(c_last, 1, 7, bias=False)
        self.audio_encoder = AudioEncoder(downsample_rates, downsample_channels, latent_dim)
        # The decoder's signal layout and folding (configure_decoder); the values are the same.
        self.channels_last = False
        self.fold_below, self.fold_to = FOLD_BELOW, FOLD_TO
        self.decoder_dtype = torch.float32

    # ---- construction and loading -------------------------------------------------------

    @classmethod
    def from_config(cls, model_init_kwargs: dict) -> "AuKVAE":
        """Build from a checkpoint's `model_init_kwargs`; training-only keys are ignored."""
        known = {k: v for k, v in model_init_kwargs.items() if k in DEFAULT_INIT_KWARGS}
        return cls(**known)

    def load_weights(self, path) -> "AuKVAE":
        """Load a released-layout `vae.safetensors` and fold weight norm on this module's device."""
        device = self.global_mean.device
        stored = load_file(str(path), device="cpu")
        stored = {k: v for k, v in stored.items() if not k.startswith("flow.")}
        state = {}
        for name, tensor in stored.items():
            if name.endswith(".weight_v"):
                continue
            if name.endswith(".weight_g"):
                prefix = name[: -len("_g")]
                v = stored.get(prefix + "_v")
                if v is None:
                    raise ValueError(f"checkpoint {path} has {name} without {prefix}_v")
                state[prefix] = torch._weight_norm(v.to(device), tensor.to(device), 0)
            else:
                state[name] = tensor
        orphans = [k for k in stored if k.endswith(".weight_v") and k[: -len("_v")] + "_g" not in stored]
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected)) + orphans
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {path} does not match the AuK VAE: "
                f"missing keys {missing[:20]}{' ...' if len(missing) > 20 else ''}; "
                f"unexpected keys {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}"
            )
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ValueError(
                    f"checkpoint {path}: {name} has shape {tuple(tensor.shape)}, "
                    f"the module expects {tuple(expected[name].shape)}"
                )
        self.load_state_dict({k: v.to(device=device, dtype=torch.float32) for k, v in state.items()})
        self._derive_layout()  # the folded and polyphase weights follow the loaded ones
        return self

    @classmethod
    def from_pretrained(cls, checkpoint_dir, device="cpu", **decoder_options) -> "AuKVAE":
        """Read an AuK checkpoint directory (`config.json` + `vae.safetensors`), ready for inference.

        `decoder_options` go to `configure_decoder` (the GPU decode's kernels and layout).
        """
        checkpoint_dir = Path(checkpoint_dir)
        config_path = checkpoint_dir / "config.json"
        weights_path = checkpoint_dir / "vae.safetensors"
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"AuK checkpoint {checkpoint_dir} has no {path.name}")
        try:
            config = json.loads(config_path.read_text())
            section = config["vae"]
            init_kwargs = section.get("model_init_kwargs", {})
            if not isinstance(init_kwargs, dict):
                raise TypeError(f"model_init_kwargs is a {type(init_kwargs).__name__}, not an object")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{config_path} is not an AuK config with a 'vae' section: {err}") from None
        vae = cls.from_config(init_kwargs)
        for key, actual in (
            ("latent_dim", vae.latent_dim),
            ("downsample_rate", vae.hop_size),
            ("target_sample_rate", vae.sample_rate),
        ):
            if key in section and int(section[key]) != actual:
                raise ValueError(f"{config_path}: vae.{key} is {section[key]}, but the codec it describes has {actual}")
        vae = vae.to(device)
        vae.load_weights(weights_path)
        vae.eval().requires_grad_(False)
        if decoder_options:
            vae.configure_decoder(**decoder_options)
        return vae

    def configure_decoder(
        self,
        *,
        activation_kernel: ActivationKernel | None = None,
        channels_last: bool = False,
        fold_below: int = FOLD_BELOW,
        fold_to: int = FOLD_TO,
        dtype: torch.dtype = torch.float32,
    ) -> "AuKVAE":
        """Choose how the decoder runs on a GPU; before or after loading weights, as often as needed
        (but see `dtype`).

        `activation_kernel`: run every anti-aliased activation as one Triton kernel
        with these launch settings on CUDA (None: the eager ops; a CPU always runs them).

        `channels_last`: run the decoder on channels-last signals, [B, C, L] tensors
        over [B, L, C] memory. cuDNN's convolution kernels read and write NHWC; fed
        channels-first signals they transpose every input and output. Storing the
        decoder's weights channels-last and converting the signal once after
        `conv_pre` keeps every convolution, upsampler (in its polyphase form),
        residual add and fused activation in that layout. Causal convolutions
        narrower than `fold_below` channels run time-folded to `fold_to` channels
        where their width divides it (CausalConv1d.build_fold); `fold_to=0` turns
        folding off. The weights keep their values, only their strides change;
        decodes differ at rounding level, where other convolution algorithms run.

        `dtype`: the decoder's convolution weights and signals, float32 (cuDNN runs
        its convolutions in TF32 where PyTorch allows it, its default) or float16
        (fp16 tensor-core convolutions with fp32 accumulation: TF32 and fp16 both keep
        10 mantissa bits, and the signals stay far inside fp16's range). Either way the
        activations compute in float32 (their parameters and filters stay float32), and so do the
        latents' de-normalisation, the last activation's output, `conv_post` and the
        clamp: the waveform comes out float32. float16 rounds the loaded weights, so
        going back to float32 needs the checkpoint loaded again. For fp16 set
        `torch.backends.cudnn.benchmark`: cuDNN's heuristics give some dilated fp16
        convolutions a direct (non-tensor-core) kernel many times slower than the
        implicit GEMM that timing finds (benchmarks/studies/fp16-decoder.md).
        """
        if dtype not in DECODER_DTYPES:
            raise ValueError(f"decoder dtype {dtype}: use one of {', '.join(map(str, DECODER_DTYPES))}")
        if dtype == torch.float32 and self.decoder_dtype != torch.float32:
            raise ValueError(f"the decoder's weights are already rounded to {self.decoder_dtype}; "
                             "load the checkpoint again for a float32 decoder")
        fused = None
        if activation_kernel is not None:  # Triton is imported only when the kernel is asked for
            from .activation_kernel import fused_activation as fused
        for module in self.modules():
            if isinstance(module, Activation1d):
                module.kernel, module.fused = activation_kernel, fused
        self.channels_last = bool(channels_last)
        self.fold_below, self.fold_to = int(fold_below), int(fold_to)
        self.decoder_dtype = dtype
        self._derive_layout()
        return self

    def _derive_layout(self) -> None:
        """Weight strides, folded and polyphase weights for the chosen layout, from the current weights."""
        enabled, fold_below, fold_to = self.channels_last, self.fold_below, self.fold_to
        decoder = [self.conv_pre, self.conv_post, *self.ups, *self.resblocks]
        for part in decoder:
            for module in part.modules():
                if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d)):
                    # conv_post keeps float32: it writes the waveform (fp16 would step by 2^-11 near 1).
                    dtype = torch.float32 if module is self.conv_post else self.decoder_dtype
                    weight = module.weight.detach().to(dtype)
                    module.weight.data = _channels_last(weight) if enabled else weight.contiguous()
                    if module.bias is not None:
                        module.bias.data = module.bias.detach().to(dtype)
        for conv in self.modules():
            if isinstance(conv, CausalConv1d):
                width = conv.in_channels
                folds = enabled and width < fold_below and fold_to > width and fold_to % width == 0
                conv.build_fold(fold_to // width if folds else 1)
        for up in self.ups:
            if enabled:
                up[0].build_polyphase()
            else:
                up[0].drop_polyphase()

    # ---- geometry ------------------------------------------------------------------------

    def decode_context_frames(self) -> tuple[int, int]:
        """Latent frames (left, right) that can change a frame's samples, for any weights.

        Summed layer by layer in samples at the rate each layer runs, converted to
        frames by that rate's samples per frame, then rounded up once at the end.
        """
        act_left, act_right = Activation1d.context_samples(self.act_causal)
        left, right = 3.0, 3.0  # conv_pre: kernel 7, zero padding 3 on both sides
        samples_per_frame = 1
        for rate in self.upsample_rates:
            left += 1.0 / samples_per_frame  # causal transposed conv: one input frame back
            samples_per_frame *= rate
            block_left = block_right = 0.0
            for kernel, dilations in zip(self.resblock_kernel_sizes, self.resblock_dilation_sizes):
                reach_left = sum(d * (kernel - 1) + (kernel - 1) for d in dilations)
                reach_left += 2 * len(dilations) * act_left
                reach_right = 2 * len(dilations) * act_right
                block_left = max(block_left, reach_left)
                block_right = max(block_right, reach_right)
            left += block_left / samples_per_frame
            right += block_right / samples_per_frame
        left += (act_left + 6) / samples_per_frame  # activation_post, conv_post (kernel 7)
        right += act_right / samples_per_frame
        return math.ceil(left - 1e-9), math.ceil(right - 1e-9)

    # ---- inference -----------------------------------------------------------------------

    def _check_float32(self, name: str, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {tensor.dtype}")

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents [B, frames, latent_dim] -> waveform [B, frames * hop_size] in [-1, 1]."""
        self._check_float32("latents", latents)
        if latents.dim() != 3 or latents.shape[-1] != self.latent_dim:
            raise ValueError(
                f"latents must be [batch, frames, {self.latent_dim}], got {list(latents.shape)}"
            )
        if latents.shape[1] == 0:
            raise ValueError("latents have zero frames")
        return self(latents)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """`decode` without its checks, for callers that have made them (the graph wrapper)."""
        x = latents * torch.sqrt(self.global_log_std) + self.global_mean
        x = self.conv_pre(x.transpose(1, 2).to(self.decoder_dtype))
        if self.channels_last:
            x = _channels_last(x)
        blocks = len(self.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up[0](x)
            stage = self.resblocks[i * blocks : (i + 1) * blocks]
            # The three blocks' average is summed in fp32 and rounded once: in an fp16 decoder
            # each partial sum rounded to fp16 adds its own error (a compiled bucket fuses this
            # anyway; the eager kernels of plain graphs and batched rows need it spelled out).
            acc = stage[0](x).float()
            for block in stage[1:]:
                acc = acc + block(x)
            x = (acc / blocks).to(x.dtype)
        x = self.conv_post(self.activation_post(x, out_dtype=torch.float32))
        return torch.clamp(x, -1.0, 1.0).squeeze(1)

    def zero_latent(self) -> torch.Tensor:
        """The normalized latent that de-normalizes to raw zero: -mean / sqrt(var)."""
        return -self.global_mean / torch.sqrt(self.global_log_std)

    def check_wav(self, wav: torch.Tensor) -> None:
        """Raise ValueError unless `wav` is what `encode` takes: float32 mono [1, samples >= hop]."""
        self._check_float32("wav", wav)
        if wav.dim() != 2 or wav.shape[0] != 1:
            raise ValueError(f"wav must be mono [1, samples], got {list(wav.shape)}")
        if wav.shape[1] < self.hop_size:
            raise ValueError(f"wav has {wav.shape[1]} samples, fewer than one hop ({self.hop_size})")

    def encode(self, wav: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Mono [1, T] at the codec's rate -> normalized latents [1, T // hop_size, latent_dim].

        The posterior mean, or a sample from the posterior when `generator` is given.
        """
        self.check_wav(wav)
        stats = self.audio_encoder(wav.unsqueeze(1))
        return self.posterior_latents(stats, wav.shape[1] // self.hop_size, generator)

    def posterior_latents(
        self, stats: torch.Tensor, frames: int, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """The encoder head's output [1, 2 * latent_dim, T'] -> normalized latents [1, frames,
        latent_dim]: the posterior mean, or a sample from it when `generator` is given."""
        mean, log_std = stats.chunk(2, dim=1)
        raw = mean
        if generator is not None:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
            raw = mean + noise * torch.exp(log_std)
        latents = (raw - self.global_mean.view(1, -1, 1)) / torch.sqrt(self.global_log_std.view(1, -1, 1))
        return latents.transpose(1, 2)[:, :frames]
