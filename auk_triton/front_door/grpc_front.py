"""The public gRPC port: a grpc.aio server that checks each call and forwards its bytes to
tritonserver over a grpc.aio channel.

grpc-core speaks the protocol on both sides: HTTP/2 framing, HPACK, flow control, gRPC's
message framing, and its defences against the known HTTP/2 attacks (floods of pings,
settings and resets, endless header blocks, oversized frames). The server's bounds come
from `settings.GrpcBounds`: connections at once, streams per connection, idle and
handshake time, and the longest message any model takes (refused from its length prefix,
RESOURCE_EXHAUSTED, before it is buffered).

What is ours: every ModelInfer and ModelStreamInfer message is parsed (upb) and its
declared shapes checked against its own model's limits (request_limits.py) before it goes
on, as the bytes it came as; a refused stream message gets Triton's stream error and the
stream goes on. A stream opens its call upstream only once its first message has passed
the checks, so streams that never send one cost tritonserver nothing. A client that goes
(a reset, a cancel, a closed connection) cancels its call upstream at once.

Statuses on streams: Triton 2.51's own `triton_grpc_error: true` crashed the server, so
the front takes that header out and sends `auk_status_in_error_message: true` instead,
which tritonserver hands to every request of the stream as a parameter
(`--grpc-header-forward-pattern`, set by the launcher). The models then open each error
message with its status, and the front ends the stream with that status.
"""

from __future__ import annotations

import asyncio
import sys
from functools import partial
from typing import Mapping

import grpc
from tritonclient.grpc import service_pb2

from auk_triton.serving.config import STATUS_IN_MESSAGE_PARAMETER
from auk_triton.serving.errors import STATUS_TAG

from .request_limits import ModelLimits, Refused, check_grpc_infer, max_message_bytes
from .settings import GrpcBounds
from .upstream import STOPPING_MESSAGE, UpstreamState

