"""The models' counters on Triton's metrics port. No torch here: the offline model, which
imports none, keeps its gauges with `OfflineMetrics`."""

from __future__ import annotations

import threading
import time
from typing import Protocol

import triton_python_backend_utils as pb_utils

from .triton_common import log

TIERS = ("compiled", "batched", "graph", "eager")
WINDOWS_PER_REPLAY_BUCKETS = [1, 2, 4, 8, 16, 32]
FIRST_AUDIO_BUCKETS_S = [0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]


class GraphCounts(Protocol):
    """What the counters read of the decode's graph wrapper (`AuKVAEDecodeGraph`)."""

    captures: int
    generations_retired: int
    pending_fallbacks: int


class DecodeMetrics:
    """The model's counters on Triton's metrics port; no-ops where the backend has no MetricFamily.

    Every counter update is a round trip to the server process, about a tenth of
    a millisecond. Made inline, a request's updates delayed the offline model's
    response (its `execute` returns it) and a streaming client's next request.
    So `record` only adds to sums in this process, and a reporter thread sends
    them REPORT_DELAY_S after a request ends (on a GPU, the next request is
    decoding by then), each counter once however many tiles and requests it
    covers. The counters trail the responses by about that much; `close` has the
    reporter send what is left, waiting for it a bounded time.
    """

    REPORT_DELAY_S = 0.005
    CLOSE_TIMEOUT_S = 2.0

    def __init__(self, labels: dict[str, str]):
        self._families = []
        self._tiles = self._audio = self._captures = self._retired = self._send = self._pending_windows = None
        self._active = self._queued = self._windows = self._first_audio = self._underruns = None
        self._seconds: dict[str, object] = {}
        self._lock = threading.Lock()
        self._pending = self._nothing_pending()
        self._seen_captures = self._seen_retired = self._seen_pending = 0
        self._wake = threading.Event()
        self._closing = False
        self._reporter = None
        family_cls = getattr(pb_utils, "MetricFamily", None)
        if family_cls is None:
            log("warn", "this Python backend has no MetricFamily: the model exports no metrics")
            return
        try:

            def counter(name: str, description: str):
                return self._family(family_cls, name, description, family_cls.COUNTER)

            self._tiles = counter("auk_vae_tiles_sent_total", "Decoded tiles sent (streamed or concatenated)").Metric(
                labels=labels
            )
            self._audio = counter("auk_vae_audio_seconds_total", "Seconds of audio decoded and sent").Metric(
                labels=labels
            )
            seconds = counter(
                "auk_vae_decode_seconds_total",
                "Time launching tile decodes and waiting for their samples, by tier (compiled, graph, eager)",
            )
            self._seconds = {tier: seconds.Metric(labels={**labels, "tier": tier}) for tier in TIERS}
            self._send = counter(
                "auk_vae_send_seconds_total",
                "Wall time the streaming model waits in response sends (each returns once the server "
                "has written the response to the client's connection)",
            ).Metric(labels=labels)
            self._captures = counter("auk_vae_graph_captures_total", "Plain CUDA graphs captured").Metric(
                labels=labels
            )
            self._retired = counter(
                "auk_vae_graph_generations_retired_total", "Generations of plain CUDA graphs retired"
            ).Metric(labels=labels)
            self._pending_windows = counter(
                "auk_vae_pending_graph_windows_total",
                "Windows decoded by another tier because their graph was still being built after READY",
            ).Metric(labels=labels)
            self._underruns = counter(
                "auk_vae_underruns_total", "Tiles sent after the audio already sent to their stream ran out"
            ).Metric(labels=labels)
            self._active = self._family(
                family_cls, "auk_vae_active_requests", "Requests in the tile scheduler", family_cls.GAUGE
            ).Metric(labels=labels)
            self._queued = self._family(
                family_cls, "auk_vae_queued_requests", "Requests waiting in the tile scheduler's queue",
                family_cls.GAUGE,
            ).Metric(labels=labels)
            self._windows = self._family(
                family_cls, "auk_vae_windows_per_replay", "Decode windows per replay", family_cls.HISTOGRAM
            ).Metric(labels=labels, buckets=WINDOWS_PER_REPLAY_BUCKETS)
            self._first_audio = self._family(
                family_cls, "auk_vae_first_audio_seconds",
                "From a request's arrival at the model to its first tile sent", family_cls.HISTOGRAM,
            ).Metric(labels=labels, buckets=FIRST_AUDIO_BUCKETS_S)
        except Exception as err:  # metrics disabled on the server, or an older backend
            log("warn", f"custom metrics are unavailable ({err}); the model exports none")
            self._families, self._seconds = [], {}
            self._tiles = self._audio = self._captures = self._retired = self._send = None
            self._pending_windows = None
            self._active = self._queued = self._windows = self._first_audio = self._underruns = None
            return
        self._reporter = threading.Thread(target=self._report_until_closed, name="auk-metrics", daemon=True)
        self._reporter.start()

    def _family(self, family_cls, name: str, description: str, kind):
        family = family_cls(name=name, description=description, kind=kind)
        self._families.append(family)
        return family

    @staticmethod
    def _nothing_pending() -> dict:
        return {"tiles": 0, "audio": 0.0, "send": 0.0, "captures": 0, "retired": 0, "pending_windows": 0, "underruns": 0,
                "seconds": dict.fromkeys(TIERS, 0.0), "windows": [], "first_audio": [], "active": None,
                "queued": None}

    def record_iteration(self, windows: int, first_audio: list[float], active: int, underruns: int,
                         queued: int) -> None:
        """Add one scheduler iteration: its windows per replay, the first-audio times of the
        requests whose first tile it sent, the requests active and queued after it, new underruns."""
        if self._reporter is None:
            return
        with self._lock:
            pending = self._pending
            pending["windows"].append(windows)
            pending["first_audio"].extend(first_audio)
            pending["active"], pending["queued"] = active, queued
            pending["underruns"] += underruns
        self._wake.set()

    def record(self, decoded: list, send_seconds: float, graph: GraphCounts) -> None:
        """Add one request's tiles ((tier, seconds, audio seconds) each), send time and the
        graph wrapper's capture counts to what the reporter sends next."""
        if self._reporter is None:
            return
        with self._lock:
            pending = self._pending
            for tier, seconds, audio_seconds in decoded:
                pending["tiles"] += 1
                pending["audio"] += audio_seconds
                pending["seconds"][tier or "eager"] += seconds
            pending["send"] += send_seconds
            pending["captures"] += graph.captures - self._seen_captures
            pending["retired"] += graph.generations_retired - self._seen_retired
            pending["pending_windows"] += graph.pending_fallbacks - self._seen_pending
            self._seen_captures, self._seen_retired = graph.captures, graph.generations_retired
            self._seen_pending = graph.pending_fallbacks
        self._wake.set()

    def _report_until_closed(self) -> None:
        # `_report` clears `_wake`, so a `close` that lands during the delay or a report is
        # seen through `_closing`, checked after every report; the last report runs here,
        # on this thread, so that `close` can bound its wait.
        while True:
            self._wake.wait()
            if not self._closing:
                time.sleep(self.REPORT_DELAY_S)  # let the response reach its client first
            self._report()
            if self._closing:
                self._report()  # anything recorded while the last report ran
                return

    def _report(self) -> None:
        with self._lock:
            self._wake.clear()
            pending, self._pending = self._pending, self._nothing_pending()
        increments = [
            (self._tiles, pending["tiles"]),
            (self._audio, pending["audio"]),
            (self._send, pending["send"]),
            (self._captures, pending["captures"]),
            (self._retired, pending["retired"]),
            (self._pending_windows, pending["pending_windows"]),
        ] + [(self._seconds[tier], seconds) for tier, seconds in pending["seconds"].items()]
        increments.append((self._underruns, pending["underruns"]))
        try:
            for metric, amount in increments:
                if amount > 0:
                    metric.increment(amount)
            for value in pending["windows"]:
                self._windows.observe(value)
            for value in pending["first_audio"]:
                self._first_audio.observe(value)
            if pending["active"] is not None:
                self._active.set(pending["active"])
                self._queued.set(pending["queued"])
        except Exception as err:  # the server is shutting down
            log("warn", f"could not update the model's metrics: {err}")

    def close(self) -> None:
        """Stop the reporter once it has sent what is left, waiting for it CLOSE_TIMEOUT_S at
        most: a reporter stuck in a round trip to a server that is going away is left
        behind (a daemon thread), since `finalize` must not wait on it."""
        if self._reporter is None:
            return
        self._closing = True
        self._wake.set()
        self._reporter.join(self.CLOSE_TIMEOUT_S)
        if self._reporter.is_alive():
            log("warn", "the metrics reporter did not finish its last report in time; the model stops without it")
        self._reporter = None


