"""benchmarks/bench_deferred_build.py: how it splits the client's requests around the build, and
what it reports of a GPU trace (the measurement itself needs CUDA)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_deferred_build import Request, gpu_operations, phases, serving_gaps, summary  # noqa: E402


def request(began: float, first_ms: float = 2.0, gpu_ms: float = 1.9) -> Request:
    return Request(began, first_ms, 0.3, first_ms - 0.3, gpu_ms, (1, 0, 2))


def test_requests_are_split_at_the_builds_start_and_end_and_run_to_the_end_when_it_never_ended():
    requests = [request(t) for t in (0.5, 1.0, 2.0, 3.0, 4.0)]
    split = phases(requests, build_began=1.0, build_ended=3.0)
    began = [[r.began for r in split[phase]] for phase in ("before", "during", "after")]
    assert began == [[0.5], [1.0, 2.0, 3.0], [4.0]]
    unfinished = phases(requests, build_began=1.0, build_ended=None)
    assert [r.began for r in unfinished["during"]] == [1.0, 2.0, 3.0, 4.0] and not unfinished["after"]


def test_a_phases_line_gives_the_slowest_request_and_the_allocators_calls_meanwhile():
    line = summary([request(0.0, 2.0, 1.9), request(1.0, 70.0, 69.8)])
    assert line.startswith("2 requests:")
    assert "max 70.0" in line and "GPU p50 35.85, max 69.80" in line
    assert "allocator: 2 mallocs, 0 frees, 4 all-stream syncs" in line


def kernel(stream: int, ts: float, dur: float, name: str) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_the_serving_streams_longest_gap_lists_what_other_streams_ran_meanwhile(tmp_path):
    # Stream 7 serves (most operations): idle from 30 to 100 us while stream 69 runs a long kernel.
    events = [kernel(7, 0, 10, "a"), kernel(7, 20, 10, "b"), kernel(7, 100, 10, "c"), kernel(7, 115, 5, "d"),
              kernel(69, 25, 80, "long candidate"), kernel(69, 200, 5, "later")]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events + [{"ph": "i", "name": "marker", "ts": 0}]}))
    gaps = serving_gaps(gpu_operations(trace), top=2)
    assert [(round(gap, 3), after["name"]) for gap, after, _ in gaps] == [(0.07, "c"), (0.01, "b")]
    assert [e["name"] for e in gaps[0][2]] == ["long candidate"]
    assert serving_gaps([]) == []
