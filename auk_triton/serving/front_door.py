"""The front door: the public HTTP and gRPC ports, in front of a tritonserver on loopback.

Triton 2.51 trusts what a request declares. Its HTTP frontend sizes a buffer from a
JSON input's declared shape before it reads the data (a shape of [2000000000, 64]
aborts the server with std::bad_alloc), and its gRPC frontend takes messages of up to
2 GB and copies them before any model sees them. Nothing in 2.51 bounds either, so
each request passes through here first:

- gRPC: grpc-core refuses a message longer than the largest legitimate request from
  its length prefix (RESOURCE_EXHAUSTED), before buffering it. Every ModelInfer and
  ModelStreamInfer message is parsed and its declared shapes checked against the
  model's limits; a good one is forwarded as the bytes it came as.
- HTTP: a body longer than its model takes is refused (413) from Content-Length, or
  while it is read. An /infer request's declared shapes are checked against the
  model's limits and against the data it sends (JSON values, or the binary part's
  sizes), and generate / generate_stream inputs by their counts (400). An /infer request
  is then answered over gRPC (http_infer.py): Triton 2.51's HTTP server never sees a
  client that closes its connection (triton-inference-server/server#7077), while a gRPC
  call the front cancels stops at the model's next window. A request gRPC would take
  differently is forwarded unchanged over HTTP, as are generate and the other routes.

The limits come from the model repository's configs, read once: each variable-length
input's rows by `config.input_row_limits` (a decoder's `max_frames`, auk_dit's
`max_prompt_tokens` and `max_frames`, an ensemble's through its steps' input maps),
fixed dimensions as configured. Everything else (health, metadata, shared memory,
statistics) passes through. While tritonserver is down, health answers 503 and other
requests 503 / UNAVAILABLE.

A stop (`FrontDoor.quiesce`, which the launcher runs on SIGINT / SIGTERM before it
signals tritonserver) refuses new requests (503 / UNAVAILABLE), half-closes every gRPC
stream upstream so that Triton ends it once its requests are done, lets what is in flight
finish for the drain, cancels the rest upstream and closes the front's own connections to
tritonserver: Triton 2.51 waits out its exit timeout for an open stream and for any open
HTTP connection.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Mapping

from . import config, http_infer

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
GRPC_SERVICE = "/inference.GRPCInferenceService/"
HOP_HEADERS = {"host", "content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive", "upgrade"}
STOPPING_MESSAGE = "the server is stopping and takes no new requests: send it again (to another replica)"
CUT_MESSAGE = "the server is stopping: the request was cut short after {drain:g} s of draining: send it again"
# After the drain, how long the cut requests get to end here before the front closes its
# connections to tritonserver (a cancelled call ends at once on this side).
CUT_SETTLE_S = 1.0
# The upstream is on loopback: reconnect within a second of a restart, not after gRPC's
# default back-off (up to two minutes). While tritonserver runs, calls upstream wait for the
# channel to connect (wait_for_ready): a channel that failed while the server was down
# would otherwise fail them at once until its next attempt.
# A client's ask for statuses on its gRPC stream (Triton's own header): the front serves it,
# and never passes it on (Triton 2.51's handling of it crashed the server).
STATUS_HEADER = "triton_grpc_error"
STATUS_IN_MESSAGE = re.compile(r"\[(" + "|".join(config.STATUS_NAMES) + r")\] ")
UPSTREAM_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


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
        if len(shape) != len(self.bounds) or any(d < 0 for d in shape) or any(
            bound is not None and d > bound for d, bound in zip(shape, self.bounds)
        ):
            most = [("-1" if b is None else str(b)) for b in self.bounds]
            raise Refused(
                f"input '{self.name}' of model '{model}' declares shape {list(shape)}; "
                f"this model takes at most [{', '.join(most)}] ({self.source})"
            )
        return math.prod(shape)


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
    settings, and for an ensemble from the step each input feeds."""
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
            bounds, source = list(inherited.bounds), inherited.source
        if batching:
            # A request carries one clip: the model batches requests itself, and refuses a
            # batch axis other than 1 (requests.one_row).
            bounds.insert(0, 1)
        inputs[tensor["name"]] = InputLimit(tensor["name"], _datatype(tensor["data_type"]), tuple(bounds), source)
    return ModelLimits(name, inputs, batching)


