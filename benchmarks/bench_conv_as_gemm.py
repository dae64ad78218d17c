"""The decoder's dense convolutions through cuDNN against a chain of cuBLAS matrix products.

A causal convolution of kernel k and dilation d on a channels-last signal
[L, C] is out[t] = sum_j x_pad[t + d*j] @ W_j^T, where x_pad is the signal with
d*(k-1) zero rows in front and W_j the weights' tap j ([C_out, C_in]). Each term
is a row-offset view of x_pad times a C_in x C_out matrix: k matrix products
accumulated into one output (`addmm` with beta 1), no im2col copy. cuBLAS runs
TF32 products near the measured matrix rate on large shapes; cuDNN's kernels for
the widest stages run at about half of it (benchmarks/RESULTS.md). This script
measures, stage by stage at the `auk` geometry, the 18 convolutions of a stage's
three AMP blocks both ways, each replayed from a CUDA graph, and how far each is
from the same convolution in plain fp32.

    PYTHONPATH=. python3 benchmarks/bench_conv_as_gemm.py --frames 512
"""

import argparse
import datetime
import statistics
import sys

import torch
import torch.nn.functional as F

from auk_triton.vae import DEFAULT_INIT_KWARGS


def causal_conv_cudnn(x: torch.Tensor, weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """As CausalConv1d runs it on a channels-last signal: the 4-D op, padded inside, cropped."""
    length, kernel = x.shape[-1], weight.shape[-1]
    out = F.conv2d(x.unsqueeze(2), weight.unsqueeze(2), None, 1, (0, dilation * (kernel - 1)), (1, dilation))
    return out.squeeze(2)[..., :length]


def causal_conv_gemm(x_padded: torch.Tensor, taps: torch.Tensor, dilation: int, out: torch.Tensor) -> torch.Tensor:
    """out [L, C_out] = sum_j x_padded[d*j : d*j + L] @ taps[j] (taps: [k, C_in, C_out])."""
    length = out.shape[0]
    torch.mm(x_padded[:length], taps[0], out=out)
    for j in range(1, taps.shape[0]):
        out.addmm_(x_padded[dilation * j : dilation * j + length], taps[j])
    return out


def graph_ms(fn, iters: int) -> float:
    """Median ms of one replay of `fn` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times[2:])


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--stages", type=int, nargs="*", default=None, help="stage indices (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default for convolutions
    print(f"# Dense convolutions: cuDNN against cuBLAS product chains, {args.frames} frames, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.date.today()}", flush=True)
    kwargs = DEFAULT_INIT_KWARGS
    rates, c0 = kwargs["upsample_rates"], kwargs["upsample_initial_channel"]
    kernels, dilations = kwargs["resblock_kernel_sizes"], kwargs["resblock_dilation_sizes"]
    print("| stage | C x L | cuDNN ms (18 convs) | products ms | products / cuDNN | rel. L2 vs fp32: cuDNN | products |")
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    length = args.frames
    generator = torch.Generator(device="cuda").manual_seed(0)
    for stage, rate in enumerate(rates):
        length *= rate
        channels = c0 // 2 ** (stage + 1)
        if args.stages is not None and stage not in args.stages:
            continue
        x = torch.randn(1, length, channels, device="cuda", generator=generator).transpose(1, 2)  # channels-last
        convs = []  # (weight [C, C, k] channels-last, dilation): convs1 then convs2, per block
        for kernel, block_dilations in zip(kernels, dilations):
            for dilation in (*block_dilations, *(1,) * len(block_dilations)):
                weight = torch.randn(channels, channels, kernel, device="cuda", generator=generator)
                weight = weight / (channels * kernel) ** 0.5
                convs.append((weight.transpose(1, 2).contiguous().transpose(1, 2), dilation))
        reach = max(d * (w.shape[-1] - 1) for w, d in convs)
        x_padded = F.pad(x.squeeze(0).t(), (0, 0, reach, 0))  # [reach + L, C], zero rows in front
        plans = []
        for weight, dilation in convs:
            left = dilation * (weight.shape[-1] - 1)
            taps = weight.permute(2, 1, 0).contiguous()  # [k, C_in, C_out]
            plans.append((x_padded[reach - left :], taps, dilation, torch.empty(length, channels, device="cuda")))
        cudnn_out = [None] * len(convs)

        def run_cudnn():
            for n, (weight, dilation) in enumerate(convs):
                cudnn_out[n] = causal_conv_cudnn(x, weight, dilation)

        def run_gemm():
            for padded, taps, dilation, out in plans:
                causal_conv_gemm(padded, taps, dilation, out)

        torch.backends.cuda.matmul.allow_tf32 = True
        cudnn_ms, gemm_ms = graph_ms(run_cudnn, args.iters), graph_ms(run_gemm, args.iters)
        run_cudnn()
        run_gemm()
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        exact = [causal_conv_cudnn(x, weight, dilation) for weight, dilation in convs[:3]]
        torch.backends.cudnn.allow_tf32 = True
        err_cudnn = max(rel_l2(cudnn_out[n], exact[n]) for n in range(3))
        err_gemm = max(rel_l2(plans[n][3].t().unsqueeze(0), exact[n]) for n in range(3))
        print(f"| {stage} | {channels} x {length} | {cudnn_ms:.3f} | {gemm_ms:.3f} | {gemm_ms / cudnn_ms:.2f} | "
              f"{err_cudnn:.1e} | {err_gemm:.1e} |", flush=True)
        del x, x_padded, plans, convs, cudnn_out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
