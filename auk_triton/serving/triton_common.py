"""What every Python-backend model shares with Triton, without torch: logging, the heap frozen
after load, a request's parameters, errors as responses, which waveform a request asks for,
and numpy arrays as output tensors. The offline model, which imports no torch, needs no more
than this; `triton_io.py` adds what the torch models need.

Tensors cross by DLPack (`np.from_dlpack(tensor)` in, `array_tensor` out), never through
numpy's own interface: Triton 2.51's Python backend reads numpy 2 arrays with numpy 1's
layout, so `as_numpy()` and `pb_utils.Tensor(name, ndarray)` silently carry wrong or empty
data where the environment has numpy 2, while DLPack describes the buffer itself.
"""

from __future__ import annotations

import ctypes
import gc
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from .config import STATUS_IN_MESSAGE_PARAMETER
from .errors import RelayedError, RequestCancelled, ServerStopping, status_of

WAVEFORM, WAVEFORM_PCM16, START_SAMPLE = "WAVEFORM", "WAVEFORM_PCM16", "START_SAMPLE"
# pb_utils.TritonError's code of each status (config.STATUS_NAMES). The stub adds TritonError
# to pb_utils only after it has imported the model: looked up when an error is made.
ERROR_CODES = {"INVALID_ARGUMENT": "INVALID_ARG", "CANCELLED": "CANCELLED", "UNAVAILABLE": "UNAVAILABLE",
               "INTERNAL": "INTERNAL"}


def log(level: str, message: str) -> None:
    """Log through Triton's logger (`level`: info, warn, error, verbose)."""
    logger = getattr(pb_utils, "Logger", None)
    if logger is None:
        print(f"{level}: {message}", flush=True)
    else:
        getattr(logger, f"log_{level}")(message)


def freeze_heap() -> None:
    """Leave what `initialize` built out of the cyclic garbage collector's passes (gc.freeze).

    A model that compiled at load keeps a great many Python objects for its life (Dynamo's
    and Inductor's caches, the traced graphs), and each full collection walked them all on
    the thread that was serving: stalls of tens of milliseconds in the middle of a request
    (benchmarks/studies/pipeline-first-audio.md). Objects made later are collected as usual."""
    gc.collect()
    gc.freeze()


def request_parameters(request) -> dict:
    """The request's parameters (a forwarded header, the client's own), {} where it has none."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except (AttributeError, TypeError, ValueError):
        return {}
    return parameters if isinstance(parameters, dict) else {}


def wants_status_in_message(request) -> bool:
    """Whether the front door asked for the status at the head of this request's error message
    (config.STATUS_IN_MESSAGE_PARAMETER: a forwarded header, "true", or a bool parameter)."""
    asked = request_parameters(request).get(STATUS_IN_MESSAGE_PARAMETER)
    return asked is True or isinstance(asked, str) and asked.strip().lower() == "true"


def wants_pcm16(request) -> bool:
    """Whether to send WAVEFORM_PCM16 (int16) instead of WAVEFORM (float32).

    Only when the request names WAVEFORM_PCM16 among its outputs and not WAVEFORM:
    a request that names no outputs asks, to Triton, for all of them, and gets the
    float32 waveform alone, as before the int16 output existed.
    """
    names = set(request.requested_output_names())
    return WAVEFORM_PCM16 in names and WAVEFORM not in names


def error_response(message: str, code):
    """An error response with status `code` (a `pb_utils.TritonError` code)."""
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def failure_response(model: str, action: str, err: Exception, request=None):
    """The error response for a request that raised `err`, with a status the client can act on
    (`errors.status_of`).

    A RequestError is the client's mistake: its own message, INVALID_ARG. A
    RequestCancelled: its message, CANCELLED. A ServerStopping or ServerBusy: its message,
    UNAVAILABLE (send it again, later or elsewhere). A RelayedError: the status and message
    another model gave the request. Anything else is the model's failure:
    "<action> failed: ...", INTERNAL, and logged. Where `request` asks for it
    (`wants_status_in_message`), the message opens with the status: "[INVALID_ARGUMENT] ...".

    Seen on Triton 2.51: INVALID_ARG reaches an HTTP /infer client as 400 and a gRPC
    call as INVALID_ARGUMENT; INTERNAL as 500 and INTERNAL; UNAVAILABLE as 503 and
    UNAVAILABLE; CANCELLED as CANCELLED over gRPC (400 over HTTP). An ensemble passes its step's code on. A gRPC stream's error
    carries its message alone, unless the client opened the stream with the header
    `triton_grpc_error: true` (a mode that crashed that server in our tests; through the
    front door the status comes in the message instead), and HTTP generate_stream answers
    400 to an error before the first response whatever its code.
    """
    status, message = status_of(err), str(err)
    if isinstance(err, (RequestCancelled, ServerStopping)):
        log("info", f"{model}: {err}")
    elif status == "INTERNAL" and not isinstance(err, RelayedError):
        log("error", f"{model}: {action} failed: {type(err).__name__}: {err}")
        message = f"{action} failed: {type(err).__name__}: {err}"
    # Not logged: a client's mistake, a refusal under overload (one per request there), and an
    # error relayed from the model that logged it.
    if request is not None and wants_status_in_message(request):
        message = f"[{status}] {message}"
    return error_response(message, getattr(pb_utils.TritonError, ERROR_CODES[status]))


# Triton 2.51's Python backend renames a DLPack capsule it takes to "used_dlpack", where DLPack
# says "used_dltensor": numpy's capsule destructor then takes it for one nobody took, and under
# numpy 1.26 it fails over and over until the process crashes. The capsule gets the name DLPack
# gives a taken capsule once the tensor holds it. The name must outlive the capsule: a module
# constant.
_USED_CAPSULE = ctypes.c_char_p(b"used_dltensor")
_set_capsule_name = ctypes.pythonapi.PyCapsule_SetName
_set_capsule_name.argtypes = [ctypes.py_object, ctypes.c_char_p]


def array_tensor(name: str, array: np.ndarray):
    """A numpy array as a Triton tensor named `name` (an output, or a forwarded request's input), by
    DLPack: the tensor keeps the array."""
    capsule = np.ascontiguousarray(array).__dlpack__()
    tensor = pb_utils.Tensor.from_dlpack(name, capsule)
    _set_capsule_name(capsule, _USED_CAPSULE)
    return tensor