def _row_source(input_name: str) -> str:
    return {"LATENTS": "max_frames", "REF_LATENTS": "max_frames", "PROMPT_EMBEDS": "max_prompt_tokens",
            "AUDIO": "max_frames x 480 samples"}.get(input_name, "no limit configured")


def _step_input(model_config: Mapping, name: str, step_limits: Mapping[str, ModelLimits]) -> InputLimit | None:
    """The limit of the ensemble step input that ensemble tensor `name` feeds, if any."""
    for step in (model_config.get("ensemble_scheduling") or {}).get("step", []):
        step_model = step_limits.get(step["model_name"])
        for step_input, tensor in (step.get("input_map") or {}).items():
            if tensor == name and step_model is not None and step_input in step_model.inputs:
                limit = step_model.inputs[step_input]
                if step_model.batching:  # the ensemble adds the step's batch axis itself
                    limit = InputLimit(limit.name, limit.datatype, limit.bounds[1:], limit.source)
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
    """Every model's limits in a model repository; ensembles after the models they use."""
    configs = {
        d.name: read_model_config(d, config_name) for d in sorted(Path(repository).iterdir()) if (d / "config.pbtxt").is_file()
    }
    limits: dict[str, ModelLimits] = {}
    for name, model_config in sorted(configs.items(), key=lambda item: "ensemble_scheduling" in item[1]):
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


def _log(text: str) -> None:
    print(f"auk_triton.serving.front_door: {text}", file=sys.stderr, flush=True)


# ---- the HTTP front -------------------------------------------------------------------------


