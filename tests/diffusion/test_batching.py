"""Several requests as the rows of one sampler run (CPU, fp32): each row is its request alone."""

import json

import pytest
import torch

from auk_triton.diffusion.sampler import Request, SamplingStopped, load_sampler, run_key, sampler_runs, time_grid, Schedule
from auk_triton.diffusion.synthetic import write_synthetic_dit_checkpoint

from dit_inputs import max_error, prompt, reference  # beside this file

VAE_SECTION = {"latent_dim": 64, "downsample_rate": 480, "target_sample_rate": 24000}
TOLERANCE = 1e-5  # fp32: padding and masks, not rounding, would show above this


@pytest.fixture(scope="module")
def sampler(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("dit_batch")
    (ckpt / "config.json").write_text(json.dumps({"vae": VAE_SECTION}))
    write_synthetic_dit_checkpoint(ckpt, "small", seed=0)
    return load_sampler(ckpt)


# Prompts, targets and references of different lengths, seeds and guidance scales of their own.
GUIDED = [
    Request(prompt(5, 0), 0.2, 1, num_steps=3, guidance=2.0),
    Request(prompt(9, 1), 0.14, 2, num_steps=3, guidance=1.5),
    Request(prompt(3, 2), 0.3, 3, num_steps=3, guidance=2.0, ref_latents=reference(6, 2)),
    Request(prompt(9, 3), 0.3, 4, num_steps=3, guidance=3.0, ref_latents=reference(4, 3)),
]
UNGUIDED = [
    Request(prompt(4, 4), 0.3, 5, num_steps=2, guidance=0.0),
    Request(prompt(7, 5), 0.1, 6, num_steps=2, guidance=0.0, ref_latents=reference(5, 5)),
    Request(prompt(7, 6), 0.3, 7, num_steps=2, guidance=0.0),
]


@pytest.mark.parametrize("requests", [GUIDED, UNGUIDED], ids=["guided", "unguided"])
def test_a_batched_request_equals_its_alone_result(sampler, requests):
    plans = [sampler.plan(r) for r in requests]
    assert len({run_key(p.schedule) for p in plans}) == 1
    batched = sampler.generate_batch(plans)
    for request, plan, row in zip(requests, plans, batched):
        alone = sampler.generate(request)
        assert row.shape == alone.shape == (plan.frames, 64)
        assert max_error(row, alone) < TOLERANCE, (plan.frames, plan.text.shape)


def test_padding_does_not_reach_a_row_whatever_the_batch_around_it(sampler):
    # The same request next to a longer prompt, a longer target, and a reference: each time
    # it is padded differently (text, target, reference) and each time it is itself.
    me = Request(prompt(4, 7), 0.1, 8, num_steps=2, guidance=0.0)
    alone = sampler.generate(me)
    for other in (
        Request(prompt(12, 8), 0.1, 9, num_steps=2, guidance=0.0),
        Request(prompt(4, 9), 0.4, 9, num_steps=2, guidance=0.0),
        Request(prompt(2, 10), 0.04, 9, num_steps=2, guidance=0.0, ref_latents=reference(8, 10)),
    ):
        rows = sampler.generate_batch([sampler.plan(other), sampler.plan(me)])
        assert max_error(rows[1], alone) < TOLERANCE
        assert max_error(rows[0], sampler.generate(other)) < TOLERANCE


def test_an_unpadded_batch_takes_no_masks_and_each_row_keeps_its_own_noise(sampler, monkeypatch):
    requests = [Request(prompt(6, s), 0.1, s, num_steps=2, guidance=0.0) for s in (20, 21)]
    contexts = []
    step = sampler.model.step
    monkeypatch.setattr(sampler.model, "step", lambda x, t, ctx: contexts.append(ctx) or step(x, t, ctx))
    rows = sampler.generate_batch([sampler.plan(r) for r in requests])
    assert all(c.joint_bias is None and c.target_mask is None for c in contexts)
    assert [c.c.shape[0] for c in contexts] == [2, 2], "one forward of both rows per step"
    monkeypatch.undo()
    assert max_error(rows[0], sampler.generate(requests[0])) < TOLERANCE
    assert not torch.equal(rows[0], rows[1])


def test_a_row_that_fails_fails_alone_and_the_others_get_their_latents(sampler):
    good = [Request(prompt(5, 11), 0.1, 1, num_steps=2), Request(prompt(3, 12), 0.2, 2, num_steps=2)]
    overflowing = Request(torch.full((2, 2048), 3e38), 0.1, 3, num_steps=2)  # finite, overflows the DiT
    rows = sampler.generate_batch([sampler.plan(good[0]), sampler.plan(overflowing), sampler.plan(good[1])])
    assert isinstance(rows[1], RuntimeError) and "non-finite" in str(rows[1])
    for request, row in zip(good, (rows[0], rows[2])):
        assert max_error(row, sampler.generate(request)) < TOLERANCE


def test_a_stopped_row_is_stopped_alone_and_a_run_of_stopped_rows_ends(sampler, monkeypatch):
    requests = [Request(prompt(5, s), 0.1, s, num_steps=4, guidance=0.0) for s in (30, 31)]
    plans = [sampler.plan(r) for r in requests]
    answers = iter([False, False, True])  # row 1 goes before step 3 (asked: start, step 2, step 3)
    rows = sampler.generate_batch(plans, [None, lambda: next(answers)])
    assert isinstance(rows[1], SamplingStopped) and "before step 3 of 4" in str(rows[1])
    assert max_error(rows[0], sampler.generate(requests[0])) < TOLERANCE

    steps = []
    step = sampler.model.step
    monkeypatch.setattr(sampler.model, "step", lambda x, t, ctx: steps.append(t) or step(x, t, ctx))
    rows = sampler.generate_batch(plans, [lambda: len(steps) >= 1, lambda: len(steps) >= 2])
    assert [str(r) for r in rows] == ["before step 2 of 4", "before step 3 of 4"]
    assert len(steps) == 2, "the run ends once every row has stopped"


def test_plans_of_different_grids_or_guidance_modes_do_not_share_a_run(sampler):
    base = Request(prompt(3, 0), 0.1, 0, num_steps=2, guidance=2.0)
    for other in (Request(prompt(3, 0), 0.1, 0, num_steps=3, guidance=2.0),
                  Request(prompt(3, 0), 0.1, 0, num_steps=2, guidance=0.0),
                  Request(prompt(3, 0), 0.1, 0, num_steps=2, guidance=2.0, sway=0.0)):
        plans = [sampler.plan(base), sampler.plan(other)]
        assert run_key(plans[0].schedule) != run_key(plans[1].schedule)
        with pytest.raises(ValueError, match="cannot share a sampler run"):
            sampler.generate_batch(plans)
    # Guidance scales may differ: one run.
    assert run_key(sampler.plan(base).schedule) == run_key(sampler.plan(
        Request(prompt(3, 0), 0.1, 0, num_steps=2, guidance=4.0)).schedule)


def test_runs_gather_the_requests_of_one_key_in_order_up_to_the_row_limit():
    flash, base, other = Schedule(time_grid(4, -1.0), 0.0), Schedule(time_grid(32, -1.0), 2.0), Schedule(time_grid(32, -1.0), 3.0)
    schedules = [flash, base, flash, other, flash, base, flash]
    assert sampler_runs(schedules, max_rows=16) == [[0, 2, 4, 6], [1, 3, 5]]  # base and other: one key
    assert sampler_runs(schedules, max_rows=3) == [[0, 2, 4], [1, 3, 5], [6]]
    assert sampler_runs(schedules, max_rows=1) == [[i] for i in range(7)]  # batching off: as they came
    assert sampler_runs([], max_rows=4) == []


def _context_tensors(ctx):
    fields = ("target_mask", "c_mask", "audio_mask", "single_mask", "joint_bias", "single_bias")
    tables = ("rope_audio", "rope_text", "rope_single", "joint_keys", "single_valid_first")
    return [getattr(ctx, f) for f in fields] + [t for f in tables for t in getattr(ctx, f) or (None,)]


@pytest.mark.parametrize("request_", [GUIDED[2], UNGUIDED[1], UNGUIDED[0]], ids=["guided", "reference", "plain"])
def test_lone_requests_of_one_padding_share_its_masks_and_get_the_context_a_fresh_sampler_builds(sampler, request_):
    plan = sampler.plan(request_)
    guided = plan.schedule.guided
    sampler._masks.clear()
    first, _, _ = sampler._batch_context([plan], guided)
    # The same lengths, another prompt, reference and seed: the masks are the first run's own tensors.
    other = sampler.plan(Request(prompt(request_.prompt_embeds.shape[0], 50), request_.gen_seconds, 60,
                                 num_steps=request_.num_steps, guidance=request_.guidance,
                                 ref_latents=None if request_.ref_latents is None else request_.ref_latents + 1.0))
    second, noise, mask = sampler._batch_context([other], guided)
    assert len(sampler._masks) == 1
    assert all(a is b for a, b in zip(_context_tensors(first), _context_tensors(second)) if a is not None)
    assert not torch.equal(first.c, second.c)
    assert mask is second.target_mask
    # Field by field what a sampler that keeps nothing builds for the same request.
    sampler._masks.clear()
    fresh, fresh_noise, _ = sampler._batch_context([other], guided)
    for kept, built in zip(_context_tensors(second) + [second.c, second.prompt, noise],
                           _context_tensors(fresh) + [fresh.c, fresh.prompt, fresh_noise]):
        assert (kept is None and built is None) or torch.equal(kept, built)


def test_another_padding_a_batch_or_a_warm_up_gets_masks_of_its_own(sampler):
    from auk_triton.diffusion.buckets import RunShape

    plans = [sampler.plan(r) for r in UNGUIDED]
    sampler._masks.clear()
    ctx, _, _ = sampler._batch_context(plans[1:2], False)
    shorter = sampler.plan(Request(prompt(3, 70), 0.1, 71, num_steps=2, guidance=0.0, ref_latents=reference(5, 5)))
    other, _, _ = sampler._batch_context([shorter], False)
    assert other.c_mask.shape != ctx.c_mask.shape and len(sampler._masks) == 2
    batch, _, _ = sampler._batch_context(plans, False)  # several requests: built, not kept
    again, _, _ = sampler._batch_context(plans, False)
    assert again.c_mask is not batch.c_mask and len(sampler._masks) == 2
    plan = plans[1]
    shape = RunShape(text=plan.text.shape[0], frames=plan.frames, ref=plan.ref.shape[0])
    own, _, _ = sampler._batch_context([plan], False, shape)  # a warm-up's: never kept nor shared
    assert own.c_mask is not ctx.c_mask and len(sampler._masks) == 2


def test_a_graph_captured_for_a_run_copies_the_runs_shared_masks_into_buffers_of_its_own(sampler):
    from auk_triton.diffusion.step_graph import _own_buffers, _static_tensors

    ctx, _, _ = sampler._batch_context([sampler.plan(r) for r in UNGUIDED], False)
    own = _own_buffers(ctx)
    for mine, shared in zip(_static_tensors(own), _static_tensors(ctx)):
        assert torch.equal(mine, shared) and mine.data_ptr() != shared.data_ptr()


def test_a_graph_given_a_run_whose_kept_masks_it_holds_already_copies_only_the_runs_own_tensors(
        sampler, monkeypatch):
    from auk_triton.diffusion.step_graph import _GraphedStep, _own_buffers, _static_tensors
    from auk_triton.diffusion.transformer import EAGER_BLOCKS

    from dit_inputs import stand_in_graphs

    stand_in_graphs(monkeypatch)
    request_ = UNGUIDED[1]
    plan = sampler.plan(request_)
    sampler._masks.clear()
    first, x, _ = sampler._batch_context([plan], False)
    mod = sampler.modulation_table(plan.schedule.grid).values[:1]
    graph = _GraphedStep(sampler.model, _own_buffers(first), x, mod, sampler._autocast, None, EAGER_BLOCKS)
    other = sampler.plan(Request(prompt(request_.prompt_embeds.shape[0], 80), request_.gen_seconds, 81,
                                 num_steps=request_.num_steps, guidance=0.0, ref_latents=request_.ref_latents * 2))
    second, _, _ = sampler._batch_context([other], False)
    assert second.rope_audio is first.rope_audio and not torch.equal(second.c, first.c)
    graph.load(first)
    marked = graph.ctx.rope_audio[0]  # a kept tensor's buffer, marked to show whether it is copied again
    marked.fill_(7.0)
    graph.load(second)
    assert torch.equal(graph.ctx.c, second.c), "the run's own prompt projection is copied in"
    assert bool((marked == 7.0).all()), "a kept tensor the graph holds already is not copied again"
    sampler._masks.clear()
    third, _, _ = sampler._batch_context([plan], False)  # equal masks, other tensors: each one copied
    assert third.rope_audio is not first.rope_audio
    graph.load(third)
    for static, source in zip(_static_tensors(graph.ctx), _static_tensors(third)):
        assert torch.equal(static, source)
