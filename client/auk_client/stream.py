"""A small Python API over the two AuK decode models served by Triton.

- `stream_decode(latents)` sends one request to the decoupled model
  `auk_vae_decode` over a gRPC stream and yields a `Tile` for every response
  as it arrives (WAVEFORM samples placed at START_SAMPLE).
- `decode_offline(latents)` sends one request to `auk_vae_decode_offline` over
  HTTP and returns the whole clip as a single `Tile`.

Every failure (server unreachable, model missing, a server-side error, a
timeout) is raised as `AuKClientError`, whose message is one line.
"""

from __future__ import annotations

import math
import queue
import re
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .wavio import from_pcm16

SAMPLE_RATE = 24000
HOP = 480  # samples per latent frame
FRAMES_PER_SECOND = SAMPLE_RATE / HOP  # 50
DEFAULT_LATENT_DIM = 64

DEFAULT_GRPC_URL = "127.0.0.1:8001"
DEFAULT_HTTP_URL = "127.0.0.1:8000"
STREAM_MODEL = "auk_vae_decode"
OFFLINE_MODEL = "auk_vae_decode_offline"
DEFAULT_TIMEOUT_S = 120.0

INPUT_NAME = "LATENTS"
WAVEFORM = "WAVEFORM"
WAVEFORM_PCM16 = "WAVEFORM_PCM16"  # the same samples as int16, half the bytes on the wire
START_SAMPLE = "START_SAMPLE"


