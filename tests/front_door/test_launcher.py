"""The launcher behind `make serve`: the tritonserver command line and environment it builds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_launcher_builds_its_backend_directory_and_puts_this_python_first_on_path(tmp_path):
    server = pytest.importorskip("auk_triton.front_door.launcher")
    try:
        argv, env = server.server_command(
            REPO_ROOT / "model_repository",
            extra_args=["--log-verbose=1"],
            env={"PATH": "/usr/bin", "AUK_GRPC_PORT": "9101", "AUK_CACHE_DIR": str(tmp_path), "AUK_DEVICE": "gpu"},
        )
    except server.TritonNotFound as err:
        pytest.skip(f"tritonserver is not available: {err}")
    assert Path(argv[0]).name == "tritonserver" and os.access(argv[0], os.X_OK)
    assert "--http-port=8000" in argv and "--grpc-port=9101" in argv and "--metrics-port=8002" in argv
    assert "--model-config-name=gpu" in argv and argv[-1] == "--log-verbose=1"
    backend = Path(next(a for a in argv if a.startswith("--backend-directory=")).split("=", 1)[1]) / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py", "triton_python_backend_stub"):
        assert (backend / name).exists(), name
    assert f"/{sys.version_info.major}.{sys.version_info.minor}/" in os.readlink(backend / "triton_python_backend_stub")
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["AUK_CACHE_DIR"] == str(tmp_path)
    assert env["AUK_SERVER_HTTP_PORT"] == "8000", "where the models' graph builders ask for READY"


def test_a_port_that_is_not_a_number_fails_naming_its_variable(tmp_path):
    server = pytest.importorskip("auk_triton.front_door.launcher")
    with pytest.raises(ValueError, match="AUK_GRPC_PORT is '80o1'; it must be a port number"):
        server.server_command(
            REPO_ROOT / "model_repository",
            env={"PATH": "/usr/bin", "AUK_GRPC_PORT": "80o1", "AUK_CACHE_DIR": str(tmp_path), "AUK_DEVICE": "cpu"},
        )


def test_the_launcher_hands_the_models_a_relative_auk_checkpoint_as_an_absolute_path(tmp_path, monkeypatch):
    server = pytest.importorskip("auk_triton.front_door.launcher")
    monkeypatch.chdir(tmp_path)
    try:
        _, env = server.server_command(
            REPO_ROOT / "model_repository",
            env={"PATH": "/usr/bin", "AUK_CHECKPOINT": "ckpt", "AUK_CACHE_DIR": str(tmp_path), "AUK_DEVICE": "cpu"},
        )
    except server.TritonNotFound as err:
        pytest.skip(f"tritonserver is not available: {err}")
    assert env["AUK_CHECKPOINT"] == str(Path.cwd() / "ckpt")


@pytest.mark.parametrize(
    "chosen, loads",
    [
        ("auk_vae_decode, auk_vae_decode_offline", ["auk_vae_decode", "auk_vae_decode_offline"]),
        # The offline model forwards every request to auk_vae_decode: named alone, it brings it.
        ("auk_vae_decode_offline", ["auk_vae_decode", "auk_vae_decode_offline"]),
        ("auk_vae_decode_offline,auk_vae_decode", ["auk_vae_decode", "auk_vae_decode_offline"]),
        ("auk_dit", ["auk_dit"]),
        ("all", None),
        ("", None),
    ],
)
def test_auk_models_chooses_which_models_the_server_loads(chosen, loads, tmp_path):
    server = pytest.importorskip("auk_triton.front_door.launcher")
    try:
        argv, _ = server.server_command(
            REPO_ROOT / "model_repository",
            env={"PATH": "/usr/bin", "AUK_CACHE_DIR": str(tmp_path), "AUK_DEVICE": "cpu", "AUK_MODELS": chosen},
        )
    except server.TritonNotFound as err:
        pytest.skip(f"tritonserver is not available: {err}")
    loaded = [a.split("=", 1)[1] for a in argv if a.startswith("--load-model=")]
    if loads is None:
        assert loaded == [] and "--model-control-mode=explicit" not in argv
    else:
        assert loaded == loads and "--model-control-mode=explicit" in argv


def cpu_server_argv(tmp_path) -> list[str]:
    """tritonserver's argv for the project's repository on the CPU configs (skips without tritonserver)."""
    server = pytest.importorskip("auk_triton.front_door.launcher")
    try:
        argv, _ = server.server_command(REPO_ROOT / "model_repository", env={"PATH": "/usr/bin", "AUK_CACHE_DIR": str(tmp_path), "AUK_DEVICE": "cpu"})
    except server.TritonNotFound as err:
        pytest.skip(f"tritonserver is not available: {err}")
    return argv


def test_the_python_backend_s_shared_memory_pool_is_sized_for_the_largest_legitimate_tensor(tmp_path):
    from auk_triton.front_door import settings
    from auk_triton.serving import config

    argv = cpu_server_argv(tmp_path)
    offline_10_minutes = config.DEFAULT_MAX_FRAMES * 64 * 4 + config.DEFAULT_MAX_FRAMES * 480 * 4  # latents + float32 waveform
    assert settings.SHM_DEFAULT_BYTES >= offline_10_minutes
    assert f"--backend-config=python,shm-default-byte-size={settings.SHM_DEFAULT_BYTES}" in argv
    assert f"--backend-config=python,shm-growth-byte-size={settings.SHM_GROWTH_BYTES}" in argv


def test_tritonserver_takes_the_model_configs_as_written_without_a_stub_to_complete_them(tmp_path):
    assert "--disable-auto-complete-config" in cpu_server_argv(tmp_path)


@pytest.mark.parametrize("address", [None, "0.0.0.0"])
def test_behind_the_front_door_tritonserver_listens_on_loopback_and_the_front_on_loopback_unless_asked(
        tmp_path, address):
    server = pytest.importorskip("auk_triton.front_door.launcher")
    env = {"PATH": "/usr/bin", "AUK_CACHE_DIR": str(tmp_path), "AUK_DEVICE": "cpu", "AUK_HTTP_PORT": "9100",
           "AUK_INTERNAL_GRPC_PORT": "9111", "AUK_MODEL_REPOSITORY": str(REPO_ROOT / "model_repository")}
    if address:
        env["AUK_ADDRESS"] = address
    public = address or "127.0.0.1"
    try:
        argv, _, front = server.front_door_setup(env, ["--exit-timeout-secs=60"])
    except server.TritonNotFound as err:
        pytest.skip(f"tritonserver is not available: {err}")
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", f"--metrics-address={public}"} <= set(argv)
    assert {"--http-port=18000", "--grpc-port=9111", "--metrics-port=8002"} <= set(argv)
    assert argv[-1] == "--exit-timeout-secs=60"
    assert (front.address, dict(front.ports)) == (public, {"http": 9100, "grpc": 8001, "metrics": 8002})
    assert front.limits["auk_vae_decode"].inputs["LATENTS"].bounds == (30000, 64)


def test_a_cpu_with_nothing_set_serves_the_small_preset_and_says_how_to_ask_for_the_released_one(tmp_path):
    server = pytest.importorskip("auk_triton.front_door.launcher")
    env = {"PATH": "/usr/bin", "AUK_CACHE_DIR": str(tmp_path), "AUK_DEVICE": "cpu"}
    try:
        argv, server_env = server.server_command(REPO_ROOT / "model_repository", env=env)
        chosen = server.describe_choice(argv, env, server_env)
        _, asked_env = server.server_command(REPO_ROOT / "model_repository", env=dict(env, AUK_PRESET="auk"))
    except server.TritonNotFound as err:
        pytest.skip(f"tritonserver is not available: {err}")
    assert server_env["AUK_PRESET"] == "small" and asked_env["AUK_PRESET"] == "auk"
    assert "SYNTHETIC weights of the 'small' preset" in chosen and "AUK_PRESET=auk" in chosen
    assert "on the CPU" in chosen and "every model in the repository" in chosen


def test_the_front_door_s_process_imports_no_torch_and_starts_in_under_a_second():
    """The launcher and both fronts import without torch (or the codec), so the front door
    is up long before the models."""
    script = (
        "import sys, time; began = time.perf_counter()\n"
        "import auk_triton.front_door.launcher, auk_triton.front_door.app\n"
        "print(time.perf_counter() - began, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')"
        " or m.startswith(('auk_triton.codec', 'auk_triton.diffusion'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    seconds, modules = done.stdout.split(" ", 1)
    assert modules.strip() == "[]", modules
    assert float(seconds) < 1.0, seconds


def test_a_tritonserver_of_its_own_runs_with_its_own_backends(tmp_path):
    server = pytest.importorskip("auk_triton.front_door.launcher")
    argv, _ = server.server_command(
        REPO_ROOT / "model_repository",
        env={"PATH": "/usr/bin", "AUK_CACHE_DIR": str(tmp_path), "AUK_DEVICE": "cpu",
             "AUK_TRITONSERVER": "/opt/tritonserver/bin/tritonserver"},
    )
    assert argv[0] == "/opt/tritonserver/bin/tritonserver"
    assert not any(a.startswith("--backend-directory=") for a in argv)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, exited and not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_what_a_dead_tritonserver_left_in_its_process_group_is_killed():
    """A process group leader killed from outside leaves its child running, as a tritonserver
    cut short leaves its Python backend stubs; reap kills the child."""
    import signal

    server = pytest.importorskip("auk_triton.front_door.launcher")
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = int(leader.stdout.readline())
    leader.send_signal(signal.SIGKILL)
    leader.wait()
    assert _running(child), "the child should outlive its leader"
    server.reap(leader.pid)
    deadline = time.monotonic() + 10
    while _running(child):
        assert time.monotonic() < deadline, "the child still runs"
        time.sleep(0.05)
    server.reap(leader.pid)  # nothing left: no error


def test_a_package_on_pythonpath_reaches_the_models_as_it_reaches_the_launcher(tmp_path):
    """Triton's Python backend starts its interpreter without reading PYTHONPATH; each model.py puts
    its entries first. A stand-in auk_triton there, whose encode model refuses to start with a
    marker, is the one the real stub loads, with the server started from another folder."""
    from triton_harness import closed_port

    server = pytest.importorskip("auk_triton.front_door.launcher")
    serving = tmp_path / "on_pythonpath" / "auk_triton" / "serving"
    serving.mkdir(parents=True)
    (serving.parent / "__init__.py").write_text("")
    (serving / "__init__.py").write_text("")
    (serving / "encode_model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('the stand-in on PYTHONPATH was loaded')\n")
    env = dict(os.environ, PYTHONPATH=str(serving.parents[1]), AUK_CACHE_DIR=str(tmp_path / "cache"),
               AUK_DEVICE="cpu", AUK_MODELS="auk_vae_encode")
    try:
        argv, env = server.server_command(
            REPO_ROOT / "model_repository",
            ports={kind: closed_port() for kind in ("http", "grpc", "metrics")},
            extra_args=["--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"],
            env=env,
        )
    except server.TritonNotFound as err:
        pytest.skip(f"tritonserver is not available: {err}")
    log_path = tmp_path / "tritonserver.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + 180
    try:  # the stand-in fails to load, so tritonserver exits; the real model would load and serve
        while process.poll() is None and "successfully loaded" not in log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, "tritonserver neither exited nor loaded the model"
            time.sleep(0.1)
    finally:
        server.reap(process.pid)
        process.wait()
    assert "the stand-in on PYTHONPATH was loaded" in log_path.read_text(errors="replace")
