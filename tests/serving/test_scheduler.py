"""The tile scheduler's policy and bookkeeping, with a stand-in decode.

The stand-in decodes a window into samples that name the request and the frames
they came from, so every test can check that each tile went to its own request
with its own samples. The served scheduler is tested against the real server in
`test_streaming.py`.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from auk_triton.serving.errors import RequestError, ServerBusy, ServerStopping
from auk_triton.serving import scheduler as scheduler_module
from auk_triton.serving.scheduler import (DELIVER_FIRST_SLACK_S, DUE_SOON_S, YIELD_SLACK_S, YIELD_WAIT_S, Job,
                                         TileScheduler, decodable, deliver_first, pick_batch, plan_under_load, yields)

HOP = 4
WINDOW = 10  # frames per window of the stand-in plan


class StandInDecoder:
    """Windows of WINDOW frames; each output sample is the window's latent value of its frame."""

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self.batches: list[list[float]] = []  # the request tags of each replay's rows
        self.gate: threading.Event | None = None  # when set, each decode waits for it
        self.permits: threading.Semaphore | None = None  # when set, each decode takes one
        self.last_mode = "stand-in"

    def plan(self, frames: int):
        return [(start, min(WINDOW, frames - start), start, min(start + WINDOW, frames))
                for start in range(0, frames, WINDOW)]

    def batch_key(self, frames: int, device) -> int:
        return WINDOW

    def batch_capacity(self, key: int) -> int:
        return self.capacity

    def decode_rows(self, rows):
        if self.gate is not None:
            assert self.gate.wait(10), "the test never opened the gate"
        if self.permits is not None:
            assert self.permits.acquire(timeout=10), "the test never let this decode run"
        self.batches.append([float(row[0, 0, 1]) for row in rows])
        return [row[0, :, 0].repeat_interleave(HOP) for row in rows]


class RecordingSink:
    def __init__(self, log: list, tag: float, cancel_after: int | None = None):
        self.log, self.tag, self.cancel_after = log, tag, cancel_after
        self.tiles: list[tuple[int, torch.Tensor]] = []
        self.ending: str | Exception | None = None
        self.ended = threading.Event()

    def cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.tiles) >= self.cancel_after

    def tile(self, start_sample, samples, last):
        self.tiles.append((start_sample, samples.clone()))
        self.log.append(self.tag)
        if last:
            self._end("complete")

    def fail(self, error):
        self._end(error)

    def stop(self):
        self._end("cancelled")

    def _end(self, how):
        self.ending = how
        self.ended.set()

    def waveform(self) -> torch.Tensor:
        return torch.cat([samples for _, samples in self.tiles])


def clip(frames: int, tag: float) -> torch.Tensor:
    """[1, frames, 2]: channel 0 the frame index (what the stand-in decodes), channel 1 the tag."""
    latents = torch.zeros(1, frames, 2)
    latents[0, :, 0] = torch.arange(frames, dtype=torch.float32)
    latents[0, :, 1] = tag
    return latents


def expected_waveform(frames: int) -> torch.Tensor:
    return torch.arange(frames, dtype=torch.float32).repeat_interleave(HOP)


@pytest.fixture
def scheduler_of():
    made = []

    def make(decoder, max_active=8, max_queued=0, **kwargs):
        scheduler = TileScheduler(decoder, torch.device("cpu"), sample_rate=1000, hop_size=HOP,
                                  max_active=max_active, max_queued=max_queued, **kwargs)
        scheduler.start()
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.close(drain_s=5)


def submit(scheduler, frames, tag, log, **sink_kwargs):
    sink = RecordingSink(log, tag, **sink_kwargs)
    scheduler.submit(Job(clip(frames, tag), sink))
    return sink


def test_every_request_gets_its_own_samples_in_order(scheduler_of):
    decoder = StandInDecoder(capacity=4)
    scheduler = scheduler_of(decoder)
    log = []
    sinks = {tag: submit(scheduler, frames, tag, log) for tag, frames in ((1.0, 35), (2.0, 10), (3.0, 52))}
    for tag, frames in ((1.0, 35), (2.0, 10), (3.0, 52)):
        assert sinks[tag].ended.wait(10) and sinks[tag].ending == "complete"
        assert [start for start, _ in sinks[tag].tiles] == list(range(0, frames * HOP, WINDOW * HOP))
        torch.testing.assert_close(sinks[tag].waveform(), expected_waveform(frames), rtol=0, atol=0)
    assert scheduler.active == 0


def test_a_new_request_s_first_window_goes_before_the_windows_of_a_stream_in_progress(scheduler_of, monkeypatch):
    # The stand-in's windows hold 40 ms of audio: every later window would be due soon.
    monkeypatch.setattr(scheduler_module, "DUE_SOON_S", -1e9)
    now = [0.0]
    decoder = StandInDecoder(capacity=1)
    decoder.permits = threading.Semaphore(1)  # the long stream's first window only
    scheduler = scheduler_of(decoder, clock=lambda: now[0])
    log = []
    long = submit(scheduler, 100, 1.0, log)  # ten windows
    deadline = time.monotonic() + 10
    while not long.tiles:  # its first tile is out; its second window waits for a permit
        assert time.monotonic() < deadline
        time.sleep(0.01)
    now[0] = 100.0  # long after the long stream's deadlines: only the first-window rule favours the new one
    short = submit(scheduler, 10, 2.0, log)
    for _ in range(20):
        decoder.permits.release()
    assert long.ended.wait(10) and short.ended.wait(10)
    # The long stream's second window was already in flight; the new request's went next.
    assert decoder.batches[:3] == [[1.0], [1.0], [2.0]], decoder.batches


