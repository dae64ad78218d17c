"""Seeded synthetic AuK codec checkpoints, written in the released layout.

The real AuK weights are not distributed with this project. To serve and test
without them, we generate a checkpoint directory (`config.json` with its `vae`
section, `vae.safetensors` with legacy weight-norm keys) from a seed and load
it through `AuKVAE.from_pretrained`, the same path a real checkpoint takes.
Its audio is NOT real: decoded latents sound like shaped noise.

Weights are drawn with fan-in scaling, then `conv_post` is rescaled so that
decoding unit-normal latents gives an RMS of about 0.2 before the clamp: loud
enough to check, far from clipped noise.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .vae import DEFAULT_INIT_KWARGS, AuKVAE

SYNTHETIC_WARNING = (
    "AuK codec weights are SYNTHETIC (seeded random, not the released checkpoint): "
    "the decoded audio is not real audio"
)

PRESETS = {
    # The released geometry: 114.5 M parameters.
    "auk": dict(DEFAULT_INIT_KWARGS),
    # Released rates, kernels and dilations (so the same decode context, (53, 9)),
    # narrow channels: decodes fast on two CPU cores.
    "small": dict(
        DEFAULT_INIT_KWARGS,
        upsample_initial_channel=128,
        downsample_channels=(4, 8, 8, 16, 16, 32, 32),
    ),
}

TARGET_RMS = 0.2
_CALIBRATION_FRAMES = 16


def _randomize(vae: AuKVAE, generator: torch.Generator) -> None:
    def normal(shape, std):
        return torch.randn(shape, generator=generator) * std

    for name, module in vae.named_modules():
        if isinstance(module, nn.ConvTranspose1d):
            fan_in = module.in_channels * module.kernel_size[0] / module.stride[0]
        elif isinstance(module, nn.Conv1d):
            fan_in = module.in_channels * module.kernel_size[0]
        else:
            continue
        # Residual branches start small so that nine stacked blocks do not blow up.
        gain = 0.5 if ".convs2." in name or ".layers." in name else 1.0
        module.weight.data = normal(module.weight.shape, gain / fan_in**0.5)
        if module.bias is not None:
            module.bias.data = normal(module.bias.shape, 0.01)
    for name, param in vae.named_parameters():
        if name.endswith(".alpha") or name.endswith(".beta"):
            param.data = normal(param.shape, 0.1)
    vae.global_mean.copy_(normal(vae.global_mean.shape, 0.5))
    vae.global_log_std.copy_(0.5 + torch.rand(vae.global_log_std.shape, generator=generator))


def _calibrate_loudness(vae: AuKVAE, generator: torch.Generator) -> None:
    captured = {}
    hook = vae.conv_post.register_forward_hook(lambda m, i, out: captured.setdefault("out", out))
    latents = torch.randn(1, _CALIBRATION_FRAMES, vae.latent_dim, generator=generator)
    vae.decode(latents)
    hook.remove()
    rms = captured["out"].pow(2).mean().sqrt().item()
    vae.conv_post.weight.data *= TARGET_RMS / max(rms, 1e-12)


def _released_state_dict(vae: AuKVAE) -> dict[str, torch.Tensor]:
    """The module's state dict with every conv weight split into weight_g / weight_v."""
    conv_weights = {
        f"{name}.weight"
        for name, module in vae.named_modules()
        if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d))
    }
    state = {}
    for key, tensor in vae.state_dict().items():
        tensor = tensor.detach().to(torch.float32).contiguous()
        if key in conv_weights:
            norm = tensor.flatten(1).norm(dim=1).view(-1, *([1] * (tensor.dim() - 1)))
            state[key + "_g"] = norm.contiguous()
            state[key + "_v"] = tensor
        else:
            state[key] = tensor
    return state


def synthetic_config(preset: str, seed: int) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown synthetic preset {preset!r}; choose one of {sorted(PRESETS)}")
    kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in PRESETS[preset].items()}
    kwargs["resblock_dilation_sizes"] = [list(d) for d in kwargs["resblock_dilation_sizes"]]
    hop = 1
    for rate in kwargs["upsample_rates"]:
        hop *= rate
    return {
        "model_type": "auk",
        "synthetic": {"preset": preset, "seed": seed, "warning": SYNTHETIC_WARNING},
        "vae": {
            "latent_dim": kwargs["latent_dim"],
            "downsample_rate": hop,
            "target_sample_rate": kwargs["sample_rate"],
            "model_init_kwargs": kwargs,
        },
    }


def write_synthetic_checkpoint(out_dir, preset: str = "small", seed: int = 0) -> Path:
    """Write a seeded synthetic AuK codec checkpoint directory and return its path.

    Idempotent: a directory that already holds this preset and seed is left as is.
    """
    out_dir = Path(out_dir)
    config = synthetic_config(preset, seed)
    config_path, weights_path = out_dir / "config.json", out_dir / "vae.safetensors"
    if config_path.is_file() and weights_path.is_file():
        try:
            if json.loads(config_path.read_text()).get("synthetic") == config["synthetic"]:
                return out_dir
        except json.JSONDecodeError:
            pass
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        vae = AuKVAE.from_config(config["vae"]["model_init_kwargs"]).eval()
        _randomize(vae, generator)
        _calibrate_loudness(vae, generator)
        state = _released_state_dict(vae)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Weights first, config last: a config naming this preset means the weights are complete.
    tmp = weights_path.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "synthetic": "true"})
    tmp.replace(weights_path)
    config_path.write_text(json.dumps(config, indent=1))
    return out_dir


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write a synthetic (not real) AuK codec checkpoint.")
    parser.add_argument("out_dir")
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_synthetic_checkpoint(args.out_dir, args.preset, args.seed))
    print(f"warning: {SYNTHETIC_WARNING}")


if __name__ == "__main__":
    main()
