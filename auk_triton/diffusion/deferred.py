"""Bucket graphs built after the service is ready: the order they are built in, and which
bucket serves a run meanwhile.

A bucket's graphs (one per request count it holds, buckets.py) are built in two parts:
its single-request graph, then its batched ones. Every bucket's single-request graph
comes first, smallest bucket first, since a lone request needs no other; the batched
graphs follow in the same order. A run whose own bucket lacks the graph for its request
count is served at once by the smallest bucket whose built graphs hold it (the buckets
built before READY hold every request), and the builder is asked to build what the run
lacked next (`wanted`), so that a request meets its own bucket after one build at most.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, NamedTuple

from .buckets import RunShape, ShapeBuckets


class DeferredGraphs(NamedTuple):
    """Graphs of one bucket built after READY: those for `requests` requests of a run."""

    shape: RunShape
    guided: bool
    requests: range


class DeferredBuckets:
    """The buckets whose graphs are still being built, with the request counts already served."""

    def __init__(self, buckets: ShapeBuckets):
        self.buckets = buckets
        self._served: dict[tuple[RunShape, bool], set[int]] = {}  # only buckets not yet whole

    def build_order(self, pending: Iterable[tuple[RunShape, bool]]) -> list[DeferredGraphs]:
        """Every pending bucket's single-request graph, smallest bucket first, then each one's
        batched graphs in the same order; the buckets are pending from now on."""
        pending = sorted(pending, key=lambda item: (item[0].tokens, item[0].ref, item[1]))
        singles, batched = [], []
        for shape, guided in pending:
            self._served.setdefault((shape, guided), set())
            most = self.buckets.requests(shape, guided)
            singles.append(DeferredGraphs(shape, guided, range(1, 2)))
            if most > 1:
                batched.append(DeferredGraphs(shape, guided, range(2, most + 1)))
        return singles + batched

    def __len__(self) -> int:
        """Buckets (with their guidance mode) not yet served whole."""
        return len(self._served)

    def pending(self, shape: RunShape, guided: bool) -> bool:
        return (shape, guided) in self._served

    def serve(self, item: DeferredGraphs, requests: Iterable[int]) -> None:
        """Serve the graphs built for these request counts of the item's bucket from now on."""
        key = (item.shape, item.guided)
        served = self._served.get(key)
        if served is None:
            return
        served.update(requests)
        if served >= set(range(1, self.buckets.requests(item.shape, item.guided) + 1)):
            del self._served[key]

    def holds(self, shape: RunShape, guided: bool) -> int:
        """The most requests a run of this bucket takes on its graphs now: every count from 1 up
        to it is built (0: not even one request's)."""
        most = self.buckets.requests(shape, guided)
        served = self._served.get((shape, guided))
        if served is None:
            return most
        count = 0
        while count + 1 in served:
            count += 1
        return count

    def served_shape(self, shape: RunShape | None, guided: bool, requests: int = 1) -> RunShape | None:
        """The bucket that serves a run of `requests` requests of bucket `shape`: itself once its
        graphs for them are built, else the smallest bucket that holds it (a run without a
        reference in one without either) and whose built graphs take that many. None (past
        the largest bucket) stays None; a shape that no built bucket holds stays itself."""
        if shape is None or self.holds(shape, guided) >= requests:
            return shape
        holders = [s for s in self.buckets.shapes()
                   if self.holds(s, guided) >= requests and s.text >= shape.text and s.frames >= shape.frames
                   and (s.ref >= shape.ref if shape.ref else s.ref == 0)]
        return min(holders, key=lambda s: (s.tokens, s.ref), default=shape)

    def wanted(self, shapes: Iterable[tuple[RunShape | None, bool]]) -> list[DeferredGraphs]:
        """What these runs' own buckets (one entry per request) lack, the most urgent last: a
        bucket's batched graphs where more of its requests wait than its graphs take, then
        its single-request graph where that is not built."""
        counts = Counter(item for item in shapes if item[0] is not None and item in self._served)
        batched, singles = [], []
        for (shape, guided), count in counts.items():
            holds, most = self.holds(shape, guided), self.buckets.requests(shape, guided)
            if min(count, most) > max(holds, 1):
                batched.append(DeferredGraphs(shape, guided, range(2, most + 1)))
            if holds == 0:
                singles.append(DeferredGraphs(shape, guided, range(1, 2)))
        return batched + singles