GRPC_SERVICE = "/inference.GRPCInferenceService/"
STATUS_HEADER = "triton_grpc_error"
# Headers grpc-core sets on each side itself, and the status request the front rewrites.
NOT_FORWARDED = ("user-agent", "content-type", "te", STATUS_HEADER)
# The upstream is on loopback: reconnect within a second of a restart, not after gRPC's
# default back-off (up to two minutes). While tritonserver runs, calls upstream wait for the
# channel to connect (wait_for_ready): a channel that failed while the server was down
# would otherwise fail them at once until its next attempt.
UPSTREAM_OPTIONS = [
    # Responses (a 10-minute float32 waveform is 57.6 MB) are not limited here.
    ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _log(text: str) -> None:
    print(f"auk_triton.front_door: {text}", file=sys.stderr, flush=True)


def server_options(limits: Mapping[str, ModelLimits], bounds: GrpcBounds) -> list[tuple[str, int]]:
    """The public server's grpc-core options."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes(limits)),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", bounds.max_streams),
        ("grpc.max_allowed_incoming_connections", bounds.max_connections),
        ("grpc.max_connection_idle_ms", int(bounds.idle_s * 1000)),
        ("grpc.server_handshake_timeout_ms", int(bounds.handshake_s * 1000)),
    ]


def status_of(error_message: str) -> tuple[str, str]:
    """A stream error's status name and its message without it: the status the models put
    in it (STATUS_IN_MESSAGE_PARAMETER), anywhere (an ensemble may put words before its
    step's message), else UNKNOWN (an error of Triton's own)."""
    found = STATUS_TAG.search(error_message)
    if found is None:
        return "UNKNOWN", error_message
    return found.group(1), error_message[: found.start()] + error_message[found.end():]


class GrpcUpstream:
    """One grpc.aio channel to tritonserver's gRPC port, its calls made once per method."""

    def __init__(self, address: str):
        self.channel = grpc.aio.insecure_channel(address, options=UPSTREAM_OPTIONS)
        self.calls: dict[str, object] = {}

    def unary(self, method: str):
        if method not in self.calls:
            self.calls[method] = self.channel.unary_unary(method)
        return self.calls[method]

    def stream(self, method: str):
        if method not in self.calls:
            self.calls[method] = self.channel.stream_stream(method)
        return self.calls[method]


class GrpcFront:
    """The generic handler: every method of Triton's service forwarded as bytes; ModelInfer
    and each ModelStreamInfer message checked first."""

    def __init__(self, limits: Mapping[str, ModelLimits], upstream: GrpcUpstream, state: UpstreamState):
        self.limits, self.upstream, self.state = limits, upstream, state

    def handler(self) -> grpc.GenericRpcHandler:
        front = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                if not details.method.startswith(GRPC_SERVICE):
                    return None
                if details.method.endswith("/ModelStreamInfer"):
                    return grpc.stream_stream_rpc_method_handler(partial(front.stream, details.method))
                # A partial of a coroutine function: grpc.aio awaits it on its loop.
                return grpc.unary_unary_rpc_method_handler(partial(front.unary, details.method))

        return Handler()

    def refusal(self, data: bytes) -> tuple[grpc.StatusCode, str] | None:
        """Why the front refuses this ModelInferRequest (a status and a message), or None."""
        try:
            request = service_pb2.ModelInferRequest.FromString(data)
            check_grpc_infer(self.limits, request)
        except Refused as err:
            return grpc.StatusCode.INVALID_ARGUMENT, str(err)
        except Exception as err:  # not a ModelInferRequest at all
            return grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a ModelInferRequest: {err}"
        most = self.limits[request.model_name].max_bytes()
        if most and len(data) > most:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"the request is {len(data)} bytes; model '{request.model_name}' takes at most {most}"
            )
        return None

    @staticmethod
    def metadata(context, with_status: bool = False) -> tuple:
        kept = tuple(
            (k, v) for k, v in context.invocation_metadata()
            if not k.startswith((":", "grpc-")) and k not in NOT_FORWARDED
        )
        return kept + ((STATUS_IN_MESSAGE_PARAMETER, "true"),) if with_status else kept

    async def unary(self, method: str, data: bytes, context):
        if self.state.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING_MESSAGE)
        if method.endswith("/ModelInfer") and (refusal := self.refusal(data)):
            _log(f"refused ModelInfer: {refusal[1]}")
            await context.abort(*refusal)
        call = self.upstream.unary(method)(
            data, metadata=self.metadata(context), timeout=context.time_remaining(), wait_for_ready=self.state.running
        )
        flight = self.state.take_off(call.cancel)
        try:
            return await call
        except asyncio.CancelledError:
            if not flight.cut:
                raise  # the client went away: so does the call upstream (finally)
            await context.abort(grpc.StatusCode.UNAVAILABLE, flight.cut)
        except grpc.aio.AioRpcError as err:
            await context.abort(err.code(), err.details() or "")
        finally:
            call.cancel()  # a no-op once done
            self.state.land(flight)

    async def stream(self, method: str, requests, context):
        if self.state.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING_MESSAGE)
        with_status = any(k == STATUS_HEADER and v.strip().lower() == "true" for k, v in context.invocation_metadata())
        relay = StreamRelay(self, method, requests, context, with_status)
        await relay.run()