class HttpFront:
    """aiohttp handlers: check, then answer /infer over gRPC (`grpc_front`'s channel) and
    forward the rest to tritonserver's HTTP port."""

    def __init__(self, limits: Mapping[str, ModelLimits], upstream: str, state: "UpstreamState", grpc_front: "GrpcFront"):
        self.limits, self.upstream, self.state, self.grpc_front = limits, upstream, state, grpc_front
        self.session = None

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=max_body_bytes(self.limits))
        # A version is digits, as in Triton's routes: any other is not an /infer route (404 there).
        app.router.add_route("POST", "/v2/models/{model}/infer", self.infer)
        app.router.add_route("POST", "/v2/models/{model}/versions/{version:[0-9]+}/infer", self.infer)
        for kind in ("generate", "generate_stream"):
            app.router.add_route("POST", f"/v2/models/{{model}}/{kind}", self.generate)
            app.router.add_route("POST", f"/v2/models/{{model}}/versions/{{version:[0-9]+}}/{kind}", self.generate)
        app.router.add_route("GET", "/v2/health/{kind}", self.health)
        app.router.add_route("*", "/{tail:.*}", self.other)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None)
        )

    async def _close(self, app) -> None:
        await self.session.close()

    @staticmethod
    def refusal(err: Refused):
        from aiohttp import web

        return web.json_response({"error": str(err)}, status=err.http_status)

    def stopping(self):
        return self.refusal(Refused(STOPPING_MESSAGE, 503)) if self.state.stopping else None

    async def _body(self, request, most: int, what: str = "this route") -> bytes:
        """The request body, refused (413) past `most` bytes, from Content-Length or as read."""
        if request.content_length is not None and request.content_length > most:
            raise Refused(f"the request body is {request.content_length} bytes; {what} takes at most {most}", 413)
        chunks, length = [], 0
        while chunk := await request.content.readany():  # decompressed when the client compressed it
            length += len(chunk)
            if length > most:
                raise Refused(f"the request body is over {most} bytes; {what} takes at most {most}", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def infer(self, request):
        if refused := self.stopping():
            return refused
        try:
            model = _model(self.limits, request.match_info["model"])
            header_length = request.headers.get("Inference-Header-Content-Length")
            binary = header_length is not None
            most = (model.max_bytes() if binary else model.max_json_bytes()) or max_body_bytes(self.limits)
            what = f"model '{model.name}' {'with binary tensors' if binary else 'in JSON'}"
            body = await self._body(request, most, what)
            if header_length is not None:
                if not header_length.isdigit() or int(header_length) > len(body):
                    raise Refused(f"Inference-Header-Content-Length is {header_length!r} for a body of {len(body)} bytes")
                header, binary = _json(body[: int(header_length)]), len(body) - int(header_length)
            else:
                header, binary = _json(body), None
            check_http_infer(model, header, binary)
        except Refused as err:
            _log(f"refused {request.method} {request.path}: {err}")
            return self.refusal(err)
        try:
            tail = body[int(header_length):] if header_length is not None else b""
            upstream, plan = http_infer.grpc_request(
                model.name, request.match_info.get("version", ""), header, tail, self.grpc_front.pb
            )
        except http_infer.Untranslatable as why:
            # Triton's HTTP endpoint answers it itself, in its own words; such a request is
            # not seen if its client goes (the HTTP server's limit), but it is not a decode.
            _log(f"forwarding {request.path} over HTTP: {why}")
            return await self.forward(request, body)
        return await self.infer_over_grpc(request, upstream, plan)

    async def infer_over_grpc(self, request, upstream, plan: http_infer.OutputPlan):
        """One ModelInfer call upstream, cancelled when this client goes (the runner cancels
        the handler) or when a stop cuts it; answered as Triton's HTTP endpoint would."""
        from aiohttp import web

        grpc = self.grpc_front.grpc
        call = self.grpc_front.call(GRPC_SERVICE + "ModelInfer")(upstream.SerializeToString(), wait_for_ready=self.state.running)
        flight = self.state.take_off(call.cancel)
        try:
            reply = self.grpc_front.pb.ModelInferResponse.FromString(await call)
        except asyncio.CancelledError:
            if not flight.cut:
                raise  # the client went away
            return self.refusal(Refused(flight.cut, 503))
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE and not self.state.running:
                return self.refusal(Refused(f"tritonserver is not reachable ({self.state.why})", 503))
            # Triton labels some of these text/plain (those its core reports in the response);
            # the body is the same JSON either way.
            status, message = http_infer.http_error_message(err.code().name, err.details() or "")
            return web.json_response({"error": message}, status=status)
        finally:
            call.cancel()  # a no-op once done
            self.state.land(flight)
        try:
            body, header_length = http_infer.http_response(reply, plan)
        except ValueError as err:  # FP16 / BF16 asked for as JSON: Triton refuses it so (400)
            return self.refusal(Refused(str(err)))
        if header_length is None:
            headers = {"Content-Type": "application/json"}
        else:
            headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(header_length)}
        encoding = http_infer.response_encoding(request.headers.get("Accept-Encoding"))
        if encoding != "identity":
            body, headers["Content-Encoding"] = http_infer.encode_body(body, encoding), encoding
        return web.Response(body=body, headers=headers)

    async def generate(self, request):
        if refused := self.stopping():
            return refused
        try:
            model = _model(self.limits, request.match_info["model"])
            body = await self._body(request, model.max_json_bytes() or max_body_bytes(self.limits), f"model '{model.name}'")
            check_http_generate(model, _json(body))
        except Refused as err:
            _log(f"refused {request.method} {request.path}: {err}")
            return self.refusal(err)
        return await self.forward(request, body, stream=request.path.endswith("_stream"))

    async def health(self, request):
        if not self.state.running:
            return self.refusal(Refused(f"tritonserver is not running ({self.state.why})", 503))
        return await self.forward(request, b"")

    async def other(self, request):
        if refused := self.stopping():
            return refused
        try:
            body = await self._body(request, CONTROL_BODY_BYTES)
        except Refused as err:
            return self.refusal(err)
        return await self.forward(request, body)

    async def forward(self, request, body: bytes, stream: bool = False):
        """Forward over HTTP; a stop's cut ends the exchange (a stream with an error event,
        as Triton's generate_stream sends one)."""
        sent: dict = {}
        exchange = asyncio.ensure_future(self._exchange(request, body, stream, sent))
        flight = self.state.take_off(exchange.cancel)
        try:
            return await exchange
        except asyncio.CancelledError:
            if not flight.cut:
                raise  # the client went away: so does the upstream request
            response = sent.get("response")
            if response is None or not response.prepared:
                return self.refusal(Refused(flight.cut, 503))
            await response.write(f"data: {json.dumps({'error': flight.cut})}\n\n".encode())
            return response
        finally:
            self.state.land(flight)

    async def _exchange(self, request, body: bytes, stream: bool, sent: dict):
        import aiohttp
        from aiohttp import web

        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            async with self.session.request(
                request.method, f"{self.upstream}{request.path_qs}", data=body, headers=headers
            ) as reply:
                kept = {k: v for k, v in reply.headers.items() if k.lower() not in HOP_HEADERS}
                if reply.headers.get("Content-Encoding"):
                    kept["Content-Encoding"] = reply.headers["Content-Encoding"]
                if not stream:
                    return web.Response(status=reply.status, body=await reply.read(), headers=kept)
                response = sent["response"] = web.StreamResponse(status=reply.status, headers=kept)
                await response.prepare(request)
                async for chunk in reply.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientConnectionError as err:
            if stream and "response" in sent and sent["response"].prepared:
                raise  # mid-stream: the client sees its stream cut
            return self.refusal(Refused(f"tritonserver is not reachable ({self.state.why or err})", 503))


