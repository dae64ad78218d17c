"""Where a decode's GPU time goes, and how far it is from the hardware's floor.

For each variant of the decode (see VARIANTS) this prints the time of one plain
CUDA-graph replay (eager kernels, no launch overhead, no compilation) and the
GPU time of a profiled eager decode split by layer kind and stage. With
`--compiled`, the compiled bucket (Inductor) of the chosen variants is timed as
a graph replay and profiled as Inductor's code run without the graph.

The roofline: FLOPs of the dense convolutions (the essential arithmetic) and the
fewest bytes a layer-by-layer decode must move (every layer reads its input and
weights and writes its output once; activations fused), turned into times at
a TF32 matrix rate and a copy bandwidth measured in the same run. The floor
sums, layer by layer, the larger of a layer's compute and memory time.

    PYTHONPATH=. python3 benchmarks/profile_decode.py --frames 512 --compiled
"""

import argparse
import collections
import datetime
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from auk_triton import fused_activation as fa
from auk_triton.decode_graph import AuKVAEDecodeGraph
from auk_triton.synthetic import write_synthetic_checkpoint
from auk_triton.vae import FOLD_BELOW, FOLD_TO, AMPBlock, AuKVAE, CausalConv1d, CausalConvTranspose1d

from bench_decode import compile_time_breakdown, median_ms  # this folder is on sys.path when run as a script


def say(line: str = "") -> None:
    print(line, flush=True)


# ---- the convolutions as they were before, for the same-run comparison ---------------------


def _padded_causal_conv(self, x, bias=True):
    """The former CausalConv1d: a zero-padded copy of the input, then the convolution."""
    left = self.dilation[0] * (self.kernel_size[0] - 1)
    return F.conv1d(F.pad(x, (left, 0)), self.weight, self.bias if bias else None, 1, 0, self.dilation[0])


def _bias_in_conv_block(self, x):
    """The former AMPBlock: each convolution adds its own bias."""
    for n, (c1, c2) in enumerate(zip(self.convs1, self.convs2)):
        x = x + c2(self.activations[2 * n + 1](c1(self.activations[2 * n](x))))
    return x


class Variant:
    """A decode configuration: fused kernel on/off, padded-copy convs, cudnn.benchmark (and its
    algorithm limit), layout, how the fused kernel evaluates sin^2 (fused_activation.SINE_METHODS;
    None: the default), and whether channels-last upsamplers run in their polyphase form."""

    def __init__(self, name, fused, padded_convs=False, cudnn_benchmark=False, channels_last=False, sine=None,
                 polyphase=True, cudnn_benchmark_limit=None, fold=(FOLD_BELOW, FOLD_TO)):
        self.name, self.fused, self.padded_convs, self.cudnn_benchmark = name, fused, padded_convs, cudnn_benchmark
        self.channels_last, self.sine = channels_last, sine
        self.polyphase, self.cudnn_benchmark_limit = polyphase, cudnn_benchmark_limit
        self.fold = fold  # (narrower than, to): see AuKVAE.use_channels_last

    def apply(self, vae: AuKVAE) -> None:
        vae.use_fused_activation(self.fused)
        vae.use_channels_last(self.channels_last, *self.fold)
        if not self.polyphase:
            for up in vae.ups:
                up[0].drop_polyphase()

    def __enter__(self):
        cudnn = torch.backends.cudnn
        self.saved = (CausalConv1d.forward, AMPBlock.forward, cudnn.benchmark, cudnn.benchmark_limit, fa.SINE)
        if self.padded_convs:
            CausalConv1d.forward, AMPBlock.forward = _padded_causal_conv, _bias_in_conv_block
        cudnn.benchmark = self.cudnn_benchmark
        if self.cudnn_benchmark_limit is not None:
            cudnn.benchmark_limit = self.cudnn_benchmark_limit
        fa.SINE = self.sine or fa.SINE
        return self

    def __exit__(self, *exc):
        cudnn = torch.backends.cudnn
        (CausalConv1d.forward, AMPBlock.forward, cudnn.benchmark, cudnn.benchmark_limit, fa.SINE) = self.saved


DEFAULT_CHANNELS_LAST = (f"fused activation ({fa.SINE} sine), channels-last, polyphase upsamplers, "
                         f"convolutions under {FOLD_BELOW} channels time-folded to {FOLD_TO}: the default")
