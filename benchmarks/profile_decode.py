"""Where a decode's GPU time goes, and how far it is from the hardware's floor.

For each variant of the decode (VARIANTS, by number) this prints the time of
one plain CUDA-graph replay (eager kernels, no launch overhead, no
compilation) and the GPU time of a profiled eager decode split by layer kind
and stage. With `--compiled`, the compiled bucket (Inductor) of the chosen
variants is timed as a graph replay and profiled as Inductor's code run
without the graph. A variant is a choice of `AuKVAE.configure_decoder`'s
options plus torch's cuDNN settings, so the numbers say what each option buys.

The roofline: FLOPs of the dense convolutions (the essential arithmetic) and the
fewest bytes a layer-by-layer decode must move (every layer reads its input and
weights and writes its output once; activations fused), turned into times at
a TF32 matrix rate and a copy bandwidth measured in the same run. The floor
sums, layer by layer, the larger of a layer's compute and memory time.

    PYTHONPATH=.:benchmarks python3 benchmarks/profile_decode.py --frames 512 --compiled
"""

import argparse
import collections
import copy
import sys
import time
from dataclasses import dataclass

import torch

from auk_triton.codec import ActivationKernel, AuKVAE, AuKVAEDecodeGraph
from auk_triton.codec.vae import FOLD_BELOW, FOLD_TO, AMPBlock, CausalConvTranspose1d
from common import (
    compile_time_breakdown,
    copy_bandwidth,
    heading,
    latents,
    median_ms,
    rel_l2,
    say,
    synthetic_checkpoint,
)


@dataclass
class Variant:
    """A decode configuration: the fused activation kernel (with `sine`, None: its default) or
    the eager ops, the signal layout and its time folding (fold_below, fold_to; fold_to 0: none),
    whether channels-last upsamplers run in their polyphase form, and cudnn.benchmark (with its
    algorithm limit)."""

    name: str
    fused: bool
    channels_last: bool = False
    sine: str | None = None
    fold: tuple[int, int] = (FOLD_BELOW, FOLD_TO)
    polyphase: bool = True
    cudnn_benchmark: bool = False
    cudnn_benchmark_limit: int | None = None
    dtype: torch.dtype = torch.float32

    def apply(self, vae: AuKVAE) -> AuKVAE:
        """`vae` configured as this variant; a copy of it for fp16, which rounds the weights for good."""
        if self.dtype != torch.float32:
            vae = copy.deepcopy(vae)
        kernel = None
        if self.fused:
            kernel = ActivationKernel() if self.sine is None else ActivationKernel(sine=self.sine)
        vae.configure_decoder(activation_kernel=kernel, channels_last=self.channels_last,
                              fold_below=self.fold[0], fold_to=self.fold[1], dtype=self.dtype)
        if not self.polyphase:
            for up in vae.ups:
                up[0].drop_polyphase()
        return vae

    def __enter__(self):
        cudnn = torch.backends.cudnn
        self.saved = (cudnn.benchmark, cudnn.benchmark_limit)
        cudnn.benchmark = self.cudnn_benchmark
        if self.cudnn_benchmark_limit is not None:
            cudnn.benchmark_limit = self.cudnn_benchmark_limit
        return self

    def __exit__(self, *exc):
        torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = self.saved


DEFAULT = (f"fused activation ({ActivationKernel().sine} sine), channels-last, polyphase upsamplers, "
           f"convolutions under {FOLD_BELOW} channels time-folded to {FOLD_TO}: the default")
