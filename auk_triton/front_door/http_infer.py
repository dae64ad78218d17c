"""An HTTP /infer request (KServe v2 JSON, with Triton's binary-tensor extension) as a gRPC
ModelInferRequest, and the ModelInferResponse back in the form Triton's HTTP endpoint answers.

Why: Triton 2.51's HTTP server does not read a connection while its /infer request runs,
so a client that closes it is never seen and its request decodes in full
(triton-inference-server/server#7077). A gRPC call that the front door cancels is: the
model sees `is_cancelled()` at its next window. So the front door answers /infer over
gRPC and cancels the call when its client goes.

The rules follow Triton 2.51's own (src/http_server.cc: ParseJsonTritonParams,
ParseJsonTritonIO, FinalizeResponse, HttpCodeFromError; src/grpc/infer_handler.cc:
SetInferenceRequestMetadata). What gRPC would take differently from HTTP, or what HTTP
itself refuses while parsing (a value of the wrong JSON type, FP16 data in JSON, a
`triton_` parameter, an input with both `data` and `binary_data_size`, ...), raises
Untranslatable: the front door forwards that request over HTTP unchanged, and Triton
answers it in its own words.
"""

from __future__ import annotations

import gzip
import itertools
import json
import zlib
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1
NUMPY_TYPES = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "FP64": np.float64,
}
# The JSON types each datatype's `data` may hold (Triton reads BOOL with AsBool, integers with
# AsInt / AsUInt, floats with AsDouble, which takes integers too).
JSON_TYPES = {"BOOL": {bool}, "FP32": {int, float}, "FP64": {int, float}, "BYTES": {str}}
# The HTTP status Triton's HTTP endpoint gives each error code (HttpCodeFromError), by the
# gRPC status its gRPC endpoint gives the same code (GrpcStatusUtil::CodeToStatus). Any other
# status (only gRPC's own: DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ...) takes its default, 400.
HTTP_STATUS = {"INTERNAL": 500, "NOT_FOUND": 404, "UNAVAILABLE": 503, "UNIMPLEMENTED": 501,
               "UNKNOWN": 400, "INVALID_ARGUMENT": 400, "ALREADY_EXISTS": 400, "CANCELLED": 400}
DECOUPLED_GRPC = "ModelInfer RPC doesn't support models with decoupled transaction policy"
DECOUPLED_HTTP = "HTTP end point doesn't support models with decoupled transaction policy"
SHM_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


class Untranslatable(Exception):
    """A request to forward over HTTP as it came; the message says why."""


@dataclass
class OutputPlan:
    """How each output goes back: as JSON `data`, as binary after the JSON header, or in
    shared memory (nothing in the body)."""

    default_binary: bool = False  # the request's binary_data_output: outputs it does not name
    kinds: dict[str, str] = field(default_factory=dict)  # a named output's "json", "binary" or "shm"

    def kind(self, name: str) -> str:
        return self.kinds.get(name, "binary" if self.default_binary else "json")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _uint(value, most: int = UINT64_MAX) -> bool:
    return _is_int(value) and 0 <= value <= most


def _parameter(message, value) -> None:
    """Set an InferParameter from a JSON value as Triton's HTTP endpoint types it
    (SetTritonParameterFromJsonParameter: string, then integer, then bool, then number)."""
    if isinstance(value, str):
        message.string_param = value
    elif isinstance(value, bool):
        message.bool_param = value
    elif _is_int(value) and -INT64_MAX - 1 <= value <= INT64_MAX:
        message.int64_param = value
    elif isinstance(value, (int, float)):
        message.double_param = float(value)
    else:
        raise Untranslatable(f"a parameter of JSON type {type(value).__name__}")


def _request_parameters(request, parameters) -> bool:
    """The request's parameters onto `request`; returns binary_data_output."""
    if parameters is None:
        return False
    if not isinstance(parameters, Mapping):
        raise Untranslatable("'parameters' is not an object")
    binary_output = False
    for key, value in parameters.items():
        if key == "binary_data_output":  # HTTP's alone: gRPC would hand it to the model
            if not isinstance(value, bool):
                raise Untranslatable("binary_data_output is not a bool")
            binary_output = value
            continue
        slot = request.parameters[key]
        if key == "sequence_id":
            if _uint(value, INT64_MAX):
                slot.int64_param = value
            elif isinstance(value, str):
                slot.string_param = value
            else:
                raise Untranslatable("a sequence_id gRPC does not take")
        elif key in ("sequence_start", "sequence_end"):
            if not isinstance(value, bool):
                raise Untranslatable(f"{key} is not a bool")
            slot.bool_param = value
        elif key == "priority":
            if not _uint(value):
                raise Untranslatable("priority is not an unsigned integer")
            slot.uint64_param = value
        elif key == "timeout":
            if not _uint(value, INT64_MAX):
                raise Untranslatable("a timeout gRPC does not take")
            slot.int64_param = value
        elif key.startswith("triton_"):
            raise Untranslatable("a reserved 'triton_' parameter")  # HTTP refuses it in its own words
        else:
            _parameter(slot, value)
    return binary_output


