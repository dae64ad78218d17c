"""Masked attention with each row's valid keys first (auk_triton/diffusion/padded_attention.py).

On a CPU: the key slots and the layout a context carries, and the attention over keys moved to
their slots (the bias made from the counts) against the masked attention over keys where they
were. On a GPU: each kernel with a key count per row (FlashAttention 4's, cuDNN's) against torch's
SDPA with the key bias, eager, compiled and replayed from a CUDA graph whose counts change after
capture.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from auk_triton.diffusion import padded_attention
from auk_triton.diffusion.padded_attention import attend_valid_keys, key_layout, key_slots
from auk_triton.diffusion.synthetic import PRESETS
from auk_triton.diffusion.transformer import AuKTransformer, key_bias

HAS_CUDA = torch.cuda.is_available()


def test_key_slots_put_each_rows_valid_keys_first_in_their_order_then_its_padded_keys():
    valid = torch.tensor([[True, True, False, True, False],
                          [False, True, True, True, True],
                          [True] * 5])
    assert key_slots(valid).tolist() == [[0, 1, 3, 2, 4], [4, 0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert key_slots(valid).dtype == torch.int32
    slots, counts, queries = key_layout(valid)
    assert counts.tolist() == [3, 4, 5] and queries.tolist() == [5, 5, 5]
    assert counts.dtype == queries.dtype == torch.int32
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        valid = torch.rand(4, 37, generator=g) < 0.7
        slots = key_slots(valid).long()
        assert all(sorted(row.tolist()) == list(range(37)) for row in slots)  # a permutation per row
        for row, row_valid in zip(slots, valid):
            assert row[row_valid].tolist() == list(range(int(row_valid.sum())))


def _moved(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """t [B, K, H, Dh] with key i of row b at slots[b, i]."""
    out = torch.empty_like(t)
    index = slots.long()[:, :, None, None].expand_as(t)
    return out.scatter_(1, index, t)


def _case(rows, keys, heads, dim_head, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, keys, heads, dim_head, generator=g).to(device, dtype) for _ in range(3))
    valid = torch.rand(rows, keys, generator=g) < 0.8
    valid[:, 0] = True
    valid[0] = True  # one row unpadded
    return q, k, v, valid.to(device)


def _masked(q, k, v, valid):
    """The masked attention as the eager step runs it: keys in place, an additive bias."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=key_bias(valid, q.dtype))
    return out.transpose(1, 2).flatten(2)


def test_attention_over_keys_moved_to_their_slots_is_the_masked_attention_over_keys_in_place():
    q, k, v, valid = _case(3, 23, 2, 8, "cpu", torch.float32)
    slots, counts, queries = key_layout(valid)
    got = attend_valid_keys(q, _moved(k, slots), _moved(v, slots), counts, queries)
    want = _masked(q, k, v, valid)
    assert got.shape == want.shape == (3, 23, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_padded_context_carries_the_joint_key_layout_and_the_single_stream_laid_valid_first():
    torch.manual_seed(0)
    model = AuKTransformer(latent_dim=64, **PRESETS["small"]).eval()
    text, ref = torch.randn(1, 4, 2048), torch.randn(1, 3, 64)
    mask = torch.tensor([[True] * 5 + [False] * 2])
    c_mask = torch.tensor([[True] * 3 + [False]])
    with torch.no_grad():
        ctx = model.prepare(text, 7, ref=ref, mask=mask, c_mask=c_mask, cfg_infer=True)
        unpadded = model.prepare(text, 7)
    assert unpadded.joint_keys is None and unpadded.single_valid_first is None
    slots, counts, queries = ctx.joint_keys
    # [audio | text] = [ref 3, target 5 + 2 padded | text 3 + 1 padded]: valid keys first.
    assert slots.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 11, 12, 8, 9, 10, 13]] * 2  # CFG: both rows alike
    assert counts.tolist() == [11, 11] and queries.tolist() == [14, 14]
    # The single stream [text 3 + 1 | ref 3 | target 5 + 2], its valid tokens first.
    first = ctx.single_valid_first
    assert first.order[1].tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 3, 12, 13]
    assert first.target[0].tolist() == [6, 7, 8, 9, 10, 12, 13]  # where the target's 7 tokens went
    assert first.mask[0].tolist() == [True] * 11 + [False] * 3 and first.counts.tolist() == [11, 11]
    # Valid tokens at their squeezed rotary positions: place p is position p.
    cos, sin = ctx.rope_single
    placed = cos[0, first.order[0], 0]
    assert torch.equal(placed[:11], first.cos[0, :11, 0]) and first.cos.shape == (1, 14, 1, cos.shape[-1])
    half = ctx.head(1)  # a graph of fewer rows reads the front of the buffers
    assert all(t.shape[0] == 1 for t in (*half.joint_keys, *half.single_valid_first))
    assert type(half.single_valid_first) is type(first)