VARIANTS = [
    Variant("eager activations, padded-copy convs (before)", fused=False, padded_convs=True),
    Variant("eager activations", fused=False),
    Variant("fused activation, padded-copy convs", fused=True, padded_convs=True),
    Variant("fused activation", fused=True),
    Variant("fused activation + cudnn.benchmark", fused=True, cudnn_benchmark=True),
    Variant(DEFAULT_CHANNELS_LAST, fused=True, channels_last=True),
    Variant("the same, libdevice sinf", fused=True, channels_last=True, sine="libdevice"),
    Variant("the same, sin.approx", fused=True, channels_last=True, sine="approx"),
    Variant("the same + cudnn.benchmark", fused=True, channels_last=True, cudnn_benchmark=True),
    Variant("the same, transposed-convolution upsamplers", fused=True, channels_last=True, polyphase=False),
    Variant("the same + cudnn.benchmark over every algorithm (benchmark_limit 0)", fused=True,
            channels_last=True, cudnn_benchmark=True, cudnn_benchmark_limit=0),
    Variant("the same, no time folding", fused=True, channels_last=True, fold=(0, 0)),
    Variant("the same, folded to 96 channels", fused=True, channels_last=True, fold=(96, 96)),
    Variant("the same, under 192 channels folded to 192 (stage 3 too)", fused=True, channels_last=True,
            fold=(192, 192)),
]


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
    reads one more.
    """
    costs, handles = [], []

    def hook(module, args, out):
        x = args[0]
        if isinstance(module, AMPBlock):
            costs.append((0.0, (3 * 12 + 4) * x.numel()))
            return
        nbytes = 4 * (x.numel() + out.numel())
        flops = 0.0
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            nbytes += 4 * module.weight.numel()
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


def matrix_rate() -> float:
    """TF32 matmul FLOP/s on 8192^3, the rate the dense convolutions could at best reach."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        a = torch.randn(8192, 8192, device="cuda")
        b = torch.randn(8192, 8192, device="cuda")
        ms = median_ms(lambda: a @ b, iters=10)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return 2 * 8192**3 / (ms / 1e3)


def copy_bandwidth() -> float:
    src = torch.empty(2**28, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() * 4 / (ms / 1e3)


def roofline(vae: AuKVAE, clip, measured: dict) -> None:
    costs = layer_costs(vae, clip)
    rate, bandwidth = matrix_rate(), copy_bandwidth()
    flops = sum(f for f, _ in costs)
    nbytes = sum(b for _, b in costs)
    floor_ms = sum(max(f / rate, b / bandwidth) for f, b in costs) * 1e3
    say(f"\n## Roofline, {clip.shape[1]} frames\n")
    say(f"Measured in this run: TF32 matmul {rate / 1e12:.0f} TFLOP/s (8192^3), "
        f"device copy {bandwidth / 1e9:.0f} GB/s (read + write).")
    say(f"Dense convolution FLOPs {flops / 1e12:.3f} TFLOP -> {flops / rate * 1e3:.2f} ms at that rate; "
        f"fewest bytes moved layer by layer {nbytes / 1e9:.2f} GB -> {nbytes / bandwidth * 1e3:.2f} ms; "
        f"floor (per layer the larger of the two, summed) {floor_ms:.2f} ms.")
    for name, ms in measured.items():
        say(f"- {name}: {ms:.2f} ms, {ms / floor_ms:.1f}x the floor")


# ---- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=512)
    parser.add_argument("--preset", default="auk")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--compiled", action="store_true", help="also compile buckets (about a minute each)")
    parser.add_argument("--compiled-variants", type=int, nargs="*", default=[0, 3],
                        help="indices into VARIANTS to compile")
    parser.add_argument("--plain-variants", type=int, nargs="*", default=list(range(len(VARIANTS))),
                        help="indices into VARIANTS to run as plain graphs and profile")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    say(f"# Decode profile, {args.preset} preset, {args.frames} frames, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, {datetime.date.today()}")
    torch.manual_seed(0)
    directory = write_synthetic_checkpoint(tempfile.mkdtemp(prefix="auk-profile-"), args.preset)
    vae = AuKVAE.from_pretrained(directory, device="cuda")
    clip = torch.randn(1, args.frames, vae.latent_dim, device="cuda")
    with torch.no_grad():
        reference = vae.decode(clip)
    measured = {}

    say("\n## Plain CUDA graph (eager kernels) per variant\n")
    for index in args.plain_variants:
        variant = VARIANTS[index]
        with variant:
            variant.apply(vae)
            graph = AuKVAEDecodeGraph(vae, compile_shapes=())
            out = graph(clip)
            err = ((out - reference).norm() / reference.norm()).item()
            ms = median_ms(lambda: graph(clip), args.iters)
            measured[f"plain graph, {variant.name}"] = ms
            say(f"\n### [{index}] {variant.name}: {ms:.2f} ms per plain-graph decode (rel. L2 vs default eager {err:.1e})")
            report_profile(*profile_by_layer(vae, vae.decode, clip))
            del graph

    if args.compiled:
        say("\n## Compiled bucket (Inductor + CUDA graph) per variant\n")
        for index in args.compiled_variants:
            variant = VARIANTS[index]
            torch._dynamo.reset()
            with variant:
                variant.apply(vae)
                began = time.perf_counter()
                graph = AuKVAEDecodeGraph(vae, compile_shapes=(args.frames,))
                graph.warmup("cuda")
                build = time.perf_counter() - began
                out = graph(clip)
                err = ((out - reference).norm() / reference.norm()).item()
                ms = median_ms(lambda: graph(clip), args.iters)
                measured[f"compiled bucket, {variant.name}"] = ms
                say(f"\n### [{index}] {variant.name}: {ms:.2f} ms per replay, built in {build:.0f} s "
                    f"(rel. L2 vs eager {err:.1e})")
                say(f"Compile phases so far (cumulative): {compile_time_breakdown()}")
                _, by_kernel, count = profile_by_layer(vae, graph._compiled_decode, clip)
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
                say("Top kernels: " + "; ".join(f"{n} {us / 1e3:.2f} ms" for n, us in by_kernel.most_common(12)))
                del graph
    VARIANTS[0].apply(vae)
    roofline(vae, clip, measured)


if __name__ == "__main__":
    main()