def _leaves(data) -> list:
    """The values of a JSON `data` field, nested or flat, in order."""
    if not isinstance(data, list):
        return [data]
    if not data or not isinstance(data[0], list):
        return data
    if all(isinstance(row, list) and (not row or not isinstance(row[0], list)) for row in data):
        return list(itertools.chain.from_iterable(data))  # the common [frames, width] case, fast
    return [leaf for item in data for leaf in _leaves(item)]


def json_tensor_bytes(datatype: str, data) -> bytes:
    """A JSON `data` field as the tensor's raw bytes (BYTES: each string length-prefixed)."""
    values = _leaves(data)
    kinds = set(map(type, values))
    if datatype == "BYTES":
        if not kinds <= {str}:
            raise Untranslatable("BYTES data that is not all strings")
        try:
            encoded = [value.encode("utf-8") for value in values]
        except UnicodeEncodeError:
            raise Untranslatable("a string that is not UTF-8") from None
        return b"".join(len(item).to_bytes(4, "little") + item for item in encoded)
    if datatype not in NUMPY_TYPES:
        raise Untranslatable(f"{datatype} data in JSON")  # FP16, BF16: HTTP refuses them
    if not kinds <= JSON_TYPES.get(datatype, {int}):
        raise Untranslatable(f"{datatype} data holding {sorted(k.__name__ for k in kinds)}")
    if not values:
        return b""
    dtype = NUMPY_TYPES[datatype]
    try:
        if datatype.startswith("INT"):  # a C cast to the narrower type, as Triton does
            array = np.array(values, dtype=np.int64).astype(dtype)
        elif datatype.startswith("UINT"):
            if min(values) < 0:
                raise Untranslatable("a negative value for an unsigned type")
            array = np.array(values, dtype=np.uint64).astype(dtype)
        else:
            array = np.array(values, dtype=dtype)
    except OverflowError:
        raise Untranslatable("an integer past 64 bits") from None
    return array.tobytes()


def grpc_request(model: str, version: str, header: Mapping, binary: bytes, service_pb2):
    """The ModelInferRequest for an /infer request whose JSON header the front door has
    checked, and the plan for its outputs. `binary`: the bytes after the header."""
    request = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    if "id" in header:
        if not isinstance(header["id"], str):
            raise Untranslatable("'id' is not a string")
        request.id = header["id"]
    plan = OutputPlan(default_binary=_request_parameters(request, header.get("parameters")))
    offset = 0
    for tensor in header["inputs"]:
        parameters = tensor.get("parameters") or {}
        if not isinstance(parameters, Mapping):
            raise Untranslatable("an input's 'parameters' is not an object")
        sources = ("data" in tensor) + ("binary_data_size" in parameters) + ("shared_memory_region" in parameters)
        if sources != 1:
            raise Untranslatable("an input without exactly one of data, binary_data_size, shared_memory_region")
        if not isinstance(tensor.get("name"), str) or not isinstance(tensor.get("datatype"), str):
            raise Untranslatable("an input's name or datatype is not a string")
        entry = request.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        if "shared_memory_region" in parameters:
            _shared_memory(entry, parameters)
        elif "binary_data_size" in parameters:
            size = parameters["binary_data_size"]
            request.raw_input_contents.append(binary[offset: offset + size])
            offset += size
        else:
            request.raw_input_contents.append(json_tensor_bytes(tensor["datatype"], tensor["data"]))
    outputs = header.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise Untranslatable("'outputs' is not a list")
        for tensor in outputs:
            _requested_output(request, plan, tensor)
    return request, plan


def _shared_memory(entry, parameters: Mapping) -> None:
    if not isinstance(parameters["shared_memory_region"], str):
        raise Untranslatable("shared_memory_region is not a string")
    entry.parameters["shared_memory_region"].string_param = parameters["shared_memory_region"]
    for key in ("shared_memory_byte_size", "shared_memory_offset"):
        if key in parameters:
            if not _uint(parameters[key], INT64_MAX):
                raise Untranslatable(f"{key} is not an unsigned integer")
            entry.parameters[key].int64_param = parameters[key]


