"""The tile scheduler: one thread per model instance decodes the next window of every active
request, several windows per replay, and hands each tile to its request's sink.

Order. Each iteration serves the most urgent window first and fills the replay
with other windows of the same batch key (`AuKVAEDecodeGraph.batch_key`) in the
same order, up to that key's batch capacity:

1. a later window whose stream's audio runs out within DUE_SOON_S, by deadline:
   the moment the audio of the windows already taken for that stream runs out if
   it is played from its first tile on. At saturation a stream that has begun then
   keeps ahead of its playback, and the wait falls on new requests' first audio.
   Its client is asked first whether it has gone: an abandoned stream falls behind
   its deadlines and would otherwise keep new requests waiting;
2. a request's first window, oldest request first, so first audio waits for at
   most the iteration in flight;
3. then the other later windows by deadline (a first tile still on its way counts
   as played from now). A second window taken while its first tile is still in
   flight waits its turn: counted as urgent, new requests' second windows would
   keep the older streams waiting for as long as requests arrive.

A clip's first window is short (the decoder's `first_tile_frames`), so its first audio comes
after one small replay; the window after it decodes those frames again as its left context
(from frame 0 with the default 32 frames, fewer than the decoder's 53 of context). With
`short_first_under_load` off, a request that has yet to begin while another request has a
window waiting to decode is planned without it (`plan_under_load`): at saturation the decoder
does each clip's work once, and the short window stays for a decoder with nothing else queued.
Another stage may tell it when the server is saturated (`saturated`, `auk_pipeline`'s DiT while
it holds requests back for want of room here): the short window is then planned away as with
`short_first_under_load` off, and kept below saturation.

The scheduler is work-conserving: it decodes ahead of the deadlines whenever it
can, so a request ends as early as the GPU allows; the deadlines only order the
windows (and count an underrun when a tile leaves after its deadline). Unless
another stage shares the GPU and asks it to yield (`yield_to`, `auk_pipeline`'s
DiT while it holds requests): then a stream's later windows wait while that stage
has work, so that its work for new requests does not queue behind clips already
playing; each for at most YIELD_WAIT_S after its stream's last tile, and not once
its audio would run out within YIELD_SLACK_S. First windows never wait.

On a GPU the next iteration's decode is launched before the tiles of this one
are handed over (their samples are copied to pinned host memory first, in
stream order, so the next replay cannot overwrite them): the GPU decodes while
Python sends. Not when the next one only goes on with the streams whose first
tile this iteration holds, their audio not due for a while (`deliver_first`),
as for a request alone: launching a replay holds the thread for up to a
millisecond, which a first tile need not wait for. And not while another stage
asks it not to (`hold_look_ahead`, `auk_pipeline`'s DiT while it holds requests):
then each iteration's tiles are handed over before the next batch is picked, so a
first window whose latents come meanwhile is picked next, not queued on the GPU
behind a later window already launched. A batch with a window due soon (order 1)
looks ahead all the same: held at saturation, the decoder's stream would idle through
every send, and the streams would fall further behind their audio. A request's host-side check
(NaN and infinite values) runs while its first window decodes; a request that
fails it, or is cancelled, leaves its batch without touching the other rows.

Latents still being made. A job may come with its latents before they are
final (`Job.ready`, a CUDA event behind the work that makes them: the DiT's
last step, in the same process). Its first window then waits on the GPU for
that event, not on the host; but it is taken only when no other request has a
window to decode, or once the event has passed, so the windows of streams in
progress never queue behind a step that has yet to run. Its `verify` (the
latents' finite flag, copied behind them) runs before its first tile leaves.

Bounded work. At most `max_active` requests are in the scheduler; past it a
request waits in the scheduler's own first-come-first-served queue, and past
`max_queued` more `submit` refuses it at once (ServerBusy). While requests wait,
the ones in the scheduler are asked, a few per iteration, whether their clients
have gone, so an abandoned request's place comes free before its next window. A request
whose cancellation Triton does not pass on (one another model forwards here) is ended
through `cancel`, at the next iteration.
`submit` never blocks, so Triton's `execute` returns at once. (Triton 2.51's dynamic batcher,
in front of a decoupled model, held a request that arrived while another's
`execute` ran until some later event: up to 0.7 s on a CPU, its 500 ms wake-up
among them. Without it, Triton's default scheduler hands each request over as
soon as the last `execute` has returned, and the waiting happens here.)

This module holds the policy and the thread; the Triton side (senders,
responses, metrics) is the `StreamSink` the decode model gives each request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from .errors import BUSY_MESSAGE, STOPPING_MESSAGE, ServerBusy, ServerStopping

log = logging.getLogger(__name__)

# A request that has waited longer than this before its first window may have been
# abandoned: ask whether it was cancelled (a round trip to the server) before decoding it.
# Later windows are asked about after each tile is sent, as a cancelled stream is seen.
STALE_FIRST_WINDOW_S = 0.02
# While requests wait for a place, the requests in the scheduler are also asked, round robin,
# for up to this share of the last iteration's time (at least a millisecond, about 30 round
# trips on an idle CPU): a place held by a client that has gone comes free within an
# iteration or a few, not only when that request's next window comes round, after other
# windows of it have decoded for nobody.
CANCELLED_SWEEP_SHARE = 0.1
# A later window whose stream's audio runs out within this goes ahead of new requests' first
# windows: several replays' time, and a small part of a 10 s clip's first tile (0.46 s of audio).
DUE_SOON_S = 0.1
# An iteration is handed over before the next one is launched when that next one only goes on
# with the streams whose first tile it holds, and their audio is due this much later or more
# (`deliver_first`): a replay or two; the next one waits for the sends.
DELIVER_FIRST_SLACK_S = 0.1
# While `yield_to` says another stage has work for the GPU, a later window waits: for at most
# YIELD_WAIT_S after its stream's last tile was handed over (a long clip does not stay in the
# scheduler through its playback), and only while its stream's audio lasts longer than
# YIELD_SLACK_S (what is left covers the replays queued ahead of it). A 10 s clip's first tile
# holds 0.46 s of audio (23 of its window's 32 frames; 9 are the decoder's right context), so its
# rest waits at most 0.2 s either way.
YIELD_WAIT_S = 0.2
YIELD_SLACK_S = 0.26
# How often a scheduler whose every window left is waiting asks `yield_to` again.
YIELD_POLL_S = 0.002


class StreamSink(Protocol):
    """Where one request's tiles go (the decode model's Triton sender, or a test's stand-in)."""

    def cancelled(self) -> bool:
        """Whether the client has gone; asked before a window is decoded."""

    def tile(self, start_sample: int, samples: torch.Tensor, last: bool) -> None:
        """One decoded tile on the host, in order; `last` marks the request's final tile."""

    def fail(self, error: Exception) -> None:
        """The request failed (its check, or its decode); no tile follows."""

    def stop(self) -> None:
        """The request was cancelled; no tile follows."""


