"""Client for the AuK decoder served on Triton: a Python API and the `auk-client` CLI."""

from .edit import encode_audio, stream_edit
from .source import SourceAudio, load_source, prepare_source
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
    "SourceAudio",
    "Tile",
    "WavWriter",
    "assemble",
    "decode_offline",
    "encode_audio",
    "load_latents",
    "load_source",
    "model_latent_dim",
    "prepare_source",
    "random_latents",
    "read_wav",
    "stream_decode",
    "stream_edit",
    "to_pcm16",
]
