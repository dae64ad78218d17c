"""Requests that join a sampler run between steps (CPU, fp32): each row is its request alone."""

import pytest
import torch

from auk_triton.diffusion.buckets import RunShape, ShapeBuckets
from auk_triton.diffusion.joined import JoinedRuns
from auk_triton.diffusion.sampler import Request, SamplingStopped, load_sampler
from auk_triton.diffusion.step_graph import DiTGraphCache

from dit_inputs import max_error, prompt, reference, small_checkpoint, stand_in_graphs  # beside this file

TOLERANCE = 1e-5  # fp32: padding, masks or another row's time, not rounding, would show above this


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("dit_joined"))


@pytest.fixture(scope="module")
def sampler(checkpoint):
    return load_sampler(checkpoint)


def _record_rows(monkeypatch, sampler) -> list[int]:
    """The model rows of every velocity call, recorded."""
    calls = []
    velocity = sampler.model.velocity
    monkeypatch.setattr(sampler.model, "velocity",
                        lambda x, mod, ctx, *a: calls.append(ctx.c.shape[0]) or velocity(x, mod, ctx, *a))
    return calls


def _run(runs: JoinedRuns, arrivals: dict[int, list[tuple[object, Request]]], sampler, stop_after=1000) -> dict:
    """Step `runs`, submitting arrivals[k] before step k, until every request has its result."""
    results, step = {}, 0
    while (step == 0 or len(runs)) and step < stop_after:
        for tag, request in arrivals.get(step, []):
            runs.submit(sampler.plan(request), tag)
        results.update(runs.step())
        step += 1
    return results


def test_a_request_that_joins_a_run_part_way_gets_its_latents_alone(sampler, monkeypatch):
    # The second arrives after two of the first's four steps, on a grid of its own (three
    # steps, another guidance scale, a reference, other lengths): from then on the two share
    # each velocity call, each at its own time.
    first = Request(prompt(5, 0), 0.2, 1, num_steps=4, guidance=2.0)
    second = Request(prompt(9, 1), 0.14, 2, num_steps=3, guidance=1.5, ref_latents=reference(6, 1))
    alone = {"first": sampler.generate(first), "second": sampler.generate(second)}
    calls = _record_rows(monkeypatch, sampler)
    results = _run(JoinedRuns(sampler, 8), {0: [("first", first)], 2: [("second", second)]}, sampler)
    assert calls == [2, 2, 4, 4, 2], "guided rows are two each: alone, together, the second alone again"
    for tag, latents in results.items():
        assert latents.shape == alone[tag].shape
        assert max_error(latents, alone[tag]) < TOLERANCE, tag


def test_unguided_rows_of_different_grids_and_lengths_each_step_on_their_own_grid(sampler, monkeypatch):
    requests = {
        "short": Request(prompt(4, 2), 0.1, 3, num_steps=2, guidance=0.0),
        "long": Request(prompt(7, 3), 0.3, 4, num_steps=5, guidance=0.0, sway=0.0),
        "late": Request(prompt(2, 4), 0.2, 5, num_steps=3, guidance=0.0, ref_latents=reference(5, 4)),
    }
    alone = {tag: sampler.generate(request) for tag, request in requests.items()}
    calls = _record_rows(monkeypatch, sampler)
    arrivals = {0: [("short", requests["short"]), ("long", requests["long"])], 1: [("late", requests["late"])]}
    results = _run(JoinedRuns(sampler, 8), arrivals, sampler)
    assert calls == [2, 3, 2, 2, 1]
    assert set(results) == set(requests)
    for tag, latents in results.items():
        assert max_error(latents, alone[tag]) < TOLERANCE, tag


def test_guided_and_unguided_runs_take_turns_and_a_full_run_keeps_the_next_request_waiting(sampler, monkeypatch):
    guided = [Request(prompt(3 + i, 10 + i), 0.1, 10 + i, num_steps=2, guidance=2.0) for i in range(3)]
    unguided = Request(prompt(6, 20), 0.1, 20, num_steps=2, guidance=0.0)
    alone = [sampler.generate(r) for r in (*guided, unguided)]
    calls = _record_rows(monkeypatch, sampler)
    arrivals = {0: [(i, r) for i, r in enumerate(guided)] + [(3, unguided)]}
    results = _run(JoinedRuns(sampler, max_requests=2), arrivals, sampler)
    # Two guided requests (four rows) at once, the unguided run between their steps, the third
    # guided request once the first two have left.
    assert calls == [4, 1, 4, 1, 2, 2]
    for tag, latents in results.items():
        assert max_error(latents, alone[tag]) < TOLERANCE, tag


