"""The feed-forward's product and SwiGLU gate through quack's Hopper GEMM, the gate in its epilogue.

quack (the quack-kernels package, GEMMs in NVIDIA's CuTe DSL, which FlashAttention 4 brings)
takes an epilogue written as a Python function over each accumulator pair. Given the weight's
[gate; up] halves as one concatenated operand, it pairs gate column j with up column j, so a
tile's epilogue holds both products and stores only the gated value: swiglu_kernel.py's fusion,
on a GEMM whose main loop runs at cuBLAS's rate (benchmarks/studies/dit-step-kernels.md).

Numerics are swiglu_kernel.py's, which are the eager feed-forward's under bf16 autocast: each
product accumulated in fp32 and rounded to bf16, SiLU in fp32 as `x / (1 + exp(-x))` and
rounded, the gate's product rounded at the store. bf16 only.

Kernels are compiled on their first call of a tile configuration (one per process for each of
the two below), at warm-up; `use_compile_cache` keeps them on disk. Importing this module
without the package raises ImportError; swiglu_kernel.py decides where it serves.
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import unpack
from quack.gemm_config import GemmConfig

ARCHITECTURES = (9,)  # compute capability majors the tile configurations below were chosen for


def _tile_config(tile_m: int, tile_n: int, cluster_m: int, cluster_n: int) -> GemmConfig:
    """A Hopper ping-pong configuration (two consumer warp groups taking turns at the epilogue)."""
    return GemmConfig(tile_m=tile_m, tile_n=tile_n, pingpong=True, cluster_m=cluster_m, cluster_n=cluster_n,
                      swap_ab=False, device_capacity=9, is_dynamic_persistent=False, use_tma_gather=False)


# Chosen by measurement on an H100 at the released width (1,536 -> 2 x 3,072): 128 x 192
# accumulator tiles (96 gated columns) in clusters of two along N at a batch's 9,024 tokens;
# 128 x 128 tiles at a text stream's 1,024, where fewer tiles would leave SMs idle.
LARGE_TILES = _tile_config(128, 192, cluster_m=1, cluster_n=2)
SMALL_TILES = _tile_config(128, 128, cluster_m=2, cluster_n=1)
LARGE_TILES_PAST = 2048  # tokens past this many take LARGE_TILES, fewer SMALL_TILES


def _bf16(x):
    """An fp32 value rounded to bf16 (to nearest even) and widened back."""
    return x.to(BFloat16).to(Float32)


@gemm_epilogue(outputs=("gated",), mode="acc_pair")
def _swiglu_as_eager(acc):
    gate, up = unpack(acc)  # gate column j and up column j of the weight's [gate; up]
    gate = _bf16(gate)
    up = _bf16(up)
    silu = _bf16(gate / (1.0 + cute.math.exp(-gate, fastmath=True)))
    return {"gated": silu * up}


def fits(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this GEMM computes these rows' product and gate: bf16 rows [M, K] and weight [2F, K],
    each with unit last stride, F a multiple of the tiles' gated columns."""
    width = weight.shape[0] // 2
    return (rows.dtype == weight.dtype == torch.bfloat16 and rows.stride(-1) == 1 and weight.stride(-1) == 1
            and width % (LARGE_TILES.tile_n // 2) == 0 and width % (SMALL_TILES.tile_n // 2) == 0)


def product_and_gate(rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """rows [M, K], linear_in's weight [2F, K] (gate rows first) -> out [M, F] = SiLU(gate) * up."""
    tiles = LARGE_TILES if rows.shape[0] > LARGE_TILES_PAST else SMALL_TILES
    # weight.T is quack's B [K, 2F]; concat_layout says its N is [gate; up], paired in the epilogue.
    _swiglu_as_eager(rows, weight.T, None, out={"gated": out}, store_d=False, config=tiles, tuned=False,
                     concat_layout=("B",))