def test_windows_go_by_deadline_after_the_first(scheduler_of):
    now = [0.0]
    decoder = StandInDecoder(capacity=1)
    scheduler = TileScheduler(decoder, torch.device("cpu"), 1000, HOP, max_active=8, max_queued=0,
                              clock=lambda: now[0])
    early = Job(clip(30, 1.0), RecordingSink([], 1.0))
    late = Job(clip(30, 2.0), RecordingSink([], 2.0))
    for job, first_sent in ((early, 5.0), (late, 1.0)):
        job.windows = decoder.plan(30)
        job.next_window, job.first_sent, job.sent_seconds = 1, first_sent, 0.04
    # late's audio runs out at 1.04 s, early's at 5.04 s: late is the more urgent.
    assert pick(early, late, capacity=1) == [late]
    fresh = Job(clip(30, 3.0), RecordingSink([], 3.0), arrived=9.0)
    fresh.windows = decoder.plan(30)
    assert pick(early, late, fresh, capacity=1) == [fresh], "first windows first"
    assert pick(early, late, fresh, capacity=2) == [fresh, late]
    del scheduler


def test_a_later_window_due_soon_goes_before_new_first_windows_and_one_due_later_after_them():
    decoder = StandInDecoder()
    streams = [Job(clip(1000, tag), RecordingSink([], tag)) for tag in (1.0, 2.0)]
    for job, first_sent in zip(streams, (1.0, 2.0)):
        job.windows = decoder.plan(1000)
        job.next_window, job.first_sent = 1, first_sent  # one window out: 40 ms of audio
    behind, ahead = streams  # audio runs out at 1.04 s and 2.04 s
    fresh = Job(clip(30, 3.0), RecordingSink([], 3.0), arrived=0.5)
    fresh.windows = decoder.plan(30)
    now = 1.04 - DUE_SOON_S / 2
    assert pick(ahead, fresh, behind, capacity=1, now=now) == [behind], "a stream about to run out waited"
    assert pick(ahead, fresh, capacity=1, now=now) == [fresh], "first windows first otherwise"
    # Overdue streams too go first, by deadline.
    assert pick(ahead, fresh, behind, capacity=2, now=5.0) == [behind, ahead]


class LeavesAfterFirstAsk(RecordingSink):
    """A client that goes right after its first tile was sent and it was asked once; that tile's
    delivery waits for `proceed`, so the test can submit another request meanwhile."""

    def __init__(self, log, tag):
        super().__init__(log, tag)
        self.asked, self.delivering, self.proceed = 0, threading.Event(), threading.Event()

    def cancelled(self) -> bool:
        self.asked += 1
        return self.asked > 1

    def tile(self, start_sample, samples, last):
        super().tile(start_sample, samples, last)
        self.delivering.set()
        assert self.proceed.wait(10), "the test never let the tile go"


def test_a_window_due_soon_of_a_client_that_has_gone_is_not_decoded_ahead_of_a_new_request(scheduler_of):
    decoder = StandInDecoder(capacity=1)
    scheduler = scheduler_of(decoder, clock=lambda: 0.0)  # 40 ms windows: every later one is due soon
    log = []
    gone = LeavesAfterFirstAsk(log, 1.0)
    scheduler.submit(Job(clip(100, 1.0), gone))
    assert gone.delivering.wait(10)
    new = submit(scheduler, 10, 2.0, log)
    gone.proceed.set()
    assert new.ended.wait(10) and new.ending == "complete" and gone.ending == "cancelled"
    assert decoder.batches == [[1.0], [2.0]], "a window was decoded for a client that had gone"


def pick(*jobs: Job, capacity: int, now: float = 0.0) -> list[Job]:
    """pick_batch over the stand-in's windows (one batch key; HOP samples per frame at 1 kHz)."""
    return pick_batch(jobs, lambda job: WINDOW, lambda key: capacity, now=now, frame_seconds=HOP / 1000)


def test_a_second_window_taken_before_its_first_tile_is_sent_waits_behind_older_streams_deadlines():
    older = Job(clip(1000, 1.0), RecordingSink([], 1.0), arrived=0.0)
    newer = Job(clip(30, 2.0), RecordingSink([], 2.0), arrived=2.9)
    for job in (older, newer):
        job.windows = StandInDecoder().plan(job.latents.shape[1])
        job.next_window = 1
    older.first_sent, older.sent_seconds = 1.0, 0.04  # its audio runs out at 1.04 s
    # newer's first tile is still on its way to the host: played from now (3.0 s), its audio
    # would run out at 3.04 s. Counted as a first window, it would go first.
    assert pick(older, newer, capacity=1, now=3.0) == [older]
    # Once 60 windows of older's are taken (2.4 s of audio, to 3.4 s), newer goes first.
    older.next_window = 60
    assert pick(older, newer, capacity=1, now=3.0) == [newer]


