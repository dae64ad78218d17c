"""The serving settings: config parameters and AUK_* variables, each with its one default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from auk_triton.codec import DEFAULT_COMPILE_SHAPES
from auk_triton.diffusion import RunShape
from auk_triton.serving.config import (
    DecodeSettings,
    DiTSettings,
    EncodeSettings,
    OfflineSettings,
    PipelineSettings,
    bool_parameter,
    cache_dir_path,
    checkpoint_path,
    config_parameters,
    environment_cache_dir,
    forwarded_model,
    int_parameter,
)

REPO_ROOT = Path(__file__).resolve().parents[2]



def shipped_config(model: str, name: str = "config.pbtxt") -> dict:
    """The parameters of a shipped config (`name`: config.pbtxt or configs/gpu.pbtxt), in the
    JSON form Triton hands the model."""
    text = (REPO_ROOT / "model_repository" / model / name).read_text()
    pairs = re.findall(r'\{ key: "(\w+)", value: \{ string_value: "([^"]*)" \} \}', text)
    return {"parameters": {key: {"string_value": value} for key, value in pairs}}


def test_the_shipped_decode_config_parses_to_the_documented_defaults(tmp_path):
    settings = DecodeSettings.from_model_config(shipped_config("auk_vae_decode"), tmp_path, environ={"AUK_CACHE_DIR": "/c"})
    assert settings.checkpoint == ""
    assert settings.buckets() == (32, 128, 256, 512)
    assert settings.tile_frames is None and settings.first_tile_frames is None
    assert settings.first_window_frames() == 32, "a long clip starts with the smallest bucket"
    assert settings.first_tile_under_load is True, "the short first window under load too"
    assert settings.fused_activation is True and settings.channels_last is True
    assert (settings.max_graphs, settings.frame_alignment, settings.max_frames) == (32, 1, 30000)
    assert settings.enable_cuda_graphs is True
    assert settings.precision is None, "the device's default precision (fp16 on a GPU)"
    assert settings.cache_dir == Path("/c")
    assert (settings.max_active_requests, settings.max_queued_requests) == (128, 64)


def test_the_shipped_offline_config_forwards_to_the_decode_model_with_its_own_bounds():
    config = shipped_config("auk_vae_decode_offline")
    assert set(config["parameters"]) == {"decode_model", "max_active_requests", "max_queued_requests"}
    assert all(value == {"string_value": ""} for value in config["parameters"].values()), "defaults from config.py"
    # Each forwarded request holds its waveform on the host until its response is out.
    assert OfflineSettings.from_model_config(config) == OfflineSettings("auk_vae_decode", 16, 64)
    assert forwarded_model(config) == "auk_vae_decode"
    assert forwarded_model(shipped_config("auk_vae_decode")) is None
    named = {"parameters": {"decode_model": {"string_value": "my_decoder"}}}
    assert forwarded_model(named) == "my_decoder"
    with pytest.raises(ValueError, match="max_queued_requests is -1; it must be at least 0"):
        OfflineSettings.from_model_config({"parameters": {"max_queued_requests": {"string_value": "-1"}}})


@pytest.mark.parametrize("settings_class", [DecodeSettings, DiTSettings])
def test_the_artifacts_folder_is_auk_artifacts_dir_else_the_parameter_else_artifacts_in_the_cache(
        settings_class, tmp_path):
    def artifacts(parameter: str, environ: dict) -> Path:
        config = {"parameters": {"artifacts_dir": {"string_value": parameter}}}
        return settings_class.from_model_config(config, tmp_path, environ=environ).artifacts_dir

    assert artifacts("", {"AUK_CACHE_DIR": "/c"}) == Path("/c/artifacts")
    assert artifacts("built", {"AUK_CACHE_DIR": "/c"}) == tmp_path / "built", "relative to the model's folder"
    assert artifacts("/opt/a", {"AUK_CACHE_DIR": "/c"}) == Path("/opt/a")
    assert artifacts("/opt/a", {"AUK_ARTIFACTS_DIR": "/mnt/b"}) == Path("/mnt/b")


@pytest.mark.parametrize("value", ["fp16", "tf32"])
def test_the_precision_parameter_takes_fp16_or_tf32(value, tmp_path):
    config = {"parameters": {"precision": {"string_value": value}}}
    assert DecodeSettings.from_model_config(config, tmp_path, environ={}).precision == value


def test_the_cpu_and_gpu_configs_differ_only_in_the_instance_kind():
    for model in ("auk_vae_decode", "auk_dit", "auk_vae_encode"):
        folder = REPO_ROOT / "model_repository" / model

        def body(path: Path) -> str:
            lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
            return "\n".join(lines).replace("KIND_GPU", "KIND_CPU")

        assert body(folder / "config.pbtxt") == body(folder / "configs" / "gpu.pbtxt"), model


def test_the_offline_model_has_one_config_on_the_cpu_whatever_the_device():
    """It holds no GPU: Triton serves its config.pbtxt under --model-config-name=gpu too."""
    folder = REPO_ROOT / "model_repository" / "auk_vae_decode_offline"
    assert not (folder / "configs").exists()
    assert "instance_group [ { kind: KIND_CPU, count: 1 } ]" in (folder / "config.pbtxt").read_text()


def test_the_shipped_encoder_config_parses_to_the_documented_defaults(tmp_path):
    settings = EncodeSettings.from_model_config(shipped_config("auk_vae_encode"), tmp_path, environ={"AUK_CACHE_DIR": "/c"})
    assert settings == EncodeSettings(cache_dir=Path("/c"))
    assert (settings.checkpoint, settings.max_frames, settings.max_graphs) == ("", 30000, 8)
    assert settings.enable_cuda_graphs is False, "eager unless configured (docs/serving.md, auk_vae_encode)"
    config = {"parameters": {"max_frames": {"string_value": "0"}}}
    with pytest.raises(ValueError, match="max_frames is 0; it must be at least 1"):
        EncodeSettings.from_model_config(config, tmp_path, environ={})


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
        ("first_tile_under_load", "sometimes", "true or false"),
        ("precision", "bf16", "use one of fp16, tf32"),
    ],
)
def test_a_bad_config_parameter_fails_the_load_naming_it(name, value, words, tmp_path):
    with pytest.raises(ValueError, match=f"{name}.*{words}"):
        DecodeSettings.from_model_config({"parameters": {name: {"string_value": value}}}, tmp_path, environ={})


@pytest.mark.parametrize(
    "shapes, first_tile, window",
    [("256,512", "", 256), ("128,512", "64", 64), ("128,512", "0", None), ("none", "", None), ("", "", 32)],
)
def test_the_first_window_is_the_smallest_bucket_unless_configured(shapes, first_tile, window, tmp_path):
    params = {"compile_shapes": {"string_value": shapes}, "first_tile_frames": {"string_value": first_tile}}
    settings = DecodeSettings.from_model_config({"parameters": params}, tmp_path, environ={})
    assert settings.first_window_frames() == window


def test_a_config_that_leaves_every_parameter_out_gets_the_documented_defaults(tmp_path):
    decode = DecodeSettings.from_model_config({"parameters": {}}, tmp_path, environ={})
    assert decode.buckets() == DEFAULT_COMPILE_SHAPES == (32, 128, 256, 512)
    assert decode.first_window_frames() == 32 and decode.tile_frames is None
    assert (decode.max_graphs, decode.max_frames, decode.fused_activation, decode.channels_last) == (32, 30000, True, True)
    assert (decode.max_active_requests, decode.max_queued_requests) == (128, 64)
    dit = DiTSettings.from_model_config({}, tmp_path, environ={})
    assert (dit.dtype, dit.max_steps, dit.max_frames, dit.max_graphs, dit.enable_cuda_graphs) == (
        "auto", 1000, 30000, 16, True)
    assert dit.max_batch_requests == 16


def test_the_launcher_and_the_models_take_the_same_cache_folder(tmp_path):
    assert environment_cache_dir({}) == DecodeSettings.from_model_config({}, tmp_path, environ={}).cache_dir
    assert environment_cache_dir({"AUK_CACHE_DIR": "/c"}) == Path("/c")
    assert DiTSettings.from_model_config({}, tmp_path, environ={"AUK_CACHE_DIR": "/c"}).cache_dir == Path("/c")


def test_a_bad_dit_dtype_fails_the_load_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="dtype is 'half'; use one of auto, bfloat16, float32"):
        DiTSettings.from_model_config({"parameters": {"dtype": {"string_value": "half"}}}, tmp_path, environ={})


def test_auk_dit_buckets_come_from_its_config_and_none_turns_them_off(tmp_path):
    dit = DiTSettings.from_model_config(shipped_config("auk_dit"), tmp_path, environ={})
    buckets = dit.shape_buckets()
    assert (buckets.text, buckets.frames, buckets.ref) == ((64, 256, 512), (256, 512, 1024, 2048), (512, 2048))
    assert (buckets.max_tokens, buckets.max_requests, dit.compile_step) == (18432, 16, True)
    assert buckets.shape(64, 500) == RunShape(64, 512, 0)  # 10 s of audio and 64 tokens
    assert buckets.requests(RunShape(64, 512, 0), guided=True) == 16, "16 guided 10 s requests share a run"
    off = {"parameters": {"frame_buckets": {"string_value": "none"}}}
    assert DiTSettings.from_model_config(off, tmp_path, environ={}).shape_buckets() is None
    custom = {"parameters": {"text_buckets": {"string_value": "128, 32"}, "ref_buckets": {"string_value": "none"},
                             "max_batch_requests": {"string_value": "4"}}}
    buckets = DiTSettings.from_model_config(custom, tmp_path, environ={}).shape_buckets()
    assert buckets.text == (32, 128) and buckets.ref == () and buckets.max_requests == 4
    assert buckets.shape(10, 10, 5) is None, "a reference has no bucket: the run falls back"
    with pytest.raises(ValueError, match="text_buckets is '64,x'"):
        DiTSettings.from_model_config({"parameters": {"text_buckets": {"string_value": "64,x"}}}, tmp_path, environ={})


def test_auk_dits_fp8_linears_are_off_as_shipped_and_on_when_asked(tmp_path):
    for name in ("config.pbtxt", "configs/gpu.pbtxt"):
        assert DiTSettings.from_model_config(shipped_config("auk_dit", name), tmp_path, environ={}).fp8_linears is False
    on = {"parameters": {"fp8_linears": {"string_value": "true"}}}
    assert DiTSettings.from_model_config(on, tmp_path, environ={}).fp8_linears is True
    with pytest.raises(ValueError, match="fp8_linears is 'e4m3'; use true or false"):
        DiTSettings.from_model_config({"parameters": {"fp8_linears": {"string_value": "e4m3"}}}, tmp_path, environ={})


@pytest.mark.parametrize("name, shipped", [
    ("decode_yields_to_dit", False),  # the decoder does not yield to the DiT
    ("decode_look_ahead_during_dit", True),  # it looks ahead while the DiT works
    ("first_tile_at_saturation", False),  # it drops the short first window at saturation
])
def test_auk_pipelines_own_switches_are_as_documented_as_shipped_and_turn_when_asked(name, shipped):
    for config in ("config.pbtxt", "configs/gpu.pbtxt"):
        assert getattr(PipelineSettings.from_model_config(shipped_config("auk_pipeline", config)), name) is shipped
    turned = {"parameters": {name: {"string_value": str(not shipped).lower()}}}
    assert getattr(PipelineSettings.from_model_config(turned), name) is (not shipped)
    with pytest.raises(ValueError, match=f"{name} is 'sometimes'; use true or false"):
        PipelineSettings.from_model_config({"parameters": {name: {"string_value": "sometimes"}}})