# A variant keeps its number for good, so the commands in RESULTS.md and studies/ keep
# naming the same decode; the numbers of dropped variants (0, 2) are not reused.
VARIANTS = {
    1: Variant("eager activations", fused=False),
    3: Variant("fused activation", fused=True),
    4: Variant("fused activation + cudnn.benchmark", fused=True, cudnn_benchmark=True),
    5: Variant(DEFAULT, fused=True, channels_last=True),
    6: Variant("the same, libdevice sinf", fused=True, channels_last=True, sine="libdevice"),
    7: Variant("the same, sin.approx", fused=True, channels_last=True, sine="approx"),
    8: Variant("the same + cudnn.benchmark", fused=True, channels_last=True, cudnn_benchmark=True),
    9: Variant("the same, transposed-convolution upsamplers", fused=True, channels_last=True, polyphase=False),
    10: Variant("the same + cudnn.benchmark over every algorithm (benchmark_limit 0)", fused=True,
                channels_last=True, cudnn_benchmark=True, cudnn_benchmark_limit=0),
    11: Variant("the same, no time folding", fused=True, channels_last=True, fold=(0, 0)),
    12: Variant("the same, folded to 96 channels", fused=True, channels_last=True, fold=(96, 96)),
    13: Variant("the same, under 192 channels folded to 192 (stage 3 too)", fused=True, channels_last=True,
                fold=(192, 192)),
    14: Variant("the default in fp16 (fp16 weights and signals, fp32 accumulation and activations)",
                fused=True, channels_last=True, dtype=torch.float16),
    15: Variant("the same in fp16 + cudnn.benchmark", fused=True, channels_last=True, dtype=torch.float16,
                cudnn_benchmark=True),
    16: Variant("fp16 + cudnn.benchmark, sin.approx", fused=True, channels_last=True, dtype=torch.float16,
                cudnn_benchmark=True, sine="approx"),
    17: Variant("fp16 + cudnn.benchmark over every algorithm (benchmark_limit 0)", fused=True, channels_last=True,
                dtype=torch.float16, cudnn_benchmark=True, cudnn_benchmark_limit=0),
    18: Variant("fp16 + cudnn.benchmark, no time folding", fused=True, channels_last=True, dtype=torch.float16,
                cudnn_benchmark=True, fold=(0, 0)),
    19: Variant("fp16 + cudnn.benchmark, folded to 96 channels", fused=True, channels_last=True,
                dtype=torch.float16, cudnn_benchmark=True, fold=(96, 96)),
    20: Variant("fp16 + cudnn.benchmark, under 192 channels folded to 192", fused=True, channels_last=True,
                dtype=torch.float16, cudnn_benchmark=True, fold=(192, 192)),
}


# ---- profiling by layer --------------------------------------------------------------------


def _label_modules(vae: AuKVAE) -> dict:
    """module -> profiler label, e.g. 's3 act', 's3 conv k7', 's3 up', 's3 block (adds)'."""
    blocks = len(vae.resblock_kernel_sizes)
    labels = {vae.conv_pre: "conv_pre", vae.conv_post: "conv_post", vae.activation_post: "post act"}
    for i, up in enumerate(vae.ups):
        labels[up[0]] = f"s{i} up"
    for j, block in enumerate(vae.resblocks):
        stage, kernel = j // blocks, vae.resblock_kernel_sizes[j % blocks]
        labels[block] = f"s{stage} block adds"
        for conv in (*block.convs1, *block.convs2):
            labels[conv] = f"s{stage} conv k{kernel}"
        for act in block.activations:
            labels[act] = f"s{stage} act"
    return labels


def profile_by_layer(vae: AuKVAE, call, clip) -> tuple[dict, dict, int]:
    """GPU microseconds of one `call(clip)` per module label and per kernel name, and the kernel count."""
    labels = _label_modules(vae)
    handles, stack = [], []
    for module, label in labels.items():
        def pre(mod, args, label=label):
            ctx = torch.profiler.record_function("auk:" + label)
            ctx.__enter__()
            stack.append(ctx)

        def post(mod, args, out):
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with torch.no_grad():
            call(clip)  # warm
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                    torch.profiler.ProfilerActivity.CPU]) as prof:
                call(clip)
                torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    by_label, by_kernel, count = collections.Counter(), collections.Counter(), 0
    for event in prof.events():
        kernels = getattr(event, "kernels", [])
        if not kernels:
            continue
        owner, label = event, "other (decode level)"
        while owner is not None:
            if owner.name.startswith("auk:"):
                label = owner.name[4:]
                break
            owner = owner.cpu_parent
        for kernel in kernels:
            by_label[label] += kernel.duration
            by_kernel[kernel.name[:90]] += kernel.duration
            count += 1
    return by_label, by_kernel, count


def _kind(label: str) -> str:
    for kind in ("act", "conv k", "up", "block adds"):
        if kind in label:
            return {"conv k": "dense conv", "block adds": "residual + stage adds"}.get(kind, kind)
    return label