def test_without_the_packages_or_off_a_gpu_the_key_bias_serves_the_attention_and_the_log_says_so(
        monkeypatch):
    assert not padded_attention.available(torch.device("cpu"))
    assert padded_attention.attention_kernel(torch.device("cpu")) == "key_bias"
    assert "for GPUs" in padded_attention.masked_attention(torch.device("cpu"))
    monkeypatch.setattr(padded_attention, "_registered", False)  # a GPU without the packages
    monkeypatch.setattr(padded_attention, "_flash4", False)
    assert not padded_attention.available(torch.device("cuda"))
    assert "requirements-gpu.txt" in padded_attention.masked_attention(torch.device("cuda"))


def _failing_check():
    raise RuntimeError("no kernel image is available for execution on the device")


@pytest.mark.parametrize("capability, check, reason", [
    ((8, 0), lambda: True, "not built for this GPU"),
    ((9, 0), lambda: False, "its check against the masked attention failed"),
    ((9, 0), _failing_check, "RuntimeError: no kernel image"),
])
def test_flashattention_4_refused_on_a_gpu_leaves_cudnns_padding_mask_and_the_log_says_why(
        monkeypatch, capability, check, reason):
    stand_in = types.ModuleType("auk_triton.diffusion.flash4_attention")  # its package installed
    stand_in.ARCHITECTURES = (9, 10)
    monkeypatch.setitem(sys.modules, stand_in.__name__, stand_in)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)
    monkeypatch.setattr(padded_attention, "_flash4_matches_the_masked_attention", check)
    monkeypatch.setattr(padded_attention, "_flash4", None)
    monkeypatch.setattr(padded_attention, "_flash4_refused", "")
    monkeypatch.setattr(padded_attention, "_registered", True)  # cuDNN's op there
    assert not padded_attention.flash4_registered()
    assert padded_attention.attention_kernel(torch.device("cuda")) == "cudnn"
    log = padded_attention.masked_attention(torch.device("cuda"))
    assert log.startswith("cuDNN's padding mask") and reason in log
    monkeypatch.setattr(padded_attention, "_registered", False)
    assert padded_attention.attention_kernel(torch.device("cuda")) == "key_bias"
    assert reason in padded_attention.masked_attention(torch.device("cuda"))


KERNELS = {  # each kernel with a key count per row, and whether it can run here
    "flash4": HAS_CUDA and padded_attention.flash4_registered(),
    "cudnn": HAS_CUDA and padded_attention.cudnn_sdpa_registered(),
}


@pytest.fixture(params=list(KERNELS))
def kernel(request, monkeypatch):
    """Each kernel in turn, the other switched off, skipped where its package or a GPU is missing."""
    if not KERNELS[request.param]:
        pytest.skip(f"needs a CUDA GPU and the {request.param} kernel's package")
    if request.param == "cudnn":
        monkeypatch.setattr(padded_attention, "_flash4", False)
    assert padded_attention.attention_kernel(torch.device("cuda")) == request.param
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_each_kernels_key_counts_give_the_masked_attention_on_a_gpu(kernel, rows):
    q, k, v, valid = _case(rows, 564, 24, 64, "cuda", torch.bfloat16)  # the released heads, a 10 s bucket
    slots, counts, queries = key_layout(valid)
    with torch.inference_mode():
        got = attend_valid_keys(q, _moved(k, slots), _moved(v, slots), counts, queries)
        want = _masked(q, k, v, valid)
        exact = _masked(q.float(), k.float(), v.float(), valid)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # Within bf16's rounding of the fp32 attention, as torch's masked kernel is.
    assert (got.float() - exact).abs().max() <= 2 * (want.float() - exact).abs().max() + 2 ** -9


@pytest.mark.gpu
def test_each_kernel_is_compiled_and_replayed_with_the_counts_a_run_copies_in(kernel):
    q, k, v, valid = _case(4, 96, 24, 64, "cuda", torch.bfloat16)
    slots, counts, queries = key_layout(valid)
    k, v = _moved(k, slots), _moved(v, slots)
    compiled = torch.compile(attend_valid_keys, fullgraph=True, dynamic=True)
    held = counts.clone()
    with torch.inference_mode():
        compiled(q, k, v, held, queries)  # compiles, and builds the kernel or plan outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(q, k, v, held, queries)
        for fewer in (counts, counts - 7):
            held.copy_(fewer)
            graph.replay()
            torch.testing.assert_close(out, attend_valid_keys(q, k, v, fewer, queries), rtol=0, atol=2 ** -8)
