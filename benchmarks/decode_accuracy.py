"""How far each decode path lands from a plain-fp32 decode (TF32 off), next to eager's own distance.

The served tiers are compared with the eager decode, which itself runs its
convolutions in TF32 (PyTorch's default for cuDNN). Two TF32 decodes whose cuDNN
kernels differ (NCHW against NHWC, another tile shape) round differently, so their
distance from each other says little on its own. This script puts every path next
to a decode with TF32 off: a path is as accurate as eager when its distance from
that reference is no larger than eager's.

    PYTHONPATH=.:benchmarks python3 benchmarks/decode_accuracy.py --frames 512
"""

import argparse
import datetime
import tempfile

import torch

from auk_triton import fused_activation as fa
from auk_triton.decode_graph import AuKVAEDecodeGraph
from auk_triton.synthetic import write_synthetic_checkpoint
from auk_triton.vae import AuKVAE


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=512)
    parser.add_argument("--preset", default="auk")
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    print(f"# Decode accuracy, {args.preset} preset, {args.frames} frames, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, {datetime.date.today()}\n", flush=True)
    directory = write_synthetic_checkpoint(tempfile.mkdtemp(prefix="auk-accuracy-"), args.preset)
    channels_first = AuKVAE.from_pretrained(directory, device="cuda")
    channels_last = AuKVAE.from_pretrained(directory, device="cuda").use_fused_activation(True)
    channels_last.use_channels_last(True)
    print("| seed | path | rel. L2 vs fp32 (TF32 off) | rel. L2 vs eager (TF32) |")
    print("| --- | --- | --- | --- |")
    for seed in range(args.seeds):
        clip = torch.randn(1, args.frames, channels_first.latent_dim,
                           generator=torch.Generator().manual_seed(seed)).cuda()
        with torch.no_grad():
            saved = torch.backends.cudnn.allow_tf32
            torch.backends.cudnn.allow_tf32 = False
            channels_first.use_fused_activation(False)
            exact = channels_first.decode(clip)
            torch.backends.cudnn.allow_tf32 = saved
            eager = channels_first.decode(clip)
            outputs = {"eager (TF32)": eager}
            channels_first.use_fused_activation(True)
            outputs["eager + fused activation"] = channels_first.decode(clip)
            outputs["plain graph + fused activation"] = AuKVAEDecodeGraph(channels_first, compile_shapes=())(clip)
            outputs["eager + fused activation, channels-last"] = channels_last.decode(clip)
            outputs["plain graph + fused activation, channels-last"] = AuKVAEDecodeGraph(
                channels_last, compile_shapes=())(clip)
            for sine in fa.SINE_METHODS:
                saved_sine, fa.SINE = fa.SINE, sine
                outputs[f"eager + fused activation ({sine} sine), channels-last"] = channels_last.decode(clip)
                fa.SINE = saved_sine
        for name, out in outputs.items():
            print(f"| {seed} | {name} | {rel_l2(out, exact):.2e} | {rel_l2(out, eager):.2e} |", flush=True)


if __name__ == "__main__":
    main()
