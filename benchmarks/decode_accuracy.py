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
import sys

import torch

from auk_triton.codec import ActivationKernel, AuKVAE, AuKVAEDecodeGraph
from auk_triton.codec.activation import SINE_METHODS
from common import heading, latents, rel_l2, synthetic_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=512)
    parser.add_argument("--preset", default="auk")
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(heading(f"Decode accuracy, {args.preset} preset, {args.frames} frames") + "\n", flush=True)
    directory = synthetic_checkpoint(preset=args.preset)
    fused = ActivationKernel()
    channels_first = AuKVAE.from_pretrained(directory, device="cuda")
    channels_last = AuKVAE.from_pretrained(directory, device="cuda", activation_kernel=fused, channels_last=True)
    print("| seed | path | rel. L2 vs fp32 (TF32 off) | rel. L2 vs eager (TF32) |")
    print("| --- | --- | --- | --- |")
    for seed in range(args.seeds):
        clip = latents(args.frames, "cuda", seed=seed)
        with torch.no_grad():
            channels_first.configure_decoder()
            saved = torch.backends.cudnn.allow_tf32
            torch.backends.cudnn.allow_tf32 = False
            exact = channels_first.decode(clip)
            torch.backends.cudnn.allow_tf32 = saved
            eager = channels_first.decode(clip)
            outputs = {"eager (TF32)": eager}
            channels_first.configure_decoder(activation_kernel=fused)
            outputs["eager + fused activation"] = channels_first.decode(clip)
            outputs["plain graph + fused activation"] = AuKVAEDecodeGraph(channels_first, compile_shapes=())(clip)
            outputs["eager + fused activation, channels-last"] = channels_last.decode(clip)
            outputs["plain graph + fused activation, channels-last"] = AuKVAEDecodeGraph(
                channels_last, compile_shapes=())(clip)
            for sine in SINE_METHODS:
                channels_last.configure_decoder(activation_kernel=ActivationKernel(sine=sine), channels_last=True)
                outputs[f"eager + fused activation ({sine} sine), channels-last"] = channels_last.decode(clip)
            channels_last.configure_decoder(activation_kernel=fused, channels_last=True)
        for name, out in outputs.items():
            print(f"| {seed} | {name} | {rel_l2(out, exact):.2e} | {rel_l2(out, eager):.2e} |", flush=True)


if __name__ == "__main__":
    main()
