"""The AMP blocks' convolutions on the GPU: cuDNN against the Triton kernel, per stage.

For each stage of the `auk` geometry at 512 frames, and each block kernel size,
this times the two convolutions an AMP block runs per residual unit, as the
decode runs them:

- convs1: dilation 3 (the middle of 1, 3, 5), no bias (the next activation adds it);
- convs2: dilation 1, bias, plus the residual add.

"cuDNN" is `CausalConv1d` as the eager decode runs it (F.conv1d padding itself,
the first L outputs kept, then the residual add as a second pass); "Triton" is
`fused_conv.causal_conv1d` (the add fused). A stage runs each pair three times
per block kernel, so its decode-weighted time is 3 * (convs1 + convs2) summed
over the kernels 3, 7 and 11.

Predictions (written before the first GPU run): the three narrow stages (96, 48
and 24 channels, 5.9 M samples each) are memory-bound; the kernel reads a
signal once, the residual once and writes once (~70 MB per convs2, ~20 us at
3.5 TB/s) while cuDNN transposes to NHWC and back and adds the residual in a
pass of its own, so expect 3x or more there: the profile gave 1.5-2.4 ms per
narrow stage, the kernel should do 0.4-1 ms. The wide stages (768, 384, 192)
are compute-bound (about 380, 380 and 285 GFLOP); Triton's TF32 `tl.dot` on a
channels-first operand (not K-major) may not beat cuDNN there.

A sweep of launch configurations runs at kernel 7 for each stage; the best one
(decode-weighted) is then timed at every kernel size.

    PYTHONPATH=.:benchmarks python3 benchmarks/bench_fused_conv.py
"""

import argparse
import datetime
import sys
import time

import torch
import triton

from auk_triton import fused_conv as fc
from auk_triton.vae import CausalConv1d
from bench_fused_activation import L2_BYTES, SHAPES_512, graph_us  # this folder is on sys.path

KERNELS = (3, 7, 11)

# (BLOCK_CO, BLOCK_CI, BLOCK_T, warps, stages) candidates by channel count.
SWEEP = {
    24: [(32, 32, 128, 4, 3), (32, 32, 256, 4, 3), (32, 32, 512, 4, 2), (32, 32, 256, 8, 3), (32, 32, 512, 8, 2)],
    48: [(64, 64, 128, 4, 3), (64, 64, 256, 4, 2), (64, 64, 256, 8, 3), (64, 32, 256, 4, 3), (64, 32, 128, 4, 4)],
    96: [(128, 32, 128, 8, 3), (128, 64, 128, 8, 2), (64, 32, 256, 4, 3), (128, 32, 256, 8, 3), (64, 64, 128, 4, 3)],
    192: [(128, 32, 128, 8, 3), (128, 64, 128, 8, 3), (64, 32, 128, 4, 3), (128, 32, 256, 8, 3), (64, 64, 256, 8, 3)],
    384: [(128, 32, 128, 8, 3), (128, 64, 128, 8, 3), (64, 32, 128, 4, 3), (128, 32, 256, 8, 3), (256, 32, 128, 8, 3)],
    768: [(128, 32, 128, 8, 3), (128, 64, 128, 8, 3), (64, 32, 128, 4, 3), (128, 32, 256, 8, 3), (256, 32, 128, 8, 3)],
}


def say(line: str = "") -> None:
    print(line, flush=True)


