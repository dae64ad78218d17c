"""The DiT sampler on CUDA: bf16 under autocast, CUDA-graph steps (skipped without a GPU)."""

import json

import pytest
import torch

from auk_triton.diffusion.sampler import Request, load_sampler
from auk_triton.diffusion.synthetic import write_synthetic_dit_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("dit_gpu")
    (path / "config.json").write_text(json.dumps({"vae": {"latent_dim": 64, "downsample_rate": 480, "target_sample_rate": 24000}}))
    return write_synthetic_dit_checkpoint(path, "small", seed=0)


def _request(seed, seconds=0.6, tokens=7, ref=False, **knobs):
    g = torch.Generator().manual_seed(100 + tokens)
    text = torch.randn(tokens, 2048, generator=g)
    ref_latents = torch.randn(9, 64, generator=g) if ref else None
    return Request(text, seconds, seed, num_steps=6, ref_latents=ref_latents, **knobs)


def test_graphed_steps_follow_the_eager_ones_and_do_not_depend_on_the_cache(checkpoint):
    eager = load_sampler(checkpoint, "cuda")
    graphed = load_sampler(checkpoint, "cuda", max_graphs=2)
    assert eager.dtype == torch.bfloat16 and graphed.graphs is not None
    for kwargs in (dict(), dict(ref=True), dict(guidance=0.0)):
        first = graphed.generate(_request(1, **kwargs))  # captures
        again = graphed.generate(_request(1, **kwargs))  # replays from the cache
        assert torch.equal(first, again)
        reference = eager.generate(_request(1, **kwargs))
        cos = torch.nn.functional.cosine_similarity(first.flatten(), reference.flatten(), dim=0)
        assert cos > 0.999, kwargs
        # Another text of the same shape reuses the graph with its own embeddings.
        other = graphed.generate(Request(torch.randn(7, 2048), 0.6, 1, num_steps=6,
                                         ref_latents=_request(1, **kwargs).ref_latents,
                                         guidance=kwargs.get("guidance")))
        assert not torch.equal(other, first)
    assert graphed.graphs.captures == 3  # three shapes; the other requests replayed a cached graph


def test_bf16_follows_fp32(checkpoint):
    fp32 = load_sampler(checkpoint, "cuda", dtype=torch.float32).generate(_request(2))
    bf16 = load_sampler(checkpoint, "cuda").generate(_request(2))
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    cos = torch.nn.functional.cosine_similarity(fp32.flatten(), bf16.flatten(), dim=0)
    assert cos > 0.99


def test_a_batched_request_follows_its_alone_result_in_bf16(checkpoint):
    # Padded rows (prompts, targets, a reference of different lengths), graphed as served.
    sampler = load_sampler(checkpoint, "cuda", max_graphs=4)
    requests = [_request(3, 0.6, 7), _request(4, 0.3, 4), _request(5, 0.5, 9, ref=True)]
    for knobs in (dict(guidance=0.0), dict(guidance=2.0)):
        rows = sampler.generate_batch([sampler.plan(Request(**{**r.__dict__, **knobs})) for r in requests])
        for request, row in zip(requests, rows):
            alone = sampler.generate(Request(**{**request.__dict__, **knobs}))
            cos = torch.nn.functional.cosine_similarity(row.flatten(), alone.flatten(), dim=0)
            rel = float((row - alone).abs().max() / alone.abs().max())
            print(f"bf16 batched vs alone {knobs}: max error {rel:.2e} of the largest value, cosine {float(cos):.6f}")
            assert cos > 0.999 and rel < 0.05, (knobs, rel, float(cos))


def test_batches_of_every_size_up_to_sixteen_stay_in_the_graph_cache(checkpoint):
    sampler = load_sampler(checkpoint, "cuda", max_graphs=16)
    alone = sampler.generate(_request(50, guidance=0.0))
    for _ in range(2):
        for rows in range(1, 17):
            results = sampler.generate_batch([sampler.plan(_request(50 + i, guidance=0.0)) for i in range(rows)])
            assert len(results) == rows
            cos = torch.nn.functional.cosine_similarity(results[0].flatten(), alone.flatten(), dim=0)
            assert cos > 0.999, rows
    assert sampler.graphs.captures == 16  # one per batch size; the second pass replayed them all
