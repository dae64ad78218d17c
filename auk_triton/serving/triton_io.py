"""What the Python-backend models share with Triton: logging, tensors in and out, errors, placement.

Tensors cross between Triton and a model by DLPack, never through numpy:
Triton 2.51's Python backend reads numpy 2 arrays with numpy 1's layout, so
`as_numpy()` and `pb_utils.Tensor(name, ndarray)` silently carry wrong or empty
data where the environment has numpy 2, while DLPack describes the buffer itself.
"""

from __future__ import annotations

import json
from typing import Mapping

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from .config import STATUS_IN_MESSAGE_PARAMETER
from .requests import RequestCancelled, RequestError, ServerBusy, ServerStopping


def log(level: str, message: str) -> None:
    """Log through Triton's logger (`level`: info, warn, error, verbose)."""
    logger = getattr(pb_utils, "Logger", None)
    if logger is None:
        print(f"{level}: {message}", flush=True)
    else:
        getattr(logger, f"log_{level}")(message)


def input_array(request, name: str) -> np.ndarray | None:
    """The request's input `name` as a numpy array, or None when it was not sent."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else torch.from_dlpack(tensor.to_dlpack()).numpy()


def output_tensor(name: str, value: torch.Tensor):
    return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(value.contiguous()))


def error_response(message: str, code):
    """An error response with status `code` (a `pb_utils.TritonError` code)."""
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def wants_status_in_message(request) -> bool:
    """Whether the front door asked for the status at the head of this request's error message
    (config.STATUS_IN_MESSAGE_PARAMETER: a forwarded header, "true", or a bool parameter)."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except (AttributeError, TypeError, ValueError):
        return False
    asked = parameters.get(STATUS_IN_MESSAGE_PARAMETER)
    return asked is True or isinstance(asked, str) and asked.strip().lower() == "true"


def failure_response(model: str, action: str, err: Exception, request=None):
    """The error response for a request that raised `err`, with a status the client can act on.

    A RequestError is the client's mistake: its own message, INVALID_ARG. A
    RequestCancelled: its message, CANCELLED. A ServerStopping or ServerBusy: its message,
    UNAVAILABLE (send it again, later or elsewhere). Anything else is the model's failure:
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
    if isinstance(err, RequestCancelled):
        log("info", f"{model}: {err}")
        message, code, status = str(err), pb_utils.TritonError.CANCELLED, "CANCELLED"
    elif isinstance(err, RequestError):
        message, code, status = str(err), pb_utils.TritonError.INVALID_ARG, "INVALID_ARGUMENT"
    elif isinstance(err, ServerStopping):
        log("info", f"{model}: {err}")
        message, code, status = str(err), pb_utils.TritonError.UNAVAILABLE, "UNAVAILABLE"
    elif isinstance(err, ServerBusy):  # not logged: under overload there would be one per request
        message, code, status = str(err), pb_utils.TritonError.UNAVAILABLE, "UNAVAILABLE"
    else:
        log("error", f"{model}: {action} failed: {type(err).__name__}: {err}")
        message, code, status = f"{action} failed: {type(err).__name__}: {err}", pb_utils.TritonError.INTERNAL, "INTERNAL"
    if request is not None and wants_status_in_message(request):
        message = f"[{status}] {message}"
    return error_response(message, code)


def instance_device(kind: str, device_id: str) -> torch.device:
    """The device of this model instance (`args["model_instance_kind"]`, `..._device_id`).

    A GPU instance pins its device first: CUDA graphs captured on a GPU other
    than the current one fail.
    """
    if kind != "GPU":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"the model instance is KIND_GPU but torch {torch.__version__} sees no CUDA device; "
            "install a CUDA build of torch or serve the KIND_CPU config"
        )
    index = int(device_id)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def check_tensor_widths(model_config: Mapping, widths: Mapping[str, tuple[str, int]]) -> None:
    """Fail the load where config.pbtxt declares a [-1, W] tensor whose W is not the checkpoint's:
    the model would be READY with every request failing. `widths`: name -> (what, width)."""
    for entry in model_config.get("input", []) + model_config.get("output", []):
        name = entry.get("name")
        dims = [int(d) for d in entry.get("dims", [])]
        if name not in widths or len(dims) != 2:
            continue
        what, width = widths[name]
        if dims[1] not in (-1, width):
            raise RuntimeError(
                f"config.pbtxt declares {name} dims {dims}, but the checkpoint's {what} is {width}: "
                f"set dims to [-1, {width}] to serve this checkpoint"
            )
