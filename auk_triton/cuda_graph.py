"""Capturing CUDA graphs, shared by the codec's and the diffusion model's graph wrappers: one
capture at a time, and a builder thread for the graphs a model builds after it is ready."""

import logging
import queue
import sys
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Sequence, TypeVar

import torch

logger = logging.getLogger(__name__)

Output = TypeVar("Output")

# The interpreter's switch interval while graphs build beside the serving thread: it
# bounds how long that thread waits for the GIL (the default is 5 ms).
BUILD_SWITCH_INTERVAL_S = 0.0005
# A builder given a condition to begin on (the whole server READY) asks it this often, and
# begins anyway after waiting this long: longer than any model set takes to load cold.
BUILD_BEGIN_POLL_S = 0.5
BUILD_BEGIN_WAIT_S = 900.0
# One build item at a time in a process. A model whose stages each build after READY (the
# pipeline's DiT and decoder in one process) would otherwise compile and capture on two threads
# at once, and torch.compile's tracing is not made for that; each stage's own serving thread
# only replays, so it never waits for this.
_ONE_BUILD_AT_A_TIME = threading.Lock()


def priority_stream(device, first: bool) -> torch.cuda.Stream:
    """A stream of its own on `device` for a serving thread: at the device's highest priority
    when `first`, else at its lowest. Where both wait, the GPU starts the first one's kernels
    before the other's. No capture or warm-up of `capture` ever runs on it."""
    low, high = torch.cuda.Stream.priority_range()  # CUDA: a lower number is a higher priority
    with torch.cuda.device(device):
        return _take_stream(high if first else low)


def _take_stream(priority: int = 0) -> torch.cuda.Stream:
    """A stream of the current device from torch's pool that nothing else here holds, held from
    now on (`_give_back` ends that). torch hands out its streams of a priority in turn, so a
    later draw returns an earlier one; a capture on a stream that another thread launches on
    would take that thread's kernels into its graph."""
    with _HELD_LOCK:
        for _ in range(2 * STREAMS_PER_PRIORITY):
            stream = torch.cuda.Stream(priority=priority)
            if stream.cuda_stream not in _HELD:
                _HELD.add(stream.cuda_stream)
                return stream
    raise RuntimeError(f"every pooled CUDA stream of priority {priority} is held")


def side_stream(priority: int) -> torch.cuda.Stream:
    """A second stream of the current device at `priority` for the calling thread, held for good:
    where a thread forks work off its current stream (diffusion/two_streams.py). One per thread,
    device and priority, so no two threads' captures or warm-ups ever share one."""
    streams = getattr(_THREAD_SIDE_STREAMS, "streams", None)
    if streams is None:
        streams = _THREAD_SIDE_STREAMS.streams = {}
    key = (torch.cuda.current_device(), priority)
    if key not in streams:
        streams[key] = _take_stream(priority)
    return streams[key]


def _give_back(stream: torch.cuda.Stream) -> None:
    with _HELD_LOCK:
        _HELD.discard(stream.cuda_stream)


@contextmanager
def _stream_for_now(priority: int = 0) -> Iterator[torch.cuda.Stream]:
    stream = _take_stream(priority)
    try:
        yield stream
    finally:
        _give_back(stream)


# torch's pool of streams per priority and device (c10's kStreamsPerPool).
STREAMS_PER_PRIORITY = 32
# The pooled streams in use (their handles): serving threads', capture streams, the side
# streams of captures in progress, and threads' second streams (side_stream).
_HELD: set[int] = set()
_HELD_LOCK = threading.RLock()
_THREAD_SIDE_STREAMS = threading.local()  # .streams: (device, priority) -> this thread's side_stream


