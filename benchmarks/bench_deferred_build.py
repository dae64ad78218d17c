r"""One client's decodes beside the decoder's deferred graph builder, in process.

The streaming decode model builds part of its graphs after READY (the buckets other than the
first window's and the largest, and every batched graph) on a thread beside the one that
serves. This script builds the decoder as the model does on a GPU (the warm-up with `defer`,
the saved trace in `--cache-dir`), then decodes a clip every `--gap-ms` on the main thread:
for `--before-s` seconds, while the builder runs, and for `--after-s` seconds after it. For
each phase it reports the first window's time to the host, split into the host's launch, the
wait for the samples, and the GPU's time between two events around the first window's
replay. A long GPU time with a short launch means the request waited on the GPU, not for the
interpreter's lock; a thread that sleeps 2 ms at a time says how late it wakes (the lock held).

Each run is one process (cuDNN keeps its algorithm choices per process, and per thread). The
options are experiments that need no change to the product: cuDNN's heuristics in place of
its timing for the whole build, the client's decodes on a stream of their own, another errata
file than the decoder's (codec/cudnn_timing.py), or none (`--errata none`). `--profile`
records the GPU's kernels for 2.5 s from the start of the builder's largest batched graph
and prints what other streams ran in the serving stream's longest gaps. Weights are a
seeded synthetic checkpoint (not real audio).

    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_deferred_build.py --cache-dir /tmp/deferred
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from auk_triton.codec import AuKVAEDecodeGraph
from auk_triton.codec.cudnn_timing import ERRATA_ENV
from auk_triton.cuda_graph import priority_stream
from auk_triton.serving.config import DecodeSettings, use_compile_cache
from common import FRAMES_PER_SECOND, heading, latents, percentile, replay_ms, say, served_graph, synthetic_checkpoint

BUILDS = ("served", "heuristic", "none")
SERVING_STREAMS = ("current", "own", "priority")
TICK_S = 0.002  # the lock probe's sleep
PROFILE_S = 2.5


@dataclass
class Request:
    began: float  # perf_counter seconds
    first_ms: float  # the first window's samples on the host
    launch_ms: float  # the host's time to launch it
    wait_ms: float  # then waiting for its samples
    gpu_ms: float  # the GPU's time between events around its replay
    allocator: tuple[int, ...]  # the caching allocator's device mallocs, frees, all-stream syncs meanwhile


def phases(requests: list[Request], build_began: float, build_ended: float | None) -> dict[str, list[Request]]:
    """The requests begun before the build, while it ran (until `build_ended`; to the end when
    it never ended), and after it."""
    end = float("inf") if build_ended is None else build_ended
    return {
        "before": [r for r in requests if r.began < build_began],
        "during": [r for r in requests if build_began <= r.began <= end],
        "after": [r for r in requests if r.began > end],
    }


def summary(requests: list[Request]) -> str:
    """One line of a phase's figures, ms."""
    first = [r.first_ms for r in requests]
    gpu = [r.gpu_ms for r in requests]
    mallocs, frees, syncs = (sum(r.allocator[i] for r in requests) for i in range(3))
    return (f"{len(requests)} requests: first window p50 {percentile(first, 50):.1f}, p99 {percentile(first, 99):.1f}, "
            f"max {max(first):.1f}; GPU p50 {percentile(gpu, 50):.2f}, max {max(gpu):.2f}; launch max "
            f"{max(r.launch_ms for r in requests):.1f}; wait max {max(r.wait_ms for r in requests):.1f}; "
            f"allocator: {mallocs} mallocs, {frees} frees, {syncs} all-stream syncs")


def serving_gaps(events: list[dict], top: int = 4) -> list[tuple[float, dict, list[dict]]]:
    """The `top` longest idle gaps between consecutive GPU operations of the serving stream (the
    stream with the most operations), each with the operation after it and the kernels other
    streams ran meanwhile. `events`: a Chrome trace's complete events (kernels, copies, sets)."""
    streams: dict[int, list[dict]] = {}
    for event in events:
        streams.setdefault(event["args"].get("stream"), []).append(event)
    if not streams:
        return []
    serving = sorted(streams[max(streams, key=lambda stream: len(streams[stream]))], key=lambda e: e["ts"])
    gaps = sorted(((after["ts"] - (before["ts"] + before["dur"]), before, after)
                   for before, after in zip(serving, serving[1:])), key=lambda gap: -gap[0])[:top]
    stream = serving[0]["args"].get("stream")
    result = []
    for gap, before, after in gaps:
        begins, ends = before["ts"] + before["dur"], after["ts"]
        meanwhile = sorted((e for e in events if e["args"].get("stream") != stream
                            and e["ts"] < ends and e["ts"] + e["dur"] > begins), key=lambda e: e["ts"])
        result.append((gap / 1e3, after, meanwhile))
    return result


