"""The q/k norm and RoPE kernel (auk_triton/diffusion/norm_rope_kernel.py) against the eager ops.

The eager reference is what the blocks run without the kernel: `rotate(q_norm(q), cos, sin)`
per stream, and in the double blocks the two streams' q, k and v joined along the sequence.

- Without CUDA but with `triton` importable: in Triton's CPU interpreter (a subprocess,
  since TRITON_INTERPRET=1 must be set before triton is imported), in fp32 at small shapes:
  a head count that is not a power of two, per-row rotary tables (a padded batch) and one
  table broadcast over the rows. The interpreter rounds fp32 to bf16 by truncation, so bf16
  is checked on the GPU only.
- With CUDA: bf16 at the released head sizes, where the kernel must round as eager does
  (all but a few values in 10^3 bit for bit, none off by more than one bf16 step of the
  largest), and the ops traced by torch.compile inside a CUDA graph.
"""

from __future__ import annotations

import sys

import pytest
import torch

from auk_triton.diffusion.transformer import (
    Attention,
    JointAttention,
    RotaryEmbedding,
    _heads,
    _norm_eps,
    _rope_for_heads,
    rotate,
)
from triton_interpreter import interpreter_results as interpreter_run
from triton_interpreter import run_checks

HAS_CUDA = torch.cuda.is_available()
FP32_TOLERANCE = 1e-5  # relative L2; the kernel's fp32 differs from eager's in summation order only


def _modules(dim: int, heads: int, dim_head: int, device, dtype, seed: int):
    torch.manual_seed(seed)
    joint, single = JointAttention(dim, heads, dim_head), Attention(dim, heads, dim_head)
    for module in (joint, single):
        for name, param in module.named_parameters():
            if "norm" in name:  # RMSNorm weights as a checkpoint holds them, not all ones
                param.data = 1 + 0.1 * torch.randn_like(param)
    return joint.to(device, dtype).eval(), single.to(device, dtype).eval()


def _case(rows: int, n_audio: int, n_text: int, heads: int, dim_head: int, device, dtype, seed: int = 0):
    """Modules, projections and rotary tables of one block: the audio rows padded differently."""
    joint, single = _modules(heads * dim_head, heads, dim_head, device, dtype, seed)
    g = torch.Generator().manual_seed(seed)
    width = 3 * heads * dim_head
    qkv_a = torch.randn(rows, n_audio, width, generator=g).to(device, dtype)
    qkv_c = torch.randn(rows, n_text, width, generator=g).to(device, dtype)
    audio_mask = torch.ones(rows, n_audio, dtype=torch.bool)
    audio_mask[-1, n_audio - 2:] = False  # the last row padded: its tables differ from the others'
    rotary = RotaryEmbedding(dim_head).to(device)
    rope_a = _rope_for_heads(rotary.tables(n_audio, audio_mask.to(device), device), 1)  # [rows, L, 1, Dh]
    rope_c = _rope_for_heads(rotary.tables(n_text, None, device), 1)  # [1, L, 1, Dh], broadcast
    return joint, single, qkv_a, qkv_c, rope_a, rope_c


def eager_joint(joint, qkv_a, qkv_c, rope_a, rope_c):
    qa, ka, va = _heads(qkv_a, joint.heads)
    qc, kc, vc = _heads(qkv_c, joint.heads)
    q = torch.cat([rotate(joint.q_norm(qa), *rope_a), rotate(joint.c_q_norm(qc), *rope_c)], dim=1)
    k = torch.cat([rotate(joint.k_norm(ka), *rope_a), rotate(joint.c_k_norm(kc), *rope_c)], dim=1)
    return q, k, torch.cat([va, vc], dim=1)


def kernel_joint(joint, qkv_a, qkv_c, rope_a, rope_c):
    from auk_triton.diffusion.norm_rope_kernel import joint_norm_rope_qkv

    return joint_norm_rope_qkv(qkv_a, qkv_c, joint.q_norm.weight, joint.k_norm.weight, joint.c_q_norm.weight,
                               joint.c_k_norm.weight, *rope_a, *rope_c, _norm_eps(joint.q_norm),
                               _norm_eps(joint.k_norm), joint.heads)


def eager_single(single, qkv, rope):
    q, k, _ = _heads(qkv, single.heads)
    return rotate(single.q_norm(q), *rope), rotate(single.k_norm(k), *rope)


def kernel_single(single, qkv, rope):
    from auk_triton.diffusion.norm_rope_kernel import norm_rope_qk

    return norm_rope_qk(qkv, single.q_norm.weight, single.k_norm.weight, *rope, _norm_eps(single.q_norm),
                        _norm_eps(single.k_norm), single.heads)


