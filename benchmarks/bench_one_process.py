r"""The DiT and the streaming decoder in one process, against each in a process of its own.

Served, `auk_dit` and `auk_vae_decode` are two Python-backend processes: two CUDA contexts,
which the GPU serves in turns (benchmarks/studies/dit-joined-steps.md). This script serves
flash requests without Triton in each layout below, one after the other: each request is
sampled as auk_dit's sampling thread samples it (rows joining their bucket's run between
steps, compiled and graphed) and its latents decoded as auk_vae_decode's tile scheduler
decodes them (its buckets and batched graphs, built before the first request); a sink notes
when each tile is handed over.

- `two processes`: the decoder in a child process, the latents passed to it through a queue,
  as an ensemble passes them from one model to the other (`auk_pipeline` did, before it became
  one model);
- `one process`: the sampling thread and the scheduler's thread in this process, each
  queuing on a stream of its own, of the same priority; a lone request's latents stay on the
  GPU, handed over as their last step is queued (as `auk_pipeline` does), the others' go
  through the host;
- `one process, decode first`: the same, the scheduler's stream at the device's highest
  priority and the sampler's at its lowest, so the decoder's kernels go first whenever both
  wait for the GPU (`auk_pipeline` as served);
- `one process, decode first, later windows yield`: the same, and while the sampling thread
  holds requests a stream's later windows wait for it, until their audio would run out within
  the scheduler's slack (`auk_pipeline` with `decode_yields_to_dit`);
- `one process, decode first, no look-ahead while the DiT holds requests`: decode first, and
  while the sampling thread holds requests the scheduler hands each replay's tiles over before
  it picks the next (`TileScheduler.hold_look_ahead`).

Per layout: one client's first audio (requests 100 ms apart), and where it goes: from a
request's arrival, the median time at which each call of the sampling thread's step
returned (the first has built the run's context and queued its first step), its latents
handed to the decoder (in two processes once on the host; in one, a lone request's as their
last step is queued), its first and last tiles; the capacity, `--clients` closed-loop clients for
`--closed-seconds`; then Poisson arrivals at `--load` of that capacity for `--duration` s, and
where the first audio of the slowest 1% of them went, against all of them. First audio runs
from a request's arrival to its first tile on the host: no client, transport or front door.
"Late tiles" are the tiles the scheduler handed over after the audio before them had run out
(underruns); "backlog" the requests in flight when the arrivals end.

Weights are seeded synthetic ones in the released dims: the audio is not real.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_one_process.py --cache-dir /tmp/one-process
    PYTHONPATH=.:benchmarks python3 benchmarks/bench_one_process.py --small   # smoke test on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import queue
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from auk_triton.codec import AuKVAE, AuKVAEDecodeGraph
from auk_triton.diffusion.buckets import ShapeBuckets
from auk_triton.diffusion.compiled import CompileOptions
from auk_triton.diffusion.joined import DeviceLatents, JoinedRuns, to_device
from auk_triton.diffusion.sampler import AuKDiTSampler, Request
from auk_triton.diffusion.synthetic import synthetic_transformer
from auk_triton.serving.config import DecodeSettings, DiTSettings, use_compile_cache
from auk_triton.serving.sampling_thread import SamplingThread
from auk_triton.serving.scheduler import Job, TileScheduler
from common import heading, percentile, poisson, sampler_config, say, served_graph, synthetic_checkpoint

LAYOUTS = ("two processes", "one process", "one process, decode first",
           "one process, decode first, later windows yield",
           "one process, decode first, no look-ahead while the DiT holds requests")
ONE_CLIENT_GAP_S = 0.1
HIGHEST_PRIORITY = -100  # CUDA: a lower number is a higher priority
CAPACITY_SETTLE_S = 2.0  # the closed loop's first seconds, not counted
DRAIN_TIMEOUT_S = 60.0


# ---- the decoder's side: a tile scheduler whose sinks report to a queue ----------------------


class ReportingSink:
    """A request's tiles: the first one's and the last one's hand-over times go to `events`."""

    def __init__(self, request_id: int, events):
        self.request_id, self.events, self.first = request_id, events, True

    def cancelled(self) -> bool:
        return False

    def tile(self, start_sample: int, samples: torch.Tensor, last: bool) -> None:
        now = time.monotonic()
        if self.first:
            self.events.put(("first", self.request_id, now))
            self.first = False
        if last:
            self.events.put(("done", self.request_id, now))

    def fail(self, error: Exception) -> None:
        self.events.put(("error", self.request_id, f"{type(error).__name__}: {error}"))

    def stop(self) -> None:
        self.events.put(("error", self.request_id, "stopped"))