class AuKClientError(Exception):
    """A failure to report as one line; `exit_code` is the process status to use."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(_one_line(message))
        self.exit_code = exit_code


class BadInput(AuKClientError):
    def __init__(self, message: str):
        super().__init__(message, exit_code=2)


@dataclass
class Tile:
    start_sample: int
    waveform: np.ndarray  # [n]: float32 in [-1, 1], or int16 PCM where PCM16 was asked for
    arrived_s: float  # seconds after the request was sent

    @property
    def end_sample(self) -> int:
        return self.start_sample + int(self.waveform.size)


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).strip()


def strip_scheme(url: str) -> str:
    """`host:port` from a URL that may start with a scheme: tritonclient wants none."""
    return re.sub(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", "", url).rstrip("/")


# -- latents --------------------------------------------------------------

def check_latents(latents: np.ndarray, what: str = "latents") -> np.ndarray:
    """Accept [frames, dim] or [1, frames, dim]; return C-contiguous float32 [frames, dim].

    The latent width is not checked here: the server's model config is the
    authority on it and answers a wrong width with an error.
    """
    arr = np.asarray(latents)
    if arr.ndim == 3 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2:
        raise BadInput(
            f"{what} must have shape [frames, dim] or [1, frames, dim], got {list(np.shape(latents))}"
        )
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise BadInput(f"{what} are empty (shape {list(arr.shape)})")
    if not np.issubdtype(arr.dtype, np.floating) and not np.issubdtype(arr.dtype, np.integer):
        raise BadInput(f"{what} must be numeric, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.isfinite(arr).all():
        raise BadInput(f"{what} contain NaN or infinite values")
    return arr


def read_npy(path: str, what: str) -> np.ndarray:
    """A .npy array from `path`; a missing or unreadable file is a BadInput naming `what`."""
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise BadInput(f"no such {what} file: {path}") from None
    except (ValueError, OSError) as exc:
        raise BadInput(f"cannot read {path} as a .npy array: {exc}") from None


def load_latents(path: str) -> np.ndarray:
    """Read latents from a .npy file ([frames, dim] or [1, frames, dim])."""
    return check_latents(read_npy(path, "latents"), what=f"latents in {path}")


def frames_for_seconds(seconds: float) -> int:
    if not math.isfinite(seconds) or seconds <= 0:
        raise BadInput(f"--seconds must be a positive number, got {seconds}")
    return max(1, int(round(seconds * FRAMES_PER_SECOND)))


def random_latents(seconds: float, seed: int, latent_dim: int = DEFAULT_LATENT_DIM) -> np.ndarray:
    """Seeded standard-normal latents for `seconds` of audio.

    A stand-in for the diffusion model's output, for exercising the decoder
    and the serving path: the audio it decodes to is not meaningful sound.
    """
    frames = frames_for_seconds(seconds)
    rng = np.random.default_rng(seed)
    return rng.standard_normal((frames, latent_dim)).astype(np.float32)


# -- errors ---------------------------------------------------------------

def describe_grpc_error(exc, url: str, model: str, timeout: float) -> AuKClientError:
    """A failure of a gRPC request (tritonclient's or the transport's) as one AuKClientError line."""
    status = str(getattr(exc, "status", lambda: "")() or "")
    message = exc.message() if hasattr(exc, "message") else str(exc)
    message = _one_line(message or str(exc))
    if "UNAVAILABLE" in status or "failed to connect" in message.lower():
        return AuKClientError(f"cannot reach Triton over gRPC at {url}: {message}")
    if "DEADLINE_EXCEEDED" in status or "deadline exceeded" in message.lower():
        return AuKClientError(f"timed out after {timeout:g} s waiting for {model} at {url}")
    if "CANCELLED" in status:
        return AuKClientError(f"the request to {model} at {url} was cancelled: {message}")
    return AuKClientError(f"server error from {model} at {url}: {message}")


def describe_http_error(exc, url: str, model: str, timeout: float) -> AuKClientError:
    """A failure of an HTTP request (tritonclient's or the transport's) as one AuKClientError line."""
    name = type(exc).__name__
    raw = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
    message = _one_line(raw or name)
    lowered = f"{name} {message}".lower()
    if isinstance(exc, TimeoutError) or "timeout" in lowered or "timed out" in lowered:
        return AuKClientError(f"timed out after {timeout:g} s waiting for {model} at {url}")
    if isinstance(exc, OSError) or "refused" in lowered:
        return AuKClientError(f"cannot reach Triton over HTTP at {url}: {message}")
    if name == "InferenceServerException":
        return AuKClientError(f"server error from {model} at {url}: {message}")
    return AuKClientError(f"HTTP request to {model} at {url} failed: {name}: {message}")


# -- metadata -------------------------------------------------------------

def model_latent_dim(
    model: str, url: str, *, http: bool = False, timeout: float = DEFAULT_TIMEOUT_S
) -> int | None:
    """The fixed latent width the served model declares for LATENTS, or None if variable.

    Doubles as a liveness check: an unreachable server or a missing model
    raises `AuKClientError` here, before any audio is requested.
    """
    url = strip_scheme(url)
    try:
        if http:
            import tritonclient.http as httpclient

            client = httpclient.InferenceServerClient(
                url, connection_timeout=timeout, network_timeout=timeout
            )
            try:
                meta = client.get_model_metadata(model)
            finally:
                client.close()
            inputs = meta.get("inputs", [])
            shapes = {i["name"]: [int(d) for d in i["shape"]] for i in inputs}
        else:
            import tritonclient.grpc as grpcclient

            client = grpcclient.InferenceServerClient(url)
            try:
                meta = client.get_model_metadata(model, client_timeout=timeout)
            finally:
                client.close()
            shapes = {i.name: [int(d) for d in i.shape] for i in meta.inputs}
    except AuKClientError:
        raise
    except Exception as exc:  # tritonclient raises its own and transport exceptions
        describe = describe_http_error if http else describe_grpc_error
        raise describe(exc, url, model, timeout) from None
    shape = shapes.get(INPUT_NAME)
    if shape is None:
        raise AuKClientError(f"model {model} at {url} has no {INPUT_NAME} input (inputs: {sorted(shapes)})")
    return shape[-1] if shape and shape[-1] > 0 else None


# -- decoding -------------------------------------------------------------

def stream_decode(
    latents: np.ndarray,
    *,
    url: str = DEFAULT_GRPC_URL,
    model: str = STREAM_MODEL,
    timeout: float = DEFAULT_TIMEOUT_S,
    pcm16: bool = False,
) -> Iterator[Tile]:
    """Decode over a gRPC stream, yielding tiles as the server sends them.

    `timeout` bounds the whole request (first byte to final response).
    Closing the generator early cancels the request on the server. `pcm16` asks
    for WAVEFORM_PCM16: int16 tiles, converted by the server, half the bytes.
    """
    import tritonclient.grpc as grpcclient

    latents = check_latents(latents)
    inp = grpcclient.InferInput(INPUT_NAME, list(latents.shape), "FP32")
    inp.set_data_from_numpy(latents)
    return stream_infer(model, [inp], url=url, timeout=timeout, waveform=WAVEFORM_PCM16 if pcm16 else WAVEFORM)


def unary_infer(model: str, inputs: list, url: str, timeout: float):
    """One unary gRPC request to `model`; its InferResult, or the error described for a user."""
    import tritonclient.grpc as grpcclient

    url = strip_scheme(url)
    client = grpcclient.InferenceServerClient(url)
    try:
        return client.infer(model, inputs, client_timeout=timeout)
    except Exception as exc:
        raise describe_grpc_error(exc, url, model, timeout) from None
    finally:
        client.close()


def stream_infer(
    model: str, inputs: list, *, url: str, timeout: float, waveform: str = WAVEFORM
) -> Iterator[Tile]:
    """Send one request to a decoupled model (or an ensemble ending in one) over a gRPC
    stream and yield a `Tile` per response carrying `waveform` (the output to ask for:
    WAVEFORM or WAVEFORM_PCM16), until the final flag.

    The final flag usually comes with the last tile, which is yielded like the
    others; an empty final response (after a cancellation) yields nothing.
    """
    import tritonclient.grpc as grpcclient

    url = strip_scheme(url)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    finished = False
    try:
        client.start_stream(
            callback=lambda result, error: responses.put((result, error)),
            stream_timeout=timeout,
        )
        outputs = [grpcclient.InferRequestedOutput(waveform), grpcclient.InferRequestedOutput(START_SAMPLE)]
        sent = time.perf_counter()
        deadline = sent + timeout
        try:
            client.async_stream_infer(
                model,
                inputs,
                outputs=outputs,
                request_id=uuid.uuid4().hex,
                enable_empty_final_response=True,
            )
        except Exception as exc:
            # A stream that already failed (refused, deadline) reports the cause
            # through the callback; prefer that to "stream no longer valid".
            try:
                _, error = responses.get(timeout=0.5)
            except queue.Empty:
                error = None
            raise describe_grpc_error(error or exc, url, model, timeout) from None
        while True:
            try:
                result, error = responses.get(timeout=max(0.0, deadline - time.perf_counter()) + 0.5)
            except queue.Empty:
                raise AuKClientError(f"timed out after {timeout:g} s waiting for {model} at {url}") from None
            if error is not None:
                raise describe_grpc_error(error, url, model, timeout)
            arrived = time.perf_counter() - sent
            response = result.get_response()
            # Marked before the last tile is yielded: a caller that stops there cancels nothing.
            finished = (
                "triton_final_response" in response.parameters
                and response.parameters["triton_final_response"].bool_param
            )
            wave = result.as_numpy(waveform)
            if wave is not None:
                start = result.as_numpy(START_SAMPLE)
                if start is None or start.size != 1:
                    raise AuKClientError(f"{model} sent a {waveform} without a one-element {START_SAMPLE}")
                yield Tile(int(start.reshape(-1)[0]), _samples(wave, waveform), arrived)
            if finished:
                return
    except AuKClientError:
        raise
    except Exception as exc:
        raise describe_grpc_error(exc, url, model, timeout) from None
    finally:
        try:
            client.stop_stream(cancel_requests=not finished)
        except Exception:
            pass
        try:
            client.close()
        except Exception:
            pass


def decode_offline(
    latents: np.ndarray,
    *,
    url: str = DEFAULT_HTTP_URL,
    model: str = OFFLINE_MODEL,
    timeout: float = DEFAULT_TIMEOUT_S,
    pcm16: bool = False,
) -> Tile:
    """Decode the whole clip with one HTTP request to the non-decoupled model
    (`pcm16`: ask for WAVEFORM_PCM16, int16 samples)."""
    waveform = WAVEFORM_PCM16 if pcm16 else WAVEFORM
    import tritonclient.http as httpclient

    latents = check_latents(latents)
    url = strip_scheme(url)
    try:
        client = httpclient.InferenceServerClient(
            url, connection_timeout=timeout, network_timeout=timeout
        )
        try:
            inp = httpclient.InferInput(INPUT_NAME, list(latents.shape), "FP32")
            inp.set_data_from_numpy(latents, binary_data=True)
            outputs = [
                httpclient.InferRequestedOutput(waveform, binary_data=True),
                httpclient.InferRequestedOutput(START_SAMPLE, binary_data=True),
            ]
            sent = time.perf_counter()
            result = client.infer(model, [inp], outputs=outputs, request_id=uuid.uuid4().hex)
            arrived = time.perf_counter() - sent
        finally:
            client.close()
    except AuKClientError:
        raise
    except Exception as exc:
        raise describe_http_error(exc, url, model, timeout) from None
    wave = result.as_numpy(waveform)
    if wave is None:
        raise AuKClientError(f"{model} at {url} returned no {waveform}")
    start = result.as_numpy(START_SAMPLE)
    start_sample = int(start.reshape(-1)[0]) if start is not None and start.size else 0
    return Tile(start_sample, _samples(wave, waveform), arrived)


def _samples(wave: np.ndarray, name: str) -> np.ndarray:
    """A received waveform output as a flat array of its declared type."""
    return np.asarray(wave, np.int16 if name == WAVEFORM_PCM16 else np.float32).reshape(-1)



def assemble(tiles: list[Tile], total_samples: int | None = None) -> np.ndarray:
    """Place tiles into one float32 array (later tiles overwrite overlaps; gaps are zeros)."""
    end = max((t.end_sample for t in tiles), default=0)
    if total_samples is not None:
        end = max(end, total_samples)
    out = np.zeros(end, dtype=np.float32)
    for t in tiles:
        out[t.start_sample:t.end_sample] = from_pcm16(t.waveform) if t.waveform.dtype == np.int16 else t.waveform
    return out
