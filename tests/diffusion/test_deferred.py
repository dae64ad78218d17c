"""The order of the graphs built after READY, and which bucket serves a run meanwhile (a policy: no model)."""

from auk_triton.diffusion.buckets import RunShape, ShapeBuckets
from auk_triton.diffusion.deferred import DeferredBuckets, DeferredGraphs

BUCKETS = ShapeBuckets(text=(8, 16), frames=(16, 32), ref=(), max_tokens=4 * 2 * 48, max_requests=16)
SMALL, WIDE, LARGE = RunShape(8, 16, 0), RunShape(16, 16, 0), RunShape(16, 32, 0)  # 24, 32 and 48 tokens


def deferred(*pending):
    buckets = DeferredBuckets(BUCKETS)
    return buckets, buckets.build_order(pending)


def test_every_single_request_graph_comes_before_any_batched_one_smallest_bucket_first():
    _, order = deferred((WIDE, True), (SMALL, False), (SMALL, True))
    assert order == [
        DeferredGraphs(SMALL, False, range(1, 2)), DeferredGraphs(SMALL, True, range(1, 2)),
        DeferredGraphs(WIDE, True, range(1, 2)),
        DeferredGraphs(SMALL, False, range(2, 17)), DeferredGraphs(SMALL, True, range(2, 9)),
        DeferredGraphs(WIDE, True, range(2, 7)),
    ]


def test_a_bucket_that_holds_one_request_has_no_batched_part():
    buckets = DeferredBuckets(ShapeBuckets((8,), (16,), (), 30, 16))
    assert buckets.build_order([(SMALL, True)]) == [DeferredGraphs(SMALL, True, range(1, 2))]


def test_a_run_is_served_by_the_smallest_bucket_whose_built_graphs_take_it():
    # Only LARGE was built before READY.
    buckets, order = deferred((SMALL, False), (WIDE, False), (RunShape(8, 32, 0), False))
    assert buckets.served_shape(SMALL, False) == LARGE and buckets.holds(SMALL, False) == 0
    buckets.serve(order[1], [1])  # WIDE's single-request graph
    assert buckets.served_shape(SMALL, False) == WIDE, "a bucket with its single graph serves a lone request"
    assert buckets.served_shape(SMALL, False, requests=3) == LARGE, "but not three"
    buckets.serve(order[0], [1])
    assert buckets.served_shape(SMALL, False) == SMALL and buckets.holds(SMALL, False) == 1
    assert buckets.served_shape(None, False) is None and buckets.served_shape(LARGE, False, 8) == LARGE


def test_a_bucket_is_whole_once_every_request_count_is_served_in_any_order():
    buckets, order = deferred((SMALL, False))
    buckets.serve(order[1], range(2, 10))  # a batched build stopped early: counts 10-16 missing
    assert buckets.holds(SMALL, False) == 0, "without the single graph no run is served"
    buckets.serve(order[0], [1])
    assert buckets.holds(SMALL, False) == 9 and buckets.pending(SMALL, False)
    buckets.serve(order[1], range(10, 17))
    assert not buckets.pending(SMALL, False) and len(buckets) == 0 and buckets.holds(SMALL, False) == 16


def test_runs_ask_for_what_their_own_bucket_lacks_the_single_graph_most_urgent():
    buckets, order = deferred((SMALL, False), (WIDE, False))
    single, batched = order[0], order[2]
    assert buckets.wanted([(SMALL, False)]) == [single], "one request needs only its single graph"
    assert buckets.wanted([(SMALL, False)] * 3) == [batched, single]
    buckets.serve(single, [1])
    assert buckets.wanted([(SMALL, False)]) == []
    assert buckets.wanted([(SMALL, False)] * 2) == [batched]
    # Runs past the buckets, or on buckets built before READY, ask for nothing.
    assert buckets.wanted([(None, False), (LARGE, False)]) == []
