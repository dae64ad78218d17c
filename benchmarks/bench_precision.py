"""The served decode in fp16 against TF32, in one run: speed and accuracy.

Both precisions run the decode as the models serve it on a GPU (the fused
activation kernel, channels-last signals, time folding), differing only in
`AuKVAE.configure_decoder(dtype=...)`: fp16 weights and signals with fp32
accumulation and activations, or fp32 storage with TF32 convolutions. For each:

- the compiled buckets' decode (replay, CUDA-event median) and a 60 s clip's
  first tile and whole decode as the model streams it (tiles to pinned host
  memory, the next window launched first);
- relative L2 and max abs error against the exact fp32 decode (TF32 off, eager
  channels-first) of seeded random latents, through eager, a plain graph and the
  compiled bucket; the stitched tiles of the 60 s clip against its exact
  whole-clip decode; and the conformance vectors (tests/data/auk_vae_tiny:
  the reference implementation's decode), eager and through a plain graph.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_precision.py
"""

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from auk_triton.codec import AuKVAE, AuKVAEDecodeGraph
from auk_triton.serving.config import DecodeSettings
from common import REPO_ROOT, heading, latents, median_ms, rel_l2, say, served_decoder_options, synthetic_checkpoint

CONFORMANCE = REPO_ROOT / "tests" / "data" / "auk_vae_tiny"
PRECISIONS = ("tf32", "fp16")


def exact_decode(vae: AuKVAE, clip: torch.Tensor) -> torch.Tensor:
    """The eager channels-first decode with TF32 off: plain fp32 arithmetic."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            return vae.decode(clip)
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item()


def first_tile_and_total_ms(graph: AuKVAEDecodeGraph, clip: torch.Tensor, reps: int) -> tuple[float, float]:
    """Medians over `reps` of the model's own loop: launch to the first tile on the host, and to the last."""
    firsts, totals = [], []
    for rep in range(reps + 2):
        torch.cuda.synchronize()
        began = time.perf_counter()
        first = None
        for _ in graph.host_tiles(clip, look_ahead=True):
            if first is None:
                first = time.perf_counter() - began
        if rep >= 2:
            firsts.append(first * 1e3)
            totals.append((time.perf_counter() - began) * 1e3)
    return statistics.median(firsts), statistics.median(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="auk")
    parser.add_argument("--buckets", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--accuracy-frames", type=int, default=512)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--long-seconds", type=float, default=60.0)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    say(heading(f"Decode precision, {args.preset} preset"))
    checkpoint = synthetic_checkpoint(preset=args.preset)
    reference = AuKVAE.from_pretrained(checkpoint, device="cuda")  # eager, channels-first, fp32
    clips = [latents(args.accuracy_frames, "cuda", seed=seed) for seed in range(args.seeds)]
    exact = [exact_decode(reference, clip) for clip in clips]
    long_clip = latents(int(args.long_seconds * 50), "cuda", seed=7)
    long_exact = exact_decode(reference, long_clip)
    tiny = AuKVAE.from_pretrained(CONFORMANCE, device="cuda")
    del reference
    torch.cuda.empty_cache()

    speed, accuracy = {}, []
    for precision in PRECISIONS:
        options = served_decoder_options("cuda", precision)
        vae = AuKVAE.from_pretrained(checkpoint, device="cuda", **options)
        # Tiled as the models tile: a long clip's first window is the smallest bucket.
        first_window = DecodeSettings(compile_shapes=tuple(args.buckets)).first_window_frames()
        graph = AuKVAEDecodeGraph(vae, compile_shapes=tuple(args.buckets), first_tile_frames=first_window)
        graph.warmup("cuda", on_bucket=lambda frames, seconds, ok: say(
            f"{precision}: bucket {frames} frames {'built' if ok else 'FAILED'} in {seconds:.0f} s"))
        for frames in args.buckets:
            clip = latents(frames, "cuda", seed=3)
            speed[(precision, frames)] = median_ms(lambda: graph(clip), args.iters)
        speed[(precision, "long")] = first_tile_and_total_ms(graph, long_clip, reps=10)

        plain = AuKVAEDecodeGraph(vae, compile_shapes=())
        with torch.no_grad():
            for seed, (clip, expected) in enumerate(zip(clips, exact)):
                for path, out in (("eager", vae.decode(clip)), ("plain graph", plain(clip)),
                                  ("compiled bucket", graph(clip))):
                    accuracy.append((precision, f"random latents, {clip.shape[1]} frames, seed {seed}", path,
                                     rel_l2(out, expected), max_abs(out, expected)))
            stitched = graph(long_clip)
            accuracy.append((precision, f"{args.long_seconds:.0f} s clip, stitched tiles vs whole clip",
                             graph.last_mode, rel_l2(stitched, long_exact), max_abs(stitched, long_exact)))
            tiny.configure_decoder(**options)  # tf32 comes first: fp16 rounds the weights for good
            tiny_plain = AuKVAEDecodeGraph(tiny, compile_shapes=())
            for frames in (7, 64):
                clip = torch.from_numpy(np.load(CONFORMANCE / f"latents_{frames}.npy")).reshape(1, frames, -1).cuda()
                expected = torch.from_numpy(np.load(CONFORMANCE / f"decode_{frames}.npy")).reshape(1, -1).cuda()
                for path, out in (("eager", tiny.decode(clip)), ("plain graph", tiny_plain(clip))):
                    accuracy.append((precision, f"conformance vector, {frames} frames", path,
                                     rel_l2(out, expected), max_abs(out, expected)))
        del graph, plain, tiny_plain, vae
        torch._dynamo.reset()
        torch.cuda.empty_cache()

    say("\n## Speed (ms)\n")
    say("| what | " + " | ".join(PRECISIONS) + " | fp16 speed-up |")
    say("| --- | " + " | ".join("---" for _ in PRECISIONS) + " | --- |")
    for frames in args.buckets:
        a, b = speed[("tf32", frames)], speed[("fp16", frames)]
        say(f"| {frames}-frame compiled bucket | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    (fa, ta), (fb, tb) = speed[("tf32", "long")], speed[("fp16", "long")]
    say(f"| {args.long_seconds:.0f} s clip, first tile on the host | {fa:.2f} | {fb:.2f} | {fa / fb:.2f}x |")
    say(f"| {args.long_seconds:.0f} s clip, all of it | {ta:.1f} | {tb:.1f} | {ta / tb:.2f}x |")
    say("\n## Accuracy against the exact fp32 decode (TF32 off)\n")
    say("| precision | input | path | rel. L2 | max abs |")
    say("| --- | --- | --- | --- | --- |")
    for precision, what, path, err, worst in accuracy:
        say(f"| {precision} | {what} | {path} | {err:.2e} | {worst:.2e} |")


if __name__ == "__main__":
    main()
