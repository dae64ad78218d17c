"""The AuK DiT module: parameter tree, checkpoint loading, forward-pass invariants (CPU, fp32)."""

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from auk_triton.diffusion.transformer import (
    AuKTransformer,
    CheckpointError,
    RotaryEmbedding,
    _attend,
    apply_rotary,
    build_transformer,
    key_bias,
    load_transformer,
    timestep_features,
)
from auk_triton.diffusion.synthetic import PRESETS, write_synthetic_dit_checkpoint

RELEASED = PRESETS["auk"]
VAE_SECTION = {"latent_dim": 64, "downsample_rate": 480, "target_sample_rate": 24000}


def spec_parameter_table(D, H, Dh, m, T, Ld, Ls, C):
    """The spec's parameter tree (section 3), written out independently of the module."""
    I, F = H * Dh, int(D * m)
    table = {
        "time_embed.time_mlp.0.weight": (D, 256), "time_embed.time_mlp.0.bias": (D,),
        "time_embed.time_mlp.2.weight": (D, D), "time_embed.time_mlp.2.bias": (D,),
        "txt_proj.weight": (D, T), "txt_proj.bias": (D,),
        "txt_norm.weight": (D,),
        "audio_embed.linear.weight": (D, C), "audio_embed.linear.bias": (D,),
        "audio_embed.conv_pos_embed.conv1d.0.weight": (D, D // 16, 31),
        "audio_embed.conv_pos_embed.conv1d.0.bias": (D,),
        "audio_embed.conv_pos_embed.conv1d.2.weight": (D, D // 16, 31),
        "audio_embed.conv_pos_embed.conv1d.2.bias": (D,),
        "rotary_embed.inv_freq": (Dh // 2,),
        "norm_out.linear.weight": (2 * D, D), "norm_out.linear.bias": (2 * D,),
        "proj_out.weight": (C, D), "proj_out.bias": (C,),
    }
    for i in range(Ld):
        p = f"transformer_blocks.{i}."
        for norm in ("attn_norm_c", "attn_norm_x"):
            table[p + norm + ".linear.weight"] = (6 * D, D)
            table[p + norm + ".linear.bias"] = (6 * D,)
        for qkv, out, qn, kn in (("to_qkv", "to_out.0", "q_norm", "k_norm"),
                                 ("to_qkv_c", "to_out_c", "c_q_norm", "c_k_norm")):
            table[p + f"attn.{qkv}.weight"] = (3 * I, D)
            table[p + f"attn.{qkv}.bias"] = (3 * I,)
            table[p + f"attn.{qn}.weight"] = (Dh,)
            table[p + f"attn.{kn}.weight"] = (Dh,)
            table[p + f"attn.{out}.weight"] = (D, I)
            table[p + f"attn.{out}.bias"] = (D,)
        for ff in ("ff_c", "ff_x"):
            table[p + ff + ".linear_in.weight"] = (2 * F, D)
            table[p + ff + ".linear_out.weight"] = (D, F)
    for i in range(Ls):
        p = f"single_transformer_blocks.{i}."
        table[p + "attn_norm.linear.weight"] = (6 * D, D)
        table[p + "attn_norm.linear.bias"] = (6 * D,)
        table[p + "attn.to_qkv.weight"] = (3 * I, D)
        table[p + "attn.to_qkv.bias"] = (3 * I,)
        table[p + "attn.q_norm.weight"] = (Dh,)
        table[p + "attn.k_norm.weight"] = (Dh,)
        table[p + "attn.to_out.0.weight"] = (D, I)
        table[p + "attn.to_out.0.bias"] = (D,)
        table[p + "ff.linear_in.weight"] = (2 * F, D)
        table[p + "ff.linear_out.weight"] = (D, F)
    return table


def test_released_parameter_tree_matches_spec_on_meta():
    model = build_transformer({"dit": RELEASED, "vae": VAE_SECTION}, device="meta")
    state = model.state_dict()
    assert all(t.is_meta for t in state.values())  # nothing allocated
    expected = spec_parameter_table(1536, 24, 64, 2, 2048, 10, 20, 64)
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    total = sum(t.numel() for t in state.values())
    assert total == 1_530_538_592  # "about 1.5305 B", rotary buffer included
    assert sum(p.numel() for p in model.transformer_blocks[0].parameters()) == 75_528_448
    assert sum(p.numel() for p in model.single_transformer_blocks[0].parameters()) == 37_764_224


def test_every_dit_config_key_is_a_constructor_argument():
    model = AuKTransformer(latent_dim=8, **PRESETS["small"])
    assert model.dim == 64 and model.text_hidden_dim == 2048 and model.latent_dim == 8
    with pytest.raises(TypeError):
        AuKTransformer(latent_dim=8, not_a_key=1, **PRESETS["small"])


def test_timestep_features_order_and_frequencies():
    t = torch.tensor([0.0, 0.25, 1.0])
    feats = timestep_features(t)
    assert feats.shape == (3, 256) and feats.dtype == torch.float32
    assert torch.equal(feats[0, :128], torch.zeros(128)) and torch.equal(feats[0, 128:], torch.ones(128))
    k = torch.arange(128, dtype=torch.float64)
    angles = 1000 * t.double()[:, None] * torch.exp(-k * math.log(10000) / 127)[None]
    assert torch.allclose(feats.double(), torch.cat([angles.sin(), angles.cos()], -1), atol=2e-4)
    # fp32 features whatever the times' dtype.
    assert torch.equal(timestep_features(t.double()), feats)


def test_rotary_adjacent_pairs_and_fp32_frequencies():
    rope = RotaryEmbedding(8)
    assert torch.equal(rope.inv_freq, 10000.0 ** (-torch.arange(0, 8, 2).float() / 8))
    cos, sin = rope.tables(3, None, "cpu")
    u = torch.randn(1, 1, 3, 8)
    out = apply_rotary(u, (cos, sin))
    theta = torch.arange(3).float()[:, None] * rope.inv_freq[None]
    even, odd = u[..., 0::2], u[..., 1::2]
    assert torch.allclose(out[..., 0::2], even * theta.cos() - odd * theta.sin(), atol=1e-6)
    assert torch.allclose(out[..., 1::2], odd * theta.cos() + even * theta.sin(), atol=1e-6)
    # Squeezed positions under a mask: padding takes the previous valid token's number.
    mask = torch.tensor([[False, True, True, False, True]])
    cos_m, _ = rope.tables(5, mask, "cpu")
    positions = torch.tensor([0, 0, 1, 1, 2]).float()
    assert torch.equal(cos_m[0, :, 0], positions.mul(rope.inv_freq[0]).cos())
    # A copy cast to bf16 is never used: the fp32 formula comes back.
    rope.to(torch.bfloat16)
    assert rope.fp32_inv_freq().dtype == torch.float32
    assert torch.equal(rope.fp32_inv_freq(), RotaryEmbedding(8).inv_freq)


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    model = AuKTransformer(latent_dim=64, **PRESETS["small"]).eval()
    with torch.no_grad():  # non-trivial modulation and gates (a zero init would hide bugs)
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1 and "linear" not in name:
                p.normal_(1.0, 0.1)
            elif p.dim() == 1:
                p.normal_(0.0, 0.1)
    return model


@torch.no_grad()
def test_prepare_step_equals_forward_and_cfg_rows(small_model):
    g = torch.Generator().manual_seed(1)
    x, text, ref = (torch.randn(*s, generator=g) for s in ((1, 12, 64), (1, 5, 2048), (1, 7, 64)))
    t = torch.tensor(0.3)
    ctx = small_model.prepare(text, 12, ref=ref, cfg_infer=True)
    both = small_model.step(x, t, ctx)
    assert both.shape == (2, 12, 64)
    assert torch.equal(both, small_model(x, text, t, ref=ref, cfg_infer=True))
    cond = small_model(x, text, t, ref=ref)
    uncond = small_model(x, text, t, ref=ref, drop_text=True, drop_audio_cond=True)
    assert torch.allclose(both[:1], cond, atol=1e-5)
    assert torch.allclose(both[1:], uncond, atol=1e-5)
    assert not torch.allclose(cond, uncond, atol=1e-3)
    # The unconditional prompt embeds zeros (not absent): it differs from no reference at all.
    no_ref = small_model(x, text, t, drop_text=True)
    assert not torch.allclose(uncond, no_ref, atol=1e-3)


@torch.no_grad()
def test_padding_is_masked_out(small_model):
    """A padded batch row gives the valid frames of the unpadded request (masks, squeezed RoPE, zeroed rows)."""
    g = torch.Generator().manual_seed(2)
    x, text, ref = torch.randn(1, 10, 64, generator=g), torch.randn(1, 4, 2048, generator=g), torch.randn(1, 6, 64, generator=g)
    t = torch.tensor([0.6])
    plain = small_model(x, text, t, ref=ref)
    pad = lambda u, k: torch.cat([u, torch.zeros(1, k, u.shape[-1])], dim=1)  # noqa: E731
    ones = lambda n, k: torch.cat([torch.ones(1, n, dtype=torch.bool), torch.zeros(1, k, dtype=torch.bool)], 1)  # noqa: E731
    padded = small_model(
        pad(x, 3), pad(text, 2), t, ref=pad(ref, 4),
        c_mask=ones(4, 2), ref_mask=ones(6, 4), mask=ones(10, 3),
    )
    assert torch.allclose(padded[:, :10], plain, atol=1e-5)
    # Text padding alone needs no c_mask: all-zero rows count as padding.
    assert torch.equal(small_model.prepare(pad(text, 2), 10).c_mask, ones(4, 2))


def test_synthetic_checkpoint_round_trips_strictly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "auk", "vae": VAE_SECTION}))
    write_synthetic_dit_checkpoint(tmp_path, "small", seed=3)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vae"] == VAE_SECTION  # merged, not replaced
    assert config["dit"] == PRESETS["small"] and config["variant"] == "base"
    assert len(config["flash_t_grid"]) == 5 and config["defaults"] == {"nfe": 32, "cfg": 2.0, "sway": -1.0}

    raw = load_file(tmp_path / "auk.safetensors")
    assert raw["layer_weights"].shape == (36,) and raw["layer_scale"].shape == (1,)
    assert all(k.startswith("transformer.") for k in raw if k not in ("layer_weights", "layer_scale"))
    model = load_transformer(tmp_path)
    state = model.state_dict()
    assert set(state) == {k[len("transformer."):] for k in raw if k.startswith("transformer.")}
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, raw["transformer." + name]), name
    # Casting as it reads: bf16 weights, inv_freq included (the rotary recomputes it in fp32).
    bf16 = load_transformer(tmp_path, dtype=torch.bfloat16)
    assert {t.dtype for t in bf16.state_dict().values()} == {torch.bfloat16}
    # Idempotent: the same preset and seed leave the file alone.
    mtime = (tmp_path / "auk.safetensors").stat().st_mtime_ns
    write_synthetic_dit_checkpoint(tmp_path, "small", seed=3)
    assert (tmp_path / "auk.safetensors").stat().st_mtime_ns == mtime