def report_profile(by_label, by_kernel, count, top: int = 12) -> None:
    total = sum(by_label.values())
    kinds = collections.Counter()
    for label, us in by_label.items():
        kinds[_kind(label)] += us
    say(f"GPU time {total / 1e3:.2f} ms in {count} kernels. By layer kind: " + ", ".join(
        f"{k} {us / 1e3:.2f} ms ({100 * us / total:.0f}%)" for k, us in kinds.most_common()))
    stages = sorted({label.split()[0] for label in by_label if label.startswith("s")})
    say("| stage | act ms | dense conv ms | up ms | adds ms |")
    say("| --- | --- | --- | --- | --- |")
    for stage in stages:
        cells = [sum(us for label, us in by_label.items() if label.split()[0] == stage and _kind(label) == kind)
                 for kind in ("act", "dense conv", "up", "residual + stage adds")]
        say(f"| {stage} | " + " | ".join(f"{us / 1e3:.2f}" for us in cells) + " |")
    say("Top kernels: " + "; ".join(f"{name} {us / 1e3:.2f} ms" for name, us in by_kernel.most_common(top)))


# ---- roofline ------------------------------------------------------------------------------


def layer_costs(vae: AuKVAE, clip) -> list[tuple[float, float]]:
    """(dense FLOPs, fewest bytes) of every layer of one decode of `clip`.

    A convolution reads its input and weights and writes its output; a fused
    activation reads and writes one signal; an AMP block's three residual adds
    read two signals and write one, and adding the block into its stage's sum
    reads one more. Bytes are counted at each tensor's own element size (fp16 or fp32).
    """
    costs, handles = [], []

    def hook(module, args, out):
        x = args[0]
        if isinstance(module, AMPBlock):
            costs.append((0.0, (3 * 3 + 1) * x.element_size() * x.numel()))
            return
        nbytes = x.element_size() * x.numel() + out.element_size() * out.numel()
        flops = 0.0
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            nbytes += module.weight.element_size() * module.weight.numel()
            length = x.shape[-1] if isinstance(module, CausalConvTranspose1d) else out.shape[-1]
            flops = 2.0 * module.in_channels * module.out_channels * module.kernel_size[0] * length
        costs.append((flops, float(nbytes)))

    for module in _label_modules(vae):
        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            vae.decode(clip)
    finally:
        for handle in handles:
            handle.remove()
    return costs


def matrix_rate(dtype: torch.dtype = torch.float32) -> float:
    """Matmul FLOP/s on 8192^3 (TF32 for float32; fp16 with fp32 accumulation for float16), the rate
    the dense convolutions could at best reach."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        ms = median_ms(lambda: a @ b, iters=10)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return 2 * 8192**3 / (ms / 1e3)


def roofline(vae: AuKVAE, clip, measured: dict) -> None:
    """The floor of `vae`'s decode at its own precision, and each `measured` decode of that precision against it."""
    costs = layer_costs(vae, clip)
    dtype = vae.decoder_dtype
    rate, bandwidth = matrix_rate(dtype), copy_bandwidth()
    flops = sum(f for f, _ in costs)
    nbytes = sum(b for _, b in costs)
    floor_ms = sum(max(f / rate, b / bandwidth) for f, b in costs) * 1e3
    kind = "fp16" if dtype == torch.float16 else "TF32"
    say(f"\n## Roofline, {clip.shape[1]} frames, {kind}\n")
    say(f"Measured in this run: {kind} matmul {rate / 1e12:.0f} TFLOP/s (8192^3), "
        f"device copy {bandwidth / 1e9:.0f} GB/s (read + write).")
    say(f"Dense convolution FLOPs {flops / 1e12:.3f} TFLOP -> {flops / rate * 1e3:.2f} ms at that rate; "
        f"fewest bytes moved layer by layer {nbytes / 1e9:.2f} GB -> {nbytes / bandwidth * 1e3:.2f} ms; "
        f"floor (per layer the larger of the two, summed) {floor_ms:.2f} ms.")
    for name, ms in measured.items():
        if ("fp16" in name) == (dtype == torch.float16):
            say(f"- {name}: {ms:.2f} ms, {ms / floor_ms:.1f}x the floor")