def build_decoder(checkpoint: Path, device: torch.device) -> AuKVAEDecodeGraph:
    """The decoder as auk_vae_decode builds it (on a CPU: uncompiled, no graphs)."""
    if device.type == "cuda":
        return served_graph(checkpoint, DecodeSettings())
    return AuKVAEDecodeGraph(AuKVAE.from_pretrained(checkpoint, device=device), enabled=False,
                             tile_frames=DecodeSettings().tile_frames)


def stream_of(device: torch.device, first: bool) -> torch.cuda.Stream | None:
    """A stream of its own: at the device's highest priority when `first`, else at its default
    (CUDA's lowest); none on a CPU."""
    if device.type != "cuda":
        return None
    # torch maps a priority past the device's range to the range's end.
    return torch.cuda.Stream(device, priority=HIGHEST_PRIORITY if first else 0)


class Decoding:
    """A tile scheduler whose thread queues its decodes on `stream`; `graph` is built on that
    thread first when `build` (the model builds its graphs on the scheduler's thread)."""

    def __init__(self, graph: AuKVAEDecodeGraph, device: torch.device, events, stream, build: bool = False):
        self.device, self.events, self.stream = device, events, stream
        settings = DecodeSettings()

        def on_iteration(report) -> None:
            if report.underruns:
                events.put(("late", report.underruns, None))

        def warmup() -> None:
            if build:
                graph.warmup(device, defer=False)
            if stream is not None:
                torch.cuda.set_stream(stream)  # this thread's work from here on

        vae = graph.vae
        self.scheduler = TileScheduler(graph, device, vae.sample_rate, vae.hop_size, settings.max_active_requests,
                                       settings.max_queued_requests, on_iteration=on_iteration)
        self.scheduler.start(warmup=warmup)

    def submit(self, request_id: int, latents: torch.Tensor | DeviceLatents) -> None:
        """Decode a request's latents [frames, C], on the host or left on the GPU by the DiT (as
        auk_pipeline hands them over); called from any thread. A copy to the GPU goes on the
        decoder's stream, not behind the caller's work."""
        sink, arrived = ReportingSink(request_id, self.events), time.monotonic()
        if isinstance(latents, DeviceLatents):
            job = Job(latents.latents[None], sink, arrived=arrived, ready=latents.ready, verify=latents.check)
        else:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                job = Job(to_device(latents.float()[None], self.device), sink, arrived=arrived)
        self.scheduler.submit(job)

    def close(self) -> None:
        self.scheduler.close()


def decoder_process(checkpoint: str, device: str, cache_dir: str | None, inbox, events) -> None:
    """The child of `two processes`: builds the decoder, says "ready", decodes what arrives."""
    if cache_dir:
        use_compile_cache(Path(cache_dir))
    decoding = Decoding(build_decoder(Path(checkpoint), torch.device(device)), torch.device(device), events,
                        stream=None, build=True)
    events.put(("ready", None, None))
    while (item := inbox.get()) is not None:
        request_id, latents = item
        decoding.submit(request_id, torch.from_numpy(latents))
    decoding.close()
    events.put(None)


class ChildDecoding:
    """`two processes`: latents go to the child's queue, as numpy arrays."""

    def __init__(self, checkpoint: Path, device: torch.device, cache_dir: str | None, events: queue.SimpleQueue):
        context = multiprocessing.get_context("spawn")
        self.inbox, child_events = context.Queue(), context.Queue()
        self.child = context.Process(target=decoder_process, daemon=True,
                                     args=(str(checkpoint), str(device), cache_dir, self.inbox, child_events))
        self.child.start()
        self._child_events, self._events = child_events, events

    def wait_ready(self) -> None:
        """Wait for the child's decoder (built meanwhile beside this process's DiT), then relay its events."""
        kind, _, _ = self._child_events.get()
        assert kind == "ready", kind
        threading.Thread(target=self._relay, args=(self._child_events, self._events), daemon=True).start()

    @staticmethod
    def _relay(source, target) -> None:
        while (event := source.get()) is not None:
            target.put(event)

    def submit(self, request_id: int, latents: torch.Tensor) -> None:
        self.inbox.put((request_id, latents.float().numpy()))

    def close(self) -> None:
        self.inbox.put(None)
        self.child.join(30)


