"""Whether the server is READY (serving/readiness.py): asked of a loopback HTTP server that
stands in for tritonserver's health endpoint, and what a model's graph builder waits for."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from auk_triton.serving.readiness import begun_note, server_is_ready, server_ready_condition


@pytest.fixture
def health():
    """A loopback server whose /v2/health/ready answers `state["status"]`."""
    state = {"status": 503, "paths": []}

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            state["paths"].append(self.path)
            self.send_response(state["status"])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state["port"] = server.server_address[1]
    yield state
    server.shutdown()
    server.server_close()


def test_the_server_is_ready_only_once_its_ready_endpoint_answers_200(health):
    assert not server_is_ready(health["port"])
    health["status"] = 200
    assert server_is_ready(health["port"])
    assert health["paths"] == ["/v2/health/ready"] * 2


def test_a_port_nothing_listens_on_is_not_ready():
    with socket.socket() as probe:  # a port that was free a moment ago: the connection is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert not server_is_ready(port, timeout_s=0.5)


def test_a_builder_waits_for_the_port_the_launcher_gives_and_begins_at_once_without_one(health):
    assert server_ready_condition({}) is None
    condition = server_ready_condition({"AUK_SERVER_HTTP_PORT": str(health["port"])})
    assert condition() is False
    health["status"] = 200
    assert condition() is True


def test_a_port_variable_that_is_not_a_port_fails_naming_it():
    with pytest.raises(ValueError, match="AUK_SERVER_HTTP_PORT is '80o0'; it must be a port number"):
        server_ready_condition({"AUK_SERVER_HTTP_PORT": "80o0"})


def test_the_log_says_when_a_builder_began():
    assert begun_note(0.0, None) == ""
    assert begun_note(12.34, True) == ", begun once the server was READY (12.3 s after this model)"
    assert begun_note(900.2, False) == ", begun 900 s after this model without the server READY"
