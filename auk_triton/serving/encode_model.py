"""Triton Python-backend model `auk_vae_encode`: mono audio in, normalized AuK latents out.

One response per request (not decoupled), no batch axis. Inputs:

- AUDIO FP32 [samples]: mono, at the codec's rate (24 kHz), in [-1, 1]; cut to whole
  480-sample frames before encoding, as the reference pipeline does;
- optional SEED INT64 [1]: sample the posterior with a generator seeded
  (SEED + 0x5EED0A0C) mod 2^63 (the AuK DiT spec, editing); without it, the posterior mean.

Output LATENTS FP32 [samples // 480, 64], ready for auk_dit's REF_LATENTS or the
decoder. A request shorter than one frame, longer than `max_frames` frames, or with
NaN or infinite samples gets an error of its own (INVALID_ARG); Triton refuses a
wrong type or rank itself. The model keeps serving.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils

from auk_triton.codec import AuKVAE, AuKVAEEncoder

from .checkpoints import resolve_checkpoint
from .config import EncodeSettings
from .requests import optional_seed, validate_audio
from .triton_common import failure_response, log
from .triton_io import check_tensor_widths, input_array, instance_device, output_tensor


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.settings = settings = EncodeSettings.from_model_config(self.model_config, Path(args["model_repository"]))
        self.device = instance_device(args["model_instance_kind"], args["model_instance_device_id"])
        checkpoint = resolve_checkpoint(settings.checkpoint, settings.cache_dir, lambda text: log("warn", text))
        began = time.perf_counter()
        try:
            vae = AuKVAE.from_pretrained(checkpoint, device=self.device)
        except (OSError, ValueError) as err:
            where = "" if str(checkpoint) in str(err) else f" {checkpoint}"
            raise RuntimeError(f"cannot load the AuK checkpoint{where}: {err}") from err
        check_tensor_widths(self.model_config, {"LATENTS": ("latent_dim", vae.latent_dim)})
        self.encoder = AuKVAEEncoder(vae, cuda_graphs=settings.enable_cuda_graphs, max_graphs=settings.max_graphs)
        log("info", f"{self.name}: loaded {checkpoint} on {self.device} in {time.perf_counter() - began:.1f} s "
                     f"(encoder {'as CUDA graphs, one per length' if self.encoder.cuda_graphs else 'eager'})")

    def execute(self, requests):
        vae = self.encoder.vae
        responses = []
        for request in requests:
            try:
                audio = validate_audio(input_array(request, "AUDIO"), vae.hop_size, self.settings.max_frames,
                                       vae.sample_rate)
                seed = optional_seed(input_array(request, "SEED"))
                wav = torch.from_numpy(audio).to(self.device)[None]
                latents = self.encoder.encode(wav, seed)[0].to("cpu")
                responses.append(pb_utils.InferenceResponse(output_tensors=[output_tensor("LATENTS", latents)]))
            except Exception as err:
                responses.append(failure_response(self.name, "encode", err, request))
        return responses

    def finalize(self):
        self.encoder = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