def test_a_stopped_row_leaves_before_its_next_step_and_the_others_go_on(sampler):
    stay = Request(prompt(5, 30), 0.2, 30, num_steps=3, guidance=0.0)
    leave = Request(prompt(8, 31), 0.3, 31, num_steps=3, guidance=0.0)
    asked = []
    runs = JoinedRuns(sampler, 8)
    runs.submit(sampler.plan(stay), "stay")
    runs.submit(sampler.plan(leave), "leave", should_stop=lambda: asked.append(1) or len(asked) > 1)
    results = {}
    while len(runs):
        results.update(runs.step())
    assert isinstance(results["leave"], SamplingStopped) and "before step 2 of 3" in str(results["leave"])
    assert max_error(results["stay"], sampler.generate(stay)) < TOLERANCE
    gone = JoinedRuns(sampler, 8)
    gone.submit(sampler.plan(stay), "gone", should_stop=lambda: True)
    assert [(tag, str(err)) for tag, err in gone.step()] == [("gone", "before sampling")] and not len(gone)


def test_a_row_that_overflows_fails_alone_and_a_failed_step_fails_its_run_only(sampler, monkeypatch):
    good = Request(prompt(5, 40), 0.1, 40, num_steps=2, guidance=0.0)
    overflowing = Request(torch.full((2, 2048), 3e38), 0.1, 41, num_steps=2, guidance=0.0)
    results = _run(JoinedRuns(sampler, 8), {0: [("good", good), ("bad", overflowing)]}, sampler)
    assert isinstance(results["bad"], RuntimeError) and "non-finite" in str(results["bad"])
    assert max_error(results["good"], sampler.generate(good)) < TOLERANCE

    velocity = sampler.model.velocity
    failing = Request(prompt(4, 42), 0.1, 42, num_steps=2, guidance=2.0)

    def out_of_memory(x, mod, ctx, *a):
        if ctx.copies == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return velocity(x, mod, ctx, *a)

    monkeypatch.setattr(sampler.model, "velocity", out_of_memory)
    results = _run(JoinedRuns(sampler, 8), {0: [("guided", failing), ("unguided", good)]}, sampler)
    assert isinstance(results["guided"], torch.OutOfMemoryError)
    monkeypatch.undo()
    assert max_error(results["unguided"], sampler.generate(good)) < TOLERANCE


def test_a_finished_row_comes_back_from_the_next_step_once_queued_or_at_once_when_no_run_is_left(
        sampler, monkeypatch):
    # The caller answers a row while the GPU runs the step after its last: the row is handed
    # back by the next call, which queues that step first.
    short = Request(prompt(4, 60), 0.1, 60, num_steps=2, guidance=0.0)
    long = Request(prompt(6, 61), 0.2, 61, num_steps=4, guidance=0.0)
    alone = {"short": sampler.generate(short), "long": sampler.generate(long)}
    calls = _record_rows(monkeypatch, sampler)
    runs = JoinedRuns(sampler, 8)
    runs.submit(sampler.plan(short), "short")
    runs.submit(sampler.plan(long), "long")
    assert runs.step() == [] and runs.step() == [] and len(runs) == 2, "short has left, not yet handed back"
    third = runs.step()
    assert [tag for tag, _ in third] == ["short"] and calls == [2, 2, 1]
    last = runs.step()
    assert [tag for tag, _ in last] == ["long"] and calls == [2, 2, 1, 1] and not len(runs)
    for tag, latents in (*third, *last):
        assert max_error(latents, alone[tag]) < TOLERANCE, tag

    runs.submit(sampler.plan(short), "again")
    runs.submit(sampler.plan(long), "other")
    runs.step(), runs.step()
    assert sorted(runs.drain()) == ["again", "other"] and not len(runs), "a row on its way back is drained too"


def test_latents_kept_on_the_device_come_back_through_the_host_on_a_cpu(sampler):
    request = Request(prompt(4, 62), 0.1, 62, num_steps=2, guidance=0.0)
    runs = JoinedRuns(sampler, 8, keep_on_device=lambda: True)
    assert runs.keep_on_device is None, "nothing to keep them on"
    results = _run(runs, {0: [("one", request)]}, sampler)
    assert isinstance(results["one"], torch.Tensor)
    assert max_error(results["one"], sampler.generate(request)) < TOLERANCE


def test_only_a_lone_request_leaves_on_the_device_and_only_when_its_reader_agrees(sampler, monkeypatch):
    # The policy alone, on a CPU: DeviceLatents stood in for by a marker of what it was given.
    import auk_triton.diffusion.joined as joined

    monkeypatch.setattr(joined.DeviceLatents, "behind", staticmethod(lambda latents: ("kept", latents.clone())))
    short = Request(prompt(4, 40), 0.1, 40, num_steps=2, guidance=0.0)
    long = Request(prompt(5, 40), 0.1, 40, num_steps=4, guidance=0.0)

    def served(arrivals, reader_agrees=True):
        runs = JoinedRuns(sampler, 8)
        asked = []
        runs.keep_on_device = lambda: asked.append(True) or reader_agrees
        return _run(runs, arrivals, sampler), asked

    results, asked = served({0: [("one", short)]})
    assert results["one"][0] == "kept" and len(asked) == 1, "alone, and the reader agrees"
    assert max_error(results["one"][1], sampler.generate(short)) < TOLERANCE

    results, asked = served({0: [("one", short)]}, reader_agrees=False)
    assert isinstance(results["one"], torch.Tensor) and len(asked) == 1, "the reader is busy: through the host"

    results, asked = served({0: [("short", short), ("long", long)]})
    assert isinstance(results["short"], torch.Tensor), "another request is being sampled"
    assert results["long"][0] == "kept" and len(asked) == 1, "alone by its last step, the other answered before"
    assert max_error(results["long"][1], sampler.generate(long)) < TOLERANCE

    results, asked = served({0: [("first", short)], 1: [("late", short)]})
    assert isinstance(results["first"], torch.Tensor), "another request waits to join"
    assert isinstance(results["late"], torch.Tensor), "the first's latents were still on their way"
    assert not asked


