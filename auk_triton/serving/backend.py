"""Helpers the Python-backend models share: logging, tensors in and out, errors, placement.

Tensors cross between Triton and a model by DLPack, never through numpy:
Triton 2.51's Python backend reads numpy 2 arrays with numpy 1's layout, so
`as_numpy()` and `pb_utils.Tensor(name, ndarray)` silently carry wrong or empty
data where the environment has numpy 2, while DLPack describes the buffer itself.
"""

from __future__ import annotations

import numpy as np
import torch
import triton_python_backend_utils as pb_utils


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


def error_response(message: str):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


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
