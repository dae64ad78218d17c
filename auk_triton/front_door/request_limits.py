"""What each model takes, read from the model repository's configs, and the checks of a
request against it that the front door makes before anything reaches tritonserver.

Each variable-length input's rows come from `config.input_row_limits` (a decoder's
`max_frames`, auk_dit's `max_prompt_tokens` and `max_frames`; an ensemble's through its
steps' input maps, and the offline model's from the decode model it forwards to,
`config.forwarded_model`), fixed dimensions as configured. A bounded declared shape also keeps
Triton 2.51 from sizing anything by it: its HTTP frontend allocates a JSON input's
declared size before reading the data, and a shape whose byte size overflows 64 bits to
the size of the data sent passes its gRPC check and kills the model's stub process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from auk_triton.serving import config

# Triton's datatypes and their sizes in bytes; BYTES (strings) has none.
DATATYPE_BYTES = {
    "BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2,
    "UINT32": 4, "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8, "FP64": 8, "BYTES": None,
}
# Room for a request's JSON header, names and parameters next to its tensors' bytes.
HEADER_ALLOWANCE = 64 * 1024
# A JSON value takes at most this many characters (float32 written as a double's repr,
# a separator, spaces): a JSON body may be this much longer than its tensors' count.
JSON_BYTES_PER_VALUE = 32
# Bodies of the other routes (load, shared-memory registration, settings) are small.
CONTROL_BODY_BYTES = 1024 * 1024


class Refused(Exception):
    """A request the front door does not forward; the message goes back to the client."""

    def __init__(self, message: str, http_status: int = 400):
        super().__init__(message)
        self.http_status = http_status


# ---- limits ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputLimit:
    name: str
    datatype: str  # Triton's name: FP32, INT64, ...
    bounds: tuple[int | None, ...]  # the most each dimension takes; None: unbounded
    source: str  # what sets the variable bound, for messages ("max_frames")
    config_dims: tuple[int, ...] = ()  # the dims as served, -1 where variable (messages only)

    def max_elements(self) -> int | None:
        return None if None in self.bounds else math.prod(self.bounds)

    def max_bytes(self) -> int | None:
        size = DATATYPE_BYTES.get(self.datatype)
        elements = self.max_elements()
        return None if size is None or elements is None else elements * size

    def check(self, model: str, datatype: str, shape) -> int:
        """The element count of a declared shape within these bounds; Refused otherwise."""
        if datatype != self.datatype:
            raise Refused(f"inference input '{self.name}' data-type is '{datatype}', but model '{model}' expects '{self.datatype}'")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise Refused(f"input '{self.name}' of model '{model}' declares shape {shape!r}: a list of integers is needed")
        if len(shape) != len(self.bounds):
            raise Refused(
                f"input '{self.name}' of model '{model}' declares shape {list(shape)}, {len(shape)} dimensions; "
                f"it takes {len(self.bounds)}: {self.expected_shape()}"
            )
        if any(d < 0 for d in shape) or any(bound is not None and d > bound for d, bound in zip(shape, self.bounds)):
            most = [("-1" if b is None else str(b)) for b in self.bounds]
            raise Refused(
                f"input '{self.name}' of model '{model}' declares shape {list(shape)}; "
                f"this model takes at most [{', '.join(most)}] ({self.source})"
            )
        return math.prod(shape)

    def expected_shape(self) -> str:
        """The shape this input takes, in words: "[n, 64] with n at most 30000 (max_frames)"."""
        variable = [i for i, d in enumerate(self.config_dims) if d < 0]
        dims = ["n" if i in variable else str(b) for i, b in enumerate(self.bounds)]
        most = [self.bounds[i] for i in variable]
        if not most:
            return f"[{', '.join(dims)}]"
        limit = "unbounded" if most[0] is None else f"at most {most[0]}"
        return f"[{', '.join(dims)}] with n {limit} ({self.source})"


@dataclass(frozen=True)
class ModelLimits:
    name: str
    inputs: dict[str, InputLimit]
    batching: bool = False  # the model's inputs carry a leading batch axis (max_batch_size > 0)

    def input(self, name: str) -> InputLimit:
        if name not in self.inputs:
            raise Refused(f"unexpected inference input '{name}' for model '{self.name}'")
        return self.inputs[name]

    def max_bytes(self) -> int:
        """The longest binary request (HTTP binary extension, a gRPC message)."""
        sizes = [limit.max_bytes() for limit in self.inputs.values()]
        if None in sizes:  # an unbounded input: only the largest of all the models bounds it
            return 0
        return HEADER_ALLOWANCE + sum(sizes)

    def max_json_bytes(self) -> int:
        counts = [limit.max_elements() for limit in self.inputs.values()]
        return 0 if None in counts else HEADER_ALLOWANCE + JSON_BYTES_PER_VALUE * sum(counts)


def _datatype(config_type: str) -> str:
    name = config_type.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def model_limits(model_config: Mapping, step_limits: Mapping[str, ModelLimits] | None = None) -> ModelLimits:
    """A model's input limits from its config (Triton's JSON form): rows from the model's
    settings; for an ensemble from the step each input feeds, and for a model that forwards
    its requests from the model it forwards them to (`step_limits` holds both)."""
    name = model_config["name"]
    rows = config.input_row_limits(model_config)
    batching = int(model_config.get("max_batch_size", 0) or 0) > 0
    inputs = {}
    for tensor in model_config.get("input", []):
        dims = [int(d) for d in tensor.get("dims", [])]
        bounds = [d if d >= 0 else rows.get(tensor["name"]) for d in dims]
        source = "its config's dims" if all(d >= 0 for d in dims) else _row_source(tensor["name"])
        inherited = _step_input(model_config, tensor["name"], step_limits or {})
        if inherited is not None:
            bounds, source, dims = list(inherited.bounds), inherited.source, list(inherited.config_dims)
        if batching:
            # A request carries one clip: the model batches requests itself, and refuses a
            # batch axis other than 1 (requests.one_row).
            bounds.insert(0, 1)
            dims.insert(0, 1)
        inputs[tensor["name"]] = InputLimit(
            tensor["name"], _datatype(tensor["data_type"]), tuple(bounds), source, tuple(dims)
        )
    return ModelLimits(name, inputs, batching)


def _row_source(input_name: str) -> str:
    return {"LATENTS": "max_frames", "REF_LATENTS": "max_frames", "PROMPT_EMBEDS": "max_prompt_tokens",
            "AUDIO": "max_frames x 480 samples"}.get(input_name, "no limit configured")


def _step_input(model_config: Mapping, name: str, step_limits: Mapping[str, ModelLimits]) -> InputLimit | None:
    """The limit of the ensemble step input that ensemble tensor `name` feeds, or of the input
    `name` of the model this one forwards its requests to, if any."""
    forwarded_to = step_limits.get(config.forwarded_model(model_config) or "")
    if forwarded_to is not None and name in forwarded_to.inputs:
        return forwarded_to.inputs[name]
    for step in (model_config.get("ensemble_scheduling") or {}).get("step", []):
        step_model = step_limits.get(step["model_name"])
        for step_input, tensor in (step.get("input_map") or {}).items():
            if tensor == name and step_model is not None and step_input in step_model.inputs:
                limit = step_model.inputs[step_input]
                if step_model.batching:  # the ensemble adds the step's batch axis itself
                    limit = InputLimit(limit.name, limit.datatype, limit.bounds[1:], limit.source, limit.config_dims[1:])
                return limit
    return None


def read_model_config(model_dir: Path, config_name: str | None = None) -> dict:
    """A model's config file as Triton would load it (configs/<config_name>.pbtxt when it
    exists, else config.pbtxt), in Triton's JSON form."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    path = model_dir / "configs" / f"{config_name}.pbtxt" if config_name else None
    if path is None or not path.is_file():
        path = model_dir / "config.pbtxt"
    message = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    as_dict = json_format.MessageToDict(message, preserving_proto_field_name=True)
    as_dict.setdefault("name", model_dir.name)
    return as_dict