def _requested_output(request, plan: OutputPlan, tensor) -> None:
    if not isinstance(tensor, Mapping) or not isinstance(tensor.get("name"), str):
        raise Untranslatable("a requested output without a name")
    parameters = tensor.get("parameters") or {}
    if not isinstance(parameters, Mapping):
        raise Untranslatable("an output's 'parameters' is not an object")
    entry = request.outputs.add(name=tensor["name"])
    binary = parameters.get("binary_data", False)
    if not isinstance(binary, bool):
        raise Untranslatable("binary_data is not a bool")
    if "classification" in parameters:
        if not _uint(parameters["classification"], INT64_MAX) or "shared_memory_region" in parameters:
            raise Untranslatable("a classification gRPC does not take")
        entry.parameters["classification"].int64_param = parameters["classification"]
    if "shared_memory_region" in parameters:
        if binary:
            raise Untranslatable("an output with both shared_memory_region and binary_data")
        _shared_memory(entry, parameters)
        plan.kinds[tensor["name"]] = "shm"
    else:
        # A named output is JSON unless it asks for binary (CheckBinaryOutputData), whatever
        # the request's binary_data_output.
        plan.kinds[tensor["name"]] = "binary" if binary else "json"


# ---- the response ---------------------------------------------------------------------------


def _json_values(datatype: str, raw: bytes, count: int) -> list:
    if datatype == "BYTES":
        values, offset = [], 0
        for _ in range(count):
            length = int.from_bytes(raw[offset: offset + 4], "little")
            values.append(raw[offset + 4: offset + 4 + length].decode("utf-8", errors="replace"))
            offset += 4 + length
        return values
    if datatype not in NUMPY_TYPES:
        raise ValueError(f"sending {datatype} data via JSON is not supported. Please use the binary data format for output")
    return np.frombuffer(raw, dtype=NUMPY_TYPES[datatype]).tolist()


def _parameter_value(parameter):
    return getattr(parameter, parameter.WhichOneof("parameter_choice"))


def http_response(response, plan: OutputPlan) -> tuple[bytes, int | None]:
    """The HTTP body Triton would answer for `response` (a ModelInferResponse): the JSON
    header, then any binary outputs in order; and the header's length where binary follows
    (the Inference-Header-Content-Length), else None."""
    body: dict = {}
    if response.id:
        body["id"] = response.id
    body["model_name"], body["model_version"] = response.model_name, response.model_version
    if response.parameters:
        body["parameters"] = {key: _parameter_value(value) for key, value in response.parameters.items()}
    outputs, tail = [], []
    for index, tensor in enumerate(response.outputs):
        raw = response.raw_output_contents[index] if index < len(response.raw_output_contents) else b""
        entry = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        kind = plan.kind(tensor.name)
        if kind == "binary":
            entry["parameters"] = {"binary_data_size": len(raw)}
            if raw:
                tail.append(raw)
        elif kind == "json":
            entry["data"] = _json_values(tensor.datatype, raw, int(np.prod(tensor.shape, dtype=np.int64)))
        outputs.append(entry)
    body["outputs"] = outputs
    header = json.dumps(body, separators=(",", ":")).encode()
    return header + b"".join(tail), (len(header) if tail else None)


def http_status(code_name: str) -> int:
    return HTTP_STATUS.get(code_name, 400)


def http_error_message(code_name: str, details: str) -> tuple[int, str]:
    """The HTTP status and message Triton's HTTP endpoint gives for this gRPC error."""
    if code_name == "UNIMPLEMENTED" and details == DECOUPLED_GRPC:
        return 501, DECOUPLED_HTTP
    return http_status(code_name), details


def response_encoding(accept_encoding: str | None) -> str:
    """The Content-Encoding Triton would answer with (CompressionTypeUsed): the highest-weighted
    of identity, deflate and gzip, the first of equals; identity when none is named."""
    chosen, weight = "identity", 0.0
    for item in (accept_encoding or "").split(","):
        name, _, q = item.lstrip(" ").partition(";q=")
        try:
            value = float(q) if q else 1.0
        except ValueError:
            continue
        if name in ("identity", "deflate", "gzip") and value > weight:
            chosen, weight = name, value
    return chosen


def encode_body(body: bytes, encoding: str) -> bytes:
    """deflate is zlib's format and gzip gzip's, as Triton's DataCompressor writes them."""
    if encoding == "gzip":
        return gzip.compress(body)
    if encoding == "deflate":
        return zlib.compress(body)
    return body
