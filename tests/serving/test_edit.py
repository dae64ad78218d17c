"""auk_vae_encode and the auk_edit ensemble on a real tritonserver (CPU, small synthetic weights:
their audio is not real audio), with the conformance codec served beside them.

One server for the module: the streaming decoder (small tiles), auk_vae_encode, auk_dit,
auk_edit, and `auk_vae_encode_tiny`, the same encoder model on the conformance checkpoint
(tests/data/auk_vae_tiny, 8 latent channels). AUK_CHECKPOINT is left empty, so each model
loads the checkpoint its own `checkpoint` parameter names.
"""

from __future__ import annotations

import re
import shutil
import struct
import wave

import numpy as np
import pytest
import torch
from triton_harness import REPO_ROOT, checkpoint_with_dit, copy_model_repository, library_tiles, start_triton

pytest.importorskip("tritonclient.grpc")
from auk_client.cli import main as auk_client_main  # noqa: E402
from auk_client.edit import encode_audio, stream_edit  # noqa: E402
from auk_client.pipeline import generate_latents, random_prompt_embeds  # noqa: E402
from auk_client.stream import AuKClientError, assemble, stream_decode  # noqa: E402

HOP, RATE = 480, 24000
CONFORMANCE = REPO_ROOT / "tests" / "data" / "auk_vae_tiny"
ENCODE_MAX_FRAMES = 250  # the served encoder's max_frames here: 5 s
DIT_MAX_FRAMES = 400  # auk_dit's here: reference + target
SPEC_SEED_OFFSET = 1_592_592_908  # 0x5EED0A0C, the AuK DiT spec, editing


def set_parameter(config, key: str, value: str) -> None:
    text, count = re.subn(rf'(key: "{key}", value: \{{ string_value: )"[^"]*"', rf'\1"{value}"', config.read_text())
    assert count == 1, f"no {key} parameter in {config}"
    config.write_text(text)


@pytest.fixture(scope="module")
def edit_server(tmp_path_factory, small_checkpoint):
    workdir = tmp_path_factory.mktemp("edit")
    checkpoint = checkpoint_with_dit(small_checkpoint, workdir / "checkpoint")
    # auk_edit runs auk_vae_encode and auk_pipeline; auk_dit and auk_vae_decode serve the
    # references its streams are checked against.
    repository = copy_model_repository(workdir / "model_repository", models=("auk_vae_decode", "auk_pipeline"))
    for model in ("auk_vae_encode", "auk_dit", "auk_edit"):
        shutil.copytree(REPO_ROOT / "model_repository" / model, repository / model,
                        ignore=shutil.ignore_patterns("__pycache__"))
    tiny = repository / "auk_vae_encode_tiny"
    shutil.copytree(repository / "auk_vae_encode", tiny)
    config = tiny / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "auk_vae_encode"', 'name: "auk_vae_encode_tiny"')
                      .replace("dims: [ -1, 64 ]", "dims: [ -1, 8 ]"))
    set_parameter(config, "checkpoint", str(CONFORMANCE))
    for model in ("auk_vae_decode", "auk_vae_encode", "auk_dit", "auk_pipeline"):
        set_parameter(repository / model / "config.pbtxt", "checkpoint", str(checkpoint))
    set_parameter(repository / "auk_vae_encode" / "config.pbtxt", "max_frames", str(ENCODE_MAX_FRAMES))
    for model in ("auk_dit", "auk_pipeline"):
        set_parameter(repository / model / "config.pbtxt", "max_frames", str(DIT_MAX_FRAMES))
    # Six model processes take a few seconds to stop on two cores: more than the harness's 5 s.
    server = start_triton(workdir, repository, "", extra_args=["--exit-timeout-secs=15"])
    server.checkpoint_dir = checkpoint
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vae(edit_server):
    from auk_triton.codec.vae import AuKVAE

    return AuKVAE.from_pretrained(edit_server.checkpoint_dir)


