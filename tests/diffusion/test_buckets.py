"""Shape buckets (CPU, fp32): which bucket a request lands on, and padding up to it changes nothing."""

import pytest
import torch

from auk_triton.diffusion.buckets import RunShape, ShapeBuckets
from auk_triton.diffusion.compiled import CompileOptions, compiled_blocks
from auk_triton.diffusion.deferred import DeferredGraphs
from auk_triton.diffusion.sampler import Request, load_sampler
from auk_triton.diffusion.synthetic import PRESETS
from auk_triton.diffusion.transformer import AuKTransformer

from dit_inputs import max_error, prompt, reference, small_checkpoint, stand_in_graphs  # beside this file

TOLERANCE = 1e-5  # fp32: padding and masks, not rounding, would show above this
BUCKETS = ShapeBuckets(text=(8, 16), frames=(16, 32), ref=(8, 24), max_tokens=4 * 2 * 56, max_requests=16)


def test_a_request_lands_on_the_smallest_bucket_that_holds_each_of_its_lengths():
    assert BUCKETS.shape(1, 1) == RunShape(8, 16, 0)
    assert BUCKETS.shape(8, 16) == RunShape(8, 16, 0)  # a length equal to a bucket fills it
    assert BUCKETS.shape(9, 17, 8) == RunShape(16, 32, 8)
    assert BUCKETS.shape(3, 5, 9) == RunShape(8, 16, 24)
    assert BUCKETS.shape(3, 5, 0) == RunShape(8, 16, 0)  # no reference: none padded in
    # Past the largest of any list: no bucket (the request runs alone at its own shape).
    assert BUCKETS.shape(17, 5) is None and BUCKETS.shape(3, 33) is None and BUCKETS.shape(3, 5, 25) is None
    # Unsorted lists with repeats are the same buckets.
    assert ShapeBuckets((16, 8, 8), (32, 16), (24, 8), 448, 16) == BUCKETS
    assert len(BUCKETS.shapes()) == 2 * 2 * 3  # text x target x (no reference and two sizes)
    with pytest.raises(ValueError, match="positive"):
        ShapeBuckets((0, 8), (16,), (), 448, 16)


def test_a_bucket_holds_the_requests_that_fit_its_token_budget_and_always_one():
    shape = RunShape(8, 16, 0)  # 24 tokens a row
    assert BUCKETS.requests(shape, guided=False) == 16  # 448 // 24 = 18, capped at max_requests
    assert BUCKETS.requests(shape, guided=True) == 9  # guided rows count twice: 448 // 48
    assert BUCKETS.requests(RunShape(16, 32, 24), guided=False) == 6  # 448 // 72
    assert BUCKETS.requests(RunShape(16, 32, 24), guided=True) == 3
    assert ShapeBuckets((8,), (16,), (), 10, 16).requests(shape, guided=True) == 1  # a request alone may exceed it
    assert BUCKETS.graphs() == sum(BUCKETS.requests(s, g) for s in BUCKETS.shapes() for g in (False, True))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("dit_buckets"))


@pytest.fixture(scope="module")
def plain(checkpoint):
    return load_sampler(checkpoint)


@pytest.fixture(scope="module")
def bucketed(checkpoint):
    return load_sampler(checkpoint, buckets=BUCKETS)


def test_runs_gather_plans_of_one_bucket_up_to_what_it_holds_and_longer_ones_run_alone(bucketed):
    small = [bucketed.plan(Request(prompt(5, s), 0.2, s, num_steps=2, guidance=2.0)) for s in range(11)]  # (8, 16)
    other = bucketed.plan(Request(prompt(12, 0), 0.2, 0, num_steps=2, guidance=2.0))  # (16, 16)
    long = bucketed.plan(Request(prompt(5, 0), 0.8, 0, num_steps=2, guidance=2.0))  # 40 frames: past 32
    assert bucketed.bucket(small[0]) == RunShape(8, 16, 0) and bucketed.bucket(long) is None
    plans = small[:4] + [other, long] + small[4:] + [long]
    runs = bucketed.runs(plans, max_requests=16)
    assert runs == [[0, 1, 2, 3, 6, 7, 8, 9, 10], [4], [5], [11, 12], [13]]  # 9 guided requests fill (8, 16)
    assert bucketed.runs(plans, max_requests=2)[:3] == [[0, 1], [2, 3], [4]]


def test_a_request_too_long_is_refused_as_before_buckets(bucketed):
    bucketed.max_frames = 40
    try:
        with pytest.raises(ValueError, match="max_frames of 40"):
            bucketed.plan(Request(prompt(3, 0), 1.0, 0))
        assert bucketed.plan(Request(prompt(3, 0), 0.8, 0)).frames == 40  # past every bucket, not refused
    finally:
        bucketed.max_frames = None


