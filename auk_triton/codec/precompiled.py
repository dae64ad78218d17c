"""The compiled decode kept across restarts: traced once, saved, and loaded by later starts.

`torch.compile` traces the decode with Dynamo on every start; only Inductor's generated
code is cached, so the trace was most of a warm start's time. torch's ahead-of-time
compile (`aot_compile`) traces it once, with the time axis symbolic, into a function
that can be saved; a later start loads it and traces nothing. The file holds the
traced program and its guards, not the weights: the loaded function reads the live
module's parameters on every call. Its kernels are Inductor's and Triton's, from the
compile caches beside it (serving/artifacts.py).

Before use, the function's guards are checked against every bucket's input. A file
that cannot be loaded (another torch, a broken file) or that refuses a bucket is
traced anew and saved over, and the reason is returned for the log. What the guards
do not check (the decoder's options, module globals, the code) is for the file's name
to carry: the caller keys it by them.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Callable, Mapping

import torch


def precompiled_decode(vae: torch.nn.Module, path: Path,
                       examples: Mapping[int, torch.Tensor]) -> tuple[Callable, str]:
    """The decode as a function of latents, loaded from `path` or else traced and saved there,
    and how it came (for the log). `examples`: an input of each bucket, by frames, the first
    one traced; call under no_grad, as the decode is served. Raises where it cannot trace
    (the caller compiles as before)."""
    why = f"none at {path}"
    if path.exists():
        try:
            with open(path, "rb") as file:
                loaded = torch.compiler.load_compiled_function(file)
            refused = [frames for frames, x in examples.items() if not loaded.guard_check(vae, x)]
            if not refused:
                return partial(loaded, vae), f"loaded {path}: nothing traced"
            why = f"{path} refuses buckets of {refused} frames"
        except Exception as err:  # another torch or Python, a broken or foreign file
            why = f"{path} cannot be loaded ({type(err).__name__}: {err})"
    traced = trace_decode(vae, next(iter(examples.values())))
    refused = [frames for frames, x in examples.items() if not traced.guard_check(vae, x)]
    if refused:
        raise RuntimeError(f"the decode traced on {next(iter(examples))} frames does not serve {refused} frames")
    try:
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        path.parent.mkdir(parents=True, exist_ok=True)
        traced.save_compiled_function(str(scratch))
        os.replace(scratch, path)  # whole or not at all, for replicas sharing the folder
        saved = f"saved to {path}"
    except OSError as err:  # a read-only folder: this start still serves
        saved = f"not saved ({err})"
    return partial(traced, vae), f"traced and {saved} ({why})"


def trace_decode(vae: torch.nn.Module, example: torch.Tensor):
    """`vae.forward` traced ahead of time on `example` [rows, frames, latent_dim], frames symbolic."""
    example = example.clone()
    torch._dynamo.mark_dynamic(example, 1)
    # Off by default in torch 2.11; set for this trace alone, not for the process (the pipeline's
    # DiT compiles in the same one).
    with torch._dynamo.config.patch(enable_aot_compile=True):
        return torch.compile(vae.forward, dynamic=None, fullgraph=True).aot_compile(((example,), {}))
