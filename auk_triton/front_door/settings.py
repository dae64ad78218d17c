"""The launcher's and the front door's settings, each with its one default: the AUK_*
variables they read and the bounds they keep. Nothing here imports torch: the front
door's process never does (the models' own settings are in auk_triton/serving/config.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
# The front door serves the public HTTP and gRPC ports; tritonserver itself listens on
# these, on loopback only.
DEFAULT_INTERNAL_PORTS = {"http": 18000, "grpc": 18001}
# Where the public ports (and Triton's metrics port) listen: loopback unless asked. The
# Docker image and the Kubernetes manifests set AUK_ADDRESS=0.0.0.0.
DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_DEVICE = "auto"
# With no checkpoint and no AUK_PRESET, a CPU serves the small synthetic preset: the
# released geometry's DiT takes minutes a request there. A GPU serves the released one.
CPU_PRESET = "small"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

# The Python backend's shared-memory pool per model instance: room from the start for
# the largest legitimate request, the offline model's 10-minute clip (its latents,
# 7.68 MB, and its float32 waveform, 57.6 MB, at once), and growth in 8 MiB steps.
SHM_DEFAULT_BYTES = 72 * 2**20
SHM_GROWTH_BYTES = 8 * 2**20
# The launcher restarts a tritonserver that died after 1 s, then 2, 4, ... up to 30 s;
# a server that ran this long before it died starts the count again.
RESTART_BACKOFF_S = (1.0, 30.0)
RESTART_RESET_AFTER_S = 60.0
# On SIGINT / SIGTERM the launcher lets the requests in flight run for the exit timeout
# less this margin (less half of it, for a timeout under twice the margin), cuts the rest,
# and only then stops tritonserver: the margin is for the cut requests to stop at their
# next window and the models to unload, so that the whole stop fits in the exit timeout.
STOP_MARGIN_S = 10.0
TRITON_EXIT_TIMEOUT_S = 30.0  # tritonserver's own default for --exit-timeout-secs


# ---- tritonserver's exit and the stop ------------------------------------------------------


def exit_timeout_seconds(server_args) -> float:
    """The --exit-timeout-secs among tritonserver's arguments (the last one), else Triton's default."""
    found = TRITON_EXIT_TIMEOUT_S
    args = list(server_args)
    for index, arg in enumerate(args):
        value = None
        if arg.startswith("--exit-timeout-secs="):
            value = arg.split("=", 1)[1]
        elif arg == "--exit-timeout-secs" and index + 1 < len(args):
            value = args[index + 1]
        if value is not None:
            try:
                found = float(int(value))
            except ValueError:
                raise ValueError(f"--exit-timeout-secs is {value!r}; it must be a whole number of seconds") from None
    return found


def stop_drain_seconds(exit_timeout_s: float) -> float:
    """How long a stop lets requests in flight run before it cuts them (STOP_MARGIN_S)."""
    return exit_timeout_s - min(exit_timeout_s / 2, STOP_MARGIN_S)


# ---- AUK_* environment variables ------------------------------------------------------------


def _port_variable(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} is {value!r}; it must be a port number such as {default}") from None


def port(environ: Mapping[str, str], kind: str) -> int:
    """AUK_<KIND>_PORT (kind: http, grpc, metrics), else its default."""
    return _port_variable(environ, f"AUK_{kind.upper()}_PORT", DEFAULT_PORTS[kind])


def address(environ: Mapping[str, str] = os.environ) -> str:
    """AUK_ADDRESS: where the public HTTP, gRPC and metrics ports listen."""
    return environ.get("AUK_ADDRESS", "").strip() or DEFAULT_ADDRESS


def internal_port(environ: Mapping[str, str], kind: str) -> int:
    """AUK_INTERNAL_<KIND>_PORT (kind: http, grpc): tritonserver's own port on loopback,
    behind the front door."""
    return _port_variable(environ, f"AUK_INTERNAL_{kind.upper()}_PORT", DEFAULT_INTERNAL_PORTS[kind])


def restarts_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """AUK_RESTART: on (default), the launcher restarts a tritonserver that died; off, it
    exits with the server's status (a container's restart policy takes over)."""
    value = (environ.get("AUK_RESTART", "").strip() or "on").lower()
    if value not in _TRUE | _FALSE:
        raise ValueError(f"AUK_RESTART is {value!r}; use on or off")
    return value in _TRUE


def tritonserver_override(environ: Mapping[str, str] = os.environ) -> str:
    """AUK_TRITONSERVER: a tritonserver binary to run with its own backends (the NGC
    image's); empty: the nvidia-pytriton wheel's."""
    return environ.get("AUK_TRITONSERVER", "").strip()


def device_choice(environ: Mapping[str, str] = os.environ) -> str:
    """AUK_DEVICE: cpu, gpu or auto (gpu when torch sees CUDA)."""
    device = (environ.get("AUK_DEVICE", "").strip() or DEFAULT_DEVICE).lower()
    if device not in ("cpu", "gpu", "auto"):
        raise ValueError(f"AUK_DEVICE is {device!r}; use cpu, gpu or auto")
    return device


def models_to_load(environ: Mapping[str, str] = os.environ) -> list[str]:
    """AUK_MODELS: comma-separated model names; empty (or "all") loads every model."""
    models = [name.strip() for name in environ.get("AUK_MODELS", "").split(",") if name.strip()]
    return [] if models == ["all"] else models


def model_repository(environ: Mapping[str, str], project_root: Path) -> Path:
    """AUK_MODEL_REPOSITORY, else `model_repository` in the project root or the current directory."""
    configured = environ.get("AUK_MODEL_REPOSITORY", "").strip()
    if configured:
        return Path(configured).absolute()
    for candidate in (project_root / "model_repository", Path.cwd() / "model_repository"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("no model_repository found; set AUK_MODEL_REPOSITORY")


# ---- the gRPC port's bounds --------------------------------------------------------------


@dataclass(frozen=True)
class GrpcBounds:
    """What one client may hold of the public gRPC port; grpc-core enforces each."""

    # Connections open at once; past it grpc-core closes new ones at once. Idle ones cost
    # little (each is closed after idle_s), so the bound is for file descriptors, set high
    # enough that one client holding many cannot lock the others out.
    max_connections: int = 4096
    # Streams open at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS); a client
    # that opens more has them refused.
    max_streams: int = 64
    # A connection with no call open for this long is closed (GOAWAY).
    idle_s: float = 300.0
    # A connection that has not finished its HTTP/2 handshake by then is closed.
    handshake_s: float = 10.0


def _positive_number(environ: Mapping[str, str], name: str, default, kind=int):
    value = environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = kind(value)
    except ValueError:
        raise ValueError(f"{name} is {value!r}; it must be a positive number such as {default}") from None
    if number <= 0:
        raise ValueError(f"{name} is {value!r}; it must be a positive number such as {default}")
    return number


def grpc_bounds(environ: Mapping[str, str] = os.environ) -> GrpcBounds:
    """AUK_GRPC_MAX_CONNECTIONS, AUK_GRPC_MAX_STREAMS and AUK_GRPC_IDLE_S, else the defaults."""
    default = GrpcBounds()
    return GrpcBounds(
        max_connections=_positive_number(environ, "AUK_GRPC_MAX_CONNECTIONS", default.max_connections),
        max_streams=_positive_number(environ, "AUK_GRPC_MAX_STREAMS", default.max_streams),
        idle_s=_positive_number(environ, "AUK_GRPC_IDLE_S", default.idle_s, float),
        handshake_s=default.handshake_s,
    )
