"""The DiT's blocks through `torch.compile`: Inductor fuses what the eager step runs as separate kernels.

The eager step at the released dims is some 2,000 kernels, most of them
elementwise (the norms, RoPE in fp32, the modulation, the gates and residuals),
and compiling it whole took 63 s per shape. The blocks are compiled instead,
one function per block kind: every double block runs through one compiled
graph and every single block through another (their weights are inputs, not
constants), so a shape costs two block compilations, not thirty. The joins between
the stacks stay eager: a few kernels. On the block kernels' path (`block_kernels`) the
double blocks are not compiled: on a GPU their work is the block kernels, cuBLAS and
cuDNN already, and run as they are their text stream's kernels go on a second CUDA
stream beside the audio stream's (two_streams.py), which Inductor's code cannot do.

`dynamic=True` (the default) compiles shapes symbolically: one compilation
serves every bucket and row count (Dynamo still specialises a single row), so
the bucket set does not multiply compile time. `dynamic=False` compiles per
shape, for comparison. Either way the compiled step is captured as a CUDA
graph; Inductor's caches (the start-up artifacts, serving/artifacts.py) keep
the generated code across restarts. With `traces_dir`, Dynamo's traces are kept
there too (precompiled.py), so a warm start traces nothing; without it, a warm
start pays Dynamo's tracing.

Fused kernels keep their intermediates in fp32, where the eager step rounds each
op's output to bf16; left so, the two bf16 answers drift apart over the blocks.
Inductor is told to round where eager rounds (`emulate_precision_casts`), which
keeps the compiled velocity within bf16's rounding of the eager one at no
measurable cost (benchmarks/studies/dit-step-kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .precompiled import PrecompiledFunction
from .transformer import (
    BlockRunners,
    run_audio_embedding,
    run_audio_embedding_kernels,
    run_double_block,
    run_double_block_kernels,
    run_output,
    run_single_block,
    run_single_block_kernels,
)

# Dynamo compiles a function again for each new guard set (rows of one, shapes, dtypes);
# past its recompile limit it runs the function eagerly from then on, silently.
RECOMPILE_LIMIT = 64
# Round each fused op's result to bf16 where the eager step does (module docstring).
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


@dataclass(frozen=True)
class CompileOptions:
    dynamic: bool = True  # one compilation for every shape; False: one per shape
    backend: str = "inductor"  # "eager" or "aot_eager" check the tracing without generating code
    # Where the blocks' traces are saved and loaded (precompiled.py), keyed by the caller; None:
    # traced on every start. Dynamic shapes only (per-shape traces would be one file a shape),
    # and not with the "eager" backend, whose traces cannot be saved.
    traces_dir: Path | None = None
    # On a GPU, the attention's q/k norms and RoPE (and the double blocks' join) run as one
    # Triton kernel per block (norm_rope_kernel.py), for heads of a power-of-two width, and each
    # block's LayerNorms with their modulation and its gated residual as the AdaLN kernels
    # (adaln_kernel.py), its feed-forward's product and gate as one (swiglu_kernel.py, on quack's
    # GEMM where that serves: swiglu_gemm.py), and the audio embedding's convolutions as the
    # position conv kernels (position_conv_kernel.py), instead of Inductor's fused ops and cuDNN.
    # A CPU runs them as the eager step does.
    block_kernels: bool = True
    # The parts around the blocks (the audio embedding with its grouped convolutions, the output
    # norm and projection, with the target's tokens gathered) compiled too, rather than run as eager ops.
    compile_edges: bool = True


def compiled_blocks(options: CompileOptions) -> BlockRunners:
    """Block runners whose calls go through torch.compile (compiled on their first call)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if options.dynamic:
        # Duck sizing gives sizes that happen to be equal one symbol, and a guard that they
        # stay equal: a bucket of 64 text tokens tied to the head width (then specialised
        # to it), a modulation view's offset to a width. Each became a recompilation.
        torch.fx.experimental._config.use_duck_shape = False
    # fullgraph: a graph break is an error at warm-up (the bucket falls back to a plain
    # graph, logged), rather than a silently slower step.
    compile_kw = dict(dynamic=options.dynamic, backend=options.backend, fullgraph=True)
    if options.backend == "inductor":
        compile_kw["options"] = dict(INDUCTOR_OPTIONS)
    double, single, embedding, kernels = run_double_block, run_single_block, run_audio_embedding, False
    if options.block_kernels:
        try:
            # Imported here: their ops are registered before a saved trace that calls them is loaded.
            from . import adaln_kernel, norm_rope_kernel, position_conv_kernel, swiglu_kernel  # noqa: F401
            from .padded_attention import cudnn_sdpa_registered, flash4_registered

            cudnn_sdpa_registered()  # the same for the attention ops, where their packages are there
            flash4_registered()
            swiglu_kernel.quack_gemm_registered()  # its check, before any capture
            double, single, kernels = run_double_block_kernels, run_single_block_kernels, True
            embedding = run_audio_embedding_kernels
        except ImportError:  # no triton (CPU torch wheels): the eager ops
            pass
    functions = dict(single=single)
    if not kernels:
        functions["double"] = double
    if options.compile_edges:
        functions.update(audio_embedding=embedding, output=run_output)
    if options.traces_dir is not None and options.dynamic and options.backend != "eager":
        folder = Path(options.traces_dir)
        runners = {name: PrecompiledFunction(fn, folder, compile_kw) for name, fn in functions.items()}
    else:
        runners = {name: torch.compile(fn, **compile_kw) for name, fn in functions.items()}
    return BlockRunners(**{"double": double, **runners}, kernels=kernels)


def traces_note(blocks: BlockRunners) -> str | None:
    """What the saved traces of `compiled_blocks` gave this start, for the log (None: not saved)."""
    runners = [runner for runner in vars(blocks).values() if isinstance(runner, PrecompiledFunction)]
    return "; ".join(runner.note() for runner in runners) or None