def source_audio(samples: int, seed: int = 0) -> np.ndarray:
    """A chirp with some noise, in [-1, 1]."""
    t = np.arange(samples) / RATE
    rng = np.random.default_rng(seed)
    wave_ = 0.5 * np.sin(2 * np.pi * (200 + 400 * t) * t) + 0.05 * rng.standard_normal(samples)
    return np.clip(wave_, -1, 1).astype(np.float32)


def library_encode(vae, audio: np.ndarray, generator=None) -> np.ndarray:
    """The library's encode of the whole frames of `audio`."""
    whole = audio[: audio.size - audio.size % HOP]
    with torch.no_grad():
        return vae.encode(torch.from_numpy(whole)[None], generator=generator)[0].numpy()


def test_the_served_encoder_reproduces_the_conformance_encode_within_1e_5(edit_server):
    wav = np.load(CONFORMANCE / "wav_4800.npy")[0]
    expected = np.load(CONFORMANCE / "encode_4800.npy")[0]
    latents = encode_audio(wav, url=edit_server.grpc_url, model="auk_vae_encode_tiny")
    assert latents.shape == expected.shape == (10, 8) and latents.dtype == np.float32
    np.testing.assert_allclose(latents, expected, atol=1e-5, rtol=0)


def test_audio_encoded_then_decoded_on_the_server_is_the_library_decode_of_the_library_encode(edit_server, vae):
    url = edit_server.grpc_url
    audio = source_audio(150 * HOP + 123)  # 3 s and a partial frame, which the encoder cuts
    latents = encode_audio(audio, url=url)
    expected_latents = library_encode(vae, audio)
    assert latents.shape == (150, 64)
    np.testing.assert_array_equal(latents, expected_latents)
    served = assemble(list(stream_decode(latents, url=url, timeout=300)))
    expected = np.concatenate([wave_ for _, wave_ in library_tiles(vae, expected_latents, edit_server)])
    np.testing.assert_array_equal(served, expected)


@pytest.mark.parametrize("seed", [7, 2**63 - 1])
def test_a_seed_samples_the_posterior_with_the_spec_generator_rule(edit_server, vae, seed):
    audio = source_audio(20 * HOP, seed=1)
    sampled = encode_audio(audio, seed=seed, url=edit_server.grpc_url)
    generator = torch.Generator().manual_seed((seed + SPEC_SEED_OFFSET) % 2**63)
    np.testing.assert_array_equal(sampled, library_encode(vae, audio, generator))
    assert not np.array_equal(sampled, encode_audio(audio, url=edit_server.grpc_url)), "without SEED: the mean"


def edit_request(**change):
    request = dict(prompt_embeds=random_prompt_embeds(3, seed=4), seconds=2.0, seed=5, num_steps=2)
    return {**request, **change}


def test_the_edit_stream_stitches_to_the_decode_of_the_dit_latents_given_the_encoders_latents(edit_server):
    url = edit_server.grpc_url
    audio = source_audio(60 * HOP + 7, seed=2)
    request = edit_request(seconds=3.0)  # 150 frames: more than one 128-frame tile
    tiles = list(stream_edit(audio, **request, url=url))
    starts = [tile.start_sample for tile in tiles]
    assert len(tiles) >= 2 and starts[0] == 0
    assert starts[1:] == [tile.end_sample for tile in tiles[:-1]], "each tile starts where the last one ended"

    reference = encode_audio(audio, url=url)
    latents = generate_latents(**request, ref_latents=reference, url=url)
    assert latents.shape == (150, 64)
    np.testing.assert_array_equal(assemble(tiles), assemble(list(stream_decode(latents, url=url, timeout=300))))
    # The reference conditions the DiT: another source gives other audio.
    other = assemble(list(stream_edit(source_audio(60 * HOP, seed=3), **request, url=url)))
    assert not np.array_equal(other, assemble(tiles))