@contextmanager
def short_switch_interval(seconds: float = BUILD_SWITCH_INTERVAL_S) -> Iterator[None]:
    """The interpreter's switch interval at most `seconds` inside: a thread that launches many
    small kernels then waits that long at most for the GIL another thread holds."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(min(switch, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(switch)


def capture(run: Callable[[], Output], pool=None, warmups: int = 2,
            beside_serving: bool = False, priority: int | None = None) -> tuple[torch.cuda.CUDAGraph, Output]:
    """Capture one call of `run` (on the current device) as a CUDA graph; return the graph and
    the call's output, the static buffer each replay rewrites.

    `run` is first called `warmups` times on a side stream: compilation, autotuning
    and library handles are created lazily and must not happen inside the capture.
    `pool` is a graph memory pool to share (None: the graph gets its own).

    `priority`: that of the stream the graph will replay on (None: the device's default).
    PyTorch instantiates a graph so that each kernel keeps the priority of the stream it was
    captured on (CUDA's cudaGraphInstantiateFlagUseNodePriority), whatever stream replays it:
    a graph meant to go ahead of other work is captured on a stream of that priority.

    `beside_serving`: another thread keeps launching work meanwhile (a graph built after
    the model is ready). The capture then runs on a stream of its own, not the one that lone
    captures of its priority share, and in CUDA's thread-local mode, which forbids unsafe
    calls (an allocation, a synchronisation) on this thread only, not on the serving one. It
    also skips what `torch.cuda.graph` does first for a lone capture: a device-wide
    synchronisation and emptying the device's and pinned host memory's caches, which the
    serving thread would wait for and then refill.
    """
    with _stream_for_now() as side:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                run()
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if not beside_serving:
        with torch.cuda.graph(graph, pool=pool, stream=_capture_stream(priority or 0)):
            output = run()
        return graph, output
    with _stream_for_now(priority or 0) as own:
        own.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(own):
            graph.capture_begin(*(() if pool is None else (pool,)), capture_error_mode="thread_local")
            try:
                output = run()
            finally:
                graph.capture_end()
    return graph, output


def _capture_stream(priority: int) -> torch.cuda.Stream:
    """The capture stream of the current device at `priority`: one, held for good, as torch keeps
    one for the default (cuBLAS keeps a workspace per stream)."""
    key = (torch.cuda.current_device(), priority)
    with _HELD_LOCK:
        if key not in _CAPTURE_STREAMS:
            _CAPTURE_STREAMS[key] = _take_stream(priority)
        return _CAPTURE_STREAMS[key]


_CAPTURE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


Item = TypeVar("Item", bound=Hashable)


def wait_for(condition: Callable[[], bool], stop: threading.Event, timeout_s: float = BUILD_BEGIN_WAIT_S,
             poll_s: float = BUILD_BEGIN_POLL_S) -> bool | None:
    """Ask `condition` every `poll_s` until it holds (True) or `timeout_s` has passed (False);
    None once `stop` is set."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        stop.wait(poll_s)
    return None


class BuildQueue:
    """The items a builder has still to build, in order, where a serving thread may move one to
    the front (`prefer`): a request that is served by another tier meanwhile asks for its own."""

    def __init__(self, items: Sequence[Item] = ()):
        self._lock = threading.Lock()
        self._waiting: OrderedDict = OrderedDict.fromkeys(items)
        self.preferred = 0  # items moved to the front

    def prefer(self, item: Item) -> bool:
        """Build `item` next (after the one in progress) if it is still waiting; any thread."""
        with self._lock:
            if item not in self._waiting:
                return False
            self._waiting.move_to_end(item, last=False)
            self.preferred += 1
            return True

    def next(self) -> Item | None:
        """The item to build now, taken off the queue; None once it is empty."""
        with self._lock:
            return self._waiting.popitem(last=False)[0] if self._waiting else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)


@dataclass
class BuildReport:
    """What a builder did, for the model's log."""

    seconds: float  # building, from the first item on
    built: int
    failed: int
    waited_s: float = 0.0  # before the first item, for its condition to begin
    condition_held: bool | None = None  # whether it held when building began (None: no condition)
    preferred: int = 0  # items built ahead of their turn, for a request served meanwhile
    graphs: int = 0  # in the items built (`count`)


class GraphBuilder:
    """Builds graphs on a thread of its own after the service is ready, beside the thread
    that serves requests; that thread takes each result over (`take`) when it next looks,
    so no table it reads ever changes under it."""

    def __init__(self, name: str):
        self.name = name
        self._built: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._queue = BuildQueue()

    def start(self, items: Sequence[Item], build: Callable[[Item], object], device,
              describe: Callable[[Item], str] = str,
              on_done: Callable[[BuildReport], None] | None = None,
              begin_when: Callable[[], bool] | None = None,
              count: Callable[[object], int] = lambda result: 1) -> None:
        """Build each item in order (an item `prefer`red goes first), with `build(item)` on a
        stream of `device`'s own (under no_grad: a build that serves under inference mode
        enters it), each result (None where it failed, logged) queued for `take`. With
        `begin_when`, first wait until it holds (`wait_for`). `on_done(report)` is called on
        the builder's thread at the end (not when stopped), with the graphs the results hold
        (`count(result)`: one each by default)."""
        if not items:
            return
        self._queue = work = BuildQueue(items)
        device = torch.device(device)
        index = torch.cuda.current_device() if device.index is None else device.index  # "cuda": the caller's

        def build_all():
            waiting_since, held = time.perf_counter(), None
            if begin_when is not None:
                held = wait_for(begin_when, self._stop)
                if held is None:
                    return
            began, built, graphs = time.perf_counter(), 0, 0
            try:
                torch.cuda.set_device(index)
                # A stream of its own: the captures' warm-up runs (and cuDNN's timing) order
                # nothing of the serving thread's behind them.
                with torch.no_grad(), torch.cuda.stream(torch.cuda.Stream()), short_switch_interval():
                    while (item := work.next()) is not None:
                        if self._stop.is_set():
                            return
                        try:
                            with _ONE_BUILD_AT_A_TIME:
                                result = build(item)
                        except Exception as err:  # out of memory, say: the tier it stands in for stays
                            logger.warning("%s: building %s failed: %s: %s", self.name, describe(item),
                                           type(err).__name__, err)
                            result = None
                        built += result is not None
                        graphs += 0 if result is None else count(result)
                        self._built.put((item, result))
            except Exception as err:  # the rest stay pending: their work keeps another tier
                logger.error("%s stopped: %s: %s", self.name, type(err).__name__, err)
            if on_done is not None and not self._stop.is_set():
                on_done(BuildReport(time.perf_counter() - began, built, len(items) - built, began - waiting_since, held,
                                    work.preferred, graphs))

        self._thread = threading.Thread(target=build_all, name=self.name, daemon=True)
        self._thread.start()

    @property
    def stopping(self) -> bool:
        """True once `stop` was called: a long build may end early (its result is not used)."""
        return self._stop.is_set()

    def prefer(self, item: Item) -> bool:
        """Build `item` next, after the one in progress, if it is still waiting (False: built,
        in progress, or never asked for)."""
        return self._queue.prefer(item)

    def take(self) -> Iterator[tuple[Item, object]]:
        """(item, result or None) for each item built since the last call: call it on the
        serving thread only."""
        while not self._built.empty():
            yield self._built.get_nowait()

    def hand_over(self, item: Item, result: object) -> None:
        """Queue a result as the builder does (a test's stand-in builder)."""
        self._built.put((item, result))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the item in progress, and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