class OfflineMetrics:
    """The offline model's gauges: its requests forwarded to the decode model (each holding its
    waveform on the host until its response is out), and those waiting for a place among them.

    Their tiles are counted once, by the decode model that decodes them (`DecodeMetrics`,
    model="auk_vae_decode"). Each update is a round trip to the server, so a reporter
    thread sends the latest counts, off the requests' way; no-ops where the backend has no
    MetricFamily.
    """

    CLOSE_TIMEOUT_S = 2.0

    def __init__(self, labels: dict[str, str]):
        self._families, self._active, self._queued, self._reporter = [], None, None, None
        self._latest = (0, 0)
        self._wake = threading.Event()
        self._closing = False
        family_cls = getattr(pb_utils, "MetricFamily", None)
        if family_cls is None:
            log("warn", "this Python backend has no MetricFamily: the model exports no metrics")
            return
        try:
            gauges = [
                family_cls(name="auk_vae_offline_active_requests", kind=family_cls.GAUGE,
                           description="Offline requests forwarded to the decode model, their waveforms being gathered"),
                family_cls(name="auk_vae_offline_queued_requests", kind=family_cls.GAUGE,
                           description="Offline requests waiting for a place among those forwarded"),
            ]
            self._active, self._queued = (family.Metric(labels=labels) for family in gauges)
        except Exception as err:  # metrics disabled on the server, or an older backend
            log("warn", f"custom metrics are unavailable ({err}); the model exports none")
            self._active = self._queued = None
            return
        self._families = gauges
        self._reporter = threading.Thread(target=self._report_until_closed, name="auk-offline-metrics", daemon=True)
        self._reporter.start()

    def update(self, active: int, queued: int) -> None:
        """The requests forwarded and waiting now; the reporter sends the latest."""
        self._latest = (active, queued)
        self._wake.set()

    def _report_until_closed(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            active, queued = self._latest
            try:
                self._active.set(active)
                self._queued.set(queued)
            except Exception as err:  # the server is shutting down
                log("warn", f"could not update the model's metrics: {err}")
            if self._closing:
                return

    def close(self) -> None:
        """Send the last counts and stop the reporter, waiting for it CLOSE_TIMEOUT_S at most."""
        if self._reporter is None:
            return
        self._closing = True
        self._wake.set()
        self._reporter.join(self.CLOSE_TIMEOUT_S)
        self._reporter = None


class DiTMetrics:
    """auk_dit's counter of sampler runs that found no step graph of their own bucket: their graph
    was captured at request time (`kind="capture"`), they stepped eagerly (`kind="eager"`),
    their bucket was still being built after READY and a larger one served them
    (`kind="larger_bucket"`), or its batched graphs were, and its requests ran apart
    (`kind="split"`: the runs beyond those that every graph built would have taken).

    Only a fallback updates it (a round trip to the server, after the run's responses are
    sent), so the runs that replay their bucket's graphs pay nothing for it. With requests
    joining runs between steps, also the steps and the requests they served (`steps`)."""

    KINDS = ("capture", "eager", "larger_bucket", "split")
    # With rows joining runs between steps: the steps and the requests they served, sent at most
    # this often (and when the sampling thread goes idle), not a round trip per step.
    STEPS_FLUSH_S = 1.0

    def __init__(self, labels: dict[str, str]):
        self._families = []  # kept alive: a metric lives as long as its family
        self._runs: dict[str, object] = {}
        self._steps = self._step_rows = None
        self._sent = (0, 0)  # steps and rows already sent
        self._sent_at = time.monotonic()
        family_cls = getattr(pb_utils, "MetricFamily", None)
        if family_cls is None:
            return
        try:
            runs = family_cls(
                name="auk_dit_fallback_runs_total",
                description="auk_dit sampler runs with no step graph of their own bucket: captured at request "
                            "time (kind=capture), stepped eagerly (kind=eager), served by a larger bucket "
                            "while theirs was built after READY (kind=larger_bucket), or run apart while its "
                            "batched graphs were (kind=split)",
                kind=family_cls.COUNTER,
            )
            steps = family_cls(name="auk_dit_steps_total", kind=family_cls.COUNTER,
                               description="auk_dit velocity calls, with requests joining runs between steps")
            rows = family_cls(name="auk_dit_step_requests_total", kind=family_cls.COUNTER,
                              description="requests served by auk_dit's velocity calls, summed over them: "
                                          "divided by auk_dit_steps_total, the requests a step serves")
            self._families = [runs, steps, rows]
            self._runs = {kind: runs.Metric(labels={**labels, "kind": kind}) for kind in self.KINDS}
            self._steps, self._step_rows = steps.Metric(labels=labels), rows.Metric(labels=labels)
        except Exception as err:  # metrics disabled on the server, or an older backend
            log("warn", f"custom metrics are unavailable ({err}); auk_dit exports none")
            self._families, self._runs, self._steps, self._step_rows = [], {}, None, None

    def steps(self, steps: int, rows: int, now: bool = False) -> None:
        """The totals of steps and of the requests they served so far; sent when STEPS_FLUSH_S
        has passed since the last send, or `now`."""
        if self._steps is None or (steps, rows) == self._sent:
            return
        clock = time.monotonic()
        if not now and clock - self._sent_at < self.STEPS_FLUSH_S:
            return
        try:
            self._steps.increment(steps - self._sent[0])
            self._step_rows.increment(rows - self._sent[1])
        except Exception as err:  # the server is shutting down
            log("warn", f"could not update auk_dit's metrics: {err}")
        self._sent, self._sent_at = (steps, rows), clock

    def fallback(self, kind: str, runs: int = 1) -> None:
        metric = self._runs.get(kind)
        if metric is None:
            return
        try:
            metric.increment(runs)
        except Exception as err:  # the server is shutting down
            log("warn", f"could not update auk_dit's metrics: {err}")