def keyed_matches(rows, n_audio, n_text, heads, dim_head, device, dtype) -> dict:
    """The joint kernel given key slots against the same kernel without: q where it was, k and v
    moved to their slots, bit for bit."""
    from auk_triton.diffusion.norm_rope_kernel import joint_norm_rope_qkv
    from auk_triton.diffusion.padded_attention import key_slots

    joint, _, qkv_a, qkv_c, rope_a, rope_c = _case(rows, n_audio, n_text, heads, dim_head, device, dtype)
    g = torch.Generator().manual_seed(1)
    slots = key_slots(torch.rand(rows, n_audio + n_text, generator=g) < 0.6).to(device)
    moved = lambda t: torch.empty_like(t).scatter_(1, slots.long()[:, :, None, None].expand_as(t), t)  # noqa: E731
    with torch.inference_mode():
        q, k, v = kernel_joint(joint, qkv_a, qkv_c, rope_a, rope_c)
        kq, kk, kv = joint_norm_rope_qkv(qkv_a, qkv_c, joint.q_norm.weight, joint.k_norm.weight,
                                         joint.c_q_norm.weight, joint.c_k_norm.weight, *rope_a, *rope_c,
                                         _norm_eps(joint.q_norm), _norm_eps(joint.k_norm), joint.heads, slots)
    return {"id": "keyed", "q": torch.equal(kq, q), "k": torch.equal(kk, moved(k)), "v": torch.equal(kv, moved(v))}


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def compare(rows, n_audio, n_text, heads, dim_head, device, dtype) -> dict:
    """Kernel against eager, joint and single, for one case: relative L2, largest difference,
    share of values not bit for bit equal, shapes, and whether v was copied exactly."""
    joint, single, qkv_a, qkv_c, rope_a, rope_c = _case(rows, n_audio, n_text, heads, dim_head, device, dtype)
    with torch.inference_mode():
        got, want = kernel_joint(joint, qkv_a, qkv_c, rope_a, rope_c), eager_joint(joint, qkv_a, qkv_c, rope_a, rope_c)
        got_single, want_single = kernel_single(single, qkv_a, rope_a), eager_single(single, qkv_a, rope_a)
    pairs = list(zip(got[:2], want[:2])) + list(zip(got_single, want_single))
    return {
        "id": f"{rows}x({n_audio}+{n_text}) {heads}x{dim_head} {str(dtype).split('.')[-1]}",
        "shapes_match": all(g.shape == w.shape and g.dtype == w.dtype for g, w in zip(got + got_single,
                                                                                     want + want_single)),
        "rel_l2": max(_rel_l2(g, w) for g, w in pairs),
        "max_abs": max(float((g.float() - w.float()).abs().max()) for g, w in pairs),
        "max_abs_over_largest": max(float((g.float() - w.float()).abs().max() / w.float().abs().max())
                                    for g, w in pairs),
        "share_differing": max(float((g != w).float().mean()) for g, w in pairs),
        "v_exact": bool(torch.equal(got[2], want[2])),
    }


INTERPRETER_CASES = ((2, 5, 3, 3, 8), (1, 4, 2, 2, 16))  # rows, audio tokens, text tokens, heads, head width


def _interpreter_main() -> int:
    return run_checks([lambda case=case: compare(*case, "cpu", torch.float32) for case in INTERPRETER_CASES]
                      + [lambda: keyed_matches(*INTERPRETER_CASES[0], "cpu", torch.float32)])


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreter_run(__file__, count=len(INTERPRETER_CASES) + 1, timeout_s=600)


def test_the_kernel_normalises_rotates_and_joins_as_the_eager_ops_do_in_fp32(interpreter_results):
    for result in interpreter_results[:len(INTERPRETER_CASES)]:
        assert "error" not in result, result
        assert result["shapes_match"] and result["v_exact"], result
        assert result["rel_l2"] <= FP32_TOLERANCE, result


def test_given_key_slots_the_kernel_writes_k_and_v_at_them_and_q_where_it_was(interpreter_results):
    result = interpreter_results[-1]
    assert "error" not in result, result
    assert result["q"] and result["k"] and result["v"], result


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_given_key_slots_the_kernel_writes_k_and_v_at_them_on_a_gpu():
    result = keyed_matches(4, 512, 64, 24, 64, "cuda", torch.bfloat16)
    assert result["q"] and result["k"] and result["v"], result


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 4])
def test_the_kernel_rounds_bf16_as_the_eager_ops_do_on_a_gpu(rows):
    result = compare(rows, 512, 64, 24, 64, "cuda", torch.bfloat16)  # the released heads, a 10 s bucket
    assert result["shapes_match"] and result["v_exact"], result
    assert result["share_differing"] < 1e-3 and result["rel_l2"] < 1e-4, result
    # Where eager's RMSNorm rounds a value the other way, RoPE's sum of two products carries
    # that one bf16 step on, relative to the larger term rather than to a small result.
    assert result["max_abs_over_largest"] <= 2 ** -7, result


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_the_kernel_is_traced_by_torch_compile_and_captured_in_a_cuda_graph():
    joint, _, qkv_a, qkv_c, rope_a, rope_c = _case(2, 64, 16, 24, 64, "cuda", torch.bfloat16)
    compiled = torch.compile(kernel_joint, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        expected = kernel_joint(joint, qkv_a, qkv_c, rope_a, rope_c)
        compiled(joint, qkv_a, qkv_c, rope_a, rope_c)  # compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(joint, qkv_a, qkv_c, rope_a, rope_c)
        graph.replay()
        torch.cuda.synchronize()
    for got, want in zip(out, expected):
        assert torch.equal(got, want)


if __name__ == "__main__" and "--interpreter" in sys.argv:
    sys.exit(_interpreter_main())