def gpu_operations(trace: Path) -> list[dict]:
    """A Chrome trace's kernels, copies and sets."""
    return [e for e in json.loads(trace.read_text())["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def late_wakes(ticks: list[tuple[float, float]], since: float, until: float) -> list[float]:
    return [late for began, late in ticks if since <= began <= until]


class Client:
    """Decodes the clip once per `decode()` on the calling thread, as a streaming request does,
    and keeps each request's figures. While `building`, it also dates the builder's items: the
    builder goes through `pending` in order and each decode takes over what is built, so the
    count still pending, read after a decode, dates each item's end."""

    ALLOCATOR = ("num_device_alloc", "num_device_free", "num_sync_all_streams")

    def __init__(self, graph: AuKVAEDecodeGraph, clip: torch.Tensor, stream, pending: list):
        self.graph, self.clip, self.stream, self.pending = graph, clip, stream, pending
        self.requests: list[Request] = []
        self.taken: list[tuple[float, int]] = []  # (when, items built by then)
        self.building = False

    def allocator(self) -> list[int]:
        stats = torch.cuda.memory_stats()
        return [stats.get(key, 0) for key in self.ALLOCATOR]

    @property
    def items_built(self) -> int:
        return len(self.pending) - self.graph.deferred_pending

    def decode(self) -> None:
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            before = self.allocator()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began = time.perf_counter()
            start.record()
            tiles = self.graph.decode_tiles(self.clip)
            _, wave = next(tiles)
            end.record()
            launched = time.perf_counter()
            wave.cpu()
            first = time.perf_counter()
            for _, wave in tiles:
                wave.cpu()
            self.requests.append(Request(began, (first - began) * 1e3, (launched - began) * 1e3,
                                         (first - launched) * 1e3, start.elapsed_time(end),
                                         tuple(b - a for a, b in zip(before, self.allocator()))))
        if self.building and self.items_built > (self.taken[-1][1] if self.taken else 0):
            self.taken.append((time.perf_counter(), self.items_built))


class LockProbe:
    """A thread that sleeps 2 ms at a time and keeps how late it wakes: the interpreter's lock held."""

    def __init__(self):
        self.ticks: list[tuple[float, float]] = []
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            slept = time.perf_counter()
            time.sleep(TICK_S)
            self.ticks.append((slept, time.perf_counter() - slept - TICK_S))

    def stop(self) -> None:
        self._stop.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="compile caches, the saved trace and the checkpoint (default: a new folder: cold)")
    parser.add_argument("--clip-seconds", type=float, default=10.0, help="the client's clip (default 10 s)")
    parser.add_argument("--gap-ms", type=float, default=10.0, help="between the client's requests (default 10)")
    parser.add_argument("--before-s", type=float, default=3.0, help="decoding before the build begins (default 3)")
    parser.add_argument("--after-s", type=float, default=3.0, help="decoding after it ends (default 3)")
    parser.add_argument("--build", choices=BUILDS, default="served",
                        help="served: as the model builds; heuristic: cuDNN's heuristics in place of its timing "
                             "while the build runs; none: no build (decoding for 30 s)")
    parser.add_argument("--serving-stream", choices=SERVING_STREAMS, default="current",
                        help="the client's decodes on the current stream (as the model), a stream of their own, "
                             "or one of the device's highest priority (its graphs captured at it)")
    parser.add_argument("--errata", default="served",
                        help="cuDNN's errata file (engines it neither times nor runs): served (the decoder's), "
                             "none, or a file")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write a Chrome trace of the GPU here while the largest batched graph builds")
    parser.add_argument("--iters", type=int, default=50, help="timed replays per graph afterwards (0: none)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_deferred_build needs CUDA: the builder captures GPU graphs")
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="auk-deferred-"))
    cache.mkdir(parents=True, exist_ok=True)
    # Set before the first convolution, when torch reads it; the served file is the model's default.
    if args.errata == "none":
        errata = cache / "no-errata.json"
        errata.write_text(json.dumps({"version": 1, "rules": []}))  # an empty file would not parse
        os.environ[ERRATA_ENV] = str(errata)
    elif args.errata != "served":
        os.environ[ERRATA_ENV] = str(Path(args.errata).resolve())
    use_compile_cache(cache)
    say(heading("One client's decodes beside the decoder's deferred builder", "cuda", f", cache {cache}"))
    say(f"build {args.build}, serving stream {args.serving_stream}, errata {args.errata}")
    stream = None if args.serving_stream == "current" else priority_stream(
        torch.device("cuda"), first=args.serving_stream == "priority")
    graph = served_graph(synthetic_checkpoint(cache / "checkpoint", "auk"), DecodeSettings(),
                         precompiled=cache / "decode-precompiled.bin",
                         stream_priority=None if stream is None else stream.priority)
    began = time.perf_counter()
    pending = graph.warmup("cuda", defer=True)
    say(f"warm-up {time.perf_counter() - began:.1f} s, {len(pending)} graphs deferred; compiled decode "
        f"{graph.compile_note}")

    client = Client(graph, latents(int(args.clip_seconds * FRAMES_PER_SECOND), "cuda"), stream, pending)
    for _ in range(50):  # the client's own first calls
        client.decode()
    client.requests.clear()
    probe = LockProbe()
    # The builder's first item with the most rows: profiled once every item before it is built.
    largest = max(range(len(pending)), key=lambda index: pending[index].rows, default=0)
    ended: list[float] = []
    profiled: list[Path] = []

    def decode_until(deadline: float) -> None:
        while time.perf_counter() < deadline and not (ended and time.perf_counter() > ended[0] + args.after_s):
            if args.profile and client.building and client.items_built >= largest and not profiled:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                    until = time.perf_counter() + PROFILE_S
                    while time.perf_counter() < until:
                        client.decode()
                        time.sleep(args.gap_ms / 1e3)
                profile.export_chrome_trace(str(args.profile))
                profiled.append(args.profile)
                continue
            client.decode()
            time.sleep(args.gap_ms / 1e3)

    decode_until(time.perf_counter() + args.before_s)
    build_began = time.perf_counter()
    if args.build == "heuristic":
        torch.backends.cudnn.benchmark = False
    if args.build == "none" or not pending:
        decode_until(build_began + 30.0)
    else:
        def on_done(report) -> None:
            ended.append(time.perf_counter())
            say(f"built {report.built} graphs in {report.seconds:.1f} s")

        client.building = True
        graph.start_deferred(pending, "cuda", on_done=on_done)
        decode_until(build_began + 600.0)
    probe.stop()
    torch.backends.cudnn.benchmark = True

    build_ended = ended[0] if ended else None
    for phase, those in phases(client.requests, build_began, build_ended).items():
        if those:
            say(f"{phase}: {summary(those)}")
    late = late_wakes(probe.ticks, build_began, build_ended or time.perf_counter())
    say(f"the 2 ms sleeper, late by p50 {percentile(late, 50) * 1e3:.2f}, p99 {percentile(late, 99) * 1e3:.2f}, "
        f"max {max(late, default=0.0) * 1e3:.1f} ms while building")
    done_before = 0
    for taken, count in client.taken:
        items = ", ".join(f"{item.rows} x {item.frames}" for item in pending[done_before:count])
        say(f"  taken over {taken - build_began:+.2f} s after the build began: {items} (rows x frames)")
        done_before = count
    for trace in profiled:
        for gap_ms, after, meanwhile in serving_gaps(gpu_operations(trace)):
            say(f"serving stream idle {gap_ms:.1f} ms before {after['name'][:60]}; meanwhile:")
            for event in meanwhile:
                fields = event["args"]
                say(f"  stream {fields.get('stream')}, {event['dur'] / 1e3:.2f} ms, grid {fields.get('grid')}, block "
                    f"{fields.get('block')}, {fields.get('registers per thread')} registers, "
                    f"{fields.get('shared memory')} B shared: {event['name'][:90]}")
    if args.iters and args.build != "none":
        table = {f"{rows} x {frames}": round(replay_ms(graph, frames, rows, args.iters), 3)
                 for frames in graph.compile_shapes for rows in graph.batch_sizes
                 if rows <= graph.batch_capacity(frames)}
        say(f"replay ms (rows x frames): {json.dumps(table)}")


if __name__ == "__main__":
    main()
