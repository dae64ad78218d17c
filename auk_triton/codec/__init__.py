"""The AuK codec: the VAE, its decode replayed as CUDA graphs, and halo tiling."""

from .activation import ActivationKernel
from .decode_graph import DEFAULT_COMPILE_SHAPES, AuKVAEDecodeGraph, HostTile
from .tiling import plan_tiles
from .vae import AuKVAE

__all__ = ["ActivationKernel", "AuKVAE", "AuKVAEDecodeGraph", "DEFAULT_COMPILE_SHAPES", "HostTile", "plan_tiles"]