class WindowDecoder(Protocol):
    """What the scheduler needs of the decode (`AuKVAEDecodeGraph` provides it)."""

    def plan(self, frames: int, short_first: bool = True) -> list[tuple[int, int, int, int]]: ...

    def batch_key(self, frames: int, device: torch.device) -> int: ...

    def batch_capacity(self, key: int) -> int: ...

    def decode_rows(self, rows: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...


@dataclass(eq=False)
class Job:
    """One request in the scheduler: its latents [1, frames, C], windows and progress."""

    latents: torch.Tensor
    sink: StreamSink
    windows: list[tuple[int, int, int, int]] = field(default_factory=list)
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None  # on the device, before the copy
    check: Callable[[], None] | None = None  # host check, run while the first window decodes
    ready: torch.cuda.Event | None = None  # passed once the latents are final (None: they are)
    verify: Callable[[], None] | None = None  # run before the first tile leaves, after the GPU work
    arrived: float = 0.0
    next_window: int = 0
    first_sent: float | None = None  # when its first tile was handed over
    last_sent: float | None = None  # when its latest tile was
    sent_seconds: float = 0.0  # audio handed over so far
    finished: bool = False
    stop_asked: bool = False  # cancelled through `TileScheduler.cancel`: ended at the next iteration
    taken_ahead: bool = False  # its window in launch went ahead of first windows (due soon)
    planned_under_load: bool = False  # its windows planned again without the short first one

    def urgency(self, now: float, frame_seconds: float) -> tuple[int, float]:
        """Smaller is more urgent: later windows due within DUE_SOON_S by deadline, first windows
        by arrival, then the other later windows by deadline (the module docstring's order;
        `frame_seconds`: the audio of one latent frame)."""
        if self.next_window == 0:
            return (1, self.arrived)
        deadline = self.deadline(now, frame_seconds)
        return (0 if deadline - now < DUE_SOON_S else 2, deadline)

    def deadline(self, now: float, frame_seconds: float) -> float:
        """When a later window's stream runs out of audio, played from its first tile (one still
        on its way: from now)."""
        played_from = self.first_sent if self.first_sent is not None else now
        emitted_frames = self.windows[self.next_window - 1][3]  # tiles are contiguous from frame 0
        return played_from + emitted_frames * frame_seconds


def pick_batch(
    jobs: Sequence[Job], key_of: Callable[[Job], int], capacity: Callable[[int], int], now: float,
    frame_seconds: float,
) -> list[Job]:
    """The jobs whose next windows decode together next: the most urgent one, then the most
    urgent of the others with the same batch key, up to that key's capacity."""
    ready = sorted((job for job in jobs if job.next_window < len(job.windows)),
                   key=lambda job: job.urgency(now, frame_seconds))
    if not ready:
        return []
    key = key_of(ready[0])
    same = [job for job in ready if key_of(job) == key]
    return same[: capacity(key)]


def decodable(jobs: Sequence[Job]) -> list[Job]:
    """The jobs whose next window may be taken: those whose latents are final, or all of them
    when none of those has a window left (the module docstring's "latents still being made")."""
    final = [job for job in jobs if job.ready is None or job.ready.query()]
    if any(job.next_window < len(job.windows) for job in final):
        return final
    return list(jobs)


def plan_under_load(jobs: Sequence[Job], plan: Callable[..., list]) -> None:
    """While more than one request has a window waiting to decode, plan each whose first window
    is still to come again without the short first window (`plan(frames, short_first=False)`):
    the short window's replay is work on top of its clip's (the window after it decodes those
    frames again as its left context); it buys an early first audio when the decoder is free,
    and under load it delays every stream behind it. Another request's first window counts as
    much as a later one: at saturation, when the streams have gone without the short window,
    first windows are all that waits."""
    waiting = [job for job in jobs if job.next_window < len(job.windows)]
    if len(waiting) < 2:
        return
    for job in waiting:
        if job.next_window == 0 and not job.planned_under_load:
            job.windows = plan(job.latents.shape[1], short_first=False)
            job.planned_under_load = True


def yields(job: Job, now: float, frame_seconds: float) -> bool:
    """Whether a job's next window may wait while another stage has work (`TileScheduler.yield_to`):
    a later window, within YIELD_WAIT_S of its stream's last tile (or with its first still on its
    way), whose stream's audio lasts longer than YIELD_SLACK_S past `now`."""
    if job.next_window == 0:
        return False
    recent = job.last_sent is None or now - job.last_sent < YIELD_WAIT_S
    return recent and job.deadline(now, frame_seconds) - now > YIELD_SLACK_S


def deliver_first(first_tiles: Sequence[Job], batch: Sequence[Job], frame_seconds: float) -> bool:
    """Whether to hand an iteration's tiles over before launching `batch` (taken: each job's
    window index has moved on): when `batch` only goes on with streams whose first tile is in
    that iteration (`first_tiles`), none of them due within DELIVER_FIRST_SLACK_S of that tile.
    Their audio cannot play before that tile anyway, and a batch with any other window keeps
    the look-ahead: under load, the replays queue back to back."""
    if not batch or any(job not in first_tiles for job in batch):
        return False
    return all(job.windows[job.next_window - 2][3] * frame_seconds >= DELIVER_FIRST_SLACK_S for job in batch)


@dataclass
class _InFlight:
    """One iteration's tiles, copied (or being copied) to the host."""

    tiles: list[tuple[Job, int, torch.Tensor, bool]]  # job, start sample, host samples, last
    done: torch.cuda.Event | None
    rows: int
    mode: str | None  # the decode tier that served the replay
    decode_seconds: float  # launching the decode and, later, waiting for its samples

    def first_tiles(self) -> list[Job]:
        """The jobs whose first tile this is."""
        return [job for job, _, _, _ in self.tiles if job.first_sent is None and not job.finished]


@dataclass
class Iteration:
    """What one iteration did, for the metrics (`TileScheduler.on_iteration`)."""

    rows: int  # windows in the replay
    mode: str | None
    decode_seconds: float
    send_seconds: float
    tile_seconds: list[float]  # audio seconds of each tile handed over
    first_audio: list[float]  # arrival to first tile, of the requests whose first tile it was
    underruns: int
    active: int  # requests in the scheduler after it
    queued: int = 0  # requests waiting in its queue after it


class TileScheduler:
    """Decodes the windows of every submitted job on one thread; see the module docstring."""

    def __init__(
        self,
        decoder: WindowDecoder,
        device: torch.device,
        sample_rate: int,
        hop_size: int,
        max_active: int,
        max_queued: int,
        on_iteration: Callable[[Iteration], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        yield_to: Callable[[], bool] | None = None,
        short_first_under_load: bool = True,
    ):
        self.decoder, self.device = decoder, torch.device(device)
        self.sample_rate, self.hop_size = sample_rate, hop_size
        self.max_active = max(1, int(max_active))
        self.max_queued = max(0, int(max_queued))
        self.on_iteration = on_iteration
        self.clock = clock
        self.look_ahead = self.device.type == "cuda"  # decodes are asynchronous there
        # Asked on the scheduler's thread before each pick (it may be set after `start`): True while
        # another stage has work for the GPU, and later windows wait (`yields`). None: never.
        self.yield_to = yield_to
        # Asked at each iteration, after its pick (it may be set after `start`): True while another
        # stage's new requests are about to bring first windows; the scheduler does not look ahead then.
        self.hold_look_ahead: Callable[[], bool] | None = None
        # False: a request's short first window is planned away while another request has a
        # window waiting to decode (`plan_under_load`).
        self.short_first_under_load = short_first_under_load
        # Asked before each pick (it may be set after `start`): True while another stage holds its
        # requests back for want of room here; the short first window is then planned away as with
        # `short_first_under_load` off. None: never.
        self.saturated: Callable[[], bool] | None = None
        self.yielding = 0  # requests whose next window waited at the last pick (a moment's view)
        self.underruns = 0  # tiles handed over after their deadline
        self._jobs: list[Job] = []  # admitted, not finished
        self._queued: deque[Job] = deque()  # waiting for a place among them, oldest first
        self._cond = threading.Condition()
        self._closing = False  # no new jobs
        self._stopping = False  # and the ones left are stopped at the next iteration
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._sweep_next = 0  # where the next sweep for cancelled requests starts

    # ---- the caller's side (Triton's execute thread) ----------------------------------------

    def start(self, warmup: Callable[[], None] | None = None, stream: torch.cuda.Stream | None = None) -> None:
        """Start the thread; `warmup` runs on it first (graphs are captured and replayed on
        one thread), and what it raises is raised here. With `stream`, the thread queues its
        decodes there afterwards (a job's latents must then be copied on it too)."""
        ready = threading.Event()

        def main():
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)  # per thread: captures on another GPU fail
                if warmup is not None:
                    warmup()
                if stream is not None:
                    torch.cuda.set_stream(stream)  # this thread's, from here on
            except BaseException as err:  # noqa: BLE001  (handed to the caller)
                self._thread_error = err
                ready.set()
                return
            ready.set()
            self._run()

        self._thread = threading.Thread(target=main, name="auk-tile-scheduler", daemon=True)
        self._thread.start()
        ready.wait()
        if self._thread_error is not None:
            raise self._thread_error

    def submit(self, job: Job) -> None:
        """Admit a job, or queue it while `max_active` jobs are in the scheduler; past
        `max_queued` queued, raise ServerBusy. Returns at once either way."""
        job.windows = job.windows or self.decoder.plan(job.latents.shape[1])
        with self._cond:
            if self._closing:
                raise ServerStopping(STOPPING_MESSAGE)
            job.arrived = job.arrived or self.clock()  # a queued job's wait counts to its first audio
            if len(self._jobs) < self.max_active:
                self._jobs.append(job)
                self._cond.notify_all()
            elif len(self._queued) < self.max_queued:
                self._queued.append(job)
            else:
                raise ServerBusy(BUSY_MESSAGE.format(active=len(self._jobs), queued=len(self._queued)))

    def cancel(self, job: Job) -> None:
        """End `job` at the next iteration as a request whose client has gone (its sink's `stop`),
        from any thread: how a request Triton cannot cancel (a forwarded one) is stopped."""
        with self._cond:
            if not job.finished:
                job.stop_asked = True
                self._cond.notify_all()

    @property
    def active(self) -> int:
        return len(self._jobs)

    @property
    def queued(self) -> int:
        return len(self._queued)

    @property
    def idle(self) -> bool:
        """No request in the scheduler, decoding or queued (read without the lock: a moment's view)."""
        return not self._jobs and not self._queued

    def close(self, drain_s: float = 2.0) -> None:
        """Let the jobs in the scheduler finish for up to `drain_s`, end the rest with
        ServerStopping, then end the thread: well inside Triton's exit timeout.

        Seen on Triton 2.51, a server stop reaches finalize (and so this) only once the
        requests in flight have ended, or at the exit timeout: a stream that outlasts the
        timeout keeps the server until then. The one question that would tell the model
        of the stop earlier, pb_utils.is_model_ready, crashed that server (an uncaught
        boost::interprocess::lock_exception in the Python backend) in 2 of 6 stops when
        asked during one, so nothing here asks it. Through the launcher this does not
        arise: its front door cuts what still runs after its drain (the model sees those
        cancelled at their next window) before it signals tritonserver."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is None:
            return
        self._thread.join(drain_s)
        if self._thread.is_alive():
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            self._thread.join(drain_s)

    # ---- the scheduler's thread -------------------------------------------------------------

    def _run(self) -> None:
        in_flight: _InFlight | None = None
        began = time.perf_counter()
        while True:
            now = time.perf_counter()
            last_iteration_s, began = now - began, now
            if self._queued and not self._stopping:
                self._sweep_cancelled(max(0.001, CANCELLED_SWEEP_SHARE * last_iteration_s))
            with self._cond:
                while not self._has_work() and in_flight is None:
                    if self._closing:
                        return
                    self._cond.wait()
                stopped = [*self._jobs, *self._queued] if self._stopping else []
                asked = [job for job in (*self._jobs, *self._queued) if job.stop_asked]
                batch = [] if self._stopping else self._take_batch()
                if not batch and self.yielding and in_flight is None and not stopped and not asked:
                    self._cond.wait(YIELD_POLL_S)  # every window left waits: ask again soon
                    continue
            for job in stopped:
                self._end(job, lambda job=job: job.sink.fail(ServerStopping(STOPPING_MESSAGE)))
            if stopped:
                in_flight = None
                continue
            for job in asked:  # a tile of theirs still in flight is dropped on delivery
                self._end(job, job.sink.stop)
            # Asked after the pick, not before a wait for work; a stream about to run out looks ahead.
            held = (self.hold_look_ahead is not None and self.hold_look_ahead()
                    and not any(job.taken_ahead for job in batch))
            try:
                if in_flight is not None and (held or deliver_first(in_flight.first_tiles(), batch,
                                                                    self.hop_size / self.sample_rate)):
                    self._deliver(in_flight)
                    in_flight = None
                launched = self._launch(batch) if batch else None
                if launched is not None and (held or not self.look_ahead):  # held: the next pick comes after
                    self._deliver(launched)
                    launched = None
                if in_flight is not None:
                    self._deliver(in_flight)
                in_flight = launched
            except Exception as err:  # a fault of the scheduler's own: fail what it holds, keep serving
                log.exception("tile scheduler iteration failed")
                in_flight = None
                for job in list(self._jobs):
                    self._end(job, lambda job=job: job.sink.fail(err))

    def _sweep_cancelled(self, budget_s: float) -> None:
        """Ask the requests in the scheduler, round robin from where the last sweep stopped,
        whether their clients have gone, for up to `budget_s`; end those that have (a queued
        request takes each place)."""
        with self._cond:
            jobs = list(self._jobs)
        began = time.perf_counter()
        asked = 0
        while asked < len(jobs) and time.perf_counter() - began < budget_s:
            job = jobs[(self._sweep_next + asked) % len(jobs)]
            asked += 1
            try:
                gone = not job.finished and job.sink.cancelled()
            except Exception as err:  # the request cannot be asked: its client is gone
                log.warning("asking a request whether it was cancelled failed: %s: %s", type(err).__name__, err)
                self._end(job, lambda: None)
                continue
            if gone:
                self._end(job, job.sink.stop)
        self._sweep_next = (self._sweep_next + asked) % max(1, len(jobs))

    def _has_work(self) -> bool:
        return (any(job.stop_asked or job.next_window < len(job.windows) for job in self._jobs)
                or any(job.stop_asked for job in self._queued))

    def _take_batch(self) -> list[Job]:
        """The next batch (under the lock); each job's window index moves on as it is taken."""
        now, frame_seconds = self.clock(), self.hop_size / self.sample_rate
        jobs = [job for job in self._jobs if not job.stop_asked and job.next_window < len(job.windows)]
        if not self.short_first_under_load or (self.saturated is not None and self.saturated()):
            plan_under_load(jobs, self.decoder.plan)
        left = len(jobs)
        if self.yield_to is not None and self.yield_to():
            jobs = [job for job in jobs if not yields(job, now, frame_seconds)]
        self.yielding = left - len(jobs)
        batch = pick_batch(
            decodable(jobs),
            key_of=lambda job: self.decoder.batch_key(job.windows[job.next_window][1], self.device),
            capacity=self.decoder.batch_capacity,
            now=now,
            frame_seconds=frame_seconds,
        )
        for job in batch:
            job.taken_ahead = job.urgency(now, frame_seconds)[0] == 0
            job.next_window += 1
        return batch

    def _launch(self, batch: list[Job]) -> _InFlight | None:
        """Decode one window of each job, run first-window checks while the GPU works, and
        start the host copies of the tiles."""
        began = time.perf_counter()
        now = self.clock()
        live = []
        for job in batch:
            # Asking is a round trip to the server: only a first window that has waited asks
            # here, and a window that goes ahead of first windows, since an abandoned stream
            # soon falls behind its deadlines and would hold new requests back (other later
            # windows ask after their tile is sent, off the first audio's path).
            stale = job.next_window == 1 and now - job.arrived > STALE_FIRST_WINDOW_S
            if (stale or job.taken_ahead) and job.sink.cancelled():
                self._end(job, job.sink.stop)
            else:
                live.append(job)
        if not live:
            return None
        rows = []
        for job in live:
            if job.ready is not None:  # its latents are still being made: the GPU waits, not this thread
                if self.device.type == "cuda":
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(job.ready)
                    job.latents.record_stream(stream)  # made on another stream: kept until read here
                job.ready = None
            start, size, _, _ = job.windows[job.next_window - 1]
            rows.append(job.latents[:, start : start + size])
        try:
            waves = self.decoder.decode_rows(rows)
        except Exception as err:  # a failed decode fails its batch, not the scheduler
            log.error("decode of %d windows failed: %s: %s", len(live), type(err).__name__, err)
            for job in live:
                self._end(job, lambda job=job: job.sink.fail(err))
            return None
        checked = []
        for job, wave in zip(live, waves):
            if job.check is not None and job.next_window == 1:
                check, job.check = job.check, None  # the job lets go of the host array it checks
                try:
                    check()
                except Exception as err:
                    self._end(job, lambda job=job, err=err: job.sink.fail(err))
                    continue
            checked.append((job, wave))
        tiles = []
        for job, wave in checked:
            start, _, emit_start, emit_end = job.windows[job.next_window - 1]
            samples = wave[(emit_start - start) * self.hop_size : (emit_end - start) * self.hop_size]
            if job.convert is not None:
                samples = job.convert(samples)
            host = torch.empty(samples.shape, dtype=samples.dtype, pin_memory=samples.is_cuda)
            host.copy_(samples, non_blocking=samples.is_cuda)
            tiles.append((job, emit_start * self.hop_size, host, job.next_window == len(job.windows)))
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        mode = getattr(self.decoder, "last_mode", None)
        return _InFlight(tiles, done, len(live), mode, time.perf_counter() - began)

    def _deliver(self, in_flight: _InFlight) -> None:
        """Wait for an iteration's host copies and hand each tile to its sink."""
        began = time.perf_counter()
        if in_flight.done is not None:
            in_flight.done.synchronize()
        decode_seconds = in_flight.decode_seconds + time.perf_counter() - began
        report = Iteration(in_flight.rows, in_flight.mode, decode_seconds, 0.0, [], [], 0, 0)
        for job, start_sample, host, last in in_flight.tiles:
            if job.finished:  # failed or cancelled since
                continue
            if job.first_sent is None and job.verify is not None:
                verify, job.verify = job.verify, None
                try:
                    verify()
                except Exception as err:
                    self._end(job, lambda job=job, err=err: job.sink.fail(err))
                    continue
            now = self.clock()
            job.last_sent = now
            if job.first_sent is None:
                job.first_sent = now
                report.first_audio.append(now - job.arrived)
            elif now > job.first_sent + job.sent_seconds:
                report.underruns += 1
            began = time.perf_counter()
            try:
                job.sink.tile(start_sample, host, last)
            except Exception as err:  # the client is gone: that request only
                log.warning("sending a tile failed: %s: %s", type(err).__name__, err)
                self._end(job, lambda: None)
                continue
            finally:
                report.send_seconds += time.perf_counter() - began
            seconds = host.numel() / self.sample_rate
            job.sent_seconds += seconds
            report.tile_seconds.append(seconds)
            if last:
                self._end(job, lambda: None)
            elif job.sink.cancelled():  # only where another tile would follow
                self._end(job, job.sink.stop)
        self.underruns += report.underruns
        report.active, report.queued = len(self._jobs), len(self._queued)
        if self.on_iteration is not None:
            self.on_iteration(report)

    def _end(self, job: Job, finish: Callable[[], None]) -> None:
        """Take a job out of the scheduler once (its place goes to the oldest queued job), then
        tell its sink how it ended."""
        with self._cond:
            if job.finished:
                return
            job.finished = True
            if job in self._queued:
                self._queued.remove(job)
            else:
                self._jobs.remove(job)
            while self._queued and len(self._jobs) < self.max_active and not self._stopping:
                self._jobs.append(self._queued.popleft())
            self._cond.notify_all()
        try:
            finish()
        except Exception as err:  # the client is gone
            log.warning("ending a request failed: %s: %s", type(err).__name__, err)