class StreamRelay:
    """One ModelStreamInfer call: the client's messages checked and written upstream (the
    pump), the server's responses written back (the main loop)."""

    def __init__(self, front: GrpcFront, method: str, requests, context, with_status: bool):
        self.front, self.method, self.requests, self.context = front, method, requests, context
        self.with_status = with_status
        self.call = None
        self.sending, self.writing = asyncio.Lock(), asyncio.Lock()
        self.half_closed = False
        self.failure: list = []  # (status, message) that ends a stream with statuses

    async def send(self, message: bytes) -> None:
        async with self.sending:
            await self.context.write(message)

    async def refuse(self, refusal: tuple[grpc.StatusCode, str]) -> None:
        """Triton's way of failing one request of a stream: an error message; it goes on.
        With statuses, the stream ends with the status instead."""
        _log(f"refused ModelStreamInfer request: {refusal[1]}")
        if self.with_status:
            self.failure.append(refusal)
            if self.call is not None:
                self.call.cancel()  # the main loop ends, and aborts with the failure
            return
        await self.send(service_pb2.ModelStreamInferResponse(error_message=refusal[1]).SerializeToString())

    async def first_request(self) -> bytes | None:
        """The first message that passes the checks (earlier ones refused), or None when the
        client ends or fails first: no call upstream until there is something to send."""
        async for data in self.requests:
            refusal = self.front.refusal(data)
            if refusal is None:
                return data
            await self.refuse(refusal)
            if self.failure:
                return None
        return None

    async def half_close(self) -> None:
        """No more requests upstream: Triton ends the stream once those sent are done."""
        async with self.writing:
            if not self.half_closed:
                self.half_closed = True
                await self.call.done_writing()

    def half_close_soon(self) -> None:
        asyncio.ensure_future(self.half_close()).add_done_callback(lambda done: done.cancelled() or done.exception())

    async def pump(self) -> None:
        async for data in self.requests:
            refusal = self.front.refusal(data)
            if refusal:
                await self.refuse(refusal)
                if self.failure:
                    return
                continue
            async with self.writing:
                forwarded = not self.half_closed  # once a stop closed it, nothing more goes upstream
                if forwarded:
                    await self.call.write(data)
            if not forwarded:
                if self.with_status:
                    self.failure.append((grpc.StatusCode.UNAVAILABLE, STOPPING_MESSAGE))
                    self.call.cancel()
                    return
                await self.send(service_pb2.ModelStreamInferResponse(error_message=STOPPING_MESSAGE).SerializeToString())
        await self.half_close()

    async def run(self) -> None:
        context, state = self.context, self.front.state
        first = await self.first_request()
        if self.failure:
            await context.abort(*self.failure[0])
        if first is None:
            return  # the client ended its stream before sending a request that passes
        if state.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING_MESSAGE)
        self.call = call = self.front.upstream.stream(self.method)(
            metadata=self.front.metadata(context, self.with_status), timeout=context.time_remaining(),
            wait_for_ready=state.running,
        )
        flight = state.take_off(call.cancel, half_close=self.half_close_soon)
        pumping = None
        try:
            async with self.writing:
                if not self.half_closed:
                    await call.write(first)
            pumping = asyncio.ensure_future(self.pump())
            async for message in call:
                # A response with an error message starts with field 1's tag (proto3 writes
                # fields in order and leaves an empty string out): tiles are not parsed.
                if self.with_status and message[:1] == b"\x0a":
                    status, text = status_of(service_pb2.ModelStreamInferResponse.FromString(message).error_message)
                    await context.abort(grpc.StatusCode[status], text)
                await self.send(message)
            if self.failure:
                await context.abort(*self.failure[0])
            if state.stopping and not pumping.done():
                pumping.cancel()  # its client keeps the stream open: the stop ends it here
            else:
                await pumping
        except asyncio.CancelledError:
            if self.failure:
                await context.abort(*self.failure[0])
            if not flight.cut:
                raise  # the client went away or cancelled
            await context.abort(grpc.StatusCode.UNAVAILABLE, flight.cut)
        except grpc.aio.AioRpcError as err:
            if self.failure:
                await context.abort(*self.failure[0])
            await context.abort(err.code(), err.details() or "")
        finally:
            if pumping is not None:
                pumping.cancel()
            call.cancel()  # the client went away or cancelled: so does the call upstream
            state.land(flight)


async def start_server(
    front: GrpcFront, limits: Mapping[str, ModelLimits], bounds: GrpcBounds, address: str, port: int
) -> grpc.aio.Server:
    server = grpc.aio.server(options=server_options(limits, bounds))
    server.add_generic_rpc_handlers((front.handler(),))
    if server.add_insecure_port(f"{address}:{port}") == 0:
        raise OSError(f"cannot listen on {address}:{port}")
    await server.start()
    return server
