"""Client for editing: a source clip's latents from `auk_vae_encode`, and the `auk_edit`
ensemble (auk_vae_encode -> auk_dit with those latents as REF_LATENTS -> auk_vae_decode).

- `encode_audio(audio)` sends mono 24 kHz samples to `auk_vae_encode` (gRPC, unary) and
  returns their normalized latents [frames, 64]: the posterior mean, or with `seed` a
  sample of the posterior.
- `stream_edit(audio, prompt_embeds, seconds, seed)` sends one request to `auk_edit` over
  a gRPC stream and yields a `Tile` for every decoded tile as it arrives. Without
  `seconds` the target is as long as the source.

`auk_client.source.load_source` turns a WAV file into such samples. The command lines are
`auk-client encode source.wav -o latents.npy` and `auk-client edit --audio source.wav ...`.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .pipeline import DEFAULT_PIPELINE_TIMEOUT_S, pipeline_inputs
from .stream import DEFAULT_GRPC_URL, DEFAULT_TIMEOUT_S, BadInput, Tile, stream_infer, unary_infer

ENCODE_MODEL = "auk_vae_encode"
EDIT_MODEL = "auk_edit"


def check_audio(audio: np.ndarray) -> np.ndarray:
    """Mono samples [n] as C-contiguous float32 (the server checks length and values)."""
    arr = np.asarray(audio)
    if arr.ndim != 1:
        raise BadInput(f"source audio must be mono [samples], got shape {list(arr.shape)}; mix it down first")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _seed(seed: int | None) -> np.ndarray | None:
    return None if seed is None else np.array([seed], dtype=np.int64)


def encode_audio(
    audio: np.ndarray,
    *,
    seed: int | None = None,
    url: str = DEFAULT_GRPC_URL,
    model: str = ENCODE_MODEL,
    timeout: float = DEFAULT_TIMEOUT_S,
    check: bool = True,
) -> np.ndarray:
    """The normalized latents [samples // 480, 64] of mono 24 kHz `audio` (gRPC, unary)."""
    import tritonclient.grpc as grpcclient

    arrays = {"AUDIO": check_audio(audio) if check else np.asarray(audio), "SEED": _seed(seed)}
    inputs = []
    for name, array in arrays.items():
        if array is not None:
            inputs.append(grpcclient.InferInput(name, list(array.shape), "INT64" if name == "SEED" else "FP32"))
            inputs[-1].set_data_from_numpy(array)
    return unary_infer(model, inputs, url, timeout).as_numpy("LATENTS")


def stream_edit(
    audio: np.ndarray,
    prompt_embeds: np.ndarray,
    seconds: float | None = None,
    seed: int = 0,
    *,
    num_steps: int | None = None,
    guidance: float | None = None,
    sway: float | None = None,
    encode_seed: int | None = None,
    url: str = DEFAULT_GRPC_URL,
    model: str = EDIT_MODEL,
    timeout: float = DEFAULT_PIPELINE_TIMEOUT_S,
    check: bool = True,
) -> Iterator[Tile]:
    """Run the editing ensemble over a gRPC stream, yielding decoded tiles as the server sends them.

    `seconds=None`: a target as long as the source. `encode_seed`: the source's latents are
    a sample of its posterior (send `seed` for the reference's vae_sample); None: its mean.
    `check=False` sends the inputs as given (to exercise the server's checks).
    """
    import tritonclient.grpc as grpcclient

    inputs = pipeline_inputs(
        grpcclient, prompt_embeds, seconds, seed, num_steps=num_steps, guidance=guidance, sway=sway, check=check,
        AUDIO=check_audio(audio) if check else np.asarray(audio), ENCODE_SEED=_seed(encode_seed),
    )
    return stream_infer(model, inputs, url=url, timeout=timeout)