def repository_limits(repository: Path, config_name: str | None = None) -> dict[str, ModelLimits]:
    """Every model's limits in a model repository; models that forward their requests after the
    models they forward to, ensembles last."""
    configs = {
        d.name: read_model_config(d, config_name) for d in sorted(Path(repository).iterdir()) if (d / "config.pbtxt").is_file()
    }

    def order(item) -> int:
        return 2 if "ensemble_scheduling" in item[1] else 1 if config.forwarded_model(item[1]) else 0

    limits: dict[str, ModelLimits] = {}
    for name, model_config in sorted(configs.items(), key=order):
        limits[name] = model_limits(model_config, limits)
    return limits


def max_message_bytes(limits: Mapping[str, ModelLimits]) -> int:
    """The longest request any model takes: the gRPC message limit."""
    return max([HEADER_ALLOWANCE] + [m.max_bytes() for m in limits.values()])


def max_body_bytes(limits: Mapping[str, ModelLimits]) -> int:
    """The longest HTTP body any model takes (JSON is the longer form)."""
    return max([CONTROL_BODY_BYTES, max_message_bytes(limits)] + [m.max_json_bytes() for m in limits.values()])


# ---- checking a request -----------------------------------------------------------------------


def count_values(data) -> int:
    """How many values a JSON `data` field holds (nested lists or flat)."""
    if not isinstance(data, list):
        return 1
    if data and isinstance(data[0], list):
        return sum(count_values(item) for item in data)
    return len(data)