def _json(body: bytes):
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise Refused(f"the request body is not valid JSON: {err}") from None


# ---- the gRPC front -------------------------------------------------------------------------


class GrpcFront:
    """A grpc.aio generic handler: every method of Triton's service forwarded as bytes;
    ModelInfer and each ModelStreamInfer message checked first."""

    def __init__(self, limits: Mapping[str, ModelLimits], upstream: str, state: "UpstreamState"):
        import grpc
        from tritonclient.grpc import service_pb2

        self.grpc, self.pb = grpc, service_pb2
        self.limits, self.state = limits, state
        # Responses (a 10-minute float32 waveform is 57.6 MB) are not limited here.
        self.channel = grpc.aio.insecure_channel(
            upstream,
            options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                     *UPSTREAM_RECONNECT_OPTIONS],
        )
        self.calls: dict[str, object] = {}

    def handler(self):
        grpc = self.grpc
        front = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                if not details.method.startswith(GRPC_SERVICE):
                    return None
                if details.method.endswith("/ModelStreamInfer"):
                    return grpc.stream_stream_rpc_method_handler(front.stream)
                # A partial of a coroutine function: grpc.aio awaits it on its loop.
                return grpc.unary_unary_rpc_method_handler(partial(front.unary, details.method))

        return Handler()

    def call(self, method: str, streaming: bool = False):
        if method not in self.calls:
            make = self.channel.stream_stream if streaming else self.channel.unary_unary
            self.calls[method] = make(method)
        return self.calls[method]

    @staticmethod
    def _metadata(context):
        return tuple((k, v) for k, v in context.invocation_metadata() if not k.startswith((":", "grpc-"))
                     and k not in ("user-agent", "content-type", "te", STATUS_HEADER))

    def _check(self, data: bytes):
        """(the ModelInferRequest, None), or (None, why the front refuses it)."""
        try:
            request = self.pb.ModelInferRequest.FromString(data)
            check_grpc_infer(self.limits, request)
        except Refused as err:
            return None, str(err)
        except Exception as err:  # not a ModelInferRequest at all
            return None, f"the request is not a ModelInferRequest: {err}"
        return request, None

    def _refusal(self, data: bytes) -> str | None:
        return self._check(data)[1]

    async def unary(self, method: str, data: bytes, context):
        if self.state.stopping:
            await context.abort(self.grpc.StatusCode.UNAVAILABLE, STOPPING_MESSAGE)
        if method.endswith("/ModelInfer"):
            refusal = self._refusal(data)
            if refusal:
                _log(f"refused ModelInfer: {refusal}")
                await context.abort(self.grpc.StatusCode.INVALID_ARGUMENT, refusal)
        call = self.call(method)(
            data, metadata=self._metadata(context), timeout=context.time_remaining(), wait_for_ready=self.state.running
        )
        flight = self.state.take_off(call.cancel)
        try:
            return await call
        except asyncio.CancelledError:
            if not flight.cut:
                raise  # the client cancelled
            await context.abort(self.grpc.StatusCode.UNAVAILABLE, flight.cut)
        except self.grpc.aio.AioRpcError as err:
            await context.abort(err.code(), err.details() or "")
        finally:
            call.cancel()  # a no-op once done; cancels upstream when this client went away
            self.state.land(flight)

    async def stream(self, requests, context):
        if self.state.stopping:
            await context.abort(self.grpc.StatusCode.UNAVAILABLE, STOPPING_MESSAGE)
        call = self.call(GRPC_SERVICE + "ModelStreamInfer", streaming=True)(
            metadata=self._metadata(context), timeout=context.time_remaining(), wait_for_ready=self.state.running
        )
        sending, writing = asyncio.Lock(), asyncio.Lock()
        half_closed = False
        # With Triton's `triton_grpc_error: true` the first error ends the stream with its
        # status: the models put the status at the head of the message for the front to take.
        with_status = any(k == STATUS_HEADER and v.strip().lower() == "true" for k, v in context.invocation_metadata())
        failure: list = []  # (status, message): what ends a stream with statuses, found by the pump

        def end_with(status, message: str) -> None:
            failure.append((status, message))
            call.cancel()  # the stream's loop below ends, and aborts with it

        async def send(message: bytes) -> None:
            async with sending:
                await context.write(message)

        async def refuse(refusal: str) -> None:  # Triton's way of failing one request of a stream
            await send(self.pb.ModelStreamInferResponse(error_message=refusal).SerializeToString())

        async def half_close() -> None:
            """No more requests upstream: Triton ends the stream once those sent are done."""
            nonlocal half_closed
            async with writing:
                if not half_closed:
                    half_closed = True
                    await call.done_writing()

        async def pump() -> None:
            async for data in requests:
                request, refusal = self._check(data)
                if refusal:
                    _log(f"refused ModelStreamInfer request: {refusal}")
                    if with_status:
                        return end_with(self.grpc.StatusCode.INVALID_ARGUMENT, refusal)
                    await refuse(refusal)
                    continue
                if with_status:
                    request.parameters[config.STATUS_IN_MESSAGE_PARAMETER].bool_param = True
                    data = request.SerializeToString()
                async with writing:
                    forwarded = not half_closed  # once the stop closed it, nothing more goes upstream
                    if forwarded:
                        await call.write(data)
                if not forwarded:
                    if with_status:
                        return end_with(self.grpc.StatusCode.UNAVAILABLE, STOPPING_MESSAGE)
                    await refuse(STOPPING_MESSAGE)
            await half_close()

        def half_close_soon() -> None:
            asyncio.ensure_future(half_close()).add_done_callback(lambda done: done.cancelled() or done.exception())

        flight = self.state.take_off(call.cancel, half_close=half_close_soon)
        pumping = asyncio.ensure_future(pump())
        try:
            async for message in call:
                # A response with an error message starts with field 1's tag (proto3 writes
                # fields in order and leaves an empty string out): tiles are not parsed.
                if with_status and message[:1] == b"\x0a":
                    status, text = status_of(self.pb.ModelStreamInferResponse.FromString(message).error_message)
                    await context.abort(self.grpc.StatusCode[status], text)
                await send(message)
            if failure:
                await context.abort(*failure[0])
            if self.state.stopping and not pumping.done():
                pumping.cancel()  # its client keeps the stream open: the stop ends it here
            else:
                await pumping
        except asyncio.CancelledError:
            if failure:
                await context.abort(*failure[0])
            if not flight.cut:
                raise  # the client went away or cancelled
            await context.abort(self.grpc.StatusCode.UNAVAILABLE, flight.cut)
        except self.grpc.aio.AioRpcError as err:
            await context.abort(err.code(), err.details() or "")
        finally:
            pumping.cancel()
            call.cancel()  # the client went away or cancelled: so does the upstream call
            self.state.land(flight)


