"""The gRPC port's bounds (settings.GrpcBounds), held by grpc-core: connections at once,
idle connections, handshakes that never finish. The front's gRPC port runs alone here, in
a process of its own with small bounds, before an upstream that is not there (these
bounds act before any call)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from triton_harness import REPO_ROOT, _free_ports, closed_port

pytest.importorskip("grpc")
from auk_triton.front_door import settings  # noqa: E402
from http2_attacker import PREFACE, Connection  # noqa: E402

BOUNDS = dict(max_connections=4, max_streams=2, idle_s=1.0, handshake_s=1.0)
SERVE = """
import asyncio, sys
from auk_triton.front_door.grpc_front import GrpcFront, GrpcUpstream, start_server
from auk_triton.front_door.settings import GrpcBounds
from auk_triton.front_door.upstream import UpstreamState

async def main(port, upstream):
    front = GrpcFront({{}}, GrpcUpstream(upstream), UpstreamState())
    server = await start_server(front, {{}}, GrpcBounds(**{bounds}), "127.0.0.1", port)
    print("serving", flush=True)
    await server.wait_for_termination()

asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
"""


@pytest.fixture
def bounded_port():
    port = _free_ports(1)[0]
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE.format(bounds=BOUNDS), str(port), f"127.0.0.1:{closed_port()}"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout.readline().strip() == "serving"
        yield port
    finally:
        process.kill()
        process.wait()


def report() -> dict:
    return {"bytes_sent": 0, "sends_blocked": 0, "frames_back": {}, "reset_codes": {}}


def settle(conns, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for conn in conns:
            conn.read()
        time.sleep(0.05)


def test_connections_past_the_bound_are_closed_while_the_first_ones_are_served(bounded_port):
    first = [Connection(("127.0.0.1", bounded_port), report()) for _ in range(BOUNDS["max_connections"])]
    settle(first, 0.3)
    extra = Connection(("127.0.0.1", bounded_port), report())
    settle(first + [extra], 0.5)
    try:
        assert extra.closed and not extra.report["frames_back"], extra.report
        assert not any(conn.closed for conn in first)
        assert all(conn.report["frames_back"].get("SETTINGS") for conn in first)
    finally:
        for conn in first + [extra]:
            conn.close()


def test_an_idle_connection_is_sent_away_after_the_idle_time(bounded_port):
    conn = Connection(("127.0.0.1", bounded_port), report())
    try:
        settle([conn], BOUNDS["idle_s"] + 2.0)
        assert conn.report["frames_back"].get("GOAWAY") == 1, conn.report
    finally:
        conn.close()


def test_a_connection_that_never_finishes_its_handshake_is_closed(bounded_port):
    silent = socket.create_connection(("127.0.0.1", bounded_port), timeout=10)
    half = socket.create_connection(("127.0.0.1", bounded_port), timeout=10)
    try:
        half.sendall(PREFACE[:10])
        began = time.monotonic()
        for sock in (silent, half):
            while sock.recv(1 << 16):  # the server's SETTINGS, then the close
                pass
        assert time.monotonic() - began < BOUNDS["handshake_s"] + 3.0
    finally:
        silent.close()
        half.close()


def test_the_bounds_come_from_the_environment_and_a_bad_value_is_named():
    bounds = settings.grpc_bounds({"AUK_GRPC_MAX_CONNECTIONS": "10", "AUK_GRPC_MAX_STREAMS": "3", "AUK_GRPC_IDLE_S": "2.5"})
    assert (bounds.max_connections, bounds.max_streams, bounds.idle_s) == (10, 3, 2.5)
    assert settings.grpc_bounds({}) == settings.GrpcBounds()
    with pytest.raises(ValueError, match="AUK_GRPC_MAX_STREAMS is '0'; it must be a positive number"):
        settings.grpc_bounds({"AUK_GRPC_MAX_STREAMS": "0"})
    with pytest.raises(ValueError, match="AUK_GRPC_IDLE_S is 'soon'"):
        settings.grpc_bounds({"AUK_GRPC_IDLE_S": "soon"})
