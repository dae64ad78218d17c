"""The AuK diffusion model: the flow-matching transformer (DiT) and its sampler."""

from .sampler import AuKDiTSampler, Plan, Request, SamplingStopped, load_sampler, run_key, sampler_runs
from .transformer import AuKTransformer, CheckpointError

__all__ = ["AuKDiTSampler", "AuKTransformer", "CheckpointError", "Plan", "Request", "SamplingStopped", "load_sampler",
           "run_key", "sampler_runs"]
