"""The front door: the public HTTP and gRPC ports, in front of a tritonserver on loopback.

Triton 2.51 trusts what a request declares: its HTTP frontend sizes a buffer from a JSON
input's declared shape before it reads the data, and its gRPC frontend takes messages of
up to 2 GB and copies them before any model sees them. So every request passes a check
here first (http_front.py, grpc_front.py), against limits read once from the model
repository's configs (request_limits.py).

A stop (`FrontDoor.quiesce`, which the launcher runs on SIGINT / SIGTERM before it
signals tritonserver) refuses new requests (503 / UNAVAILABLE), half-closes every gRPC
stream upstream so that Triton ends it once its requests are done, lets what is in flight
finish for the drain, cancels the rest upstream and closes the front's own connections to
tritonserver: Triton 2.51 waits out its exit timeout for an open stream and for any open
HTTP connection.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Mapping

from .grpc_front import GrpcFront, GrpcUpstream, start_server
from .http_front import HttpFront
from .request_limits import ModelLimits, max_body_bytes, max_message_bytes
from .settings import GrpcBounds
from .upstream import CUT_MESSAGE, UpstreamState

# After the drain, how long the cut requests get to end here before the front closes its
# connections to tritonserver (a cancelled call ends at once on this side).
CUT_SETTLE_S = 1.0


def _log(text: str) -> None:
    print(f"auk_triton.front_door: {text}", file=sys.stderr, flush=True)


@dataclass
class FrontDoor:
    limits: Mapping[str, ModelLimits]
    address: str
    ports: Mapping[str, int]  # public: http, grpc
    upstream_ports: Mapping[str, int]  # tritonserver's, on loopback
    state: UpstreamState
    grpc_bounds: GrpcBounds = GrpcBounds()

    async def start(self) -> None:
        from aiohttp import web

        self.grpc_upstream = GrpcUpstream(f"127.0.0.1:{self.upstream_ports['grpc']}")
        self.http = HttpFront(self.limits, f"http://127.0.0.1:{self.upstream_ports['http']}", self.state, self.grpc_upstream)
        # handler_cancellation: a client that closes its connection cancels its handler, and so
        # the handler's call upstream.
        self.runner = web.AppRunner(self.http.app(), access_log=None, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.address, self.ports["http"]).start()
        front = GrpcFront(self.limits, self.grpc_upstream, self.state)
        self.grpc_server = await start_server(front, self.limits, self.grpc_bounds, self.address, self.ports["grpc"])
        bounds = self.grpc_bounds
        _log(
            f"HTTP on {self.address}:{self.ports['http']}, gRPC on {self.address}:{self.ports['grpc']} -> tritonserver "
            f"on 127.0.0.1:{self.upstream_ports['http']}/{self.upstream_ports['grpc']}; gRPC messages up to "
            f"{max_message_bytes(self.limits)} bytes, {bounds.max_connections} connections of at most "
            f"{bounds.max_streams} streams; HTTP bodies up to {max_body_bytes(self.limits)}"
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

    async def stop(self) -> None:
        await self.grpc_server.stop(grace=1)
        await self.grpc_upstream.channel.close()
        await self.runner.cleanup()
