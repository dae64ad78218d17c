"""Client for the AuK pipeline: text condition in, streamed audio out.

- `stream_pipeline(prompt_embeds, seconds, seed)` sends one request to
  `auk_pipeline` (the DiT, then the decoder) over a gRPC stream and
  yields a `Tile` for every decoded tile as it arrives.
- `generate_latents(...)` asks `auk_dit` alone for the latents of the same request.

Prompt embeddings are the fused text condition of AuK's encoder stage,
[tokens, 2048], read from a `.npy` file. That encoder is not served by this
project: `random_prompt_embeds` gives seeded stand-ins, which exercise the
serving path but do not describe any sound.

The command line is `auk-client pipeline` (auk_client.cli):

    auk-client pipeline --prompt-embeds prompt.npy --seconds 10 -o out.wav
    auk-client pipeline --random-tokens 32 --seconds 10 --seed 1 -o out.wav
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .stream import (
    DEFAULT_GRPC_URL,
    DEFAULT_TIMEOUT_S,
    BadInput,
    Tile,
    check_latents,
    read_npy,
    stream_infer,
    unary_infer,
)

PIPELINE_MODEL = "auk_pipeline"
DIT_MODEL = "auk_dit"
TEXT_DIM = 2048
DEFAULT_PIPELINE_TIMEOUT_S = max(DEFAULT_TIMEOUT_S, 600.0)  # the DiT runs before the first tile


def check_prompt_embeds(embeds: np.ndarray, what: str = "prompt embeddings") -> np.ndarray:
    """Accept [tokens, 2048] or [1, tokens, 2048]; return C-contiguous float32 [tokens, 2048]."""
    arr = np.asarray(embeds)
    if arr.ndim == 3 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] != TEXT_DIM:
        raise BadInput(f"{what} must have shape [tokens >= 1, {TEXT_DIM}], got {list(np.shape(embeds))}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.isfinite(arr).all():
        raise BadInput(f"{what} contain NaN or infinite values")
    return arr


def load_prompt_embeds(path: str) -> np.ndarray:
    return check_prompt_embeds(read_npy(path, "prompt embeddings"), what=f"prompt embeddings in {path}")


def random_prompt_embeds(tokens: int, seed: int) -> np.ndarray:
    """Seeded standard-normal [tokens, 2048]: a stand-in for the encoder stage's output."""
    if tokens < 1:
        raise BadInput(f"the number of stand-in prompt tokens must be at least 1, got {tokens}")
    return np.random.default_rng(seed).standard_normal((tokens, TEXT_DIM)).astype(np.float32)


def pipeline_inputs(
    client_module,
    prompt_embeds: np.ndarray,
    seconds: float | None,
    seed: int,
    *,
    num_steps: int | None = None,
    guidance: float | None = None,
    sway: float | None = None,
    ref_latents: np.ndarray | None = None,
    check: bool = True,
    batch_axis: bool = False,
    **extra: np.ndarray | None,
) -> list:
    """The InferInputs of one request (for `tritonclient.grpc` or `.http`). Unset knobs are left
    out (`seconds=None` too: a request with a reference then gets a target as long as it);
    `extra` adds inputs by name (None: left out).

    `batch_axis=True` gives every input a leading axis of 1, as `auk_dit` takes them (it
    batches requests; auk_pipeline and auk_edit take them without it)."""
    arrays = {"PROMPT_EMBEDS": check_prompt_embeds(prompt_embeds) if check else np.asarray(prompt_embeds)}
    if seconds is not None:
        arrays["GEN_SECONDS"] = np.array([seconds], dtype=np.float32)
    arrays["SEED"] = np.array([seed], dtype=np.int64)
    if num_steps is not None:
        arrays["NUM_STEPS"] = np.array([num_steps], dtype=np.int32)
    if guidance is not None:
        arrays["GUIDANCE"] = np.array([guidance], dtype=np.float32)
    if sway is not None:
        arrays["SWAY"] = np.array([sway], dtype=np.float32)
    if ref_latents is not None:
        arrays["REF_LATENTS"] = check_latents(ref_latents, "reference latents") if check else np.asarray(ref_latents)
    arrays.update({name: array for name, array in extra.items() if array is not None})
    types = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32"}
    inputs = []
    for name, array in arrays.items():
        if batch_axis:
            array = array[None]
        inp = client_module.InferInput(name, list(array.shape), types.get(array.dtype, "FP32"))
        inp.set_data_from_numpy(array)
        inputs.append(inp)
    return inputs


def stream_pipeline(
    prompt_embeds: np.ndarray,
    seconds: float,
    seed: int = 0,
    *,
    num_steps: int | None = None,
    guidance: float | None = None,
    sway: float | None = None,
    ref_latents: np.ndarray | None = None,
    url: str = DEFAULT_GRPC_URL,
    model: str = PIPELINE_MODEL,
    timeout: float = DEFAULT_PIPELINE_TIMEOUT_S,
    check: bool = True,
) -> Iterator[Tile]:
    """Run the pipeline over a gRPC stream, yielding decoded tiles as the server sends them.

    `timeout` bounds the whole request. Closing the generator early cancels the
    request on the server (at the DiT's next step or the decoder's next window).
    `check=False` sends the inputs as given (to exercise the server's checks).
    """
    import tritonclient.grpc as grpcclient

    inputs = pipeline_inputs(
        grpcclient, prompt_embeds, seconds, seed, num_steps=num_steps, guidance=guidance, sway=sway,
        ref_latents=ref_latents, check=check,
    )
    return stream_infer(model, inputs, url=url, timeout=timeout)


def generate_latents(
    prompt_embeds: np.ndarray,
    seconds: float,
    seed: int = 0,
    *,
    url: str = DEFAULT_GRPC_URL,
    model: str = DIT_MODEL,
    timeout: float = DEFAULT_PIPELINE_TIMEOUT_S,
    **knobs,
) -> np.ndarray:
    """The normalized latents [frames, 64] that `auk_dit` returns for one request (gRPC, unary)."""
    import tritonclient.grpc as grpcclient

    inputs = pipeline_inputs(grpcclient, prompt_embeds, seconds, seed, batch_axis=True, **knobs)
    return unary_infer(model, inputs, url, timeout).as_numpy("LATENTS")[0]  # one clip: drop the batch axis
