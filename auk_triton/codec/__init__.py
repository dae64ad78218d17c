"""The AuK codec: the VAE, its decode replayed as CUDA graphs, halo tiling, and the encode as served."""

from .activation import ActivationKernel, activation_kernel_for
from .decode_graph import DEFAULT_COMPILE_SHAPES, AuKVAEDecodeGraph, HostTile
from .encode_graph import AuKVAEEncoder, posterior_seed
from .tiling import plan_tiles
from .vae import AuKVAE

__all__ = [
    "ActivationKernel", "AuKVAE", "AuKVAEDecodeGraph", "AuKVAEEncoder", "DEFAULT_COMPILE_SHAPES", "HostTile",
    "activation_kernel_for", "plan_tiles", "posterior_seed",
]
