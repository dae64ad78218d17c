"""The pieces of the serving code that need no server: config parameters, request checks, the launcher."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from auk_triton.serving.settings import (
    DecodeSettings,
    RequestError,
    bool_parameter,
    cache_dir_path,
    checkpoint_path,
    config_parameters,
    int_parameter,
    require_finite,
    validate_latents,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def shipped_config(model: str) -> dict:
    """The parameters of a shipped config.pbtxt, in the JSON form Triton hands the model."""
    text = (REPO_ROOT / "model_repository" / model / "config.pbtxt").read_text()
    pairs = re.findall(r'\{ key: "(\w+)", value: \{ string_value: "([^"]*)" \} \}', text)
    return {"parameters": {key: {"string_value": value} for key, value in pairs}}


@pytest.mark.parametrize("model", ["auk_vae_decode", "auk_vae_decode_offline"])
def test_the_shipped_configs_parse_to_the_documented_defaults(model, tmp_path):
    settings = DecodeSettings.from_model_config(shipped_config(model), tmp_path, environ={"AUK_CACHE_DIR": "/c"})
    assert settings.checkpoint == ""
    assert settings.compile_shapes == (32, 128, 256, 512)
    assert settings.tile_frames is None and settings.first_tile_frames is None
    assert settings.first_window_frames() == 32, "a long clip starts with the smallest bucket"
    assert settings.fused_activation is True and settings.channels_last is True
    assert (settings.max_graphs, settings.frame_alignment, settings.max_frames) == (32, 1, 30000)
    assert settings.enable_cuda_graphs is True
    assert settings.cache_dir == Path("/c")


def test_the_cpu_and_gpu_configs_differ_only_in_the_instance_kind():
    for model in ("auk_vae_decode", "auk_vae_decode_offline", "auk_dit"):
        folder = REPO_ROOT / "model_repository" / model

        def body(path: Path) -> str:
            lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
            return "\n".join(lines).replace("KIND_GPU", "KIND_CPU")

        assert body(folder / "config.pbtxt") == body(folder / "configs" / "gpu.pbtxt"), model


def test_auk_checkpoint_overrides_the_parameter_and_relative_parameters_follow_the_model_folder(tmp_path):
    config = {"parameters": {"checkpoint": {"string_value": "weights"}, "tile_frames": {"string_value": "0"}}}
    settings = DecodeSettings.from_model_config(config, tmp_path, environ={})
    assert settings.checkpoint == str(tmp_path / "weights")
    assert settings.tile_frames == 0
    settings = DecodeSettings.from_model_config(config, tmp_path, environ={"AUK_CHECKPOINT": "/ckpt"})
    assert settings.checkpoint == "/ckpt"


def test_a_relative_auk_checkpoint_is_taken_from_the_working_directory_by_every_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    environ = {"AUK_CHECKPOINT": "ckpt"}
    config = {"parameters": {"checkpoint": {"string_value": "weights"}}}
    decoder = DecodeSettings.from_model_config(config, tmp_path / "auk_vae_decode", environ=environ).checkpoint
    dit = checkpoint_path(config_parameters(config), tmp_path / "auk_dit", environ)
    assert decoder == dit == str(Path.cwd() / "ckpt")


def test_a_relative_checkpoint_parameter_is_taken_from_the_model_folder(tmp_path):
    model_dir = tmp_path / "auk_dit"
    assert checkpoint_path({"checkpoint": "weights"}, model_dir, environ={}) == str(model_dir / "weights")
    assert checkpoint_path({"checkpoint": "/weights"}, model_dir, environ={}) == "/weights"
    assert checkpoint_path({"checkpoint": ""}, model_dir, environ={}) == "", "neither set: the synthetic preset"


def test_a_relative_cache_dir_parameter_is_taken_from_the_model_folder_before_auk_cache_dir(tmp_path):
    model_dir = tmp_path / "auk_dit"
    environ = {"AUK_CACHE_DIR": "/elsewhere"}
    assert cache_dir_path({"cache_dir": "cache"}, model_dir, environ) == model_dir / "cache"
    assert cache_dir_path({"cache_dir": ""}, model_dir, environ) == Path("/elsewhere")


@pytest.mark.parametrize(
    "text, value",
    [("1", True), ("true", True), ("Yes", True), ("ON", True), ("0", False), ("false", False), ("no", False),
     ("Off", False), ("", True)],
)
def test_every_model_reads_the_same_boolean_spellings(text, value, tmp_path):
    params = {"enable_cuda_graphs": text}
    assert bool_parameter(params, "enable_cuda_graphs", True) is value  # as auk_dit reads it
    config = {"parameters": {"enable_cuda_graphs": {"string_value": text}}}
    assert DecodeSettings.from_model_config(config, tmp_path, environ={}).enable_cuda_graphs is value


def test_a_bad_parameter_value_fails_naming_the_parameter_and_the_value():
    with pytest.raises(ValueError, match="max_steps is 'many'; it must be an integer"):
        int_parameter({"max_steps": "many"}, "max_steps", 1000, 1)
    with pytest.raises(ValueError, match="max_graphs is -1; it must be at least 0"):
        int_parameter({"max_graphs": "-1"}, "max_graphs", 4, 0)
    with pytest.raises(ValueError, match="enable_cuda_graphs is 'Maybe'; use true or false"):
        bool_parameter({"enable_cuda_graphs": "Maybe"}, "enable_cuda_graphs", True)


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("compile_shapes", "128,x", "comma-separated"),
        ("compile_shapes", "0,128", "positive"),
        ("tile_frames", "big", "must be an integer"),
        ("max_frames", "0", "at least 1"),
        ("enable_cuda_graphs", "maybe", "true or false"),
        ("fused_activation", "fast", "true or false"),
        ("channels_last", "yes please", "true or false"),
        ("first_tile_frames", "-1", "at least 0"),
    ],
)
def test_a_bad_config_parameter_fails_the_load_naming_it(name, value, words, tmp_path):
    with pytest.raises(ValueError, match=f"{name}.*{words}"):
        DecodeSettings.from_model_config({"parameters": {name: {"string_value": value}}}, tmp_path, environ={})


@pytest.mark.parametrize(
    "shapes, first_tile, window",
    [("256,512", "", 256), ("128,512", "64", 64), ("128,512", "0", None), ("", "", None)],
)
def test_the_first_window_is_the_smallest_bucket_unless_configured(shapes, first_tile, window, tmp_path):
    params = {"compile_shapes": {"string_value": shapes}, "first_tile_frames": {"string_value": first_tile}}
    settings = DecodeSettings.from_model_config({"parameters": params}, tmp_path, environ={})
    assert settings.first_window_frames() == window


def test_validate_latents_accepts_a_good_clip_and_names_each_problem():
    good = np.zeros((5, 64), np.float32)
    assert validate_latents(good, 64, 10, 50.0) is not None
    cases = [
        (None, "no LATENTS"),
        (good.astype(np.float16), "float16; this model takes FP32"),
        (np.zeros((5, 64, 1), np.float32), "this model takes one clip as \\[frames, 64\\]"),
        (np.zeros((5, 32), np.float32), "LATENTS has 32 channels per frame; this model decodes 64"),
        (np.zeros((0, 64), np.float32), "zero frames"),
        (np.zeros((11, 64), np.float32), "11 frames, more than this model's max_frames of 10"),
    ]
    for array, message in cases:
        with pytest.raises(RequestError, match=message):
            validate_latents(array, 64, 10, 50.0)
    bad = good.copy()
    bad[2, 1], bad[4, 0] = np.nan, np.inf
    with pytest.raises(RequestError, match="1 NaN and 1 infinite values \\(the first in frame 2\\)"):
        validate_latents(bad, 64, 10, 50.0)


def test_the_finiteness_check_can_be_left_for_later_and_then_names_the_same_values():
    bad = np.zeros((5, 64), np.float32)
    bad[2, 1], bad[4, 0] = np.nan, np.inf
    assert validate_latents(bad, 64, 10, 50.0, check_finite=False) is not None
    with pytest.raises(RequestError, match="1 NaN and 1 infinite values \\(the first in frame 2\\)"):
        require_finite(bad)
    require_finite(np.zeros((5, 64), np.float32))


def test_the_launcher_builds_its_backend_directory_and_puts_this_python_first_on_path(tmp_path):
    server = pytest.importorskip("auk_triton.server")
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
    server = pytest.importorskip("auk_triton.server")
    with pytest.raises(ValueError, match="AUK_GRPC_PORT is '80o1'; it must be a port number"):
        server.server_command(
            REPO_ROOT / "model_repository",
            env={"PATH": "/usr/bin", "AUK_GRPC_PORT": "80o1", "AUK_CACHE_DIR": str(tmp_path), "AUK_DEVICE": "cpu"},
        )


def test_the_launcher_hands_the_models_a_relative_auk_checkpoint_as_an_absolute_path(tmp_path, monkeypatch):
    server = pytest.importorskip("auk_triton.server")
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
    server = pytest.importorskip("auk_triton.server")
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