# ---- the DiT's side ---------------------------------------------------------------------------


class RunsOnStream:
    """JoinedRuns whose submissions and steps are queued on `stream` (None: as they are); each
    step's return goes to `events` as ("step", requests held when it was called, time)."""

    def __init__(self, runs: JoinedRuns, stream, events):
        self.runs, self.stream, self.events = runs, stream, events

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def __len__(self) -> int:
        return len(self.runs)

    def submit(self, *args, **kwargs) -> None:
        with self._on_stream():
            self.runs.submit(*args, **kwargs)

    def step(self):
        held = len(self.runs)
        with self._on_stream():
            done = self.runs.step()
        self.events.put(("step", held, time.monotonic()))
        return done

    def drain(self):
        return self.runs.drain()


def build_sampler(preset: str, frames: int, tokens: int, device: torch.device) -> AuKDiTSampler:
    """auk_dit's flash sampler on the default bucket that holds the requests, built before serving."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = synthetic_transformer(preset, seed=0, device=device, dtype=dtype)
    settings = DiTSettings()
    shape = settings.shape_buckets().shape(tokens, frames)
    bucket = ShapeBuckets((shape.text,), (shape.frames,), (), settings.max_batch_tokens, settings.max_batch_requests)
    options = CompileOptions(backend="inductor" if device.type == "cuda" else "eager")
    sampler = AuKDiTSampler(model, sampler_config(model, "flash"), device, dtype, buckets=bucket, compile=options)
    sampler.warmup()
    return sampler


# ---- the load ---------------------------------------------------------------------------------


@dataclass
class Phase:
    """What one phase of a layout's load gave."""

    arrived: dict[int, float] = field(default_factory=dict)  # request -> its arrival (monotonic s)
    first: dict[int, float] = field(default_factory=dict)  # -> its first tile
    done: dict[int, float] = field(default_factory=dict)  # -> its last tile
    latents: dict[int, float] = field(default_factory=dict)  # -> its latents handed to the decoder
    steps: list[float] = field(default_factory=list)  # when each step call returned
    held: list[int] = field(default_factory=list)  # the requests the DiT held at each step call
    errors: list[str] = field(default_factory=list)
    late_tiles: int = 0
    backlog: int = 0  # in flight when the arrivals ended

    def first_audio_ms(self) -> list[float]:
        return [(self.first[i] - self.arrived[i]) * 1e3 for i in self.first]

    def in_flight(self) -> int:
        return len(self.arrived) - len(self.done) - len(self.errors)


class Load:
    """Sends requests to a layout (`submit(request_id)`) and reads its events."""

    def __init__(self, submit, events: queue.SimpleQueue):
        self.submit, self.events, self.next_id = submit, events, 0

    def _send(self, phase: Phase) -> None:
        request_id, self.next_id = self.next_id, self.next_id + 1
        phase.arrived[request_id] = time.monotonic()
        self.submit(request_id)

    def _read(self, phase: Phase, until: float, on_done=None) -> None:
        """Record events until the monotonic time `until`."""
        while (left := until - time.monotonic()) > 0:
            try:
                kind, key, value = self.events.get(timeout=left)
            except queue.Empty:
                return
            if kind == "first":
                phase.first[key] = value
            elif kind == "done":
                phase.done[key] = value
                if on_done is not None:
                    on_done(value)
            elif kind == "error":
                phase.errors.append(value)
                if on_done is not None:
                    on_done(time.monotonic())
            elif kind == "latents":
                phase.latents[key] = value
            elif kind == "step":
                phase.steps.append(value)
                phase.held.append(key)
            elif kind == "late":
                phase.late_tiles += key

    def _drain(self, phase: Phase) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while phase.in_flight() > 0 and time.monotonic() < deadline:
            self._read(phase, min(deadline, time.monotonic() + 0.1))

    def arrivals(self, offsets: list[float]) -> Phase:
        """Requests at these offsets (s) from now; waits until all have ended."""
        phase, began = Phase(), time.monotonic()
        for offset in offsets:
            self._read(phase, began + offset)
            self._send(phase)
        phase.backlog = phase.in_flight()
        self._drain(phase)
        return phase

    def closed_loop(self, clients: int, seconds: float) -> tuple[Phase, float]:
        """`clients` requests kept in flight for `seconds`; the requests per second that ended
        after the first CAPACITY_SETTLE_S (or half of `seconds`)."""
        phase, began = Phase(), time.monotonic()
        end = began + seconds

        def on_done(at: float) -> None:
            if at < end:
                self._send(phase)

        for _ in range(clients):
            self._send(phase)
        self._read(phase, end, on_done)
        self._drain(phase)
        settle = min(CAPACITY_SETTLE_S, seconds / 2)
        counted = [at for at in phase.done.values() if began + settle <= at < end]
        return phase, len(counted) / (seconds - settle)