def test_an_edit_without_a_duration_is_as_long_as_the_source_and_encode_seed_samples_it(edit_server):
    url = edit_server.grpc_url
    audio = source_audio(75 * HOP + 300, seed=4)
    request = edit_request(seconds=None)
    sampled = encode_audio(audio, seed=9, url=url)
    tiles = list(stream_edit(audio, **request, encode_seed=9, url=url))
    latents = generate_latents(**request, ref_latents=sampled, url=url)
    assert latents.shape == (75, 64), "as many frames as the source's whole frames"
    audio_out = assemble(tiles)
    assert audio_out.shape == (75 * HOP,)
    np.testing.assert_array_equal(audio_out, assemble(list(stream_decode(latents, url=url, timeout=300))))


def raw_encode(url: str, inputs: dict, model: str = "auk_vae_encode"):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        tensors = []
        for name, (array, datatype) in inputs.items():
            tensors.append(grpcclient.InferInput(name, list(array.shape), datatype))
            tensors[-1].set_data_from_numpy(array)
        return client.infer(model, tensors, client_timeout=120)
    finally:
        client.close()


def with_sample(value: float, at: int = 1000) -> np.ndarray:
    audio = source_audio(10 * HOP)
    audio[at] = value
    return audio


BAD_AUDIO = [
    ("one-sample-short-of-a-frame", np.zeros(HOP - 1, np.float32), "FP32",
     ["AUDIO", "479 samples", "fewer than one frame of 480"]),
    ("empty", np.zeros(0, np.float32), "FP32", ["AUDIO", "0 samples", "fewer than one frame"]),
    ("nan", with_sample(np.nan), "FP32", ["AUDIO", "1 NaN", "sample 1000", "finite"]),
    ("inf", with_sample(-np.inf, at=5), "FP32", ["AUDIO", "1 infinite", "sample 5", "finite"]),
    ("too-long", np.zeros(ENCODE_MAX_FRAMES * HOP + 1, np.float32), "FP32",
     ["AUDIO", str(ENCODE_MAX_FRAMES * HOP + 1), f"max_frames of {ENCODE_MAX_FRAMES}"]),
    # Triton refuses these itself: the config's rank and datatype.
    ("stereo-rank-2", np.zeros((2, 10 * HOP), np.float32), "FP32", ["AUDIO", "shape"]),
    ("fp64", np.zeros(10 * HOP, np.float64), "FP64", ["AUDIO", "FP64", "FP32"]),
]


@pytest.mark.parametrize("audio, datatype, words", [case[1:] for case in BAD_AUDIO], ids=[c[0] for c in BAD_AUDIO])
def test_bad_audio_is_a_client_error_naming_the_problem_and_the_encoder_keeps_serving(
    edit_server, audio, datatype, words
):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as caught:
        raw_encode(edit_server.grpc_url, {"AUDIO": (audio, datatype)})
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT", caught.value
    for word in words:
        assert word in caught.value.message(), f"{word!r} not in {caught.value.message()!r}"
    good = raw_encode(edit_server.grpc_url, {"AUDIO": (source_audio(HOP), "FP32")})
    assert good.as_numpy("LATENTS").shape == (1, 64)


def test_a_seed_of_the_wrong_type_is_refused_by_triton_naming_it(edit_server):
    from tritonclient.utils import InferenceServerException

    audio = source_audio(4 * HOP)
    with pytest.raises(InferenceServerException, match="SEED") as caught:
        raw_encode(edit_server.grpc_url, {"AUDIO": (audio, "FP32"), "SEED": (np.array([3], np.int32), "INT32")})
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"


BAD_EDITS = [
    (dict(audio=np.zeros(100, np.float32)), "fewer than one frame"),
    (dict(audio=with_sample(np.nan)), "NaN"),
    (dict(seconds=-1.0), "positive number of seconds"),
    (dict(num_steps=0), "at least 1"),
    # A 5 s source (250 frames) and a 4 s target (200 frames) exceed auk_dit's 400 here.
    (dict(audio=source_audio(250 * HOP), seconds=4.0), f"250 reference \\+ 200 target frames exceed this model's "
                                                       f"max_frames of {DIT_MAX_FRAMES}"),
    (dict(audio=source_audio(250 * HOP), seconds=None), "250 reference \\+ 250 target frames exceed"),
]


