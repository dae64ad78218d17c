"""The public HTTP port: an aiohttp server in front of tritonserver's HTTP port.

Triton 2.51's HTTP frontend sizes a buffer from a JSON input's declared shape before it
reads the data (a shape of [2000000000, 64] aborts the server with std::bad_alloc), so
every request is checked here first (request_limits.py):

- A body longer than its model takes is refused (413) from Content-Length, or while it
  is read.
- An /infer request's declared shapes are checked against the model's limits and against
  the data it sends (JSON values, or the binary part's sizes), and generate /
  generate_stream inputs by their counts (400).
- An /infer request is then answered over gRPC (http_infer.py): Triton 2.51's HTTP server
  never sees a client that closes its connection (triton-inference-server/server#7077),
  while a gRPC call the front cancels stops at the model's next window. A request gRPC
  would take differently is forwarded unchanged over HTTP, as are generate and the other
  routes (health, metadata, shared memory, statistics).

While tritonserver is down, health answers 503 and other requests 503.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Mapping

import grpc
from tritonclient.grpc import service_pb2

from . import http_infer
from .grpc_front import GRPC_SERVICE, GrpcUpstream
from .request_limits import CONTROL_BODY_BYTES, ModelLimits, Refused, _model, check_http_generate, check_http_infer, max_body_bytes
from .upstream import STOPPING_MESSAGE, UpstreamState

HOP_HEADERS = {"host", "content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive", "upgrade"}


def _log(text: str) -> None:
    print(f"auk_triton.front_door: {text}", file=sys.stderr, flush=True)



class HttpFront:
    """aiohttp handlers: check, then answer /infer over gRPC (`grpc_upstream`'s channel) and
    forward the rest to tritonserver's HTTP port."""

    def __init__(self, limits: Mapping[str, ModelLimits], upstream: str, state: UpstreamState, grpc_upstream: GrpcUpstream):
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
                model.name, request.match_info.get("version", ""), header, tail, service_pb2
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

        call = self.grpc_upstream.unary(GRPC_SERVICE + "ModelInfer")(upstream.SerializeToString(), wait_for_ready=self.state.running)
        flight = self.state.take_off(call.cancel)
        try:
            reply = service_pb2.ModelInferResponse.FromString(await call)
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
