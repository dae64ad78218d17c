r"""The decoder's first window beside a low-priority load: its graph captured at the default
priority, or at the priority of the stream that replays it.

PyTorch runs each kernel of a CUDA graph at the priority recorded when it was captured, not at
the priority of the stream that launches the replay (cuda_graph.capture). In `auk_pipeline`
the decoder replays on a stream of the device's highest priority beside the DiT's steps on
one of its lowest. This script measures what the capture's priority does there, in process:
a client decodes a clip's first window (`--frames`, the decode model's plain CUDA graph of the
`auk` preset with its GPU options) on a highest-priority stream every `--gap-ms`, while a load
of large bf16 matrix products (the bulk of a DiT step) replays back to back on a
lowest-priority stream. Three phases, each `--requests` windows:

- alone: no load;
- beside the load, the window's graph captured at the default priority (the served decoder
  before its graphs were captured at its stream's);
- beside the load, the window's graph captured at its stream's priority (the served decoder now).

Each line gives the window's time from launch to its samples on the host, p50 / p99 / max,
and the load's throughput meanwhile. Weights are a seeded synthetic checkpoint (not real audio).

    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_graph_priority.py
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch

from auk_triton.codec import AuKVAE, AuKVAEDecodeGraph
from auk_triton.cuda_graph import capture, priority_stream
from common import heading, latents, percentile, say, served_decoder_options, synthetic_checkpoint

WARM_REQUESTS = 10  # first replays left out of each phase's figures
LOAD_IN_FLIGHT = 2  # load replays queued ahead of the GPU, as a sampling thread runs ahead


class Load:
    """`count` chained [size x size] bf16 matrix products, captured once at `stream`'s priority,
    replayed back to back on `stream` from a thread of their own while running."""

    def __init__(self, stream: torch.cuda.Stream, size: int, count: int):
        self.stream, self.replays = stream, 0
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16) / size**0.5
        x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)

        def products():
            y = x
            for _ in range(count):
                y = a @ y
            return y

        with torch.cuda.stream(stream):
            self.graph, _ = capture(products, warmups=1, priority=stream.priority)
        # A graph holds no reference to the tensors it reads: kept here, or the next capture's
        # emptying of the allocator's cache hands their memory back while replays still read it.
        self._operands = (a, x)
        self.flops = 2 * size**3 * count
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Load":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        torch.cuda.set_stream(self.stream)
        queued: list[torch.cuda.Event] = []
        while not self._stop.is_set():
            self.graph.replay()
            done = torch.cuda.Event()
            done.record()
            queued.append(done)
            if len(queued) > LOAD_IN_FLIGHT:
                queued.pop(0).synchronize()
                self.replays += 1
        self.stream.synchronize()


def first_windows(graph: AuKVAEDecodeGraph, stream: torch.cuda.Stream, frames: int, requests: int,
                  gap_s: float) -> list[float]:
    """ms from launching each window's decode on `stream` to its samples on the host."""
    clip = latents(frames, "cuda")
    host, times = None, []
    with torch.cuda.stream(stream):
        for index in range(requests + WARM_REQUESTS):
            began = time.perf_counter()
            wave = graph(clip)  # the first call captures the window's plain graph
            if host is None:
                host = torch.empty(wave.shape, dtype=wave.dtype, pin_memory=True)
            host.copy_(wave, non_blocking=True)
            stream.synchronize()
            if index >= WARM_REQUESTS:
                times.append((time.perf_counter() - began) * 1e3)
            time.sleep(gap_s)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=32, help="the first window's latent frames")
    parser.add_argument("--requests", type=int, default=200, help="windows measured per phase")
    parser.add_argument("--gap-ms", type=float, default=10.0, help="the client's pause between windows")
    parser.add_argument("--load-size", type=int, default=8192, help="the load's square matrix side")
    parser.add_argument("--load-products", type=int, default=8, help="matrix products per load replay")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    device = torch.device("cuda")
    high, low = priority_stream(device, first=True), priority_stream(device, first=False)
    say(heading(f"A {args.frames}-frame first window beside a load of bf16 products "
                f"({args.load_products} x {args.load_size}^2), auk preset (synthetic weights, not real audio)"))
    say(f"stream priorities: the window's {high.priority}, the load's {low.priority}")
    vae = AuKVAE.from_pretrained(synthetic_checkpoint(), device="cuda", **served_decoder_options("cuda"))
    graphs = {
        "captured at the default priority": AuKVAEDecodeGraph(vae, compile_shapes=()),
        "captured at its stream's priority": AuKVAEDecodeGraph(vae, compile_shapes=(), stream_priority=high.priority),
    }
    load = Load(low, args.load_size, args.load_products)
    gap_s = args.gap_ms / 1e3
    phases = [("alone", graphs["captured at its stream's priority"], False)]
    phases += [(f"beside the load, {name}", graph, True) for name, graph in graphs.items()]
    for name, graph, loaded in phases:
        first_windows(graph, high, args.frames, 0, 0.0)  # its capture and warm-up, outside the phase
        began = time.perf_counter()
        if loaded:
            with load:
                times = first_windows(graph, high, args.frames, args.requests, gap_s)
            replays, load.replays = load.replays, 0
        else:
            times, replays = first_windows(graph, high, args.frames, args.requests, gap_s), 0
        seconds = time.perf_counter() - began
        throughput = f"; load {replays * load.flops / seconds / 1e12:.0f} TFLOP/s" if loaded else ""
        say(f"{name}: {len(times)} windows, p50 {percentile(times, 50):.2f} ms, p99 {percentile(times, 99):.2f} ms, "
            f"max {max(times):.2f} ms{throughput}")


if __name__ == "__main__":
    main()