class ShortFirstWindows(StandInDecoder):
    """The served plan's shape: a short first window (batched up to 16 rows), then longer ones
    (one per replay); each replay takes `cost` seconds of the test's clock."""

    FIRST, REST = 25, 50  # frames: 100 ms and 200 ms of audio (HOP samples a frame at 1 kHz)

    def __init__(self, now: list, cost: float):
        super().__init__()
        self.now, self.cost = now, cost

    def plan(self, frames: int):
        windows = [(0, self.FIRST, 0, self.FIRST)]
        for start in range(self.FIRST, frames, self.REST):
            end = min(start + self.REST, frames)
            windows.append((start, end - start, start, end))
        return windows

    def batch_key(self, frames: int, device) -> int:
        return frames

    def batch_capacity(self, key: int) -> int:
        return 16 if key == self.FIRST else 1

    def decode_rows(self, rows):
        self.now[0] += self.cost
        return super().decode_rows(rows)


class ClosedLoopClient(RecordingSink):
    """A client that sends its next clip the moment its last one ends, while `left` says so."""

    def __init__(self, scheduler, frames: int, left: list, took: list, clock):
        super().__init__([], 0.0)
        self.scheduler, self.frames, self.left, self.took, self.clock = scheduler, frames, left, took, clock
        # Timed from the scheduler's own stamp of its arrival: a clock read before `submit`
        # would count the decodes of other threads' clients run while this thread waits.
        self.job = Job(clip(frames, 0.0), self)
        scheduler.submit(self.job)

    def tile(self, start_sample, samples, last):
        super().tile(start_sample, samples, last)
        if last:
            self.took.append(self.clock() - self.job.arrived)
            if self.left[0] > 0:
                self.left[0] -= 1
                ClosedLoopClient(self.scheduler, self.frames, self.left, self.took, self.clock)


def test_in_a_closed_loop_new_requests_second_windows_do_not_starve_older_streams(scheduler_of):
    # 16 clients of two-window clips (a 10 s clip's shape), decodes launched a window ahead as on
    # a GPU, 1 ms a replay: after a batch of first windows, every stream's second window is due
    # 100 ms after its first tile, and all 16 take 16 ms. Were a second window taken while its
    # first tile is still in flight as urgent as a first window, each request that ends would
    # put its client's next request through whole, ahead of the streams left behind in that
    # batch, for as long as requests come (underruns, requests taking 0.8 s).
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    scheduler = scheduler_of(ShortFirstWindows(now, cost=0.001), max_active=64, clock=clock)
    scheduler.look_ahead = True
    frames = ShortFirstWindows.FIRST + ShortFirstWindows.REST
    left, took = [400], []
    for _ in range(16):
        ClosedLoopClient(scheduler, frames, left, took, clock)
    deadline = time.monotonic() + 60
    while len(took) < 416:
        assert time.monotonic() < deadline, f"{len(took)} of 416 requests ended"
        time.sleep(0.01)
    assert scheduler.underruns == 0, f"{scheduler.underruns} tiles came after their stream's audio ran out"
    # Fair turns take about 32 ms of decodes a request (16 streams, two windows each); starved,
    # some took 0.8 s. Every request ends before its first tile's 100 ms of audio run out.
    assert max(took) < 0.1, f"a request took {max(took) * 1e3:.0f} ms of decodes"


class LongFirstTiles(ShortFirstWindows):
    """The served 10 s clip's shape: a first tile of 0.4 s of audio, then one window of the rest."""

    FIRST, REST = 100, 150


@pytest.mark.parametrize("due_soon", [True, False], ids=["streams due soon first", "first windows always first"])
def test_at_saturation_streams_that_have_begun_keep_ahead_of_their_playback(scheduler_of, monkeypatch, due_soon):
    # 24 closed-loop clients, 10 ms a replay: each stream's rest waits for about 24 others, near
    # the 0.4 s its first tile plays, as in auk_pipeline at 48 clients (the DiT's admission holds
    # about 30 streams in its decoder). First windows always first, nearly every stream ran out
    # before its rest; with streams due soon first, the wait falls on the first windows instead.
    if not due_soon:
        monkeypatch.setattr(scheduler_module, "DUE_SOON_S", -1e9)
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    scheduler = scheduler_of(LongFirstTiles(now, cost=0.01), max_active=64, clock=clock)
    scheduler.look_ahead = True
    left, took = [300], []
    for _ in range(24):
        ClosedLoopClient(scheduler, LongFirstTiles.FIRST + LongFirstTiles.REST, left, took, clock)
    deadline = time.monotonic() + 60
    while len(took) < 324:
        assert time.monotonic() < deadline, f"{len(took)} of 324 requests ended"
        time.sleep(0.01)
    if due_soon:
        assert scheduler.underruns == 0, f"{scheduler.underruns} tiles came after their stream's audio ran out"
    else:
        assert scheduler.underruns > 100, "the load left the decoder time to spare: the test shows nothing"


