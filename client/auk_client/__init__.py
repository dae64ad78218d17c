"""Client for the AuK decoder served on Triton: a Python API and the `auk-client` CLI."""

from .stream import (
    AuKClientError,
    Tile,
    assemble,
    decode_offline,
    load_latents,
    model_latent_dim,
    random_latents,
    stream_decode,
)
from .wavio import RawPcm16Stream, WavWriter, read_wav, to_pcm16

__all__ = [
    "AuKClientError",
    "RawPcm16Stream",
    "Tile",
    "WavWriter",
    "assemble",
    "decode_offline",
    "load_latents",
    "model_latent_dim",
    "random_latents",
    "read_wav",
    "stream_decode",
    "to_pcm16",
]