@torch.no_grad()
def test_a_row_padded_up_to_its_bucket_gives_its_own_velocity():
    torch.manual_seed(0)
    model = AuKTransformer(latent_dim=64, **PRESETS["small"]).eval()
    g = torch.Generator().manual_seed(3)
    x, text, ref = torch.randn(1, 11, 64, generator=g), torch.randn(1, 5, 2048, generator=g), torch.randn(1, 6, 64, generator=g)
    t = torch.tensor(0.4)
    pad = lambda u, k: torch.cat([u, torch.zeros(1, k, u.shape[-1])], dim=1)  # noqa: E731
    valid = lambda n, k: torch.cat([torch.ones(1, n, dtype=torch.bool), torch.zeros(1, k, dtype=torch.bool)], 1)  # noqa: E731
    for guided in (False, True):
        alone = model(x, text, t, ref=ref, cfg_infer=guided)
        # Up to the bucket (16 tokens, 32 frames, 24 reference frames), as a bucketed run pads it.
        padded = model(pad(x, 21), pad(text, 11), t, ref=pad(ref, 18), c_mask=valid(5, 11), ref_mask=valid(6, 18),
                       mask=valid(11, 21), cfg_infer=guided)
        assert padded.shape[1] == 32
        assert max_error(padded[:, :11], alone) < TOLERANCE


@pytest.mark.parametrize("guidance", [0.0, 2.0], ids=["unguided", "guided"])
def test_a_bucketed_run_of_mixed_lengths_gives_each_request_its_result_alone(plain, bucketed, guidance):
    requests = [
        Request(prompt(5, 0), 0.2, 1, num_steps=3, guidance=guidance),
        Request(prompt(9, 1), 0.14, 2, num_steps=3, guidance=guidance * 0.75),
        Request(prompt(3, 2), 0.3, 3, num_steps=3, guidance=guidance, ref_latents=reference(6, 2)),
        Request(prompt(11, 3), 0.3, 4, num_steps=3, guidance=guidance, ref_latents=reference(4, 3)),
    ]
    plans = [bucketed.plan(r) for r in requests]
    contexts = []
    step = bucketed.model.step
    bucketed.model.step = lambda x, t, ctx: contexts.append(ctx) or step(x, t, ctx)
    try:
        rows = bucketed.generate_batch(plans)
    finally:
        del bucketed.model.step
    ctx = contexts[0]
    assert ctx.c.shape[1] == 16 and ctx.n == 16 and ctx.prompt.shape[1] == 8  # the bucket (16, 16, 8)
    assert ctx.joint_bias is not None  # a bucketed run is masked
    for request, plan, row in zip(requests, plans, rows):
        alone = plain.generate(request)  # no buckets, no padding, no masks
        assert row.shape == alone.shape == (plan.frames, 64)
        assert max_error(row, alone) < TOLERANCE, (plan.frames, plan.text.shape)
        assert max_error(bucketed.generate(request), alone) < TOLERANCE  # a run of one, padded alone


@torch.no_grad()
def test_compiled_blocks_trace_whole_and_one_compilation_serves_every_bucket():
    # Dynamo's tracing without code generation (the "eager" backend): fullgraph, so a graph
    # break would raise; the GPU tests run Inductor's code.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AuKTransformer(latent_dim=64, **PRESETS["small"]).eval()
    blocks = compiled_blocks(CompileOptions(backend="eager"))
    mod = model.modulation_at(torch.tensor(0.3))
    from torch._dynamo.utils import counters

    counters.clear()
    for rows, frames, tokens, ref in ((2, 16, 8, 0), (3, 32, 16, 0), (2, 32, 8, 24)):
        mask = torch.ones(rows, frames, dtype=torch.bool)
        mask[0, -3:] = False
        ref_latents = torch.randn(rows, ref, 64) if ref else None
        ref_mask = torch.ones(rows, ref, dtype=torch.bool) if ref else None
        ctx = model.prepare(torch.randn(rows, tokens, 2048), frames, mask=mask, ref=ref_latents, ref_mask=ref_mask)
        x = torch.randn(rows, frames, 64)
        assert torch.equal(model.velocity(x, mod, ctx, blocks), model.velocity(x, mod, ctx))
        if ref == 0 and frames == 16:
            compiled = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == compiled, "the other shapes reused the first compilation"
    torch._dynamo.reset()


def test_bucket_graphs_serve_every_run_of_their_bucket_from_shared_buffers(plain, checkpoint, monkeypatch):
    # The graph cache's bookkeeping on the CPU: warm-up contexts whose keys a run must find,
    # smaller runs reading the front of a bucket's buffers, each run's inputs copied in.
    from auk_triton.diffusion import step_graph

    stand_in_graphs(monkeypatch)
    buckets = ShapeBuckets(text=(8, 16), frames=(16,), ref=(8,), max_tokens=4 * 2 * 40, max_requests=4)
    sampler = load_sampler(checkpoint, buckets=buckets)
    sampler.graphs = step_graph.DiTGraphCache(sampler.model, sampler._autocast, max_graphs=0)
    sampler.warmup()
    graphs = sampler.graphs
    assert graphs.captures == buckets.graphs() == 4 * 2 * 4  # every bucket holds 4 requests, guided or not
    requests = [
        Request(prompt(5, 0), 0.2, 1, num_steps=2, guidance=0.0),
        Request(prompt(12, 1), 0.3, 2, num_steps=2, guidance=2.0),
        Request(prompt(3, 2), 0.1, 3, num_steps=2, guidance=0.0, ref_latents=reference(7, 2)),
        Request(prompt(7, 3), 0.3, 4, num_steps=2, guidance=1.5),
    ]
    for batch in ([requests[0]], requests[:2] * 2, [requests[2], requests[0]], [requests[3], requests[1], requests[3]]):
        plans = [sampler.plan(r) for r in batch]
        for run in sampler.runs(plans, max_requests=4):
            rows = sampler.generate_batch([plans[i] for i in run])
            for i, row in zip(run, rows):
                assert max_error(row, plain.generate(batch[i])) < TOLERANCE
    assert (graphs.captures, graphs.request_captures, graphs.eager_runs) == (32, 0, 0)
    sampler.generate(Request(prompt(3, 4), 0.4, 5, num_steps=2, guidance=0.0))  # 20 frames: past the bucket
    assert graphs.eager_runs == 1, "with max_graphs 0, a run past the buckets steps eagerly, counted"