def report_compiled_kernels(by_kernel, count, top: int = 12) -> None:
    """Inductor's kernels grouped: the fused activation, its own pointwise and reduction kernels,
    the convolution libraries' kernels, the rest."""
    total = sum(by_kernel.values())
    groups = collections.Counter()
    for name, us in by_kernel.items():
        group = ("fused activation" if "fused_activation" in name else
                 "inductor pointwise/reduction" if name.startswith("triton_") else
                 "convolution (cuDNN / CUTLASS)" if any(s in name.lower() for s in ("conv", "xmma", "gemm", "cudnn", "sm90", "sm80", "cutlass")) else
                 "other")
        groups[group] += us
    say(f"Inductor code without the graph: {total / 1e3:.2f} ms GPU in {count} kernels: " + ", ".join(
        f"{g} {us / 1e3:.2f} ms" for g, us in groups.most_common()))
    say("Top kernels: " + "; ".join(f"{n} {us / 1e3:.2f} ms" for n, us in by_kernel.most_common(top)))


# ---- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="variants:\n" + "\n".join(f"  {number:2d}  {v.name}" for number, v in VARIANTS.items()))
    parser.add_argument("--frames", type=int, default=512)
    parser.add_argument("--preset", default="auk")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--compiled", action="store_true", help="also compile buckets (about a minute each)")
    parser.add_argument("--compiled-variants", type=int, nargs="*", default=[1, 5],
                        help="variant numbers to compile")
    parser.add_argument("--plain-variants", type=int, nargs="*", default=list(VARIANTS),
                        help="variant numbers to run as plain graphs and profile (default: all)")
    args = parser.parse_args()
    unknown = sorted(set(args.plain_variants + args.compiled_variants) - set(VARIANTS))
    if unknown:
        parser.error(f"no variant {unknown}; the variants are {list(VARIANTS)} (see --help)")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    say(heading(f"Decode profile, {args.preset} preset, {args.frames} frames"))
    vae = AuKVAE.from_pretrained(synthetic_checkpoint(preset=args.preset), device="cuda")
    clip = latents(args.frames, "cuda")
    with torch.no_grad():
        reference = vae.decode(clip)  # eager activations, channels-first: as loaded
    measured = {}

    say("\n## Plain CUDA graph (eager kernels) per variant\n")
    for number in args.plain_variants:
        variant = VARIANTS[number]
        with variant:
            configured = variant.apply(vae)
            graph = AuKVAEDecodeGraph(configured, compile_shapes=())
            err = rel_l2(graph(clip), reference)
            ms = median_ms(lambda: graph(clip), args.iters)
            measured[f"plain graph, {variant.name}"] = ms
            say(f"\n### [{number}] {variant.name}: {ms:.2f} ms per plain-graph decode (rel. L2 vs default eager {err:.1e})")
            report_profile(*profile_by_layer(configured, configured.decode, clip))
            graph = configured = None

    if args.compiled:
        say("\n## Compiled bucket (Inductor + CUDA graph) per variant\n")
        for number in args.compiled_variants:
            variant = VARIANTS[number]
            torch._dynamo.reset()
            with variant:
                configured = variant.apply(vae)
                began = time.perf_counter()
                graph = AuKVAEDecodeGraph(configured, compile_shapes=(args.frames,))
                graph.warmup("cuda")
                build = time.perf_counter() - began
                err = rel_l2(graph(clip), reference)
                ms = median_ms(lambda: graph(clip), args.iters)
                measured[f"compiled bucket, {variant.name}"] = ms
                say(f"\n### [{number}] {variant.name}: {ms:.2f} ms per replay, built in {build:.0f} s "
                    f"(rel. L2 vs eager {err:.1e})")
                say(f"Compile phases so far (cumulative): {compile_time_breakdown()}")
                # The bucket's compiled decode, run outside its graph so the profiler sees each kernel.
                _, by_kernel, count = profile_by_layer(configured, graph._compiled_decode, clip)
                report_compiled_kernels(by_kernel, count)
                graph = configured = None
    roofline(VARIANTS[1].apply(vae), clip, measured)
    roofline(VARIANTS[14].apply(vae), clip, measured)


if __name__ == "__main__":
    main()
