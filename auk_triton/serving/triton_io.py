"""What the torch models (decode, DiT, encode) share with Triton beyond `triton_common.py`:
tensors in and out as torch tensors (by DLPack: see triton_common's docstring), placement,
and the checks of a config against the checkpoint.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
import triton_python_backend_utils as pb_utils


def input_array(request, name: str) -> np.ndarray | None:
    """The request's input `name` as a numpy array, or None when it was not sent."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else torch.from_dlpack(tensor.to_dlpack()).numpy()


def output_tensor(name: str, value: torch.Tensor):
    return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(value.contiguous()))


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