def test_a_bucket_still_being_built_leaves_its_runs_to_the_smallest_built_bucket_that_holds_them(
        plain, checkpoint, monkeypatch):
    # Deferred buckets (built after READY on a thread of their own): meanwhile a run takes a
    # larger bucket's graphs, counted, with the same result; never a capture at request time.
    from auk_triton.diffusion import step_graph

    stand_in_graphs(monkeypatch)
    sampler = load_sampler(checkpoint, buckets=BUCKETS)
    sampler.graphs = graphs = step_graph.DiTGraphCache(sampler.model, sampler._autocast, max_graphs=0)
    asked = []
    monkeypatch.setattr(sampler._builder, "prefer", asked.append)
    pending = sampler.warmup(defer=True)
    ready = {(RunShape(16, 32, ref), guided) for ref in (0, 8, 24) for guided in (False, True)}
    assert sampler.ready_buckets() == ready
    assert {(item.shape, item.guided) for item in pending} == {
        (s, g) for s in BUCKETS.shapes() for g in (False, True)} - ready
    single = DeferredGraphs(RunShape(8, 16, 0), False, range(1, 2))
    assert pending[0] == single, "the smallest bucket's single-request graph is built first"
    assert graphs.captures == sum(BUCKETS.requests(s, g) for s, g in ready)
    captures = graphs.captures

    short = Request(prompt(5, 0), 0.2, 1, num_steps=2, guidance=0.0)  # its own bucket: (8, 16, 0)
    edit = Request(prompt(3, 1), 0.1, 2, num_steps=2, guidance=2.0, ref_latents=reference(7, 1))  # (8, 16, 8)
    for request, holder in ((short, RunShape(16, 32, 0)), (edit, RunShape(16, 32, 8))):
        plans = [sampler.plan(request)] * 3
        runs = sampler.runs(plans, max_requests=16)
        assert sampler.bucket(plans[0]) == holder and runs == [[0, 1, 2]]
        for row in sampler.generate_batch(plans):
            assert max_error(row, plain.generate(request)) < TOLERANCE
    batched = DeferredGraphs(RunShape(8, 16, 0), False, range(2, 17))
    assert asked[:2] == [batched, single], "the runs asked for their own bucket's graphs, the single one last"
    assert sampler.pending_runs == 2
    assert (graphs.captures, graphs.request_captures, graphs.eager_runs) == (captures, 0, 0)

    # The builder hands the single-request graph over; the serving thread takes it at its next
    # run. A lone request is served on its own bucket, several apart, counted.
    sampler._builder.hand_over(single, graphs.bucket_graphs(*sampler._warmup_inputs(single.shape, False),
                                                            requests=single.requests))
    assert sampler.runs([sampler.plan(short)], max_requests=16) == [[0]] and sampler.split_runs == 0
    assert sampler.bucket(sampler.plan(short)) == RunShape(8, 16, 0)
    assert max_error(sampler.generate(short), plain.generate(short)) < TOLERANCE
    assert sampler.pending_runs == 2 and graphs.captures == captures + 1
    asked.clear()
    assert sampler.runs([sampler.plan(short)] * 3, max_requests=16) == [[0], [1], [2]]
    assert sampler.split_runs == 2 and asked == [batched]
    # Its batched graphs come next: the three share a run again.
    sampler._builder.hand_over(batched, graphs.bucket_graphs(*sampler._warmup_inputs(batched.shape, False),
                                                             requests=batched.requests))
    assert sampler.runs([sampler.plan(short)] * 3, max_requests=16) == [[0, 1, 2]]
    assert sampler.deferred_pending == len({(item.shape, item.guided) for item in pending}) - 1
    assert graphs.captures == captures + BUCKETS.requests(RunShape(8, 16, 0), False)
    # Graphs whose build failed stay pending: their runs keep the larger bucket.
    failed = DeferredGraphs(RunShape(8, 16, 8), True, range(1, 2))
    sampler._builder.hand_over(failed, None)
    sampler.generate(edit)
    assert sampler.pending_runs == 3 and sampler._deferred.pending(failed.shape, True)
    assert graphs.request_captures == 0
