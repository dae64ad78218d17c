"""The rectified-flow sampler: time grid, Euler steps, guidance, flash recipe, request limits."""

import json
import logging
import math

import pytest
import torch

from auk_triton.diffusion.transformer import CheckpointError
from auk_triton.diffusion.sampler import (
    MAX_LATENT_FRAMES,
    MODULATION_TABLES_KEPT,
    AuKDiTSampler,
    Request,
    SamplingStopped,
    SchedulePolicy,
    cfg_combine,
    check_grid,
    euler_integrate,
    initial_noise,
    load_sampler,
    time_grid,
)
from auk_triton.diffusion.synthetic import FLASH_T_GRID, write_synthetic_dit_checkpoint

VAE_SECTION = {"latent_dim": 64, "downsample_rate": 480, "target_sample_rate": 24000}


def test_time_grid_uniform_and_sway():
    assert torch.equal(time_grid(4), torch.linspace(0, 1, 5))
    assert torch.equal(time_grid(4, 0.0), torch.linspace(0, 1, 5))
    t = torch.linspace(0, 1, 33, dtype=torch.float64)
    swayed = time_grid(32, -1.0)
    assert swayed.dtype == torch.float32 and swayed.shape == (33,)
    assert torch.allclose(swayed.double(), 1 - torch.cos(math.pi / 2 * t), atol=1e-6)  # s = -1
    s = 0.5
    assert torch.allclose(time_grid(32, s).double(), t + s * (torch.cos(math.pi / 2 * t) - 1 + t), atol=1e-6)
    assert swayed[0] == 0 and swayed[-1] == 1
    assert (swayed[1:] - swayed[:-1])[0] < 1 / 32  # small steps near the noise end


def test_flash_grid_is_the_swayed_four_step_grid():
    ulp = torch.finfo(torch.float32).eps
    assert torch.allclose(time_grid(4, -1.0), torch.tensor(FLASH_T_GRID), atol=ulp, rtol=0)


def test_bad_grids_are_request_errors():
    with pytest.raises(ValueError, match="at least 1"):
        time_grid(0)
    with pytest.raises(ValueError, match="strictly increase"):
        time_grid(8, -5.0)  # bends the grid backwards
    with pytest.raises(ValueError, match="finite"):
        check_grid([0.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match="2 points"):
        check_grid([0.5])
    assert torch.equal(check_grid([0.2, 0.5]), torch.tensor([0.2, 0.5]))  # endpoints are free


def test_euler_update_on_a_toy_velocity():
    # dx/dt = -x: each Euler step multiplies by (1 - dt).
    grid = torch.tensor([0.0, 0.1, 0.4, 1.0])
    x0 = torch.randn(1, 3, 2)
    out = euler_integrate(lambda x, t: -x, x0, grid, cfg=0.0)
    assert torch.allclose(out, x0 * 0.9 * 0.7 * 0.4)
    # The velocity sees each grid time but the last, in order.
    seen = []
    euler_integrate(lambda x, t: (seen.append(float(t)), torch.zeros_like(x))[1], x0, grid, cfg=0.0)
    assert seen == pytest.approx([0.0, 0.1, 0.4])


def test_cfg_combination_on_a_toy_velocity():
    v_c, v_u = torch.tensor([2.0]), torch.tensor([0.5])
    assert torch.equal(cfg_combine(v_c, v_u, 2.0), 3 * v_c - 2 * v_u)  # (1 + cfg) v_c - cfg v_u

    calls = []

    def velocity(x, t):  # rows [cond; uncond], constant velocities 1 and -1
        calls.append(x.shape[0])
        return torch.cat([torch.ones_like(x), -torch.ones_like(x)]) if guided else torch.ones_like(x)

    x0, grid = torch.zeros(1, 4, 2), time_grid(8)
    guided = True
    out = euler_integrate(velocity, x0, grid, cfg=2.0)
    assert torch.allclose(out, torch.full_like(x0, 1 + 2 * (1 - -1)))
    guided = False
    for cfg in (0.0, 1e-6, -3.0):  # below 1e-5: the conditional branch alone
        assert torch.allclose(euler_integrate(velocity, x0, grid, cfg), torch.ones_like(x0))


def test_cfg_and_dt_in_velocity_dtype_added_into_fp32():
    x = torch.zeros(1, 2, 2)
    out = euler_integrate(lambda x, t: torch.full((1, 2, 2), 1 / 3, dtype=torch.bfloat16), x, time_grid(1), 0.0)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.full_like(x, 1 / 3).bfloat16().float())