@pytest.fixture()
def checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vae": VAE_SECTION}))
    return write_synthetic_dit_checkpoint(tmp_path, "small", seed=0)


def _rewrite(checkpoint, edit):
    raw = load_file(checkpoint / "auk.safetensors")
    edit(raw)
    save_file(raw, checkpoint / "auk.safetensors")


def test_stray_transformer_key_fails(checkpoint):
    _rewrite(checkpoint, lambda raw: raw.__setitem__("transformer.extra.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match="extra.weight"):
        load_transformer(checkpoint)


def test_missing_key_fails(checkpoint):
    _rewrite(checkpoint, lambda raw: raw.pop("transformer.proj_out.bias"))
    with pytest.raises(CheckpointError, match="proj_out.bias"):
        load_transformer(checkpoint)


def test_wrong_shape_fails(checkpoint):
    _rewrite(checkpoint, lambda raw: raw.__setitem__("transformer.proj_out.bias", torch.zeros(65)))
    with pytest.raises(CheckpointError, match="proj_out.bias"):
        load_transformer(checkpoint)


def test_other_keys_outside_the_prefix_warn_and_are_ignored(checkpoint, caplog):
    _rewrite(checkpoint, lambda raw: raw.__setitem__("thinker.lm_head.weight", torch.zeros(2)))
    with caplog.at_level(logging.WARNING, logger="auk_triton.diffusion.transformer"):
        load_transformer(checkpoint)
    assert "thinker.lm_head.weight" in caplog.text
    assert "layer_weights" not in caplog.text  # the fusion keys are skipped silently


def test_missing_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_transformer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vae": VAE_SECTION, "dit": PRESETS["small"]}))
    with pytest.raises(CheckpointError, match="auk.safetensors"):
        load_transformer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vae": VAE_SECTION}))
    with pytest.raises(CheckpointError, match="'dit'"):
        load_transformer(tmp_path)


@torch.no_grad()
def test_the_modulation_table_holds_what_each_block_computes_from_its_time(small_model):
    grid = torch.tensor([0.0, 0.07612049579620361, 0.2928932309150696, 0.6173166036605835])
    table = small_model.modulation_table(grid)
    D = small_model.dim
    assert table.values.shape == (4, (2 * 6 * 2 + 6 * 2 + 2) * D)  # two double, two single blocks, the final norm
    for index, t in enumerate(grid):
        # The per-block reference: the time repeated to a batch of three rows, as a step without a table does.
        temb = small_model.time_embed(t.repeat(3))
        expected = [norm.linear(torch.nn.functional.silu(temb)) for norm in small_model.adaln_norms()]
        row = table.lookup(t)
        assert row.shape == (1, table.values.shape[1])
        for got, want in zip(small_model.split_modulation(row), expected):
            assert torch.allclose(got.expand_as(want), want, rtol=0, atol=1e-6)
    assert table.lookup(0.5) is None and table.lookup(torch.tensor([0.0, 0.0])) is None


@torch.no_grad()
def test_a_step_that_looks_its_time_up_equals_the_step_that_computes_it(small_model):
    g = torch.Generator().manual_seed(4)
    x, text, ref = torch.randn(2, 9, 64, generator=g), torch.randn(2, 5, 2048, generator=g), torch.randn(2, 3, 64, generator=g)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    ctx = small_model.prepare(text, 9, ref=ref, mask=mask, cfg_infer=True)
    t = torch.tensor(0.2928932309150696)
    computed = small_model.step(x, t, ctx)
    ctx.modulation = small_model.modulation_table(torch.tensor([0.0, 0.2928932309150696]))
    looked_up = small_model.step(x, t, ctx)
    assert torch.allclose(looked_up, computed, rtol=0, atol=1e-6 * float(computed.abs().max()))
    # The AdaLN modules' own forward (time embedding in, modulated input out) is the same math.
    h = torch.randn(2, 4, small_model.dim, generator=g)
    temb = small_model.time_embed(t.repeat(2))
    norm = small_model.single_transformer_blocks[0].attn_norm
    reference = norm(h, temb)[0]
    own = list(small_model.split_modulation(ctx.modulation.lookup(t)))[2 * len(small_model.transformer_blocks)]
    assert torch.allclose(norm.modulate(h, own)[0], reference, atol=1e-6)


@torch.no_grad()
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # CPU autocast's RMSNorm
def test_padding_reaches_the_attention_as_an_additive_key_bias_in_its_dtype(small_model):
    text, ref = torch.randn(1, 4, 2048), torch.randn(1, 3, 64)
    mask = torch.tensor([[True] * 5 + [False] * 2])
    ctx = small_model.prepare(text, 7, ref=ref, mask=mask, cfg_infer=True)
    inf = float("-inf")
    assert ctx.joint_bias.dtype == torch.float32 and ctx.joint_bias.shape == (2, 1, 1, 3 + 7 + 4)
    assert ctx.joint_bias[0, 0, 0].tolist() == [0.0] * 8 + [inf] * 2 + [0.0] * 4  # [audio | text]
    assert ctx.single_bias[1, 0, 0].tolist() == [0.0] * 4 + [0.0] * 8 + [inf] * 2  # [text | audio]
    assert small_model.prepare(text, 7).joint_bias is None  # nothing padded, no mask
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the sampler prepares a GPU's runs
        assert small_model.prepare(text, 7, ref=ref, mask=mask).single_bias.dtype == torch.bfloat16


@torch.no_grad()
def test_the_key_bias_gives_the_attention_of_a_boolean_mask_exactly(small_model):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 9, 4, 16, generator=g) for _ in range(3))
    valid = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=valid[:, None, None, :]).transpose(1, 2).flatten(2)
    assert torch.equal(_attend(q, k, v, key_bias(valid, torch.float32)), expected)


def test_the_synthetic_transformer_built_in_memory_holds_the_checkpoints_weights(checkpoint):
    from auk_triton.diffusion.synthetic import synthetic_transformer

    built, loaded = synthetic_transformer("small", seed=0).state_dict(), load_transformer(checkpoint).state_dict()
    assert built.keys() == loaded.keys()
    assert all(torch.equal(built[name], loaded[name]) for name in loaded)