def summary(name: str, phase: Phase, one_client_ms: float | None = None) -> str:
    first = phase.first_audio_ms()
    ratio = f" ({percentile(first, 99) / one_client_ms:.2f}x one client)" if one_client_ms else ""
    return (f"  {name}: {len(phase.done)} of {len(phase.arrived)} requests; first audio p50 "
            f"{percentile(first, 50):.1f} / p99 {percentile(first, 99):.1f} ms{ratio}; "
            f"{phase.late_tiles} late tiles; {len(phase.errors)} errors"
            + (f" ({phase.errors[0]})" if phase.errors else ""))


def one_client_phases(phase: Phase) -> str:
    """Where a lone request's first audio goes: the medians, in ms from its arrival, of each step
    call's return, its latents handed to the decoder, its first and its last tile."""
    rows = []
    for request, arrived in phase.arrived.items():
        if request in phase.first and request in phase.latents and request in phase.done:
            steps = [at for at in phase.steps if arrived < at <= phase.latents[request] + 1e-3]
            rows.append([(at - arrived) * 1e3 for at in (*steps, phase.latents[request], phase.first[request],
                                                         phase.done[request])])
    if not rows or len({len(row) for row in rows}) != 1:
        return "  one client, by phase: not separable (requests overlapped)"
    medians = [statistics.median(column) for column in zip(*rows)]
    steps = ", ".join(f"{ms:.2f}" for ms in medians[:-3])
    return (f"  one client, by phase (median ms from arrival): step calls returned at {steps}; latents "
            f"handed over {medians[-3]:.2f}; first tile {medians[-2]:.2f}; last tile {medians[-1]:.2f}")


def tail_phases(phase: Phase, slowest: float = 0.01) -> str:
    """Where the open loop's first audio goes, for all requests and for the slowest share of
    them: the medians of its sampling (arrival to latents handed to the decoder) and its first
    window (to its first tile), and of the step calls that returned while it was sampled: how
    many, how far apart, and how many requests the DiT held at each."""
    rows = []
    for request, arrived in phase.arrived.items():
        if request in phase.first and request in phase.latents:
            handed = phase.latents[request]
            calls = [(at, held) for at, held in zip(phase.steps, phase.held) if arrived < at <= handed + 1e-3]
            spacing = [b[0] - a[0] for a, b in zip(calls, calls[1:])]
            rows.append(((phase.first[request] - arrived) * 1e3, (handed - arrived) * 1e3,
                         (phase.first[request] - handed) * 1e3, len(calls),
                         statistics.median(spacing) * 1e3 if spacing else math.nan,
                         statistics.median(held for _, held in calls) if calls else math.nan))
    if not rows:
        return "  open loop, by phase: no request with all its stamps"
    rows.sort()
    tail = rows[-max(1, math.ceil(slowest * len(rows))):]

    def medians(column: int) -> str:
        return " / ".join(f"{statistics.median(row[column] for row in part):.1f}" for part in (rows, tail))

    return (f"  open loop, by phase (medians of all {len(rows)} / of the slowest {len(tail)}): first audio "
            f"{medians(0)} ms; arrival to latents handed over {medians(1)} ms; to the first tile {medians(2)} ms; "
            f"step calls returned meanwhile {medians(3)}, {medians(4)} ms apart, the DiT holding {medians(5)} "
            "requests at each")


