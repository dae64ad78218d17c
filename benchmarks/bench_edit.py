"""Editing on one GPU: the codec's encode in process (eager against CUDA graphs), then the
auk_edit ensemble through a real tritonserver (time to first audio).

- In process, for each clip length (`--seconds`, default 10 and 60 s of seeded noise-like
  audio at 24 kHz): `AuKVAEEncoder.encode` as `auk_vae_encode` runs it, CUDA-synchronised
  wall time, median of `--reps` after a warm-up call. Eager; and with CUDA graphs both the
  first call at a new length (warm-ups, capture, replay: what a server pays for every length
  it has not seen) and a replay (a length seen before). Also the graphed latents against
  eager's (max abs difference; expected 0) and the GPU encode against the CPU's fp32 encode
  (relative L2), for the first length.
- Through a real server (auk_vae_encode + auk_pipeline + auk_edit on the GPU configs), the
  flash recipe: a unary auk_vae_encode request of a `--edit-seconds` source, and an auk_edit
  request (that source, `--edit-seconds` of target, 64 prompt tokens) over
  a gRPC stream: time to first audio (first WAVEFORM tile) and total (final flag), medians
  of `--reps` after a warm-up request.

Synthetic seeded weights of the released geometry (`--preset auk`): the speed depends only
on the geometry; the audio is not real audio.

    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_edit.py                 # GPU: 10 s and 60 s, 10 s edit
    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_edit.py --device cpu --preset small \\
        --seconds 1,2 --edit-seconds 1 --reps 2                                      # a quick check on a CPU

The checkpoints (6.1 GB of fp32 DiT weights for `auk`) are written once under --cache-dir.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from auk_triton.codec import AuKVAE, AuKVAEEncoder
from common import heading, recipe_checkpoints, rel_l2, say, start_server

RATE = 24000
MODELS = ("auk_vae_encode", "auk_pipeline", "auk_edit")


def source_audio(seconds: float, seed: int = 0) -> np.ndarray:
    """Seeded audio-like samples in [-1, 1]: a chirp under noise."""
    samples = int(round(seconds * RATE))
    t = np.arange(samples) / RATE
    noise = np.random.default_rng(seed).standard_normal(samples)
    return np.clip(0.4 * np.sin(2 * np.pi * (100 + 300 * t / max(seconds, 1e-9)) * t) + 0.1 * noise, -1, 1).astype(
        np.float32
    )


def timed(fn, sync) -> float:
    sync()
    began = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - began) * 1e3


def in_process(checkpoint: Path, seconds_list: list[float], reps: int, device: str) -> list[dict]:
    """Per clip length: eager ms, graph first-call ms and replay ms (CUDA only), and checks."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    vae = AuKVAE.from_pretrained(checkpoint, device=device)
    eager = AuKVAEEncoder(vae)
    rows = []
    for index, seconds in enumerate(seconds_list):
        wav = torch.from_numpy(source_audio(seconds, seed=index)).to(device)[None]
        wav = wav[:, : wav.shape[1] - wav.shape[1] % vae.hop_size]  # whole frames, as the model cuts them
        row = {"seconds": seconds}
        timed(lambda: eager.encode(wav), sync)  # warm-up: kernels, allocator, cuDNN's choices
        row["eager"] = statistics.median(timed(lambda: eager.encode(wav), sync) for _ in range(reps))
        if cuda:
            graphed = AuKVAEEncoder(vae, cuda_graphs=True, max_graphs=len(seconds_list))
            row["graph_first"] = timed(lambda: graphed.encode(wav), sync)
            row["graph"] = statistics.median(timed(lambda: graphed.encode(wav), sync) for _ in range(reps))
            assert graphed.last_mode == "graph", "the capture failed: the length ran eager"
            row["graph_vs_eager"] = (graphed.encode(wav) - eager.encode(wav)).abs().max().item()
            if index == 0:
                cpu = AuKVAE.from_pretrained(checkpoint, device="cpu")
                with torch.no_grad():
                    row["gpu_vs_cpu"] = rel_l2(eager.encode(wav).cpu(), cpu.encode(wav.cpu()))
                del cpu
            del graphed
        say(f"in process, {seconds:g} s: " + ", ".join(
            f"{key} {value:.4g}" for key, value in row.items() if key != "seconds"))
        rows.append(row)
    del eager, vae
    if cuda:
        torch.cuda.empty_cache()
    return rows