def test_noise_is_fp32_and_seeded():
    a, b = initial_noise(5, 64, 123, "cpu"), initial_noise(5, 64, 123, "cpu")
    assert a.dtype == torch.float32 and a.shape == (1, 5, 64) and torch.equal(a, b)
    assert torch.equal(a[0], torch.randn(5, 64, generator=torch.Generator().manual_seed(123)))
    assert not torch.equal(a, initial_noise(5, 64, 124, "cpu"))


def _config(**extra):
    return {"vae": VAE_SECTION, **extra}


def test_base_schedule_resolution():
    policy = SchedulePolicy(_config())
    s = policy.resolve()
    assert s.steps == 32 and s.cfg == 2.0 and torch.equal(s.grid, time_grid(32, -1.0))
    s = policy.resolve(num_steps=6, guidance=0.0, sway=0.0)
    assert s.steps == 6 and not s.guided and torch.equal(s.grid, time_grid(6))
    s = policy.resolve(num_steps=6, sway=1.0, t_grid=[0.0, 0.5, 1.0])  # an explicit grid wins
    assert s.steps == 2
    assert SchedulePolicy(_config(defaults={"nfe": 8, "cfg": 1.5, "sway": None})).resolve().grid.equal(time_grid(8))


def test_flash_locks_its_recipe(caplog):
    policy = SchedulePolicy(_config(variant="flash", flash_t_grid=FLASH_T_GRID))
    with caplog.at_level(logging.WARNING, logger="auk_triton.diffusion.sampler"):
        locked = [policy.resolve(num_steps=50, guidance=4.0, sway=0.3), policy.resolve(num_steps=7), policy.resolve()]
    for s in locked:
        assert s.steps == 4 and s.cfg == 0.0 and not s.guided
        assert s.grid.tolist() == FLASH_T_GRID  # the stored values, exactly
    assert caplog.text.count("locked recipe") == 1  # a single warning
    for grid in (None, FLASH_T_GRID[:4]):
        with pytest.raises(CheckpointError, match="flash_t_grid"):
            SchedulePolicy(_config(variant="flash", flash_t_grid=grid))


@pytest.fixture(scope="module")
def sampler(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("dit")
    (ckpt / "config.json").write_text(json.dumps(_config()))
    write_synthetic_dit_checkpoint(ckpt, "small", seed=0)
    return load_sampler(ckpt)


def _text(tokens=6, seed=0):
    return torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(seed))


def test_same_seed_same_latents(sampler):
    req = Request(_text(), gen_seconds=0.2, seed=5, num_steps=4)
    a = sampler.generate(req)
    assert a.shape == (10, 64) and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.equal(a, sampler.generate(req))
    assert not torch.equal(a, sampler.generate(Request(_text(), 0.2, seed=6, num_steps=4)))
    assert not torch.equal(a, sampler.generate(Request(_text(seed=1), 0.2, seed=5, num_steps=4)))


def test_one_forward_per_step_batch_two_when_guided(sampler, monkeypatch):
    batches = []
    step = sampler.model.step
    monkeypatch.setattr(sampler.model, "step", lambda x, t, ctx: batches.append(ctx.copies * x.shape[0]) or step(x, t, ctx))
    sampler.generate(Request(_text(), 0.1, 0, num_steps=3, guidance=2.0))
    assert batches == [2, 2, 2]
    batches.clear()
    sampler.generate(Request(_text(), 0.1, 0, num_steps=5, guidance=0.0, ref_latents=torch.randn(4, 64)))
    assert batches == [1] * 5


def test_runs_of_one_time_grid_compute_its_modulation_table_once_and_sample_as_a_fresh_sampler_does(
    sampler, tmp_path, monkeypatch
):
    computed = []
    table = sampler.model.modulation_table
    monkeypatch.setattr(sampler.model, "modulation_table",
                        lambda times: computed.append(tuple(times.tolist())) or table(times))
    sampler._tables.clear()
    four = Request(_text(), 0.1, 3, num_steps=4)
    first, again = sampler.generate(four), sampler.generate(Request(_text(seed=2), 0.2, 4, num_steps=4))
    sampler.generate(Request(_text(), 0.1, 3, num_steps=5))
    assert len(computed) == 2, "one table per grid: the second run of four steps looked its table up"
    assert computed[0] == tuple(sampler.plan(four).schedule.grid[:-1].tolist())
    assert torch.equal(sampler.generate(four), first) and again.shape == (10, 64)
    ckpt = tmp_path / "dit"  # a sampler that never ran: its own table, the same latents
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(_config()))
    write_synthetic_dit_checkpoint(ckpt, "small", seed=0)
    assert torch.equal(load_sampler(ckpt).generate(four), first)
    for steps in range(6, 6 + MODULATION_TABLES_KEPT + 2):  # the kept tables stay bounded
        sampler.generate(Request(_text(), 0.1, 3, num_steps=steps))
    assert len(sampler._tables) == MODULATION_TABLES_KEPT


