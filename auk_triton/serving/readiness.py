"""Whether the tritonserver behind a port is READY: asked by the launcher's artifacts step, and
by the models' graph builders, which begin once the whole server is READY (the port the
launcher gives them in AUK_SERVER_HTTP_PORT), not beside the other models' warm-up."""

from __future__ import annotations

import os
import urllib.request
from functools import partial
from typing import Callable, Mapping

from .config import server_http_port

# How a model's log marks the graphs it leaves for after READY, and the end of their build: a
# benchmark of the steady state waits from the one to the other (benchmarks/common.py).
BUILD_AFTER_READY = "to build after READY"
BUILT_AFTER_READY = "deferred graphs built in"


def server_is_ready(http_port: int, timeout_s: float = 5.0) -> bool:
    """`/v2/health/ready` on loopback answered 200, on a new connection (as a probe asks)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=timeout_s) as reply:
            return reply.status == 200
    except Exception:  # refused while tritonserver loads, a reset, a bad reply: not ready
        return False


def server_ready_condition(environ: Mapping[str, str] = os.environ) -> Callable[[], bool] | None:
    """What a model's graph builder waits for before it begins: the whole server READY, where
    the launcher says where to ask; None (begin at once) for a tritonserver started otherwise."""
    port = server_http_port(environ)
    return None if port is None else partial(server_is_ready, port, 1.0)


def begun_note(waited_s: float, server_ready: bool | None) -> str:
    """When a builder began, after its model's READY, for the log ("" when it did not wait)."""
    if server_ready is None:
        return ""
    if server_ready:
        return f", begun once the server was READY ({waited_s:.1f} s after this model)"
    return f", begun {waited_s:.0f} s after this model without the server READY"
