"""The front door: the public HTTP and gRPC ports, in front of a tritonserver on loopback.

Triton 2.51 trusts what a request declares. Its HTTP frontend sizes a buffer from a
JSON input's declared shape before it reads the data (a shape of [2000000000, 64]
aborts the server with std::bad_alloc), and its gRPC frontend takes messages of up to
2 GB and copies them before any model sees them. Nothing in 2.51 bounds either, so
each request passes through here first:

- gRPC (grpc_splice.py): each client connection is spliced to one of the front's own to
  tritonserver. A message longer than the largest legitimate request is refused from its
  length prefix (RESOURCE_EXHAUSTED) before a byte of it goes on; every ModelInfer and
  ModelStreamInfer message's head (the inputs' names, datatypes and shapes, before the
  tensor bytes) is held and checked against its model's limits, and the message's length
  against the model's own; a good one goes on as the bytes it came as.
- HTTP: a body longer than its model takes is refused (413) from Content-Length, or
  while it is read. An /infer request's declared shapes are checked against the
  model's limits and against the data it sends (JSON values, or the binary part's
  sizes), and generate / generate_stream inputs by their counts (400). An /infer request
  is then answered over gRPC (http_infer.py): Triton 2.51's HTTP server never sees a
  client that closes its connection (triton-inference-server/server#7077), while a gRPC
  call the front cancels stops at the model's next window. A request gRPC would take
  differently is forwarded unchanged over HTTP, as are generate and the other routes.

The limits come from the model repository's configs, read once (request_limits.py).
Everything else (health, metadata, shared memory,
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
import sys
import time
from dataclasses import dataclass
from typing import Mapping

from . import http_infer
from .grpc_splice import GrpcSplice
from .request_limits import (
    CONTROL_BODY_BYTES, ModelLimits, Refused, _model, check_http_generate, check_http_infer, max_body_bytes,
    max_message_bytes,
)
from .upstream import CUT_MESSAGE, STOPPING_MESSAGE, UpstreamState

GRPC_SERVICE = "/inference.GRPCInferenceService/"
HOP_HEADERS = {"host", "content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive", "upgrade"}
# After the drain, how long the cut requests get to end here before the front closes its
# connections to tritonserver (a cancelled call ends at once on this side).
CUT_SETTLE_S = 1.0
# The upstream is on loopback: reconnect within a second of a restart, not after gRPC's
# default back-off (up to two minutes). While tritonserver runs, calls upstream wait for the
# channel to connect (wait_for_ready): a channel that failed while the server was down
# would otherwise fail them at once until its next attempt.
UPSTREAM_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _log(text: str) -> None:
    print(f"auk_triton.serving.front_door: {text}", file=sys.stderr, flush=True)



# ---- the HTTP front -------------------------------------------------------------------------


class HttpFront:
    """aiohttp handlers: check, then answer /infer over gRPC (`grpc_upstream`'s channel) and
    forward the rest to tritonserver's HTTP port."""

    def __init__(self, limits: Mapping[str, ModelLimits], upstream: str, state: UpstreamState, grpc_upstream: "GrpcUpstream"):
        self.limits, self.upstream, self.state, self.grpc_upstream = limits, upstream, state, grpc_upstream
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
                model.name, request.match_info.get("version", ""), header, tail, self.grpc_upstream.pb
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

        grpc = self.grpc_upstream.grpc
        call = self.grpc_upstream.call(GRPC_SERVICE + "ModelInfer")(upstream.SerializeToString(), wait_for_ready=self.state.running)
        flight = self.state.take_off(call.cancel)
        try:
            reply = self.grpc_upstream.pb.ModelInferResponse.FromString(await call)
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


# ---- tritonserver's gRPC port, for /infer ----------------------------------------------------


class GrpcUpstream:
    """A grpc.aio channel to tritonserver's gRPC port: the HTTP front answers /infer through it."""

    def __init__(self, upstream: str):
        import grpc
        from tritonclient.grpc import service_pb2

        self.grpc, self.pb = grpc, service_pb2
        # Responses (a 10-minute float32 waveform is 57.6 MB) are not limited here.
        self.channel = grpc.aio.insecure_channel(
            upstream,
            options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
                     *UPSTREAM_RECONNECT_OPTIONS],
        )
        self.calls: dict[str, object] = {}

    def call(self, method: str):
        if method not in self.calls:
            self.calls[method] = self.channel.unary_unary(method)
        return self.calls[method]


# ---- the whole front ------------------------------------------------------------------------


@dataclass
class FrontDoor:
    limits: Mapping[str, ModelLimits]
    address: str
    ports: Mapping[str, int]  # public: http, grpc
    upstream_ports: Mapping[str, int]  # tritonserver's, on loopback
    state: UpstreamState

    async def start(self) -> None:
        from aiohttp import web

        self.grpc_upstream = GrpcUpstream(f"127.0.0.1:{self.upstream_ports['grpc']}")
        self.http = HttpFront(self.limits, f"http://127.0.0.1:{self.upstream_ports['http']}", self.state, self.grpc_upstream)
        # handler_cancellation: a client that closes its connection cancels its handler, and so
        # the handler's call upstream.
        self.runner = web.AppRunner(self.http.app(), access_log=None, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.address, self.ports["http"]).start()
        self.grpc = GrpcSplice(self.limits, self.upstream_ports["grpc"], self.state)
        await self.grpc.start(self.address, self.ports["grpc"])
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
        await self.grpc_upstream.channel.close()
        self.grpc.close_upstream()

    async def stop(self) -> None:
        await self.grpc.stop()
        await self.grpc_upstream.channel.close()
        await self.runner.cleanup()