def test_equal_streams_share_the_decoder_and_finish_together(scheduler_of, monkeypatch):
    monkeypatch.setattr(scheduler_module, "DUE_SOON_S", -1e9)  # 40 ms windows: all due soon otherwise
    decoder = StandInDecoder(capacity=1)
    decoder.gate = threading.Event()
    scheduler = scheduler_of(decoder)
    log = []
    sinks = [submit(scheduler, 60, tag, log) for tag in (1.0, 2.0, 3.0)]
    decoder.gate.set()
    for sink in sinks:
        assert sink.ended.wait(10)
    # Round robin: no stream gets two windows ahead of another.
    for prefix in range(1, len(log) + 1):
        counts = [log[:prefix].count(tag) for tag in (1.0, 2.0, 3.0)]
        assert max(counts) - min(counts) <= 1, log


def test_windows_of_several_requests_share_one_replay_up_to_the_capacity(scheduler_of):
    decoder = StandInDecoder(capacity=2)
    decoder.gate = threading.Event()
    scheduler = scheduler_of(decoder)
    log = []
    sinks = [submit(scheduler, 20, tag, log) for tag in (1.0, 2.0, 3.0)]
    decoder.gate.set()
    for sink in sinks:
        assert sink.ended.wait(10) and sink.ending == "complete"
    assert max(len(batch) for batch in decoder.batches) == 2
    assert sum(len(batch) for batch in decoder.batches) == 6  # two windows each, none decoded twice


def test_a_request_cancelled_in_the_middle_of_a_batch_leaves_and_the_others_finish(scheduler_of):
    decoder = StandInDecoder(capacity=3)
    decoder.gate = threading.Event()
    scheduler = scheduler_of(decoder)
    log = []
    first = submit(scheduler, 50, 1.0, log)
    gone = submit(scheduler, 50, 2.0, log, cancel_after=2)
    third = submit(scheduler, 50, 3.0, log)
    decoder.gate.set()
    assert gone.ended.wait(10) and gone.ending == "cancelled"
    assert len(gone.tiles) == 2
    for sink in (first, third):
        assert sink.ended.wait(10) and sink.ending == "complete"
        torch.testing.assert_close(sink.waveform(), expected_waveform(50), rtol=0, atol=0)
    assert all(2.0 not in batch for batch in decoder.batches[3:]), "the cancelled request kept decoding"


def test_a_request_whose_check_fails_gets_its_error_and_its_batch_still_decodes(scheduler_of):
    decoder = StandInDecoder(capacity=3)
    decoder.gate = threading.Event()
    scheduler = scheduler_of(decoder)
    log = []
    good = submit(scheduler, 30, 1.0, log)
    bad_sink = RecordingSink(log, 2.0)

    def check():
        raise RequestError("LATENTS holds 1 NaN")

    scheduler.submit(Job(clip(30, 2.0), bad_sink, check=check))
    other = submit(scheduler, 30, 3.0, log)
    decoder.gate.set()
    assert bad_sink.ended.wait(10)
    assert isinstance(bad_sink.ending, RequestError) and bad_sink.tiles == []
    for sink in (good, other):
        assert sink.ended.wait(10) and sink.ending == "complete"
        torch.testing.assert_close(sink.waveform(), expected_waveform(30), rtol=0, atol=0)


class Flag:
    """A stand-in for the CUDA event that marks a job's latents final."""

    def __init__(self, passed: bool):
        self.passed = passed

    def query(self) -> bool:
        return self.passed


def test_a_request_whose_latents_are_still_being_made_waits_while_others_have_windows_then_goes_alone(
        scheduler_of):
    decoder = StandInDecoder(capacity=4)
    decoder.gate = threading.Event()
    scheduler = scheduler_of(decoder)
    log = []
    ready = submit(scheduler, 30, 1.0, log)  # three windows, its first one held at the gate
    making = RecordingSink(log, 2.0)
    scheduler.submit(Job(clip(20, 2.0), making, ready=Flag(False)))
    decoder.gate.set()
    assert ready.ended.wait(10) and making.ended.wait(10)
    assert making.ending == "complete", "taken once no other request had a window left"
    tags = [tag for batch in decoder.batches for tag in batch]
    assert tags == [1.0, 1.0, 1.0, 2.0, 2.0], decoder.batches
    torch.testing.assert_close(making.waveform(), expected_waveform(20), rtol=0, atol=0)


class ShortFirstDecoder(StandInDecoder):
    """The stand-in's windows after a short first window of SHORT frames, as the codec plans a clip."""

    SHORT = 3

    def plan(self, frames: int, short_first: bool = True):
        if not short_first or frames <= self.SHORT:
            return super().plan(frames)
        return [(0, self.SHORT, 0, self.SHORT)] + [
            (start, min(WINDOW, frames - start), start, min(start + WINDOW, frames))
            for start in range(self.SHORT, frames, WINDOW)]


