"""The encoder replayed as CUDA graphs: eager's latents, one graph per length, the oldest dropped.
Skipped without CUDA."""

import pytest
import torch

from auk_triton.codec import AuKVAE, AuKVAEEncoder
from auk_triton.codec.synthetic import write_synthetic_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    checkpoint = write_synthetic_checkpoint(tmp_path_factory.mktemp("small"), "small")
    return AuKVAE.from_pretrained(checkpoint, device="cuda")


def audio(samples: int, seed: int) -> torch.Tensor:
    return (0.3 * torch.randn(1, samples, generator=torch.Generator().manual_seed(seed))).cuda()


def test_a_graph_replays_eager_and_is_reused_for_its_length(vae):
    eager, graphed = AuKVAEEncoder(vae), AuKVAEEncoder(vae, cuda_graphs=True, max_graphs=2)
    for seed in (0, 1):  # the second call of a length replays the graph captured by the first
        wav = audio(480 * 250, seed)
        assert torch.equal(graphed.encode(wav), eager.encode(wav))
        assert graphed.last_mode == "graph"
        assert torch.equal(graphed.encode(wav, seed=5), eager.encode(wav, seed=5))
    assert list(graphed._graphs) == [480 * 250]


def test_the_least_recently_used_length_is_dropped_past_max_graphs(vae):
    graphed = AuKVAEEncoder(vae, cuda_graphs=True, max_graphs=2)
    for frames in (10, 20, 10, 30):
        graphed.encode(audio(480 * frames, frames))
    assert list(graphed._graphs) == [480 * 10, 480 * 30]
