"""A broken or mismatched checkpoint fails the model load with a message that says what is wrong.

One short-lived server in explicit model-control mode, its AUK_CHECKPOINT
pointing at a directory each test fills before asking the server to load the
decoder (auk_vae_decode: the offline model reads no checkpoint) or auk_dit; the
last test loads a good checkpoint, so the real loading path also succeeds there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from triton_harness import REPO_ROOT
from safetensors.torch import load_file, save_file

MODEL = "auk_vae_decode"
DIT_MODEL = "auk_dit"


@pytest.fixture(scope="module")
def explicit_server(launch_triton, tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("checkpoint_under_test")
    server = launch_triton("explicit", checkpoint, models=(MODEL,), extra_args=["--model-control-mode=explicit"])
    # Explicit mode reads a model's folder when asked to load it: auk_dit can join after the start.
    shutil.copytree(REPO_ROOT / "model_repository" / DIT_MODEL, server.model_repository / DIT_MODEL,
                    ignore=shutil.ignore_patterns("__pycache__"))
    yield server
    server.stop()


def place_checkpoint(server, source: Path, mutate) -> None:
    """Put a copy of `source`, changed by `mutate(dir)`, where the server looks."""
    target = server.checkpoint_dir
    shutil.rmtree(target)
    shutil.copytree(source, target)
    mutate(target)


def load_error(server, source: Path, mutate, model: str = MODEL) -> str:
    """Put a copy of `source`, changed by `mutate(dir)`, where the server looks; return `model`'s load error."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    place_checkpoint(server, source, mutate)
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=300)
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.load_model(model)
        assert not client.is_model_ready(model)
        assert client.is_server_live()
        return str(caught.value)
    finally:
        client.close()


def test_a_checkpoint_with_a_stray_weight_fails_the_load_naming_the_key(explicit_server, small_checkpoint):
    def add_stray_key(directory: Path) -> None:
        weights = load_file(str(directory / "vae.safetensors"))
        weights["decoder.stray.weight"] = weights[next(iter(weights))].clone()
        save_file(weights, str(directory / "vae.safetensors"))

    message = load_error(explicit_server, small_checkpoint, add_stray_key)
    assert "unexpected keys" in message and "decoder.stray.weight" in message, message
    assert "cannot load the AuK checkpoint" in message, message


def test_a_config_that_does_not_match_its_codec_fails_the_load_naming_the_field(explicit_server, small_checkpoint):
    def change_latent_dim(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        config["vae"]["latent_dim"] = 32
        (directory / "config.json").write_text(json.dumps(config))

    message = load_error(explicit_server, small_checkpoint, change_latent_dim)
    assert "vae.latent_dim is 32" in message, message


def test_a_checkpoint_without_its_weights_fails_the_load_naming_the_file(explicit_server, small_checkpoint):
    message = load_error(explicit_server, small_checkpoint, lambda d: (d / "vae.safetensors").unlink())
    assert "has no vae.safetensors" in message, message


def add_dit_weights(directory: Path, **dims) -> None:
    """Give a codec checkpoint freshly initialised DiT weights: the small preset's sizes, changed by `dims`."""
    from auk_triton.diffusion.transformer import CHECKPOINT_PREFIX, CONFIG_FILE, WEIGHTS_FILE, build_transformer
    from auk_triton.diffusion.synthetic import PRESETS

    config = json.loads((directory / CONFIG_FILE).read_text())
    config["dit"] = {**PRESETS["small"], **dims}
    state = build_transformer(config).state_dict()
    save_file({CHECKPOINT_PREFIX + name: t.contiguous() for name, t in state.items()}, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(config))


def test_a_dit_whose_text_width_is_not_the_configs_fails_the_load_naming_both(explicit_server, small_checkpoint):
    message = load_error(explicit_server, small_checkpoint, lambda d: add_dit_weights(d, text_hidden_dim=1024),
                         model=DIT_MODEL)
    assert "PROMPT_EMBEDS dims [-1, 2048]" in message and "text width (dit.text_hidden_dim) is 1024" in message, message


def test_a_flash_dit_serves_a_num_steps_above_max_steps_as_its_fixed_recipe(explicit_server, small_checkpoint):
    import tritonclient.http as httpclient
    from auk_client.pipeline import generate_latents, random_prompt_embeds

    from auk_triton.diffusion.synthetic import write_synthetic_dit_checkpoint

    place_checkpoint(explicit_server, small_checkpoint,
                     lambda d: write_synthetic_dit_checkpoint(d, preset="small", seed=0, variant="flash"))
    client = httpclient.InferenceServerClient(explicit_server.http_url, network_timeout=300)
    try:
        client.load_model(DIT_MODEL)
        embeds = random_prompt_embeds(3, seed=0)
        # The shipped max_steps is 1000; flash ignores NUM_STEPS, so 1001 is not refused.
        latents = generate_latents(embeds, 0.1, 5, url=explicit_server.grpc_url, num_steps=1001)
        np.testing.assert_array_equal(latents, generate_latents(embeds, 0.1, 5, url=explicit_server.grpc_url))
    finally:
        client.unload_model(DIT_MODEL)
        client.close()


def test_a_decode_config_that_is_not_decoupled_fails_the_load_saying_so(explicit_server):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    name = "auk_vae_decode_one_response"
    folder = explicit_server.model_repository / name
    shutil.copytree(explicit_server.model_repository / MODEL, folder, ignore=shutil.ignore_patterns("__pycache__"))
    config = folder / "config.pbtxt"
    text = config.read_text().replace(f'name: "{MODEL}"', f'name: "{name}"')
    config.write_text(text.replace("model_transaction_policy { decoupled: true }\n", ""))
    client = httpclient.InferenceServerClient(explicit_server.http_url, network_timeout=300)
    try:
        with pytest.raises(InferenceServerException, match="must set model_transaction_policy") as caught:
            client.load_model(name)
        assert "auk_vae_decode_offline" in str(caught.value), "it names the model for one response per request"
        assert not client.is_model_ready(name)
    finally:
        client.close()


def test_the_same_server_then_loads_a_good_checkpoint(explicit_server, small_checkpoint):
    import tritonclient.http as httpclient

    shutil.rmtree(explicit_server.checkpoint_dir)
    shutil.copytree(small_checkpoint, explicit_server.checkpoint_dir)
    client = httpclient.InferenceServerClient(explicit_server.http_url, network_timeout=300)
    try:
        client.load_model(MODEL)
        assert client.is_model_ready(MODEL)
    finally:
        client.close()