def _model(limits: Mapping[str, ModelLimits], name: str) -> ModelLimits:
    if name not in limits:
        raise Refused(f"Request for unknown model: '{name}' is not found", http_status=404)
    return limits[name]


def check_http_infer(model: ModelLimits, header: Mapping, binary_bytes: int | None) -> None:
    """An HTTP /infer request's JSON header against the model's limits and the data it sends;
    `binary_bytes`: the length of the binary part (None: a JSON-only body)."""
    inputs = header.get("inputs") if isinstance(header, Mapping) else None
    if not isinstance(inputs, list):
        raise Refused("the request has no 'inputs' list")
    declared_binary = 0
    for tensor in inputs:
        if not isinstance(tensor, Mapping):
            raise Refused("each of 'inputs' must be an object")
        limit = model.input(tensor.get("name"))
        elements = limit.check(model.name, tensor.get("datatype"), tensor.get("shape"))
        parameters = tensor.get("parameters") or {}
        if "binary_data_size" in parameters:
            size = parameters["binary_data_size"]
            expected = DATATYPE_BYTES.get(limit.datatype)
            if not isinstance(size, int) or size < 0 or (expected is not None and size != elements * expected):
                raise Refused(
                    f"input '{limit.name}' declares shape {tensor['shape']} ({elements} values) "
                    f"but binary_data_size {size!r}"
                )
            declared_binary += size
        elif "data" in tensor:
            count = count_values(tensor["data"])
            if count != elements:
                raise Refused(
                    f"input '{limit.name}' declares shape {tensor['shape']} ({elements} values) "
                    f"but its data holds {count}"
                )
    if declared_binary != (binary_bytes or 0):
        raise Refused(f"the inputs declare {declared_binary} bytes of binary data; the request sends {binary_bytes or 0}")


def check_http_generate(model: ModelLimits, body: Mapping) -> None:
    """A generate / generate_stream body: each input (a JSON value or flat array) within its limit."""
    if not isinstance(body, Mapping):
        raise Refused("the request body must be a JSON object")
    for name, limit in model.inputs.items():
        if name in body:
            count, most = count_values(body[name]), limit.max_elements()
            if most is not None and count > most:
                raise Refused(f"input '{name}' of model '{model.name}' holds {count} values; it takes at most {most} ({limit.source})")


def check_grpc_infer(limits: Mapping[str, ModelLimits], request) -> None:
    """A ModelInferRequest's declared shapes against its model's limits."""
    model = _model(limits, request.model_name)
    for tensor in request.inputs:
        model.input(tensor.name).check(model.name, tensor.datatype, list(tensor.shape))