def test_bad_edits_get_their_errors_and_the_server_keeps_serving(edit_server):
    url = edit_server.grpc_url
    for change, message in BAD_EDITS:
        request = {"audio": source_audio(10 * HOP), **edit_request(seconds=0.2), **change}
        with pytest.raises(AuKClientError, match=message):
            list(stream_edit(**request, url=url, check=False, timeout=120))
    assert edit_server.is_ready()
    assert assemble(list(stream_edit(source_audio(10 * HOP), **edit_request(seconds=0.2), url=url))).size == 10 * HOP


def test_a_dit_request_without_a_duration_needs_a_reference(edit_server):
    with pytest.raises(AuKClientError, match="no GEN_SECONDS input; only a request with REF_LATENTS may leave it out"):
        generate_latents(random_prompt_embeds(2, seed=0), None, 0, url=edit_server.grpc_url, num_steps=1)


# ---- the client --------------------------------------------------------------------------


def write_pcm16_wav(path, samples: np.ndarray, rate: int) -> None:
    """`samples` [n, channels] in [-1, 1] as PCM16 with the standard library's writer."""
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(samples.shape[1])
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(np.round(samples * 32767).astype("<i2").tobytes())


def test_cli_encode_writes_the_latents_of_the_mixed_down_resampled_wav(edit_server, tmp_path, capsys):
    from auk_client.source import load_source

    t = np.arange(48000 * 2) / 48000  # 2 s of stereo at 48 kHz
    stereo = np.stack([0.6 * np.sin(2 * np.pi * 440 * t), 0.2 * np.sin(2 * np.pi * 440 * t)], axis=1)
    write_pcm16_wav(tmp_path / "source.wav", stereo, 48000)
    out = tmp_path / "latents.npy"
    status = auk_client_main(["encode", str(tmp_path / "source.wav"), "--url", edit_server.grpc_url, "-o", str(out)])
    assert status == 0
    latents = np.load(out)
    assert latents.shape == (100, 64)
    np.testing.assert_array_equal(latents, encode_audio(load_source(str(tmp_path / "source.wav")).samples,
                                                        url=edit_server.grpc_url))
    err = capsys.readouterr().err
    assert "2 channels mixed to mono, resampled from 48000 Hz" in err and "posterior mean" in err


def test_cli_edit_writes_the_streamed_edit_and_reports_first_audio(edit_server, tmp_path, capsys):
    from auk_client.source import load_source

    write_pcm16_wav(tmp_path / "source.wav", source_audio(30 * HOP)[:, None], RATE)
    out = tmp_path / "edited.wav"
    status = auk_client_main([
        "edit", "--audio", str(tmp_path / "source.wav"), "--random-tokens", "3", "--seconds", "1", "--seed", "2",
        "--steps", "2", "--url", edit_server.grpc_url, "-o", str(out), "--float32",
    ])
    assert status == 0
    err = capsys.readouterr().err
    assert "time to first audio" in err and "tiles received" in err
    expected = assemble(list(stream_edit(load_source(str(tmp_path / "source.wav")).samples,
                                         random_prompt_embeds(3, seed=2), 1.0, 2, num_steps=2,
                                         url=edit_server.grpc_url)))
    blob = out.read_bytes()
    data = blob.index(b"data")
    samples = np.frombuffer(blob[data + 8:data + 8 + struct.unpack_from("<I", blob, data + 4)[0]], "<f4")
    np.testing.assert_array_equal(samples, expected)
    assert samples.size == 50 * HOP


def test_cli_edit_refuses_a_source_shorter_than_a_frame_before_asking_the_server(tmp_path, capsys):
    write_pcm16_wav(tmp_path / "short.wav", np.zeros((100, 1)), RATE)
    status = auk_client_main(["edit", "--audio", str(tmp_path / "short.wav"), "--random-tokens", "2",
                              "--url", "127.0.0.1:1", "-o", str(tmp_path / "never.wav")])
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("auk-client edit: error: the source audio is 4.2 ms"), lines
    assert not (tmp_path / "never.wav").exists()
