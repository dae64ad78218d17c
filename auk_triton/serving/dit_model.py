"""Triton Python-backend model `auk_dit`: text condition in, normalized AuK latents out.

One response per request (not decoupled). Inputs, all without a batch axis:

- PROMPT_EMBEDS FP32 [tokens, 2048]: the fused text condition of AuK's encoder stage
  (the encoder itself is not served here);
- GEN_SECONDS FP32 [1]: target duration (> 0);
- SEED INT64 [1]: the same seed gives the same latents on the same device;
- optional NUM_STEPS INT32 [1], GUIDANCE FP32 [1], SWAY FP32 [1] (checkpoint
  defaults otherwise; a flash checkpoint ignores them), and REF_LATENTS FP32
  [frames, 64]: a source clip's normalized latents, for editing.

Output LATENTS FP32 [ceil(50 * GEN_SECONDS), 64]. A request that breaks a limit
(duration, steps, MAX_LATENT_FRAMES, shapes, non-finite values) gets an error
response of its own (INVALID_ARG); the model keeps serving. A request whose client
is gone stops before sampling or at the next Euler step (CANCELLED).
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils

from auk_triton.diffusion import SamplingStopped, load_sampler

from .checkpoints import resolve_checkpoint
from .config import DiTSettings
from .requests import RequestCancelled, dit_plan
from .triton_io import check_tensor_widths, failure_response, input_array, instance_device, log, output_tensor

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.settings = settings = DiTSettings.from_model_config(self.model_config, Path(args["model_repository"]))
        self.device = instance_device(args["model_instance_kind"], args["model_instance_device_id"])
        checkpoint = resolve_checkpoint(
            settings.checkpoint, settings.cache_dir, lambda text: log("warn", text), with_dit=True
        )
        began = time.perf_counter()
        # A missing auk.safetensors (or config.json) fails the load with the file's name.
        self.sampler = load_sampler(
            checkpoint, self.device, DTYPES[settings.dtype], max_frames=settings.max_frames,
            max_graphs=settings.max_graphs if settings.enable_cuda_graphs else 0,
        )
        check_tensor_widths(self.model_config, {
            "PROMPT_EMBEDS": ("text width (dit.text_hidden_dim)", self.sampler.text_dim),
            "REF_LATENTS": ("latent_dim", self.sampler.latent_dim),
            "LATENTS": ("latent_dim", self.sampler.latent_dim),
        })
        log("info", f"{self.name}: loaded {checkpoint} ({self.sampler.variant}, {self.sampler.dtype}, "
                     f"CUDA graphs {'on' if self.sampler.graphs else 'off'}) on {self.device} "
                     f"in {time.perf_counter() - began:.1f} s")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                plan = dit_plan(
                    self.sampler, partial(input_array, request), self.settings.max_steps, self.settings.max_prompt_tokens
                )
                # Asked before sampling and between steps: one round trip each, next to
                # steps that take milliseconds.
                latents = self.sampler.generate(plan, should_stop=request.is_cancelled).to("cpu", torch.float32)
                responses.append(pb_utils.InferenceResponse(output_tensors=[output_tensor("LATENTS", latents)]))
            except SamplingStopped as stopped:
                cancelled = RequestCancelled(f"request cancelled {stopped}")
                responses.append(failure_response(self.name, "generation", cancelled))
            except Exception as err:
                responses.append(failure_response(self.name, "generation", err))
        return responses

    def finalize(self):
        self.sampler = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