def run_layout(load: Load, args) -> list[str]:
    one = load.arrivals([ONE_CLIENT_GAP_S * k for k in range(args.one_client_requests)])
    one_ms = statistics.median(one.first_audio_ms())
    closed, capacity = load.closed_loop(args.clients, args.closed_seconds)
    rate = args.load * capacity
    opened = load.arrivals(poisson(rate, args.duration, args.seed))
    return [summary("one client", one), one_client_phases(one),
            summary(f"{args.clients} closed-loop clients", closed) + f"; {capacity:.2f} requests/s",
            summary(f"open loop at {args.load:g} of that ({rate:.2f} requests/s, {args.duration:g} s)", opened, one_ms)
            + f"; backlog {opened.backlog}", tail_phases(opened)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny presets on the CPU: a smoke test")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--seconds", type=float, default=None, help="clip seconds (default 10; 0.5 with --small)")
    parser.add_argument("--tokens", type=int, default=None, help="prompt tokens (default 64; 8 with --small)")
    parser.add_argument("--one-client-requests", type=int, default=16)
    parser.add_argument("--clients", type=int, default=48, help="closed-loop clients for the capacity")
    parser.add_argument("--closed-seconds", type=float, default=15.0)
    parser.add_argument("--load", type=float, default=0.7, help="the open loop's rate, a share of the capacity")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of open-loop arrivals")
    parser.add_argument("--seed", type=int, default=0, help="the Poisson arrivals' seed")
    parser.add_argument("--cache-dir", default=None, help="Inductor's and Triton's caches (default: a fresh folder)")
    args = parser.parse_args()
    # An indexed device: the decoder's thread sets it as its own (TileScheduler.start).
    device = torch.device("cpu") if args.small else torch.device("cuda", 0)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --small for the CPU smoke test)")
    preset = "small" if args.small else "auk"
    seconds = args.seconds or (0.5 if args.small else 10.0)
    tokens = args.tokens or (8 if args.small else 64)
    cache_dir = args.cache_dir or (tempfile.mkdtemp(prefix="auk-one-process-") if device.type == "cuda" else None)
    if cache_dir:
        use_compile_cache(Path(cache_dir))  # before the child starts: it inherits the variables
    say(heading(f"DiT and decoder, one process or two: flash, {seconds:g} s clips, {tokens} prompt tokens, "
                f"{preset} presets (synthetic weights, not real audio)", device.type))
    with tempfile.TemporaryDirectory(prefix="auk-one-process-ckpt-") as folder:
        run_layouts(args, synthetic_checkpoint(Path(folder), preset), preset, seconds, tokens, device, cache_dir)


def run_layouts(args, checkpoint: Path, preset: str, seconds: float, tokens: int, device: torch.device,
                cache_dir: str | None) -> None:
    events: queue.SimpleQueue = queue.SimpleQueue()
    child = ChildDecoding(checkpoint, device, cache_dir, events) if "two processes" in args.layouts else None
    began = time.perf_counter()
    sampler = build_sampler(preset, math.ceil(seconds * 50), tokens, device)
    graph = build_decoder(checkpoint, device)
    say(f"DiT built and the decoder loaded in {time.perf_counter() - began:.0f} s")
    texts = [torch.randn(tokens, sampler.text_dim, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    built = False
    for layout in args.layouts:
        if layout == "two processes":
            child.wait_ready()
            decoding, dit_stream = child, None
        else:
            first = "decode first" in layout
            decoding = Decoding(graph, device, events, stream_of(device, first), build=not built)
            dit_stream, built = stream_of(device, False), True

        def answer(request_id, result, decoding=decoding) -> None:
            try:
                if isinstance(result, Exception):
                    raise result
                events.put(("latents", request_id, time.monotonic()))
                decoding.submit(request_id, result)
            except Exception as err:  # the sampling thread's answer must not raise
                events.put(("error", request_id, f"{type(err).__name__}: {err}"))

        # In one process a lone request's latents stay on the GPU, as auk_pipeline keeps them.
        kept = None if layout == "two processes" else (lambda scheduler=decoding.scheduler: scheduler.idle)
        runs = JoinedRuns(sampler, DiTSettings().max_batch_requests, keep_on_device=kept)
        sampling = SamplingThread(RunsOnStream(runs, dit_stream, events), answer)
        if layout.endswith("later windows yield"):
            decoding.scheduler.yield_to = lambda sampling=sampling: sampling.busy
        if layout.endswith("no look-ahead while the DiT holds requests"):
            decoding.scheduler.hold_look_ahead = lambda sampling=sampling: sampling.busy
        plan = lambda request_id: sampler.plan(Request(texts[request_id % 8], seconds, request_id))  # noqa: E731
        load = Load(lambda request_id: sampling.submit(plan(request_id), request_id), events)
        say(f"{layout}:")
        for line in run_layout(load, args):
            say(line)
        sampling.stop()
        decoding.close()
    if sampler.graphs is not None:
        assert sampler.graphs.request_captures == sampler.graphs.eager_runs == 0, "the runs replayed their graphs"


if __name__ == "__main__":
    main()
