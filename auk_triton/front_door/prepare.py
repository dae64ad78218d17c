"""Build the start-up artifacts once, before any pod serves: `make artifacts`, the image's
artifacts step and the Kubernetes Job run this.

    python -m auk_triton.front_door.prepare [extra tritonserver arguments]

It starts tritonserver as the launcher would (the same AUK_* variables, model set and
device), on free loopback ports and without the front door, waits for READY and stops it.
The models compile into the artifacts folder's subfolder for this GPU, torch and code
(AUK_ARTIFACTS_DIR, else `artifacts` in AUK_CACHE_DIR; serving/artifacts.py,
docs/operating.md); the next server that starts with that folder finds its compile
caches warm. Exits 0 once the server was READY, else 1, with the models' lines about their
artifacts and buckets printed either way.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time

from auk_triton.serving.readiness import server_is_ready

from . import launcher, settings

READY_TIMEOUT_S = 1800.0  # a cold build of every model set, with room for a slow host


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_ready(process: subprocess.Popen, http_port: int, timeout_s: float) -> bool:
    """Poll readiness with a new connection each time (as a probe does) until READY, the server's
    exit or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        if server_is_ready(http_port):
            return True
        time.sleep(0.5)
    return False


def bucket_lines(log: str) -> list[str]:
    """The models' lines about their artifacts, compiled buckets and warm-up, from the server's log."""
    marks = ("start-up artifacts:", "bucket of", ": ready (", "step graphs of")
    return [line for line in log.splitlines() if any(mark in line for mark in marks)]


def main(argv: list[str] | None = None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    loopback = ["--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"]
    try:
        command, env = launcher.server_command(ports=ports, extra_args=loopback + extra)
    except (launcher.TritonNotFound, FileNotFoundError, ValueError) as err:
        sys.exit(f"auk_triton.front_door.prepare: {err}")
    models = ", ".join(settings.models_to_load(env)) or "every model in the repository"
    print(f"auk_triton.front_door.prepare: building the start-up artifacts of {models}", flush=True)
    began = time.monotonic()
    with tempfile.NamedTemporaryFile("w+", prefix="auk-prepare-", suffix=".log") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            ready = wait_ready(process, ports["http"], READY_TIMEOUT_S)
            seconds = time.monotonic() - began
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    process.kill()
            launcher.reap(process.pid)
        log.seek(0)
        text = log.read()
    for line in bucket_lines(text):
        print(line, flush=True)
    if not ready:
        print(text[-4000:], file=sys.stderr)
        print(f"auk_triton.front_door.prepare: the server was not READY ({launcher.describe_exit(process.returncode)})",
              file=sys.stderr, flush=True)
        return 1
    print(f"auk_triton.front_door.prepare: READY after {seconds:.1f} s; the artifacts are in place", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
