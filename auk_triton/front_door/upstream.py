"""What the supervisor tells the front door's two fronts: whether tritonserver runs, and
why not; whether the server is stopping; and the requests in flight upstream, which a
stop half-closes, drains and cuts (`FrontDoor.quiesce`)."""

from __future__ import annotations

import asyncio
import time

STOPPING_MESSAGE = "the server is stopping and takes no new requests: send it again (to another replica)"
CUT_MESSAGE = "the server is stopping: the request was cut short after {drain:g} s of draining: send it again"
LOST_MESSAGE = "tritonserver stopped with the request in flight ({why}): send it again"


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

    def lost(self, why: str) -> None:
        """tritonserver died: not running, and each request in flight upstream is cut. Those
        sent just before the supervisor saw it wait for a connection (wait_for_ready) that
        only the restart would give them."""
        self.running, self.why = False, why
        for flight in list(self.flights):
            flight.cut = LOST_MESSAGE.format(why=why)
            flight.cancel()

    def land(self, flight: Flight) -> None:
        self.flights.discard(flight)

    async def landed(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every flight to end; whether they all did."""
        deadline = time.monotonic() + timeout_s
        while self.flights and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.flights
