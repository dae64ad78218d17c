"""A broken or mismatched checkpoint fails the model load with a message that says what is wrong.

One short-lived server in explicit model-control mode, its AUK_CHECKPOINT
pointing at a directory each test fills before asking the server to load the
offline model; the last test loads a good checkpoint, so the real loading path
also succeeds there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

MODEL = "auk_vae_decode_offline"


@pytest.fixture(scope="module")
def explicit_server(launch_triton, tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("checkpoint_under_test")
    server = launch_triton("explicit", checkpoint, models=(MODEL,), extra_args=["--model-control-mode=explicit"])
    yield server
    server.stop()


def load_error(server, source: Path, mutate) -> str:
    """Put a copy of `source`, changed by `mutate(dir)`, where the server looks; return the load error."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    target = server.checkpoint_dir
    shutil.rmtree(target)
    shutil.copytree(source, target)
    mutate(target)
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=300)
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.load_model(MODEL)
        assert not client.is_model_ready(MODEL)
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
