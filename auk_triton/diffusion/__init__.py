"""The AuK diffusion model: the flow-matching transformer (DiT) and its sampler."""

from .buckets import RunShape, ShapeBuckets
from .compiled import CompileOptions
from .sampler import (AuKDiTSampler, NonFiniteLatents, Plan, Request, SamplingStopped, load_sampler, run_key,
                      sampler_runs)
from .transformer import AuKTransformer, CheckpointError

__all__ = ["AuKDiTSampler", "AuKTransformer", "CheckpointError", "CompileOptions", "NonFiniteLatents", "Plan",
           "Request", "RunShape", "SamplingStopped", "ShapeBuckets", "load_sampler", "run_key", "sampler_runs"]