def status_of(error_message: str) -> tuple[str, str]:
    """A stream error's status name and its message without it: the status the models put
    in it (config.STATUS_IN_MESSAGE_PARAMETER), anywhere (an ensemble may put words before
    its step's message), else UNKNOWN (an error of Triton's own)."""
    found = STATUS_IN_MESSAGE.search(error_message)
    if found is None:
        return "UNKNOWN", error_message
    return found.group(1), error_message[: found.start()] + error_message[found.end():]


# ---- the whole front ------------------------------------------------------------------------


class Flight:
    """A request in flight upstream, as a stop sees it: `cancel` cuts it; a stream also
    has `half_close` (no more requests from it). `cut`: the message once cut."""

    def __init__(self, cancel, half_close=None):
        self.cancel, self.half_close = cancel, half_close
        self.cut: str | None = None


class UpstreamState:
    """What the supervisor tells the front: whether tritonserver runs, and why not; whether
    the server is stopping; and the requests in flight upstream."""

    def __init__(self):
        self.running = False
        self.why = "starting"
        self.stopping = False
        self.flights: set[Flight] = set()

    def take_off(self, cancel, half_close=None) -> Flight:
        flight = Flight(cancel, half_close)
        self.flights.add(flight)
        if self.stopping and half_close is not None:
            half_close()
        return flight

    def land(self, flight: Flight) -> None:
        self.flights.discard(flight)

    async def landed(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every flight to end; whether they all did."""
        deadline = time.monotonic() + timeout_s
        while self.flights and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.flights


@dataclass
class FrontDoor:
    limits: Mapping[str, ModelLimits]
    address: str
    ports: Mapping[str, int]  # public: http, grpc
    upstream_ports: Mapping[str, int]  # tritonserver's, on loopback
    state: UpstreamState

    async def start(self) -> None:
        import grpc
        from aiohttp import web

        self.grpc_front = GrpcFront(self.limits, f"127.0.0.1:{self.upstream_ports['grpc']}", self.state)
        self.http = HttpFront(self.limits, f"http://127.0.0.1:{self.upstream_ports['http']}", self.state, self.grpc_front)
        # handler_cancellation: a client that closes its connection cancels its handler, and so
        # the handler's call upstream.
        self.runner = web.AppRunner(self.http.app(), access_log=None, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.address, self.ports["http"]).start()
        # grpc-core refuses a longer message from its length prefix, before reading it.
        self.grpc_server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", max_message_bytes(self.limits)),
                     ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)]
        )
        self.grpc_server.add_generic_rpc_handlers((self.grpc_front.handler(),))
        if self.grpc_server.add_insecure_port(f"{self.address}:{self.ports['grpc']}") == 0:
            raise OSError(f"cannot listen on {self.address}:{self.ports['grpc']}")
        await self.grpc_server.start()
        _log(
            f"HTTP on {self.address}:{self.ports['http']}, gRPC on {self.address}:{self.ports['grpc']} -> tritonserver "
            f"on 127.0.0.1:{self.upstream_ports['http']}/{self.upstream_ports['grpc']}; gRPC messages up to "
            f"{max_message_bytes(self.limits)} bytes, HTTP bodies up to {max_body_bytes(self.limits)}"
        )

    async def quiesce(self, drain_s: float) -> None:
        """The front's part of a stop: refuse new requests, half-close the gRPC streams, let
        what is in flight finish for up to `drain_s`, cut the rest, and close the front's
        connections to tritonserver. Then tritonserver has nothing to wait for."""
        state = self.state
        state.stopping, state.running, state.why = True, False, "stopping"
        began, in_flight = time.monotonic(), len(state.flights)
        for flight in list(state.flights):
            if flight.half_close is not None:
                flight.half_close()
        await state.landed(drain_s)
        cut = list(state.flights)
        for flight in cut:
            flight.cut = CUT_MESSAGE.format(drain=drain_s)
            flight.cancel()
        await state.landed(CUT_SETTLE_S)
        _log(
            f"stopping: {in_flight} requests in flight at the signal; after {time.monotonic() - began:.1f} s "
            f"{len(cut)} cut (drain {drain_s:g} s), {len(state.flights)} still open"
        )
        # Triton 2.51 waits out its exit timeout while any HTTP connection to it is open (the
        # session's kept-alive ones too) and, at its end, for any open gRPC stream.
        await self.http.session.close()
        await self.grpc_front.channel.close()

    async def stop(self) -> None:
        await self.grpc_server.stop(grace=1)
        await self.grpc_front.channel.close()
        await self.runner.cleanup()