def test_under_load_a_request_yet_to_begin_is_planned_once_without_its_short_first_window():
    decoder = ShortFirstDecoder()
    begun, waiting, done = (Job(clip(30, tag), RecordingSink([], tag)) for tag in (1.0, 2.0, 3.0))
    for job in (begun, waiting, done):
        job.windows = decoder.plan(30)
    done.next_window = len(done.windows)
    plan_under_load([waiting, done], decoder.plan)  # no other window waits: nothing changes
    assert waiting.windows == decoder.plan(30) and not waiting.planned_under_load
    begun.next_window = 1
    plan_under_load([begun, waiting], decoder.plan)
    assert waiting.windows == decoder.plan(30, short_first=False) and waiting.planned_under_load
    assert begun.windows == decoder.plan(30), "a stream that has begun keeps its windows"
    waiting.windows = ["kept"]
    plan_under_load([begun, waiting], decoder.plan)
    assert waiting.windows == ["kept"], "planned once"


def test_under_load_another_request_s_first_window_waiting_counts_as_much_as_a_later_one():
    decoder = ShortFirstDecoder()
    one, other = (Job(clip(30, tag), RecordingSink([], tag)) for tag in (1.0, 2.0))
    one.windows = decoder.plan(30)
    other.windows = decoder.plan(30, short_first=False)  # a full first window, yet to decode
    plan_under_load([one, other], decoder.plan)
    assert one.windows == decoder.plan(30, short_first=False) and one.planned_under_load
    assert other.windows == decoder.plan(30, short_first=False)


@pytest.mark.parametrize("short_first_under_load, saturated", [(True, None), (False, None), (True, False),
                                                                 (True, True)])
