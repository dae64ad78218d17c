"""The launcher behind `make serve`: the tritonserver command line and environment it builds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

def test_the_launcher_builds_its_backend_directory_and_puts_this_python_first_on_path(tmp_path):
    server = pytest.importorskip("auk_triton.serving.launcher")
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


def test_a_port_that_is_not_a_number_fails_naming_its_variable(tmp_path):
    server = pytest.importorskip("auk_triton.serving.launcher")
    with pytest.raises(ValueError, match="AUK_GRPC_PORT is '80o1'; it must be a port number"):
        server.server_command(
            REPO_ROOT / "model_repository",
            env={"PATH": "/usr/bin", "AUK_GRPC_PORT": "80o1", "AUK_CACHE_DIR": str(tmp_path), "AUK_DEVICE": "cpu"},
        )


def test_the_launcher_hands_the_models_a_relative_auk_checkpoint_as_an_absolute_path(tmp_path, monkeypatch):
    server = pytest.importorskip("auk_triton.serving.launcher")
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
        ("all", None),
        ("", None),
    ],
)
def test_auk_models_chooses_which_models_the_server_loads(chosen, loads, tmp_path):
    server = pytest.importorskip("auk_triton.serving.launcher")
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
