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

    python -m auk_triton.serving.launcher [extra tritonserver arguments]

It reads the AUK_* variables through `config` (ports, model repository, cache
folder, device, models to load; the README lists them with their defaults).
`AUK_DEVICE=gpu` (or `auto` with CUDA present) serves the models'
`configs/gpu.pbtxt` through `--model-config-name`. A relative `AUK_CHECKPOINT`
is made absolute here, so it means the directory the server starts in.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from . import config

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


def _wants_gpu(device: str) -> bool:
    if device != "auto":
        return device == "gpu"
    import torch

    return torch.cuda.is_available()


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
    for kind in config.DEFAULT_PORTS:
        if kind not in ports:
            ports[kind] = config.port(env, kind)
    if model_repository:
        repository = Path(model_repository).absolute()
    else:
        repository = config.model_repository(env, PROJECT_ROOT)
    env["AUK_CACHE_DIR"] = str(config.environment_cache_dir(env))  # the models resolve it alike
    # A relative AUK_CHECKPOINT means the directory the server is started from, for every model.
    if env.get("AUK_CHECKPOINT", "").strip():
        env["AUK_CHECKPOINT"] = os.path.abspath(env["AUK_CHECKPOINT"].strip())
    argv = [
        str(tritonserver_executable()),
        f"--model-repository={repository}",
        f"--backend-directory={build_backend_directory(Path(env['AUK_CACHE_DIR']))}",
        f"--http-port={ports['http']}",
        f"--grpc-port={ports['grpc']}",
        f"--metrics-port={ports['metrics']}",
    ]
    if _wants_gpu(config.device_choice(env)):
        argv.append(f"--model-config-name={GPU_CONFIG_NAME}")
    # AUK_MODELS picks the models to load; an ensemble brings up its steps itself.
    models = config.models_to_load(env)
    if models:
        argv.append("--model-control-mode=explicit")
        argv.extend(f"--load-model={name}" for name in models)
    argv.extend(extra_args)
    # The stub resolves `python3` on PATH to find its packages: this interpreter's first.
    # sys.executable is not resolved: a venv's python is a link whose folder is the venv's bin.
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir])
    return argv, env


def main(argv: list[str] | None = None) -> None:
    extra = list(sys.argv[1:] if argv is None else argv)
    try:
        command, env = server_command(extra_args=extra)
    except (TritonNotFound, FileNotFoundError, ValueError) as err:
        sys.exit(f"auk_triton.serving.launcher: {err}")
    print("auk_triton.serving.launcher:", " ".join(command), flush=True)
    os.execve(command[0], command, env)


if __name__ == "__main__":
    main()