def served(url: str, seconds: float, tokens: int, reps: int) -> dict:
    from auk_client.edit import encode_audio, stream_edit

    audio = source_audio(seconds, seed=7)
    embeds = np.random.default_rng(0).standard_normal((tokens, 2048)).astype(np.float32)
    encode, first, total = [], [], []
    for rep in range(reps + 1):  # the first request warms the connection and every step
        began = time.perf_counter()
        latents = encode_audio(audio, url=url, timeout=600)
        encode_ms = (time.perf_counter() - began) * 1e3
        began = time.perf_counter()
        arrivals = [tile.arrived_s for tile in stream_edit(audio, embeds, seconds, rep, url=url, timeout=600)]
        total_ms = (time.perf_counter() - began) * 1e3
        if rep:
            encode.append(encode_ms)
            first.append(arrivals[0] * 1e3)
            total.append(total_ms)
    say(f"served: source latents {list(latents.shape)}, {len(arrivals)} tiles per edit")
    return {"encode": statistics.median(encode), "first": statistics.median(first), "total": statistics.median(total)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="auto: cuda when present")
    parser.add_argument("--preset", default="auk", help="synthetic preset for the DiT and the codec")
    parser.add_argument("--seconds", default="10,60", help="clip lengths to encode in process, comma-separated")
    parser.add_argument("--edit-seconds", type=float, default=10.0, help="source and target seconds of the edit")
    parser.add_argument("--tokens", type=int, default=64, help="prompt tokens (seeded stand-in embeddings)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-server", action="store_true", help="only the in-process encode times")
    parser.add_argument("--cache-dir", default=None, help="checkpoints and compile caches (reused across runs)")
    parser.add_argument("--log", default="tritonserver-edit.log")
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    seconds_list = [float(s) for s in args.seconds.split(",") if s]

    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="auk-edit-"))
    began = time.perf_counter()
    flash = recipe_checkpoints(cache, args.preset)["flash"]
    say(heading(f"AuK editing, {args.preset} (synthetic, not real audio)", device)
        + f" (checkpoints ready in {time.perf_counter() - began:.0f} s)")

    rows = in_process(flash, seconds_list, args.reps, device)
    say("| audio | eager ms | graph, new length ms | graph, replay ms | graph vs eager (max abs) |")
    say("| --- | --- | --- | --- | --- |")
    for row in rows:
        cells = [f"{row[k]:.2f}" if k in row else "-" for k in ("eager", "graph_first", "graph")]
        diff = f"{row['graph_vs_eager']:.1e}" if "graph_vs_eager" in row else "-"
        say(f"| {row['seconds']:g} s | " + " | ".join(cells) + f" | {diff} |")
    if "gpu_vs_cpu" in rows[0]:
        say(f"GPU encode against the CPU's fp32 encode, {rows[0]['seconds']:g} s: relative L2 {rows[0]['gpu_vs_cpu']:.2e}")
    if device == "cuda":
        for row in rows:
            new = "eager" if row["eager"] <= row["graph_first"] else "graphs"
            seen = "eager" if row["eager"] <= row["graph"] else "graphs"
            say(f"{row['seconds']:g} s: faster for a new length: {new}; for a length seen before: {seen}")

    if not args.no_server:
        process, url, _, _ = start_server(flash, cache, Path(args.log), MODELS, ready_timeout_s=900,
                                          device="gpu" if device == "cuda" else "cpu")
        try:
            result = served(url, args.edit_seconds, args.tokens, args.reps)
        finally:
            process.terminate()
            process.wait(timeout=120)
        say("| recipe | source + target | served encode ms | edit first audio ms | edit total ms |")
        say("| --- | --- | --- | --- | --- |")
        say(f"| flash | {args.edit_seconds:g} s + {args.edit_seconds:g} s | {result['encode']:.1f} | "
            f"{result['first']:.1f} | {result['total']:.1f} |")


if __name__ == "__main__":
    main()
