"""The encode as served (AuKVAEEncoder) on the CPU: the library's encode, and the posterior seed rule."""

from pathlib import Path

import numpy as np
import pytest
import torch

from auk_triton.codec import AuKVAE, AuKVAEEncoder, posterior_seed

CONFORMANCE = Path(__file__).resolve().parents[1] / "data" / "auk_vae_tiny"


@pytest.fixture(scope="module")
def tiny():
    return AuKVAE.from_pretrained(CONFORMANCE)


def test_the_seed_rule_adds_0x5eed0a0c_modulo_2_to_the_63():
    assert posterior_seed(0) == 1_592_592_908
    assert posterior_seed(2**63 - 1) == 1_592_592_907
    assert posterior_seed(-1_592_592_908) == 0


def test_on_the_cpu_the_encoder_is_the_library_encode_mean_or_seeded_sample(tiny):
    wav = torch.from_numpy(np.load(CONFORMANCE / "wav_4800.npy"))
    encoder = AuKVAEEncoder(tiny, cuda_graphs=True)  # graphs are CUDA-only: eager here
    assert not encoder.cuda_graphs
    mean = encoder.encode(wav)
    assert encoder.last_mode == "eager"
    np.testing.assert_allclose(mean.numpy(), np.load(CONFORMANCE / "encode_4800.npy"), atol=1e-5, rtol=0)
    sample = encoder.encode(wav, seed=3)
    expected = tiny.encode(wav, generator=torch.Generator().manual_seed(3 + 0x5EED0A0C))
    assert torch.equal(sample, expected) and not torch.equal(sample, mean)
