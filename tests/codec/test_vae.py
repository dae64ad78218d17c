"""The AuK codec: conformance with the reference implementation, loading, geometry."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from auk_triton.codec.synthetic import SYNTHETIC_WARNING, _released_state_dict, write_synthetic_checkpoint
from auk_triton.codec.vae import AuKVAE

CONFORMANCE = Path(__file__).parents[1] / "data" / "auk_vae_tiny"


@pytest.fixture(scope="module")
def tiny():
    return AuKVAE.from_pretrained(CONFORMANCE)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("small"), "small", seed=0)


@pytest.fixture(scope="module")
def small(small_dir):
    return AuKVAE.from_pretrained(small_dir)


@pytest.mark.parametrize("frames", [7, 64])
def test_decode_reproduces_the_reference_implementation(tiny, frames):
    latents = torch.from_numpy(np.load(CONFORMANCE / f"latents_{frames}.npy"))
    expected = np.load(CONFORMANCE / f"decode_{frames}.npy")
    decoded = tiny.decode(latents).numpy()
    assert decoded.shape == expected.shape == (1, frames * 480)
    np.testing.assert_allclose(decoded, expected, atol=1e-5, rtol=0)


def test_encode_reproduces_the_reference_posterior_mean(tiny):
    wav = torch.from_numpy(np.load(CONFORMANCE / "wav_4800.npy"))
    expected = np.load(CONFORMANCE / "encode_4800.npy")
    encoded = tiny.encode(wav).numpy()
    assert encoded.shape == expected.shape == (1, 10, 8)
    np.testing.assert_allclose(encoded, expected, atol=1e-5, rtol=0)


def test_encode_samples_around_the_mean_when_given_a_generator(tiny):
    wav = torch.from_numpy(np.load(CONFORMANCE / "wav_4800.npy"))
    mean = tiny.encode(wav)
    first = tiny.encode(wav, generator=torch.Generator().manual_seed(3))
    again = tiny.encode(wav, generator=torch.Generator().manual_seed(3))
    assert torch.equal(first, again)
    assert not torch.allclose(first, mean)
    # The posterior's std is exp(log-std) (the encoder head's second half) in raw units,
    # divided by sqrt(global_log_std) in the normalized latents encode returns.
    with torch.no_grad():
        log_std = tiny.audio_encoder(wav.unsqueeze(1)).chunk(2, dim=1)[1]
    std = (log_std.exp() / tiny.global_log_std.sqrt().view(1, -1, 1)).transpose(1, 2)[:, : mean.shape[1]]
    z = (first - mean) / std  # 80 standard normal draws
    assert z.abs().max() < 5
    assert 0.7 < z.pow(2).mean().sqrt() < 1.3


def test_from_pretrained_is_ready_for_inference(tiny):
    assert not tiny.training
    assert all(not p.requires_grad for p in tiny.parameters())
    assert (tiny.hop_size, tiny.sample_rate, tiny.latent_dim) == (480, 24000, 8)


def test_released_geometry_has_the_documented_size_and_context():
    vae = AuKVAE.from_config({})
    decoder = sum(p.numel() for n, p in vae.named_parameters() if not n.startswith("audio_encoder."))
    assert round(decoder / 1e6, 1) == 114.5
    assert vae.decode_context_frames() == (53, 9)


def test_from_config_ignores_training_only_keys_and_refuses_use_vae_false():
    vae = AuKVAE.from_config({"latent_dim": 8, "upsample_initial_channel": 64, "lambda_kl": 0.1})
    assert vae.latent_dim == 8
    with pytest.raises(ValueError, match="use_vae"):
        AuKVAE.from_config({"use_vae": False})


def test_decode_context_frames_is_a_true_bound(small):
    left, right = small.decode_context_frames()
    generator = torch.Generator().manual_seed(0)
    frames, hop = 150, small.hop_size
    latents = torch.randn(1, frames, 64, generator=generator)
    base = small.decode(latents).view(frames, hop)
    for frame in (0, 40, 75, 149):
        changed = latents.clone()
        changed[0, : max(0, frame - left)] = torch.randn(max(0, frame - left), 64, generator=generator)
        beyond = frames - (frame + right + 1)
        if beyond > 0:
            changed[0, frame + right + 1 :] = torch.randn(beyond, 64, generator=generator)
        assert torch.equal(small.decode(changed).view(frames, hop)[frame], base[frame])


def test_decode_context_frames_is_not_wildly_loose(small):
    left, right = small.decode_context_frames()
    frames, probe, hop = 160, 80, small.hop_size
    latents = torch.randn(1, frames, 64, generator=torch.Generator().manual_seed(1))
    base = small.decode(latents)
    poked = latents.clone()
    poked[0, probe] += 3.0
    changed = torch.nonzero((small.decode(poked) - base).view(frames, hop).abs().amax(1) > 0).flatten()
    reach_left = changed.max().item() - probe  # later frames see the poked one through their left context
    reach_right = probe - changed.min().item()
    assert reach_left <= left and reach_right <= right
    assert left + right <= 1.3 * (reach_left + reach_right), (reach_left, reach_right)


@pytest.mark.parametrize(
    "latents, message",
    [
        (torch.zeros(2, 5), "latents must be"),
        (torch.zeros(1, 5, 32), "latents must be"),
        (torch.zeros(1, 5, 64, dtype=torch.float64), "float32"),
        (torch.zeros(1, 0, 64), "zero frames"),
    ],
)
def test_decode_rejects_bad_latents_with_a_clear_error(small, latents, message):
    with pytest.raises(ValueError, match=message):
        small.decode(latents)


def test_encode_rejects_stereo_and_wrong_dtype(tiny):
    with pytest.raises(ValueError, match="mono"):
        tiny.encode(torch.zeros(2, 4800))
    with pytest.raises(ValueError, match="float32"):
        tiny.encode(torch.zeros(1, 4800, dtype=torch.float64))


def test_synthetic_audio_is_audible_but_not_clipped(small, small_dir):
    wave = small.decode(torch.randn(1, 100, 64, generator=torch.Generator().manual_seed(2)))
    rms = wave.pow(2).mean().sqrt().item()
    assert 0.05 <= rms <= 0.5
    assert (wave.abs() >= 1.0).float().mean().item() < 1e-3
    config = json.loads((small_dir / "config.json").read_text())
    assert config["synthetic"]["warning"] == SYNTHETIC_WARNING


def test_synthetic_checkpoint_is_seeded(tmp_path, small_dir):
    again = write_synthetic_checkpoint(tmp_path / "again", "small", seed=0)
    other = write_synthetic_checkpoint(tmp_path / "other", "small", seed=1)
    first, second = load_file(small_dir / "vae.safetensors"), load_file(again / "vae.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in first)
    third = load_file(other / "vae.safetensors")
    assert not torch.equal(first["conv_pre.weight_v"], third["conv_pre.weight_v"])


def _copy_checkpoint(src: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        state = load_file(dst / "vae.safetensors")
        edit(state)
        save_file(state, dst / "vae.safetensors")
    return dst


def test_checkpoint_round_trips_through_the_released_layout(tmp_path, small, small_dir):
    assert any(k.endswith(".weight_g") for k in load_file(small_dir / "vae.safetensors"))
    resaved = _copy_checkpoint(small_dir, tmp_path / "resaved")
    save_file(_released_state_dict(small), resaved / "vae.safetensors")
    reloaded = AuKVAE.from_pretrained(resaved)
    latents = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(reloaded.decode(latents), small.decode(latents), atol=1e-6, rtol=0)


def test_flow_tensors_are_skipped(tmp_path, small, small_dir):
    def add_flow(state):
        state["flow.coupling.0.weight"] = torch.ones(3, 3)

    with_flow = AuKVAE.from_pretrained(_copy_checkpoint(small_dir, tmp_path / "flow", add_flow))
    assert "flow.coupling.0.weight" in load_file(tmp_path / "flow" / "vae.safetensors")
    latents = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(5))
    assert torch.equal(with_flow.decode(latents), small.decode(latents))


def test_a_stray_key_fails_the_load_naming_it(tmp_path, small_dir):
    def add_stray(state):
        state["conv_pre.extra"] = torch.ones(1)

    with pytest.raises(ValueError, match="conv_pre.extra"):
        AuKVAE.from_pretrained(_copy_checkpoint(small_dir, tmp_path / "stray", add_stray))


def test_a_missing_key_fails_the_load_naming_it(tmp_path, small_dir):
    with pytest.raises(ValueError, match="resblocks.4.convs2.1.bias"):
        AuKVAE.from_pretrained(
            _copy_checkpoint(small_dir, tmp_path / "missing", lambda s: s.pop("resblocks.4.convs2.1.bias"))
        )


def test_a_config_that_disagrees_with_the_module_fails_the_load(tmp_path, small_dir):
    broken = _copy_checkpoint(small_dir, tmp_path / "mismatch")
    config = json.loads((broken / "config.json").read_text())
    config["vae"]["downsample_rate"] = 512
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="downsample_rate"):
        AuKVAE.from_pretrained(broken)


def test_a_config_whose_stage_lists_differ_in_length_fails_naming_both():
    with pytest.raises(ValueError, match=r"upsample_rates \[8, 5\] and upsample_kernel_sizes \[16\]"):
        AuKVAE(upsample_rates=[8, 5], upsample_kernel_sizes=[16])
    with pytest.raises(ValueError, match="resblock_kernel_sizes .* and resblock_dilation_sizes"):
        AuKVAE(resblock_kernel_sizes=[3, 7], resblock_dilation_sizes=[[1, 3, 5]])


def test_a_config_whose_init_kwargs_are_not_an_object_fails_naming_the_file(tmp_path, small_dir):
    broken = _copy_checkpoint(small_dir, tmp_path / "kwargs")
    config = json.loads((broken / "config.json").read_text())
    config["vae"]["model_init_kwargs"] = [1, 2]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json is not an AuK config .*model_init_kwargs is a list"):
        AuKVAE.from_pretrained(broken)


def test_weights_loaded_after_the_switch_to_channels_last_decode_as_channels_first_does(small_dir, tmp_path):
    other = write_synthetic_checkpoint(tmp_path / "other", preset="small", seed=7)
    vae = AuKVAE.from_pretrained(small_dir, channels_last=True)
    vae.load_weights(other / "vae.safetensors")  # the folded and polyphase weights must follow
    reference = AuKVAE.from_pretrained(other)
    latents = torch.randn(1, 29, reference.latent_dim, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(vae.decode(latents), reference.decode(latents), atol=1e-5, rtol=0)
    assert vae.resblocks[0].convs1[0].weight.stride(1) == 1, "the loaded weights lost the channels-last layout"


def test_a_checkpoint_directory_without_weights_fails_naming_the_file(tmp_path, small_dir):
    broken = _copy_checkpoint(small_dir, tmp_path / "noweights")
    (broken / "vae.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="vae.safetensors"):
        AuKVAE.from_pretrained(broken)


def test_a_channels_last_decode_equals_the_channels_first_decode(small_dir):
    from auk_triton.codec.vae import AuKVAE

    reference = AuKVAE.from_pretrained(small_dir)
    channels_last = AuKVAE.from_pretrained(small_dir).configure_decoder(channels_last=True)
    conv = channels_last.resblocks[0].convs1[0].weight
    assert conv.stride(1) == 1, "channels_last must store the convolution weights channels-last"
    # With the default thresholds every stage of the small preset is time-folded; 29 frames
    # leave some stages' lengths indivisible by their fold, so both paths run.
    assert all(block.convs1[0].fold > 1 for block in channels_last.resblocks)
    latents = torch.randn(1, 29, reference.latent_dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(channels_last.decode(latents), reference.decode(latents), atol=1e-5, rtol=0)
        channels_last.configure_decoder(channels_last=False)
        assert channels_last.resblocks[0].convs1[0].weight.is_contiguous()
        torch.testing.assert_close(channels_last.decode(latents), reference.decode(latents), atol=0, rtol=0)


@pytest.mark.parametrize("fold", [2, 3, 8])
@pytest.mark.parametrize("kernel, dilation", [(3, 1), (7, 3), (11, 5), (2, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_time_folded_convolution_equals_the_causal_convolution(fold, kernel, dilation, bias):
    from auk_triton.codec.vae import CausalConv1d

    torch.manual_seed(fold * 100 + kernel * 10 + dilation)
    conv = CausalConv1d(6, 5, kernel, dilation=dilation, bias=bias).requires_grad_(False)
    x = torch.randn(2, 96, 6).transpose(1, 2)  # channels-last [B, C, L], L divisible by every fold
    with torch.no_grad():
        expected = conv(x.contiguous())
        expected_no_bias = conv(x.contiguous(), bias=False)
        conv.build_fold(fold)
        assert conv.folded_weight.shape[:2] == (5 * fold, 6 * fold)
        actual = conv(x)
        actual_no_bias = conv(x, bias=False)
        conv.drop_fold()
        unfolded = conv(x)
    assert actual.shape == (2, 5, 96)
    assert actual.stride(1) == 1, "the folded output must stay channels-last"
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual_no_bias, expected_no_bias, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unfolded, expected, atol=1e-5, rtol=1e-5)


def test_a_folded_convolution_falls_back_where_the_length_does_not_divide():
    from auk_triton.codec.vae import CausalConv1d

    torch.manual_seed(5)
    conv = CausalConv1d(4, 4, 7, dilation=3).requires_grad_(False)
    x = torch.randn(1, 50, 4).transpose(1, 2)  # 50 samples: not a multiple of 4
    with torch.no_grad():
        expected = conv(x.contiguous())
        conv.build_fold(4)
        folded_calls = []
        folded = conv._folded
        conv._folded = lambda *args: folded_calls.append(args) or folded(*args)
        torch.testing.assert_close(conv(x), expected, atol=1e-5, rtol=1e-5)
        # A channels-first signal is never folded either.
        torch.testing.assert_close(conv(x.contiguous()), expected, atol=0, rtol=0)
        assert not folded_calls
        conv(x[..., :48])  # 48 samples divide by 4: folded
        assert len(folded_calls) == 1


def test_channels_last_folds_the_convolutions_narrower_than_the_threshold(small_dir):
    from auk_triton.codec.vae import AuKVAE

    vae = AuKVAE.from_pretrained(small_dir, channels_last=True, fold_below=16, fold_to=32)
    folds = {block.convs1[0].in_channels: block.convs1[0].fold for block in vae.resblocks}
    # The small preset's stages are 64, 32, 16, 8, 4 and 2 channels wide.
    assert folds == {64: 1, 32: 1, 16: 1, 8: 4, 4: 8, 2: 16}
    assert vae.conv_post.fold == 16
    vae.configure_decoder(channels_last=False)
    assert all(block.convs1[0].fold == 1 and block.convs1[0].folded_weight is None for block in vae.resblocks)


@pytest.mark.parametrize("rate", [2, 3, 5])
def test_the_polyphase_upsampler_equals_the_transposed_convolution(rate):
    from auk_triton.codec.vae import CausalConvTranspose1d

    torch.manual_seed(rate)
    up = CausalConvTranspose1d(12, 8, 2 * rate, stride=rate).requires_grad_(False)
    x = torch.randn(2, 41, 12).transpose(1, 2)  # channels-last [B, C, L]
    with torch.no_grad():
        expected = up(x.contiguous())
        up.build_polyphase()
        actual = up(x)
    assert actual.shape == (2, 8, 41 * rate)
    assert actual.stride(1) == 1, "the polyphase output must stay channels-last"
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
