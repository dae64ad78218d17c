"""The decoder in fp16 (fp16 weights and signals, fp32 accumulation and activations) on a CUDA GPU,
against the exact fp32 decode (TF32 off). Skipped without CUDA.

The decode as served: the fused activation kernel (with fp16's hardware sine), channels-last
signals, time folding.
The bound is the one the served fp16 decode is held to: 2e-3 relative L2 and 1e-2
max abs from the exact decode (TF32 eager sits at about 1.2e-3).
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from auk_triton.codec import ActivationKernel, AuKVAE, AuKVAEDecodeGraph, activation_kernel_for
from auk_triton.codec.synthetic import write_synthetic_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONFORMANCE = Path(__file__).parents[1] / "data" / "auk_vae_tiny"
REL_L2_BOUND, MAX_ABS_BOUND = 2e-3, 1e-2
FP16 = {"activation_kernel": activation_kernel_for(torch.float16), "channels_last": True, "dtype": torch.float16}


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item()


def latents(frames: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, frames, 64, generator=generator).cuda()


def exact_decode(vae: AuKVAE, clip: torch.Tensor) -> torch.Tensor:
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            return vae.decode(clip)
    finally:
        torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("small-fp16"), "small")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return AuKVAE.from_pretrained(checkpoint, device="cuda")


@pytest.fixture(scope="module")
def fp16(checkpoint):
    return AuKVAE.from_pretrained(checkpoint, device="cuda", **FP16)


def test_the_fp16_decoder_holds_fp16_weights_and_keeps_the_waveform_in_fp32(fp16):
    assert fp16.decoder_dtype == torch.float16
    assert fp16.conv_pre.weight.dtype == fp16.ups[0][0].weight.dtype == torch.float16
    assert fp16.resblocks[0].convs1[0].weight.dtype == torch.float16
    assert fp16.conv_post.weight.dtype == torch.float32, "conv_post writes the waveform"
    assert fp16.resblocks[0].activations[0].act.alpha.dtype == torch.float32
    assert fp16.global_mean.dtype == torch.float32
    with torch.no_grad():
        assert fp16.decode(latents(20, 0)).dtype == torch.float32
    with pytest.raises(ValueError, match="load the checkpoint again"):
        fp16.configure_decoder(activation_kernel=ActivationKernel(), channels_last=True)


@pytest.mark.parametrize("frames", [1, 37, 300, 512])
def test_an_fp16_decode_is_within_the_bound_of_the_exact_decode(reference, fp16, frames):
    clip = latents(frames, frames)
    with torch.no_grad():
        out = fp16.decode(clip)
    expected = exact_decode(reference, clip)
    assert rel_l2(out, expected) <= REL_L2_BOUND and max_abs(out, expected) <= MAX_ABS_BOUND, (
        rel_l2(out, expected), max_abs(out, expected))


def test_the_fp16_conformance_decode_is_within_the_bound_of_the_reference_implementation():
    vae = AuKVAE.from_pretrained(CONFORMANCE, device="cuda", **FP16)
    for frames in (7, 64):
        clip = torch.from_numpy(np.load(CONFORMANCE / f"latents_{frames}.npy")).reshape(1, frames, -1).cuda()
        expected = torch.from_numpy(np.load(CONFORMANCE / f"decode_{frames}.npy")).reshape(1, -1).cuda()
        with torch.no_grad():
            out = vae.decode(clip)
        assert rel_l2(out, expected) <= REL_L2_BOUND and max_abs(out, expected) <= MAX_ABS_BOUND, (
            frames, rel_l2(out, expected), max_abs(out, expected))


def test_an_fp16_plain_graph_replays_the_fp16_eager_decode_bit_for_bit(fp16):
    graph = AuKVAEDecodeGraph(fp16, compile_shapes=())
    for seed in (0, 1):
        clip = latents(77, seed)
        out = graph(clip)
        assert graph.last_mode == "graph"
        with torch.no_grad():
            assert torch.equal(out, fp16.decode(clip))


def test_fp16_compiled_buckets_and_their_stitched_tiles_are_within_the_bound(reference, fp16):
    graph = AuKVAEDecodeGraph(fp16, compile_shapes=(32, 128), first_tile_frames=32, batch_sizes=(1, 2),
                              batch_frames=256)
    graph.warmup("cuda")
    assert graph.compiled_bucket(128) == 128, "the fp16 compiled bucket failed to build (see the warning log)"
    clip = latents(128, 3)
    out = graph(clip)
    assert graph.last_mode == "compiled"
    expected = exact_decode(reference, clip)
    assert rel_l2(out, expected) <= REL_L2_BOUND and max_abs(out, expected) <= MAX_ABS_BOUND
    # A clip of many tiles (first window 32 frames, then 128) against its exact whole-clip decode.
    long_clip = latents(1000, 4)
    stitched = graph(long_clip)
    assert graph.last_mode == "tiled"
    expected = exact_decode(reference, long_clip)
    assert rel_l2(stitched, expected) <= REL_L2_BOUND and max_abs(stitched, expected) <= MAX_ABS_BOUND
    # Batched rows in fp16: each within the bound of its exact decode.
    rows = [latents(128, 5), latents(100, 6)]
    with torch.no_grad():
        together = [wave.clone() for wave in graph.decode_rows(rows)]
    assert graph.last_mode == "batched"
    right = fp16.decode_context_frames()[1] * fp16.hop_size
    for row, wave in zip(rows, together):
        settled = slice(0, wave.numel() - right)
        expected = exact_decode(reference, row)[0]
        assert rel_l2(wave[settled], expected[settled]) <= REL_L2_BOUND
