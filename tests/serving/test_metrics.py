"""The models' metrics reporters, in this process.

The Python backend's `MetricFamily` is a round trip to the server, so here a
small recording stand-in takes its place: these tests are about the
reporter's threading (every count reported once, `close` never hangs), not
about Triton. The served metrics are tested against a real server in
`test_streaming.py`.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
import types

import pytest


class RecordingFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    totals: dict[tuple, float] = {}  # counters and gauges: their value; histograms: the sum observed

    def __init__(self, name: str, description: str, kind: str):
        self.name = name

    def Metric(self, labels: dict, buckets=None):
        key = (self.name, tuple(sorted(labels.items())))
        RecordingFamily.totals.setdefault(key, 0.0)

        class Metric:
            def increment(self, amount):
                RecordingFamily.totals[key] += amount

            def set(self, value):
                RecordingFamily.totals[key] = value

            def observe(self, value):
                RecordingFamily.totals[key] += value

        return Metric()


@pytest.fixture
def metrics_module(monkeypatch):
    backend = types.ModuleType("triton_python_backend_utils")
    backend.MetricFamily = RecordingFamily
    backend.Logger = None  # log() falls back to print where the stub's logger is missing
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", backend)
    stubbed = ("auk_triton.serving.metrics", "auk_triton.serving.triton_common")
    for name in stubbed:
        monkeypatch.delitem(sys.modules, name, raising=False)
    RecordingFamily.totals = {}
    yield importlib.import_module("auk_triton.serving.metrics")
    for name in stubbed:
        sys.modules.pop(name, None)


@pytest.fixture
def metrics_class(metrics_module):
    return metrics_module.DecodeMetrics


def total(name: str) -> float:
    return sum(amount for (family, _), amount in RecordingFamily.totals.items() if family == name)


def test_close_during_the_report_delay_returns_and_reports_everything_once(metrics_class):
    graph = types.SimpleNamespace(captures=0, generations_retired=0, pending_fallbacks=0)
    for _ in range(20):  # close at every point of the reporter's cycle
        metrics = metrics_class({"model": "m", "version": "1"})
        metrics.record([("compiled", 0.01, 2.0)], 0.001, graph)
        time.sleep(metrics.REPORT_DELAY_S / 3)  # the reporter is in its delay now
        closer = threading.Thread(target=metrics.close, daemon=True)
        closer.start()
        closer.join(timeout=5)
        assert not closer.is_alive(), "close() hung: the reporter thread never saw it"
    assert total("auk_vae_tiles_sent_total") == 20
    assert total("auk_vae_audio_seconds_total") == pytest.approx(40.0)


def test_windows_served_while_their_graph_was_built_after_ready_are_counted_once(metrics_class):
    graph = types.SimpleNamespace(captures=0, generations_retired=0, pending_fallbacks=3)
    metrics = metrics_class({"model": "m", "version": "1"})
    metrics.record([("compiled", 0.01, 2.0)], 0.001, graph)
    metrics.record([("compiled", 0.01, 2.0)], 0.001, graph)  # nothing new since
    graph.pending_fallbacks = 5
    metrics.record([("compiled", 0.01, 2.0)], 0.001, graph)
    metrics.close()
    assert total("auk_vae_pending_graph_windows_total") == 5


def test_a_scheduler_iteration_reports_its_windows_first_audio_active_and_queued_requests_and_underruns(
    metrics_class,
):
    metrics = metrics_class({"model": "m", "version": "1"})
    metrics.record_iteration(windows=4, first_audio=[0.01, 0.02], active=3, underruns=1, queued=5)
    metrics.record_iteration(windows=2, first_audio=[], active=1, underruns=0, queued=2)
    metrics.close()
    assert total("auk_vae_windows_per_replay") == 6
    assert total("auk_vae_first_audio_seconds") == pytest.approx(0.03)
    assert total("auk_vae_active_requests") == 1, "the gauge holds the latest count"
    assert total("auk_vae_queued_requests") == 2, "the gauge holds the latest count"
    assert total("auk_vae_underruns_total") == 1


def test_close_returns_within_its_bound_when_a_report_hangs(metrics_class, monkeypatch):
    """A report is a round trip to a server that may be going away: finalize must not wait on it."""
    hung = threading.Event()

    class HangingFamily(RecordingFamily):
        def Metric(self, labels: dict, buckets=None):
            metric = super().Metric(labels, buckets)

            def increment(amount):
                hung.set()
                threading.Event().wait(10)

            metric.increment = increment
            return metric

    backend = sys.modules["triton_python_backend_utils"]
    monkeypatch.setattr(backend, "MetricFamily", HangingFamily)
    monkeypatch.setattr(metrics_class, "CLOSE_TIMEOUT_S", 0.3)
    metrics = metrics_class({"model": "m", "version": "1"})
    graph = types.SimpleNamespace(captures=0, generations_retired=0, pending_fallbacks=0)
    metrics.record([("compiled", 0.01, 2.0)], 0.001, graph)
    assert hung.wait(5), "the reporter never reported"
    began = time.monotonic()
    metrics.close()
    assert time.monotonic() - began < 2.0


def test_the_offline_model_s_gauges_hold_its_latest_counts_once_closed(metrics_module):
    metrics = metrics_module.OfflineMetrics({"model": "auk_vae_decode_offline", "version": "1"})
    for active, queued in ((1, 0), (16, 3), (16, 4), (15, 4)):
        metrics.update(active, queued)
    metrics.close()
    assert total("auk_vae_offline_active_requests") == 15
    assert total("auk_vae_offline_queued_requests") == 4
    # Its tiles are the decode model's to count.
    assert not [name for name, _ in RecordingFamily.totals if name.startswith("auk_vae_tiles")]


def test_the_dit_s_step_counters_are_sent_at_most_once_a_second_and_whenever_it_goes_idle(metrics_module, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    metrics = metrics_module.DiTMetrics({"model": "auk_dit", "version": "1"})
    metrics.steps(4, 10)  # within the second since it began: kept
    assert (total("auk_dit_steps_total"), total("auk_dit_step_requests_total")) == (0, 0)
    clock[0] += metrics.STEPS_FLUSH_S
    metrics.steps(6, 14)
    assert (total("auk_dit_steps_total"), total("auk_dit_step_requests_total")) == (6, 14)
    clock[0] += 0.1
    metrics.steps(9, 20)
    assert total("auk_dit_steps_total") == 6
    metrics.steps(10, 21, now=True)  # idle: sent at once, the steps since the last send
    assert (total("auk_dit_steps_total"), total("auk_dit_step_requests_total")) == (10, 21)
