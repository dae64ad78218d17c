"""Start Triton Inference Server on this project's model repository.

The server is the one the `nvidia-pytriton` wheel carries (Triton 2.51 with the
Python backend). Its Python backend looks for `triton_python_backend_stub` next
to `libtriton_python.so`, and the wheel keeps one stub per Python version in a
separate folder, so we assemble a backend directory of our own (symbolic links,
nothing written into site-packages) under the project's cache folder and pass
it with `--backend-directory`.

The stub embeds the Python it was built for and finds its packages the way
`python3` on PATH would, so the running interpreter's `bin` folder (the virtual
environment's) goes first on PATH: `import torch` and `import auk_triton`
inside the model then resolve to this environment.

    python -m auk_triton.front_door.launcher [extra tritonserver arguments]

It reads the AUK_* variables through `config` (ports, model repository, cache
folder, device, models to load; docs/serving.md lists them with their defaults).
`AUK_DEVICE=gpu` (or `auto` with CUDA present) serves the models'
`configs/gpu.pbtxt` through `--model-config-name`. A relative `AUK_CHECKPOINT`
is made absolute here, so it means the directory the server starts in.

`main` (`make serve`, the image's command) puts the front door (`app.py`)
on the public HTTP and gRPC ports and runs tritonserver behind it on loopback
(AUK_INTERNAL_*_PORT), its metrics port public. It supervises the server: one that
dies is logged with its status and restarted after a back-off (1 s, doubling to 30 s;
AUK_RESTART=off exits instead), and the front answers not-ready meanwhile. The requests
in flight upstream when it dies are cut at once (UNAVAILABLE / 503, naming how it died),
even those still waiting for their connection.

On SIGINT or SIGTERM the front door stops first (`FrontDoor.quiesce`): it refuses new
requests, half-closes every gRPC stream so that Triton ends it once its requests are done,
lets the requests in flight run for the drain (`settings.stop_drain_seconds`: the exit
timeout less a margin), cuts the rest (their clients get UNAVAILABLE / 503, the models stop
them at their next window) and closes its own connections to tritonserver. Only then does
the signal go on to tritonserver, which finds nothing to wait for, unloads the models and
exits; the launcher exits with its status. A second signal goes on at once.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from auk_triton.serving import config

from . import settings

PROJECT_ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIG_NAME = "gpu"


class TritonNotFound(RuntimeError):
    """The tritonserver from the nvidia-pytriton wheel is not installed here."""


def _pytriton_server_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonNotFound(
            "nvidia-pytriton is not installed in this Python environment "
            f"({sys.executable}); run `make serve` or `pip install nvidia-pytriton==0.7.0`"
        )
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise TritonNotFound(f"{root} holds no bin/tritonserver; is nvidia-pytriton complete?")
    return root


def tritonserver_executable() -> Path:
    return _pytriton_server_root() / "bin" / "tritonserver"


def build_backend_directory(cache_root: Path) -> Path:
    """Link the wheel's Python backend and the stub for this Python under `cache_root`.

    Returns the directory to pass as `--backend-directory` (it holds `python/`).
    Idempotent; links that point elsewhere (another environment) are replaced.
    """
    server_root = _pytriton_server_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server_root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise TritonNotFound(f"nvidia-pytriton has no Python backend stub for Python {version} ({stub})")
    backend = server_root / "backends" / "python"
    targets = {
        "libtriton_python.so": backend / "libtriton_python.so",
        "triton_python_backend_utils.py": backend / "triton_python_backend_utils.py",
        "triton_python_backend_stub": stub,
    }
    root = Path(cache_root) / "triton_backends" / f"py{version}"
    python_dir = root / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name, target in targets.items():
        link = python_dir / name
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        tmp = python_dir / f".{name}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        tmp.replace(link)
    return root


# Whether the CUDA driver sees a device, asked in a child process: the launcher (the front
# door's process) never loads torch or the driver itself.
_CUDA_PROBE = """
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    sys.exit(1)
count = ctypes.c_int(0)
sys.exit(0 if cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0 else 1)
"""


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """What torch.cuda.is_available() would say, without torch: the driver and a device."""
    return subprocess.run([sys.executable, "-c", _CUDA_PROBE], capture_output=True).returncode == 0


def _wants_gpu(device: str) -> bool:
    return device == "gpu" if device != "auto" else cuda_available()


def served_repository(model_repository: Path | None, env: dict[str, str]) -> Path:
    """The model repository served: `model_repository`, else AUK_MODEL_REPOSITORY or the project's."""
    return Path(model_repository).absolute() if model_repository else settings.model_repository(env, PROJECT_ROOT)