def test_drain_gives_back_every_request_held(sampler):
    runs = JoinedRuns(sampler, 1)
    for tag in "abc":
        runs.submit(sampler.plan(Request(prompt(3, 50), 0.1, 50, num_steps=4, guidance=0.0)), tag)
    runs.step()
    assert len(runs) == 3 and sorted(runs.drain()) == ["a", "b", "c"] and not len(runs)


def test_bucketed_rows_replay_their_buckets_graphs_each_row_at_its_own_time(checkpoint, sampler, monkeypatch):
    # Graph replays with a modulation row per model row; runs of two buckets share none of
    # their graphs' buffers, and one that a graph served before is loaded again.
    stand_in_graphs(monkeypatch)
    buckets = ShapeBuckets(text=(8, 16), frames=(16, 32), ref=(), max_tokens=3 * 2 * 48, max_requests=3)
    bucketed = load_sampler(checkpoint, buckets=buckets)
    bucketed.graphs = DiTGraphCache(bucketed.model, bucketed._autocast, max_graphs=0)
    bucketed.warmup()
    captures = bucketed.graphs.captures
    requests = {
        "a": Request(prompt(5, 60), 0.2, 60, num_steps=3, guidance=2.0),  # bucket (8, 16)
        "b": Request(prompt(7, 61), 0.3, 61, num_steps=2, guidance=1.5),  # bucket (8, 16)
        "c": Request(prompt(12, 62), 0.5, 62, num_steps=4, guidance=2.0),  # bucket (16, 32)
        "d": Request(prompt(3, 63), 0.1, 63, num_steps=2, guidance=2.0),  # bucket (8, 16)
    }
    assert bucketed.own_bucket(bucketed.plan(requests["c"])) == RunShape(16, 32, 0)
    arrivals = {0: [("a", requests["a"]), ("c", requests["c"])], 1: [("b", requests["b"])], 3: [("d", requests["d"])]}
    results = _run(JoinedRuns(bucketed, 8), arrivals, bucketed)
    for tag, request in requests.items():
        assert max_error(results[tag], sampler.generate(request)) < TOLERANCE, tag
    graphs = bucketed.graphs
    assert (graphs.captures, graphs.request_captures, graphs.eager_runs) == (captures, 0, 0)


def test_a_graph_loads_its_run_again_after_another_graph_of_its_bucket_has_written_their_shared_buffers(
        checkpoint, monkeypatch):
    # Two runs that take turns on one bucket's graphs of one and of two requests (a run whose
    # own bucket is still being built takes a larger one): the smaller graph reads the front of
    # the larger one's buffers, so it must copy its run's context in again, kept tensors too.
    from auk_triton.diffusion.step_graph import _static_tensors

    stand_in_graphs(monkeypatch)
    buckets = ShapeBuckets(text=(8,), frames=(16,), ref=(), max_tokens=3 * 2 * 48, max_requests=2)
    bucketed = load_sampler(checkpoint, buckets=buckets)
    bucketed.graphs = DiTGraphCache(bucketed.model, bucketed._autocast, max_graphs=0)
    bucketed.warmup()
    alone = [bucketed.plan(Request(prompt(5, 90), 0.2, 90, num_steps=2, guidance=0.0))]
    pair = [bucketed.plan(Request(prompt(6, 91 + i), 0.25, 91 + i, num_steps=2, guidance=0.0)) for i in range(2)]
    with torch.inference_mode():  # as the runs: the graphs' buffers are inference tensors
        (one, x_one, _), (two, x_two, _) = (bucketed._batch_context(plans, False) for plans in (alone, pair))
        graph_one = bucketed.graphs.velocity(one, x_one.shape)
        graph_two = bucketed.graphs.velocity(two, x_two.shape)
        assert graph_one is not graph_two and graph_one.ctx.c.data_ptr() == graph_two.ctx.c.data_ptr()
        assert not torch.equal(graph_one.ctx.c, one.c), "the pair's run overwrote the front of the buffers"
        graph_one.load(one)
    for static, source in zip(_static_tensors(graph_one.ctx), _static_tensors(one)):
        assert torch.equal(static, source)
