"""Seeded synthetic AuK DiT weights, written in the released layout.

`auk.safetensors` holds every DiT tensor under `transformer.` plus the encoder
stage's `layer_weights` [36] and `layer_scale` [1]; `config.json` gets the
`dit`, `variant`, `flash_t_grid` and `defaults` sections merged into whatever
the codec writer (`auk_triton.codec.synthetic`) already put there. The weights are
seeded random values, NOT a trained model: sampled latents decode to noise.

Weights use fan-in scaling, so the velocity has about unit scale and a 32-step
trajectory stays finite and bounded; the AdaLN linears are kept small so the
time embedding modulates rather than dominates.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .sampler import DEFAULTS
from .transformer import (CHECKPOINT_PREFIX, CONFIG_FILE, ENCODER_FUSION_KEYS, WEIGHTS_FILE, AuKTransformer,
                          build_transformer, ready_for_inference)

SYNTHETIC_DIT_WARNING = (
    "AuK DiT weights are SYNTHETIC (seeded random, not the released checkpoint): "
    "generated latents are not real audio"
)

# The released flash grid, 1 - cos(pi t / 2) at t = 0, 1/4, 1/2, 3/4, 1, exactly as released.
FLASH_T_GRID = [0.0, 0.07612049579620361, 0.2928932309150696, 0.6173166036605835, 1.0]
ENCODER_LAYERS = 36

PRESETS = {
    # The released dims: about 1.5305 B parameters (6.1 GB in fp32). For the GPU.
    "auk": dict(dim=1536, heads=24, dim_head=64, ff_mult=2, text_hidden_dim=2048,
                num_layers=10, num_single_layers=20, attn_mask_enabled=True),
    # Samples in seconds on two CPU cores. text_hidden_dim stays 2048: it is the
    # served PROMPT_EMBEDS width. dim must stay a multiple of the conv's 16 groups.
    "small": dict(dim=64, heads=4, dim_head=16, ff_mult=2, text_hidden_dim=2048,
                  num_layers=2, num_single_layers=2, attn_mask_enabled=True),
}
VARIANTS = ("base", "flash")


def _synthetic_tensor(name: str, shape, generator: torch.Generator, dim_head: int) -> torch.Tensor:
    def normal(std):
        return torch.randn(shape, generator=generator) * std

    if name.endswith("inv_freq"):
        return 1.0 / (10000.0 ** (torch.arange(0, dim_head, 2, dtype=torch.float32) / dim_head))
    if "norm" in name and len(shape) == 1 and not name.endswith("bias"):
        return 1.0 + normal(0.1)  # RMSNorm weights
    modulation = ".attn_norm" in name or name.startswith("norm_out.")
    if name.endswith("bias"):
        return normal(0.1 if modulation else 0.02)
    fan_in = 1
    for size in shape[1:]:
        fan_in *= size
    return normal((0.2 if modulation else 1.0) / fan_in**0.5)


def _dit_tensors(preset: str, seed: int, latent_dim: int):
    """(name without the prefix, fp32 tensor) for every DiT tensor, in the checkpoint's order, then
    the generator that made them (the encoder fusion keys are drawn from it next)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown synthetic DiT preset {preset!r}; choose one of {sorted(PRESETS)}")
    dims = PRESETS[preset]
    shapes = build_transformer({"dit": dims, "vae": {"latent_dim": latent_dim}}, device="meta").state_dict()
    generator = torch.Generator().manual_seed(seed)
    tensors = ((name, _synthetic_tensor(name, tuple(t.shape), generator, dims["dim_head"]).contiguous())
               for name, t in shapes.items())
    return tensors, generator


def synthetic_dit_state(preset: str, seed: int, latent_dim: int = 64) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (prefixed keys, fp32) for a preset and seed."""
    tensors, generator = _dit_tensors(preset, seed, latent_dim)
    state = {CHECKPOINT_PREFIX + name: tensor for name, tensor in tensors}
    layer_weights, layer_scale = ENCODER_FUSION_KEYS
    state[layer_weights] = torch.randn(ENCODER_LAYERS, generator=generator) * 0.1
    state[layer_scale] = torch.ones(1)
    return state


@torch.no_grad()
def synthetic_transformer(preset: str = "small", seed: int = 0, device="cpu", dtype=torch.float32,
                          latent_dim: int = 64) -> AuKTransformer:
    """The DiT with the weights `write_synthetic_dit_checkpoint` writes for this preset and seed,
    built in memory: each tensor is cast onto `device` as it is made (no checkpoint on disk, and
    one fp32 tensor at a time on the host)."""
    tensors, _ = _dit_tensors(preset, seed, latent_dim)  # refuses an unknown preset
    model = build_transformer({"dit": PRESETS[preset], "vae": {"latent_dim": latent_dim}}, device="meta")
    state = {name: tensor.to(device=device, dtype=dtype) for name, tensor in tensors}
    model.load_state_dict(state, strict=True, assign=True)
    return ready_for_inference(model)


def write_synthetic_dit_checkpoint(out_dir, preset: str = "small", seed: int = 0, variant: str = "base") -> Path:
    """Add seeded synthetic DiT weights to a checkpoint directory and return its path.

    Writes `auk.safetensors` and merges the DiT sections into `config.json`, keeping
    what is there (run the codec writer first: it rewrites config.json whole). The
    latent width comes from the config's `vae` section (64 when there is none yet).
    Idempotent: a directory that already holds this preset, seed and variant is left as is.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
    out_dir = Path(out_dir)
    config_path, weights_path = out_dir / CONFIG_FILE, out_dir / WEIGHTS_FILE
    config = json.loads(config_path.read_text()) if config_path.is_file() else {"model_type": "auk"}
    marker = {"preset": preset, "seed": seed, "variant": variant, "warning": SYNTHETIC_DIT_WARNING}
    if config.get("synthetic_dit") == marker and weights_path.is_file():
        return out_dir
    latent_dim = int(config.get("vae", {}).get("latent_dim", 64))
    with torch.no_grad():
        state = synthetic_dit_state(preset, seed, latent_dim)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Weights first, config last: a config naming these weights means they are complete.
    tmp = weights_path.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "synthetic": "true"})
    tmp.replace(weights_path)
    config.update(
        dit=dict(PRESETS[preset]),
        variant=variant,
        flash_t_grid=list(FLASH_T_GRID),
        defaults=dict(DEFAULTS),
        synthetic_dit=marker,
    )
    tmp = config_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config, indent=1))
    tmp.replace(config_path)
    return out_dir


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Add synthetic (not trained) AuK DiT weights to a checkpoint dir.")
    parser.add_argument("out_dir")
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", default="base", choices=VARIANTS)
    args = parser.parse_args()
    print(write_synthetic_dit_checkpoint(args.out_dir, args.preset, args.seed, args.variant))
    print(f"warning: {SYNTHETIC_DIT_WARNING}")


if __name__ == "__main__":
    main()