def pair_us(channels: int, length: int, kernel: int, config=None) -> tuple[float, float, float]:
    """(convs1 us, convs2 us, worst relative L2 against cuDNN) for one block kernel size;
    `config` None means cuDNN."""
    torch.manual_seed(channels * 100 + kernel)
    c1 = CausalConv1d(channels, channels, kernel, dilation=3).cuda().requires_grad_(False)
    c2 = CausalConv1d(channels, channels, kernel).cuda().requires_grad_(False)
    nbytes = 3 * channels * length * 4
    count = max(2, -(-3 * L2_BYTES // nbytes))
    xs = [torch.randn(1, channels, length, device="cuda") for _ in range(count)]
    rs = [torch.randn(1, channels, length, device="cuda") for _ in range(count)]
    outs = [torch.empty_like(x) for x in xs]
    if config is None:
        first = graph_us([lambda x=x: c1(x, bias=False) for x in xs])
        second = graph_us([lambda x=x, r=r: c2(x, residual=r) for x, r in zip(xs, rs)])
        return first, second, 0.0
    first = graph_us([lambda x=x, y=y: fc.causal_conv1d(x, c1.weight, None, None, 3, out=y, config=config)
                      for x, y in zip(xs, outs)])
    second = graph_us([lambda x=x, r=r, y=y: fc.causal_conv1d(x, c2.weight, c2.bias, r, 1, out=y, config=config)
                       for x, r, y in zip(xs, rs, outs)])
    with torch.no_grad():
        err = 0.0
        for conv, kwargs, fused_kwargs in (
            (c1, {"bias": False}, (None, None, 3)),
            (c2, {"residual": rs[0]}, (c2.bias, rs[0], 1)),
        ):
            expected = conv(xs[0], **kwargs)
            actual = fc.causal_conv1d(xs[0], conv.weight, *fused_kwargs, config=config)
            err = max(err, ((actual - expected).norm() / expected.norm()).item())
    return first, second, err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channels", type=int, nargs="*", default=[c for c, _, _ in SHAPES_512])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    say(f"# Causal convolution kernel, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, {datetime.date.today()}, TF32 "
        f"{'on' if torch.backends.cudnn.allow_tf32 else 'off'}")
    began = time.perf_counter()
    lengths = {c: l for c, l, _ in SHAPES_512}

    say("\n## Launch sweep at kernel 7 (convs1 + convs2 us; Triton's relative L2 against cuDNN)\n")
    say("| C @ L | cuDNN us | " + " | ".join(f"cfg {i}" for i in range(5)) + " | best |")
    say("| --- | --- |" + " --- |" * 6)
    chosen = {}
    for channels in args.channels:
        length = lengths[channels]
        cudnn = sum(pair_us(channels, length, 7)[:2])
        cells, timings = [], {}
        for config in SWEEP[channels]:
            try:
                first, second, err = pair_us(channels, length, 7, config)
                timings[config] = first + second
                cells.append(f"{first + second:.1f} ({err:.0e})")
            except Exception as err:  # a configuration that does not compile (registers, shared memory)
                cells.append(f"failed: {type(err).__name__}")
        if not timings:
            say(f"| {channels} @ {length} | {cudnn:.1f} | " + " | ".join(cells) + " | none |")
            continue
        chosen[channels] = best = min(timings, key=timings.get)
        say(f"| {channels} @ {length} | {cudnn:.1f} | " + " | ".join(cells) + f" | {best} |")
    say("\nConfigurations: " + "; ".join(f"{c}: " + ", ".join(map(str, SWEEP[c])) for c in args.channels))

    say("\n## Per stage, decode-weighted (ms per 512-frame decode: 3 x (convs1 + convs2) per kernel size)\n")
    say("| C @ L | cuDNN ms | Triton (best) ms | Triton (LAUNCH default) ms | speed-up (best) | worst rel. L2 |")
    say("| --- | --- | --- | --- | --- | --- |")
    totals = {"cudnn": 0.0, "best": 0.0, "default": 0.0}
    for channels in chosen:
        length = lengths[channels]
        default = fc.launch_config(channels, channels)
        stage = {"cudnn": 0.0, "best": 0.0, "default": 0.0}
        worst = 0.0
        for kernel in KERNELS:
            stage["cudnn"] += 3 * sum(pair_us(channels, length, kernel)[:2])
            first, second, err = pair_us(channels, length, kernel, chosen[channels])
            stage["best"] += 3 * (first + second)
            worst = max(worst, err)
            if default == chosen[channels]:
                stage["default"] += 3 * (first + second)
            else:
                stage["default"] += 3 * sum(pair_us(channels, length, kernel, default)[:2])
        for key in totals:
            totals[key] += stage[key]
        say(f"| {channels} @ {length} | {stage['cudnn'] / 1e3:.2f} | {stage['best'] / 1e3:.2f} | "
            f"{stage['default'] / 1e3:.2f} | {stage['cudnn'] / stage['best']:.1f}x | {worst:.0e} |")
    say(f"\nAll measured stages: cuDNN {totals['cudnn'] / 1e3:.2f} ms, Triton best {totals['best'] / 1e3:.2f} ms, "
        f"default launch {totals['default'] / 1e3:.2f} ms.")
    say(f"\n(total {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