def test_a_request_that_comes_while_another_stream_is_decoding_keeps_its_short_first_window_unless_told_not_to(
        scheduler_of, short_first_under_load, saturated):
    """Told by `short_first_under_load` off, or by another stage saying the server is saturated."""
    decoder = ShortFirstDecoder(capacity=1)
    decoder.permits = threading.Semaphore(1)  # the first stream's short window only
    scheduler = scheduler_of(decoder, short_first_under_load=short_first_under_load)
    if saturated is not None:
        scheduler.saturated = lambda: saturated
    log = []
    first = submit(scheduler, 30, 1.0, log)
    deadline = time.monotonic() + 10
    while not first.tiles and time.monotonic() < deadline:
        time.sleep(0.001)
    second = submit(scheduler, 30, 2.0, log)  # while the first stream has later windows to decode
    for _ in range(20):
        decoder.permits.release()
    assert first.ended.wait(10) and second.ended.wait(10)
    assert [start // HOP for start, _ in first.tiles] == [0, 3, 13, 23], "the decoder was free: a short window"
    expected = [0, 3, 13, 23] if short_first_under_load and not saturated else [0, 10, 20]
    assert [start // HOP for start, _ in second.tiles] == expected
    for sink in (first, second):
        torch.testing.assert_close(sink.waveform(), expected_waveform(30), rtol=0, atol=0)


def test_only_jobs_whose_latents_are_final_are_decodable_while_any_of_them_has_a_window_left():
    final, making, passed = (Job(clip(20, tag), RecordingSink([], tag)) for tag in (1.0, 2.0, 3.0))
    making.ready, passed.ready = Flag(False), Flag(True)
    for job in (final, making, passed):
        job.windows = StandInDecoder().plan(20)
    assert decodable([final, making, passed]) == [final, passed]
    final.next_window = passed.next_window = 2  # both done: the one being made is all that is left
    assert decodable([final, making, passed]) == [final, making, passed]


def test_a_request_whose_verify_fails_gets_that_error_instead_of_its_first_tile_and_the_others_decode(
        scheduler_of):
    decoder = StandInDecoder(capacity=3)
    decoder.gate = threading.Event()
    scheduler = scheduler_of(decoder)
    log, verified = [], []
    good = submit(scheduler, 30, 1.0, log)
    bad_sink, passing = RecordingSink(log, 2.0), RecordingSink(log, 3.0)

    def bad():
        verified.append(len(decoder.batches))
        raise RuntimeError("the DiT produced non-finite latents")

    scheduler.submit(Job(clip(30, 2.0), bad_sink, verify=bad))
    scheduler.submit(Job(clip(30, 3.0), passing, verify=lambda: verified.append("passed")))
    decoder.gate.set()
    assert bad_sink.ended.wait(10)
    assert isinstance(bad_sink.ending, RuntimeError) and "non-finite" in str(bad_sink.ending)
    assert bad_sink.tiles == [] and verified[0] >= 1, "verified after its first window decoded, before its tile"
    for sink in (good, passing):
        assert sink.ended.wait(10) and sink.ending == "complete"
        torch.testing.assert_close(sink.waveform(), expected_waveform(30), rtol=0, atol=0)
    assert verified.count("passed") == 1, "a verify runs once"


class Recorded(StandInDecoder):
    """Windows of 50 frames (200 ms of audio each); logs each decode beside the sinks' tiles."""

    def __init__(self, log: list):
        super().__init__(capacity=4)
        self.log = log

    def plan(self, frames: int):
        return [(start, min(50, frames - start), start, min(start + 50, frames)) for start in range(0, frames, 50)]

    def decode_rows(self, rows):
        self.log.append(f"decode {int(rows[0][0, 0, 0])}")
        return super().decode_rows(rows)


def test_with_look_ahead_a_first_tile_leaves_before_its_stream_s_next_window_is_launched(scheduler_of):
    log = []
    scheduler = scheduler_of(Recorded(log))
    scheduler.look_ahead = True  # as on a GPU: the next replay is launched before a tile is sent
    sink = submit(scheduler, 150, 1.0, log)
    assert sink.ended.wait(10) and sink.ending == "complete"
    # The second window's audio is due 200 ms after the first tile: that tile does not wait for
    # its launch. The third is launched before the second's tile is sent, as look-ahead does.
    assert log == ["decode 0", 1.0, "decode 50", "decode 100", 1.0, 1.0], log
    torch.testing.assert_close(sink.waveform(), expected_waveform(150), rtol=0, atol=0)


def test_while_another_stage_holds_the_look_ahead_each_replay_s_tiles_leave_before_the_next_is_picked(scheduler_of):
    log, held = [], []

    def hold() -> bool:
        held.append(True)
        return True

    scheduler = scheduler_of(Recorded(log))
    scheduler.look_ahead = True
    scheduler.hold_look_ahead = hold  # as auk_pipeline's DiT does while it holds requests
    sink = submit(scheduler, 150, 1.0, log)
    assert sink.ended.wait(10) and sink.ending == "complete"
    # Without the hold, the third window is launched before the second's tile is sent (the
    # test above); with it, every tile leaves before the next pick.
    assert log == ["decode 0", 1.0, "decode 50", 1.0, "decode 100", 1.0], log
    assert held, "asked at each iteration"
    torch.testing.assert_close(sink.waveform(), expected_waveform(150), rtol=0, atol=0)


def test_a_window_due_soon_keeps_the_look_ahead_while_another_stage_holds_it(scheduler_of, monkeypatch):
    # Every later window due soon, as at saturation: the hold gives way, and the replays
    # queue back to back as without it (the look-ahead test above), not one per send.
    monkeypatch.setattr(scheduler_module, "DUE_SOON_S", 1e9)
    log = []
    scheduler = scheduler_of(Recorded(log))
    scheduler.look_ahead = True
    scheduler.hold_look_ahead = lambda: True
    sink = submit(scheduler, 150, 1.0, log)
    assert sink.ended.wait(10) and sink.ending == "complete"
    assert log == ["decode 0", 1.0, "decode 50", "decode 100", 1.0, 1.0], log
    torch.testing.assert_close(sink.waveform(), expected_waveform(150), rtol=0, atol=0)


def test_streams_stay_exact_and_in_order_while_the_look_ahead_is_held_and_let_go_in_turns(scheduler_of,
                                                                                          monkeypatch):
    # Held for two iterations of every three, as the DiT takes and ends requests: the scheduler
    # switches between handing tiles over first and launching ahead (tests/serving/
    # test_scheduler_gpu.py does the same where the host copies are asynchronous). The stand-in's
    # windows hold 40 ms of audio: every later window would be due soon, and look ahead. Each
    # replay holds all six streams, so two replays handed over out of order show in each stream.
    monkeypatch.setattr(scheduler_module, "DUE_SOON_S", -1e9)
    scheduler = scheduler_of(StandInDecoder(capacity=6))
    scheduler.look_ahead = True
    turns = itertools.count()
    scheduler.hold_look_ahead = lambda: next(turns) % 3 != 0
    sinks = [RecordingSink([], float(tag)) for tag in range(1, 7)]
    for sink in sinks:
        scheduler.submit(Job(clip(200, sink.tag), sink))
    for sink in sinks:
        assert sink.ended.wait(10) and sink.ending == "complete", sink.ending
        starts = [start for start, _ in sink.tiles]
        assert starts == sorted(starts) and len(starts) == 20, starts
        torch.testing.assert_close(sink.waveform(), expected_waveform(200), rtol=0, atol=0)


def test_an_iteration_is_handed_over_first_only_when_the_next_goes_on_with_its_first_tiles_alone():
    frame_s = HOP / 1000
    slack_frames = round(DELIVER_FIRST_SLACK_S / frame_s)

    def taken(first_window_frames: int, window: int = 2) -> Job:
        job = Job(clip(10 * first_window_frames, 1.0), RecordingSink([], 1.0))
        size = first_window_frames
        job.windows = [(s, size, s, s + size) for s in range(0, 10 * size, size)]
        job.next_window = window
        return job

    alone, other = taken(slack_frames + 1), taken(slack_frames + 1)
    assert deliver_first([alone], [alone], frame_s), "a request alone: its second window can wait"
    assert deliver_first([alone, other], [alone, other], frame_s)
    assert not deliver_first([], [alone], frame_s), "its first tile has left already"
    assert not deliver_first([alone], [alone, other], frame_s), "another stream's window goes as soon as it can"
    assert not deliver_first([alone], [alone, taken(slack_frames + 1, window=1)], frame_s), "a new first window"
    short = taken(slack_frames - 1)
    assert not deliver_first([short], [short], frame_s), "its first tile's audio runs out too soon"
    assert not deliver_first([alone], [], frame_s)


def test_a_failed_decode_fails_its_batch_only(scheduler_of):
    class FailingOnce(StandInDecoder):
        failed = False

        def decode_rows(self, rows):
            if not self.failed and any(float(row[0, 0, 1]) == 2.0 for row in rows):
                self.failed = True
                raise RuntimeError("out of memory")
            return super().decode_rows(rows)

    decoder = FailingOnce(capacity=1)
    scheduler = scheduler_of(decoder)
    log = []
    first = submit(scheduler, 30, 1.0, log)
    doomed = submit(scheduler, 30, 2.0, log)
    assert doomed.ended.wait(10) and isinstance(doomed.ending, RuntimeError)
    assert first.ended.wait(10) and first.ending == "complete"
    late = submit(scheduler, 30, 3.0, log)
    assert late.ended.wait(10) and late.ending == "complete", "the scheduler stopped serving"


def test_past_the_active_limit_a_request_queues_until_a_place_frees_and_past_the_queue_it_is_refused(
    scheduler_of,
):
    decoder = StandInDecoder(capacity=1)
    decoder.gate = threading.Event()
    scheduler = scheduler_of(decoder, max_active=2, max_queued=1)
    assert scheduler.idle
    log = []
    first = submit(scheduler, 20, 1.0, log)
    submit(scheduler, 20, 2.0, log)
    queued = submit(scheduler, 20, 3.0, log)  # returns at once: Triton's execute never waits
    assert (scheduler.active, scheduler.queued) == (2, 1) and not scheduler.idle
    with pytest.raises(ServerBusy, match=r"at its limit \(2 requests decoding, 1 waiting\)"):
        submit(scheduler, 20, 4.0, log)
    assert not queued.ended.is_set() and 3.0 not in log, "the queued one decoded before a place freed"
    decoder.gate.set()
    assert first.ended.wait(10)
    assert queued.ended.wait(10) and queued.ending == "complete", "a place freed but the queued request never ran"
    assert scheduler.queued == 0


def test_while_requests_wait_for_a_place_the_ones_in_the_scheduler_are_asked_whether_their_clients_have_gone(
    scheduler_of,
):
    decoder = StandInDecoder(capacity=1)
    decoder.permits = threading.Semaphore(0)
    scheduler = scheduler_of(decoder, max_active=2, max_queued=2)
    log = []
    first, second = submit(scheduler, 100, 1.0, log), submit(scheduler, 100, 2.0, log)
    queued = [submit(scheduler, 20, tag, log) for tag in (3.0, 4.0)]
    decoder.permits.release(2)  # the first windows of the two in the scheduler
    deadline = time.monotonic() + 10
    while len(log) < 2:
        assert time.monotonic() < deadline, "the first windows never decoded"
        time.sleep(0.01)
    # Both clients go; the scheduler may have taken one more window of theirs already.
    first.cancel_after = second.cancel_after = 0
    decoder.permits.release(100)
    for sink in queued:
        assert sink.ended.wait(10) and sink.ending == "complete"
        torch.testing.assert_close(sink.waveform(), expected_waveform(20), rtol=0, atol=0)
    assert first.ending == second.ending == "cancelled"
    rows = [tag for batch in decoder.batches for tag in batch]
    # Without the asking, each would decode one window past its client's going (4 rows): a
    # request's later windows are asked about only after their tile is sent.
    assert rows.count(1.0) + rows.count(2.0) <= 3, rows


def test_a_request_its_caller_cancels_stops_at_the_next_iteration_whether_decoding_or_waiting(scheduler_of):
    """`cancel` is how the model stops a request Triton cannot cancel (one forwarded to it)."""
    decoder = StandInDecoder(capacity=1)
    decoder.permits = threading.Semaphore(0)
    scheduler = scheduler_of(decoder, max_active=1, max_queued=1)
    log = []
    decoding, waiting = Job(clip(100, 1.0), RecordingSink(log, 1.0)), Job(clip(100, 2.0), RecordingSink(log, 2.0))
    scheduler.submit(decoding)
    scheduler.submit(waiting)
    decoder.permits.release(1)  # the first window of the one decoding
    deadline = time.monotonic() + 10
    while not log:
        assert time.monotonic() < deadline, "the first window never decoded"
        time.sleep(0.01)
    scheduler.cancel(decoding)  # from this thread, as the model's execute does
    scheduler.cancel(waiting)
    decoder.permits.release(100)
    for job in (decoding, waiting):
        assert job.sink.ended.wait(10) and job.sink.ending == "cancelled"
    rows = [tag for batch in decoder.batches for tag in batch]
    assert rows.count(1.0) <= 2, "more than the window in flight decoded after the cancel"
    assert 2.0 not in rows and waiting.sink.tiles == []
    after = submit(scheduler, 20, 3.0, log)
    assert after.ended.wait(10) and after.ending == "complete"
    assert (scheduler.active, scheduler.queued) == (0, 0)


def test_close_stops_the_queued_requests_too(scheduler_of):
    decoder = StandInDecoder(capacity=1)
    decoder.gate = threading.Event()
    scheduler = scheduler_of(decoder, max_active=1, max_queued=2)
    log = []
    sinks = [submit(scheduler, 20, float(i), log) for i in range(3)]
    scheduler.close(drain_s=0.2)
    decoder.gate.set()
    for sink in sinks:
        assert sink.ended.wait(10)
    assert all(isinstance(sink.ending, ServerStopping) for sink in sinks[1:]), [sink.ending for sink in sinks]


def test_close_lets_the_requests_in_the_scheduler_finish_and_refuses_new_ones(scheduler_of):
    decoder = StandInDecoder(capacity=1)
    scheduler = scheduler_of(decoder)
    log = []
    sink = submit(scheduler, 40, 1.0, log)
    scheduler.close(drain_s=10)
    assert sink.ended.is_set() and sink.ending == "complete"
    with pytest.raises(RuntimeError, match="shutting down"):
        submit(scheduler, 10, 2.0, log)


def test_close_stops_what_is_left_after_the_drain_so_shutdown_stays_prompt(scheduler_of):
    decoder = StandInDecoder(capacity=1)
    decoder.permits = threading.Semaphore(2)
    scheduler = scheduler_of(decoder)
    log = []
    sink = submit(scheduler, 100, 1.0, log)  # ten windows, two of them allowed
    began = time.monotonic()
    threading.Timer(0.5, lambda: [decoder.permits.release() for _ in range(20)]).start()
    scheduler.close(drain_s=0.2)
    assert time.monotonic() - began < 2.0
    assert sink.ended.wait(5) and isinstance(sink.ending, ServerStopping), sink.ending
    assert len(sink.tiles) < 10


def test_a_later_window_yields_only_soon_after_its_stream_s_last_tile_and_with_more_audio_left_than_the_slack():
    frame_seconds = HOP / 1000
    job = Job(clip(3000, 1.0), RecordingSink([], 1.0), arrived=0.0)
    job.windows = StandInDecoder().plan(3000)
    assert not yields(job, now=0.0, frame_seconds=frame_seconds), "a first window never waits"
    job.next_window = 200  # 200 windows taken, 8 s of audio: far ahead of its playback
    assert yields(job, now=0.0, frame_seconds=frame_seconds), "its first tile is still on its way"
    job.first_sent = job.last_sent = 0.0
    assert yields(job, now=YIELD_WAIT_S - 1e-6, frame_seconds=frame_seconds)
    assert not yields(job, now=YIELD_WAIT_S, frame_seconds=frame_seconds), "it has waited long enough"
    job.last_sent = 7.0
    assert yields(job, now=7.0, frame_seconds=frame_seconds)
    assert not yields(job, now=8.0 - YIELD_SLACK_S + 1e-6, frame_seconds=frame_seconds), "its audio runs out soon"


def test_while_another_stage_has_work_later_windows_wait_and_first_windows_go_at_once(scheduler_of):
    """At 10 samples a second a 10-frame window is 4 s of audio. A stream's next window waits
    until YIELD_WAIT_S after its last tile, or its audio would run out within YIELD_SLACK_S, or
    the other stage is idle; a new request's first window does not wait."""
    now, busy = [0.0], [True]
    decoder = StandInDecoder(capacity=1)
    scheduler = TileScheduler(decoder, torch.device("cpu"), sample_rate=10, hop_size=HOP, max_active=8,
                              max_queued=0, clock=lambda: now[0], yield_to=lambda: busy[0])
    scheduler.start()

    def settled(condition) -> bool:
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # and nothing more happens meanwhile
        return condition()

    try:
        log = []
        playing = submit(scheduler, 4 * WINDOW, 1.0, log)
        assert settled(lambda: len(playing.tiles) == 1 and scheduler.yielding == 1)
        fresh = submit(scheduler, WINDOW, 2.0, log)
        assert fresh.ended.wait(10) and fresh.ending == "complete", "a first window does not wait"
        assert len(playing.tiles) == 1
        now[0] = WINDOW * HOP / 10 - YIELD_SLACK_S + 0.01  # its audio would run out within the slack
        assert settled(lambda: len(playing.tiles) == 2 and scheduler.yielding == 1), "the third waits"
        now[0] += YIELD_WAIT_S + 0.01  # longer than a window may wait
        assert settled(lambda: len(playing.tiles) == 3 and scheduler.yielding == 1), "the fourth waits"
        busy[0] = False
        assert playing.ended.wait(10) and playing.ending == "complete"
        torch.testing.assert_close(playing.waveform(), expected_waveform(4 * WINDOW), rtol=0, atol=0)
        assert scheduler.yielding == 0 and decoder.batches == [[1.0], [2.0], [1.0], [1.0], [1.0]]
    finally:
        scheduler.close(drain_s=5)
