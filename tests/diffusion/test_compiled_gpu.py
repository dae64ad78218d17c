"""The compiled, bucketed DiT step on CUDA (skipped without a GPU): its accuracy against the eager
bf16 step, no capture or compilation at request time once the buckets are warm, and a restart that
loads the blocks' saved traces and traces nothing."""

import json
import threading
import time

import pytest
import torch
from torch._dynamo.utils import counters

from auk_triton.diffusion import CompileOptions, Request, ShapeBuckets, load_sampler
from auk_triton.diffusion.compiled import traces_note
from auk_triton.diffusion.synthetic import write_synthetic_dit_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Few buckets: each guidance mode x request count is a graph to capture at warm-up.
BUCKETS = ShapeBuckets(text=(8,), frames=(32, 64), ref=(16,), max_tokens=3 * 2 * 88, max_requests=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dit_compiled_gpu")
    (path / "config.json").write_text(json.dumps({"vae": {"latent_dim": 64, "downsample_rate": 480, "target_sample_rate": 24000}}))
    return write_synthetic_dit_checkpoint(path, "small", seed=0)


@pytest.fixture(scope="module")
def served(checkpoint):
    """The sampler as auk_dit serves it on a GPU: buckets, compiled step, warmed up."""
    torch._dynamo.reset()
    sampler = load_sampler(checkpoint, "cuda", max_graphs=4, buckets=BUCKETS, compile=CompileOptions())
    sampler.warmup()
    return sampler


def _request(seed, seconds, tokens, ref_frames=0, **knobs):
    g = torch.Generator().manual_seed(100 + seed)
    text = torch.randn(tokens, 2048, generator=g)
    ref = torch.randn(ref_frames, 64, generator=g) if ref_frames else None
    return Request(text, seconds, seed, num_steps=4, ref_latents=ref, **knobs)


def _rel_l2(actual, expected):
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("guidance", [0.0, 2.0], ids=["unguided", "guided"])
def test_the_compiled_graphed_step_follows_the_eager_bf16_step(served, guidance):
    requests = [_request(1, 0.6, 7, guidance=guidance), _request(2, 0.3, 4, ref_frames=9, guidance=guidance)]
    plans = [served.plan(r) for r in requests]
    with torch.inference_mode():
        ctx, noise, mask = served._batch_context(plans, plans[0].schedule.guided)
        t = plans[0].schedule.grid[1]
        with served._autocast():
            eager = served.model.step(noise, t, ctx).float()  # the eager bf16 step on the same inputs
        step = served.graphs.velocity(ctx, noise.shape)
        assert step is not None and served.graphs.request_captures == 0, "a bucket graph from warm-up"
        compiled = step(noise, t).float()
    valid = mask.repeat(ctx.copies, 1)[..., None].expand_as(eager)
    rel = _rel_l2(compiled[valid], eager[valid])
    print(f"compiled vs eager bf16 velocity, guidance {guidance}: relative L2 {rel:.2e}")
    assert rel <= 1e-2


def test_a_whole_run_of_the_compiled_buckets_follows_the_eager_run(served, checkpoint):
    eager = load_sampler(checkpoint, "cuda")  # bf16, no graphs, no buckets
    for request in (_request(3, 1.0, 8, guidance=0.0), _request(4, 0.5, 6, ref_frames=12, guidance=2.0)):
        rel = _rel_l2(served.generate(request), eager.generate(request))
        print(f"compiled, bucketed run vs eager run: relative L2 {rel:.2e} of the latents")
        assert rel <= 2e-2


def test_requests_joining_runs_between_steps_get_their_own_runs_latents_capture_nothing_and_never_wait(served):
    from auk_triton.diffusion.joined import JoinedRuns

    # A second request of the same bucket joins two steps into the first's four, on a grid of
    # its own (three steps): the compiled graphs replay with a modulation row per request.
    first = _request(5, 0.6, 7, guidance=2.0)
    second = Request(_request(6, 0.5, 5, guidance=1.5).prompt_embeds, 0.5, 6, num_steps=3, guidance=1.5)
    own = {tag: served.generate(r) for tag, r in (("first", first), ("second", second))}
    captures = served.graphs.captures
    runs, results = JoinedRuns(served, 16), {}
    plans = {"first": served.plan(first), "second": served.plan(second)}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # queuing the steps never waits for the GPU
    try:
        runs.submit(plans["first"], "first")
        for step in range(8):
            if step == 2:
                runs.submit(plans["second"], "second")
            results.update(runs.step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert set(results) == {"first", "second"} and runs.steps == 5 and runs.stepped_rows == 7
    for tag, latents in results.items():
        assert latents.device.type == "cpu" and latents.is_pinned(), "handed back in host memory"
        rel = _rel_l2(latents, own[tag].cpu())
        print(f"joined between steps vs its own run ({tag}): relative L2 {rel:.2e} of the latents")
        assert rel <= 1e-2, tag  # bf16: a batch of two rounds apart from a run of one
    assert served.graphs.captures == captures and served.graphs.request_captures == 0


def test_latents_kept_on_the_gpu_leave_with_the_step_that_makes_them_and_equal_those_sent_to_the_host(served):
    from auk_triton.diffusion import NonFiniteLatents
    from auk_triton.diffusion.joined import DeviceLatents, JoinedRuns

    request = _request(7, 0.6, 7, guidance=2.0)
    plans = {"host": served.plan(request), "device": served.plan(request)}
    host, kept = JoinedRuns(served, 16), JoinedRuns(served, 16, keep_on_device=lambda: True)
    results = {}
    host.submit(plans["host"], "host")
    while len(host):
        results.update(host.step())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # handing them over never waits for the GPU
    try:
        kept.submit(plans["device"], "device")
        steps = [kept.step() for _ in range(request.num_steps)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert steps[:-1] == [[]] * (request.num_steps - 1) and not len(kept), "handed back with its last step"
    (tag, left), = steps[-1]
    assert tag == "device" and isinstance(left, DeviceLatents) and left.latents.is_cuda
    left.ready.synchronize()
    left.check()
    assert torch.equal(left.latents.cpu(), results["host"]), "the same latents as the host copy"

    nan = DeviceLatents.behind(torch.full((4, 64), float("nan"), device="cuda"))
    nan.ready.synchronize()
    with pytest.raises(NonFiniteLatents, match="non-finite latents"):
        nan.check()


def test_the_sampling_thread_keeps_one_step_queued_ahead_of_the_gpu_and_no_more(served):
    from auk_triton.diffusion.joined import STEPS_QUEUED_AHEAD, JoinedRuns

    assert STEPS_QUEUED_AHEAD == 1
    runs = JoinedRuns(served, 16)
    runs.submit(served.plan(_request(8, 0.6, 7, guidance=0.0)), "one")
    before = []  # an event before each step call, behind a stretch of GPU work that holds it back
    while len(runs):
        torch.cuda._sleep(20_000_000)
        before.append(torch.cuda.Event())
        before[-1].record()
        runs.step()
        if len(before) > 1:
            assert before[-2].query(), "two steps were still to run when the call returned"
        if len(runs):
            assert not before[-1].query(), "the call waited for the step it queued, not the one before"
    assert len(before) == 4


def test_requests_in_the_buckets_capture_and_compile_nothing(served):
    graphs = served.graphs
    assert graphs.captures == BUCKETS.graphs() and graphs.compile_failures == 0
    compiled = counters["stats"]["unique_graphs"]
    captures = graphs.captures
    requests = [
        _request(10, 0.1, 3, guidance=0.0), _request(11, 0.64, 8, guidance=0.0), _request(12, 1.28, 5, guidance=2.0),
        _request(13, 0.5, 2, ref_frames=16, guidance=0.0), _request(14, 0.9, 8, ref_frames=3, guidance=3.0),
    ]
    for size in (1, 2, 3):  # runs of every request count each bucket holds
        plans = [served.plan(r) for r in requests for _ in range(size)]
        for run in served.runs(plans, max_requests=3):
            results = served.generate_batch([plans[i] for i in run])
            assert all(torch.isfinite(r).all() for r in results)
    assert (graphs.captures, graphs.request_captures, graphs.eager_runs) == (captures, 0, 0)
    assert counters["stats"]["unique_graphs"] == compiled, "no compilation at request time"
    # A request past the largest bucket is the fallback, captured now and counted.
    served.generate(_request(15, 2.0, 4, guidance=0.0))
    assert graphs.request_captures == 1 and counters["stats"]["unique_graphs"] == compiled


def test_buckets_built_after_ready_leave_their_runs_to_a_larger_bucket_meanwhile_and_capture_nothing_then(
        checkpoint):
    sampler = load_sampler(checkpoint, "cuda", max_graphs=4, buckets=BUCKETS, compile=CompileOptions())
    eager = load_sampler(checkpoint, "cuda")
    pending = sampler.warmup(defer=True)
    ready = sampler.ready_buckets()
    assert {(item.shape, item.guided) for item in pending} == {
        (s, g) for s in BUCKETS.shapes() for g in (False, True)} - ready
    assert sampler.graphs.captures == sum(BUCKETS.requests(s, g) for s, g in ready)
    requests = [_request(20, 0.5, 4, guidance=0.0), _request(21, 0.3, 6, ref_frames=10, guidance=2.0)]
    expected = [eager.generate(r) for r in requests]
    plans = [sampler.plan(r) for r in requests]
    done, reports = threading.Event(), []
    sampler.start_deferred(pending, on_done=lambda report: reports.append(report) or done.set())
    served_meanwhile, on_own_bucket_meanwhile, deadline = 0, set(), time.monotonic() + 120
    try:
        while not done.is_set() and time.monotonic() < deadline:  # served beside the builder, as auk_dit serves
            for index, (plan, reference) in enumerate(zip(plans, expected)):
                assert sampler.runs([plan], max_requests=3) == [[0]]
                if sampler.bucket(plan) == sampler.own_bucket(plan) and not done.is_set():
                    on_own_bucket_meanwhile.add(index)
                assert _rel_l2(sampler.generate_batch([plan])[0], reference) <= 2e-2
            served_meanwhile += 1
        assert done.wait(max(0.0, deadline - time.monotonic())), "the deferred buckets were built"
    finally:
        sampler.stop_deferred()
    runs_on_larger = sampler.pending_runs
    for request, reference in zip(requests, expected):  # on their own buckets now
        assert _rel_l2(sampler.generate(request), reference) <= 2e-2
    graphs = sampler.graphs
    print(f"{served_meanwhile} rounds served while building, {runs_on_larger} runs on a larger bucket, "
          f"{reports[0].preferred} builds asked for ahead of their turn")
    assert served_meanwhile >= 1 and runs_on_larger >= 1 and sampler.pending_runs == runs_on_larger
    assert on_own_bucket_meanwhile == {0, 1}, "a lone request met its own bucket before the builder ended"
    assert sampler.deferred_pending == 0 and graphs.captures == BUCKETS.graphs()
    assert (graphs.request_captures, graphs.eager_runs, graphs.compile_failures) == (0, 0, 0)


def test_a_restart_loads_the_blocks_saved_traces_traces_nothing_and_gives_the_same_velocity_bit_for_bit(
        checkpoint, tmp_path):
    def started():
        sampler = load_sampler(checkpoint, "cuda", max_graphs=4, buckets=BUCKETS,
                               compile=CompileOptions(traces_dir=tmp_path / "traces"))
        sampler.warmup()
        return sampler

    def velocity(sampler):
        requests = (_request(30, 0.6, 7, guidance=2.0), _request(31, 0.3, 4, ref_frames=9, guidance=2.0))
        plans = [sampler.plan(r) for r in requests]
        with torch.inference_mode():
            ctx, noise, _ = sampler._batch_context(plans, plans[0].schedule.guided)
            return sampler.graphs.velocity(ctx, noise.shape)(noise, plans[0].schedule.grid[1]).clone()

    torch._dynamo.reset()
    first = started()
    blocks = first.graphs.blocks
    # On a GPU the double blocks run uncompiled (compiled.py): the single blocks' traces are what is saved.
    assert blocks.single.traced >= 1 and blocks.single.loaded == 0 and first.graphs.compile_failures == 0
    expected = velocity(first)
    torch._dynamo.reset()  # a new process, as far as Dynamo knows
    graphs_before = counters["stats"]["unique_graphs"]
    restarted = started()
    blocks = restarted.graphs.blocks
    notes = traces_note(blocks)
    assert counters["stats"]["unique_graphs"] == graphs_before, f"the restart traced: {notes}"
    assert blocks.single.traced == 0 and blocks.single.loaded >= 1
    assert restarted.graphs.compile_failures == 0
    assert torch.equal(velocity(restarted), expected)


def test_the_fp8_linears_compiled_graphed_step_and_runs_stay_near_the_eager_bf16_ones(checkpoint):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    served = load_sampler(checkpoint, "cuda", max_graphs=4, buckets=BUCKETS, compile=CompileOptions(),
                          fp8_linears=True)
    served.warmup()
    eager = load_sampler(checkpoint, "cuda")  # bf16, no graphs, no buckets, bf16 linears
    plans = [served.plan(r) for r in (_request(40, 0.6, 7, guidance=2.0), _request(41, 0.3, 4, ref_frames=9,
                                                                                  guidance=2.0))]
    with torch.inference_mode():
        ctx, noise, mask = served._batch_context(plans, True)
        t = plans[0].schedule.grid[1]
        with eager._autocast():
            expected = eager.model.step(noise, t, ctx).float()
        step = served.graphs.velocity(ctx, noise.shape)
        assert step is not None and served.graphs.request_captures == 0 and served.graphs.compile_failures == 0
        got = step(noise, t).float()
    valid = mask.repeat(ctx.copies, 1)[..., None].expand_as(expected)
    velocity = _rel_l2(got[valid], expected[valid])
    request = _request(42, 1.0, 8, guidance=0.0)
    run = _rel_l2(served.generate(request), eager.generate(request))
    print(f"FP8 linears, compiled and graphed, against eager bf16: velocity {velocity:.2e}, "
          f"a 4-step run's latents {run:.2e}")
    assert velocity <= 5e-2 and run <= 1e-1