def served_config_name(env: dict[str, str]) -> str | None:
    """The models' config served: `configs/gpu.pbtxt` on a GPU, else None (config.pbtxt)."""
    return GPU_CONFIG_NAME if _wants_gpu(settings.device_choice(env)) else None


def server_command(
    model_repository: Path | None = None,
    *,
    ports: dict[str, int] | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The tritonserver argv and environment for serving `model_repository`.

    `ports` maps "http", "grpc", "metrics" to port numbers; missing ones come
    from AUK_*_PORT, then the defaults. `env` is the base environment
    (default: this process's).
    """
    env = dict(os.environ if env is None else env)
    ports = dict(ports or {})
    for kind in settings.DEFAULT_PORTS:
        if kind not in ports:
            ports[kind] = settings.port(env, kind)
    repository = served_repository(model_repository, env)
    env["AUK_CACHE_DIR"] = str(config.environment_cache_dir(env))  # the models resolve it alike
    env[config.SERVER_HTTP_PORT_VARIABLE] = str(ports["http"])  # where their builders ask for READY
    # A relative AUK_CHECKPOINT means the directory the server is started from, for every model.
    if env.get("AUK_CHECKPOINT", "").strip():
        env["AUK_CHECKPOINT"] = os.path.abspath(env["AUK_CHECKPOINT"].strip())
    gpu = served_config_name(env) == GPU_CONFIG_NAME
    if not gpu and not env.get("AUK_PRESET", "").strip():
        env["AUK_PRESET"] = settings.CPU_PRESET
    override = settings.tritonserver_override(env)
    argv = [override or str(tritonserver_executable()), f"--model-repository={repository}"]
    if not override:  # a server of its own (the NGC image's) brings its backends
        argv.append(f"--backend-directory={build_backend_directory(Path(env['AUK_CACHE_DIR']))}")
    argv += [
        f"--http-port={ports['http']}",
        f"--grpc-port={ports['grpc']}",
        f"--metrics-port={ports['metrics']}",
        # The Python backend's pool per model instance, for the largest legitimate tensors.
        f"--backend-config=python,shm-default-byte-size={settings.SHM_DEFAULT_BYTES}",
        f"--backend-config=python,shm-growth-byte-size={settings.SHM_GROWTH_BYTES}",
        # Every config here is complete. With auto-completion on, the Python backend starts a
        # stub per model only to ask it for its config, and that stub imports torch and the model.
        "--disable-auto-complete-config",
    ]
    if gpu:
        argv.append(f"--model-config-name={GPU_CONFIG_NAME}")
    # AUK_MODELS picks the models to load; an ensemble brings up its steps itself, and the
    # models others forward their requests to are added here.
    models = with_forwarded_models(settings.models_to_load(env), repository, served_config_name(env))
    if models:
        argv.append("--model-control-mode=explicit")
        argv.extend(f"--load-model={name}" for name in models)
    argv.extend(extra_args)
    # The stub resolves `python3` on PATH to find its packages: this interpreter's first.
    # sys.executable is not resolved: a venv's python is a link whose folder is the venv's bin.
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir])
    return argv, env


def with_forwarded_models(models: list[str], repository: Path, config_name: str | None) -> list[str]:
    """`models`, each preceded by the model it forwards its requests to where it does (the
    offline model forwards to auk_vae_decode): Triton loads an ensemble's steps with it, but
    not the model another's BLS calls go to."""
    from .request_limits import read_model_config  # tritonclient's protobuf: only where a set is named

    loaded: list[str] = []
    for name in models:
        folder = repository / name
        target = config.forwarded_model(read_model_config(folder, config_name)) if (folder / "config.pbtxt").is_file() else None
        if target and target not in loaded:
            if target not in models:
                _say(f"AUK_MODELS names {name}, which forwards its requests to {target}: loading {target} too")
            loaded.append(target)
        if name not in loaded:
            loaded.append(name)
    return loaded


def describe_exit(status: int) -> str:
    if status < 0:
        return f"was killed by signal {-status} ({signal.Signals(-status).name})"
    return f"exited with status {status}"


def reap(server_pid: int) -> None:
    """Kill what a tritonserver that has exited left running: its Python backend stubs, in its
    process group (it leads a session of its own). A server that exits before them (its exit
    timeout ran out, or it was killed) can leave them running with their shared memory and,
    on a GPU, device memory; seen: stubs still running an hour after their server."""
    try:
        os.killpg(server_pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # none left


def restart_delay(failures: int) -> float:
    """The back-off before restart number `failures` in a row (1, 2, 4, ... up to the cap)."""
    first, cap = settings.RESTART_BACKOFF_S
    return min(cap, first * 2 ** (failures - 1))


class Supervisor:
    """Runs tritonserver, restarts it when it dies, and stops it on SIGINT / SIGTERM."""

    def __init__(self, command: list[str], env: dict[str, str], state, restart: bool, before_stop=None):
        self.command, self.env, self.state, self.restart = command, env, state, restart
        self.before_stop = before_stop  # a coroutine function: what runs before the signal goes on
        self.process = None
        self.stopping = asyncio.Event()
        self.stopper: asyncio.Future | None = None

    def stop(self, signum: int) -> None:
        """Run `before_stop`, then forward the signal; a second signal is forwarded at once."""
        if self.stopping.is_set():
            _say(f"{signal.Signals(signum).name} again: passing it on now")
            self._signal(signum)
            return
        self.stopping.set()
        self.state.running, self.state.why = False, "stopping"
        self.stopper = asyncio.ensure_future(self._stop(signum))

    async def _stop(self, signum: int) -> None:
        if self.before_stop is not None:
            try:
                await self.before_stop()
            except Exception as err:  # the signal goes on whatever happened
                _say(f"stopping the front door failed ({type(err).__name__}: {err}); stopping tritonserver")
        self._signal(signum)

    def _signal(self, signum: int) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signum)

    async def run(self) -> int:
        failures = 0
        while True:
            began = time.monotonic()
            # Its own session: a terminal's Ctrl-C reaches it once, through stop().
            self.process = await asyncio.create_subprocess_exec(*self.command, env=self.env, start_new_session=True)
            _say(f"tritonserver started (pid {self.process.pid})")
            if not self.stopping.is_set():
                self.state.running = True
            elif self.stopper is not None and self.stopper.done():
                self._signal(signal.SIGTERM)  # it started as the stop ran: it stops too
            status = await self.process.wait()
            reap(self.process.pid)
            ran = time.monotonic() - began
            self.state.running = False
            if self.stopping.is_set():
                _say(f"tritonserver {describe_exit(status)} after the stop signal")
                return status if status >= 0 else 128 - status
            if not self.restart:
                self.state.lost(f"it {describe_exit(status)}")
                _say(f"tritonserver {describe_exit(status)} after {ran:.0f} s; AUK_RESTART is off: exiting")
                return status if status > 0 else 1
            failures = 1 if ran >= settings.RESTART_RESET_AFTER_S else failures + 1
            delay = restart_delay(failures)
            self.state.lost(f"it {describe_exit(status)}; restarting in {delay:g} s")
            _say(f"tritonserver {describe_exit(status)} after {ran:.0f} s; restarting it in {delay:g} s (not ready until then)")
            try:
                await asyncio.wait_for(self.stopping.wait(), delay)
                return 128 + signal.SIGTERM
            except asyncio.TimeoutError:
                self.state.why = f"restarting after it {describe_exit(status)}"


def _say(text: str) -> None:
    print(f"auk_triton.front_door.launcher: {text}", flush=True)


def front_door_setup(env: dict[str, str], extra: list[str]):
    """(tritonserver argv and env behind the front, the front door) from AUK_* variables."""
    from . import app, request_limits, upstream

    address = settings.address(env)
    public = {kind: settings.port(env, kind) for kind in settings.DEFAULT_PORTS}
    internal = {kind: settings.internal_port(env, kind) for kind in settings.DEFAULT_INTERNAL_PORTS}
    command, server_env = server_command(
        ports={"http": internal["http"], "grpc": internal["grpc"], "metrics": public["metrics"]},
        extra_args=[
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            f"--metrics-address={address}",  # else it follows --http-address
            # The gRPC front renames a stream's triton_grpc_error header to this one; Triton
            # hands it to each of the stream's requests as a parameter.
            f"--grpc-header-forward-pattern=^{config.STATUS_IN_MESSAGE_PARAMETER}$",
            *extra,
        ],
        env=env,
    )
    limits = request_limits.repository_limits(served_repository(None, env), served_config_name(env))
    front = app.FrontDoor(limits, address, public, internal, upstream.UpstreamState(), settings.grpc_bounds(env))
    return command, server_env, front


def describe_choice(command: list[str], env: dict[str, str], server_env: dict[str, str]) -> str:
    """What the launcher chose to serve, and how to ask for the rest."""
    gpu = f"--model-config-name={GPU_CONFIG_NAME}" in command
    device = "a GPU (configs/gpu.pbtxt)" if gpu else "the CPU (config.pbtxt)"
    models = [arg.split("=", 1)[1] for arg in command if arg.startswith("--load-model=")]
    which = ", ".join(models) if models else "every model in the repository"
    if env.get("AUK_CHECKPOINT", "").strip():
        weights = f"the checkpoint {server_env['AUK_CHECKPOINT']}"
    else:
        preset = server_env.get("AUK_PRESET") or config.DEFAULT_PRESET
        weights = f"SYNTHETIC weights of the '{preset}' preset (not real audio; AUK_CHECKPOINT serves a checkpoint"
        weights += ", AUK_PRESET=auk the released geometry)" if preset != "auk" else ")"
    return f"serving {which} on {device} with {weights}; AUK_MODELS picks models, AUK_DEVICE the device"


async def serve(command: list[str], env: dict[str, str], front, restart: bool, drain_s: float) -> int:
    supervisor = Supervisor(command, env, front.state, restart, before_stop=lambda: front.quiesce(drain_s))
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, supervisor.stop, signum)
    await front.start()
    try:
        return await supervisor.run()
    finally:
        if supervisor.stopper is not None:
            supervisor.stopper.cancel()
        await front.stop()


def raise_file_limit(wanted: int) -> None:
    """Let this process hold `wanted` open files (the front door's connections), up to the
    hard limit: a soft limit of 1024 is common, and past it new connections fail."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def main(argv: list[str] | None = None) -> None:
    extra = list(sys.argv[1:] if argv is None else argv)
    try:
        command, env, front = front_door_setup(dict(os.environ), extra)
        restart = settings.restarts_enabled(os.environ)
        drain_s = settings.stop_drain_seconds(settings.exit_timeout_seconds(extra))
    except (TritonNotFound, FileNotFoundError, ValueError) as err:
        sys.exit(f"auk_triton.front_door.launcher: {err}")
    # Each gRPC connection, and each HTTP one with its connection upstream, holds descriptors.
    raise_file_limit(2 * front.grpc_bounds.max_connections + 1024)
    _say(describe_choice(command, dict(os.environ), env))
    _say(" ".join(command))
    sys.exit(asyncio.run(serve(command, env, front, restart, drain_s)))


if __name__ == "__main__":
    main()