def test_should_stop_is_asked_before_any_work_and_between_steps_and_stops_the_sampling(sampler, monkeypatch):
    steps = []
    step = sampler.model.step
    monkeypatch.setattr(sampler.model, "step", lambda x, t, ctx: steps.append(float(t)) or step(x, t, ctx))
    request = Request(_text(), 0.1, 0, num_steps=5, guidance=0.0)

    asked = []
    out = sampler.generate(request, should_stop=lambda: asked.append(len(steps)) or False)
    assert asked == [0, 1, 2, 3, 4], "before sampling, then before each step after the first"
    assert torch.equal(out, sampler.generate(request)), "asking changes nothing"

    steps.clear()
    with pytest.raises(SamplingStopped, match="before sampling"):
        sampler.generate(request, should_stop=lambda: True)
    assert steps == []

    answers = iter([False, False, False, True])
    with pytest.raises(SamplingStopped, match="before step 4 of 5"):
        sampler.generate(request, should_stop=lambda: next(answers))
    assert len(steps) == 3


def test_reference_latents_edit_mode(sampler):
    ref = torch.randn(7, 64)
    out = sampler.generate(Request(_text(), None, 1, num_steps=2, ref_latents=ref))
    assert out.shape == (7, 64)  # no duration: as long as the reference
    same = sampler.generate(Request(_text(), 0.2, 1, num_steps=2, ref_latents=torch.zeros(0, 64)))
    assert torch.equal(same, sampler.generate(Request(_text(), 0.2, 1, num_steps=2)))  # empty = absent


def test_target_length_and_limits(sampler):
    plan = lambda **kw: sampler.plan(Request(_text(), **{"seed": 0, **kw}))  # noqa: E731
    assert plan(gen_seconds=0.1).frames == 5 and plan(gen_seconds=10.0).frames == 500
    assert plan(gen_seconds=0.001).frames == 1 and plan(gen_seconds=0.021).frames == 2
    assert plan(gen_seconds=1e6).frames == MAX_LATENT_FRAMES  # clamped to the budget
    assert plan(gen_seconds=1e6, ref_latents=torch.zeros(100, 64)).frames == MAX_LATENT_FRAMES - 100
    bad = [
        (dict(gen_seconds=0.0), "positive"),
        (dict(gen_seconds=-1.0), "positive"),
        (dict(gen_seconds=float("nan")), "positive"),
        (dict(gen_seconds=None), "needs a duration"),
        (dict(gen_seconds=1.0, num_steps=0), "at least 1"),
        (dict(gen_seconds=1.0, guidance=float("inf")), "guidance"),
        (dict(gen_seconds=1.0, ref_latents=torch.zeros(MAX_LATENT_FRAMES, 64)), "MAX_LATENT_FRAMES"),
        (dict(gen_seconds=1.0, ref_latents=torch.zeros(3, 8)), "reference latents"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            plan(**kwargs)
    with pytest.raises(ValueError, match="prompt embeddings"):
        sampler.plan(Request(torch.zeros(4, 1024), 1.0, 0))
    with pytest.raises(ValueError, match="prompt embeddings"):
        sampler.plan(Request(torch.zeros(0, 2048), 1.0, 0))
    with pytest.raises(ValueError, match="finite"):
        sampler.plan(Request(torch.full((2, 2048), float("nan")), 1.0, 0))


def test_flash_checkpoint_runs_four_unguided_steps(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(_config()))
    write_synthetic_dit_checkpoint(tmp_path, "small", seed=0, variant="flash")
    flash = AuKDiTSampler.from_checkpoint(tmp_path)
    assert flash.variant == "flash"
    batches = []
    step = flash.model.step
    monkeypatch.setattr(flash.model, "step", lambda x, t, ctx: batches.append(ctx.copies) or step(x, t, ctx))
    a = flash.generate(Request(_text(), 0.1, 3, num_steps=32, guidance=3.0, sway=0.5))
    assert batches == [1, 1, 1, 1]
    assert torch.equal(a, flash.generate(Request(_text(), 0.1, 3)))  # the knobs changed nothing


def test_a_serving_frame_limit_bounds_reference_plus_target(sampler):
    sampler.max_frames = 100
    try:
        assert sampler.plan(Request(_text(), 2.0, 0)).frames == 100
        with pytest.raises(ValueError, match="max_frames of 100"):
            sampler.plan(Request(_text(), 2.0, 0, ref_latents=torch.zeros(1, 64)))
        with pytest.raises(ValueError, match="0 reference \\+ 105 target frames exceed this model's max_frames of 100"):
            sampler.plan(Request(_text(), 2.1, 0))
    finally:
        sampler.max_frames = None
