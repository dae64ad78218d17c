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
response of its own; the model keeps serving.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from auk_triton.flow_sampler import Request, RequestError, load_sampler
from auk_triton.serving.backend import error_response, input_array, instance_device, log, output_tensor
from auk_triton.serving.settings import (
    DEFAULT_PRESET,
    bool_parameter,
    cache_dir_path,
    checkpoint_path,
    config_parameters,
    int_parameter,
    synthetic_checkpoint,
)
from auk_triton.synthetic_dit import SYNTHETIC_DIT_WARNING, write_synthetic_dit_checkpoint

DEFAULT_MAX_STEPS = 1000
DEFAULT_MAX_FRAMES = 30000  # ten minutes at 50 frames per second, as the decoder's default
DEFAULT_MAX_GRAPHS = 4
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def synthetic_dit_checkpoint(cache_dir: Path, preset: str) -> Path:
    """The synthetic codec checkpoint of `preset`, with DiT weights of the same preset added once."""
    path = synthetic_checkpoint(cache_dir, preset)
    # The codec writer's lock file: concurrent model processes add the DiT weights one at a time.
    with open(Path(cache_dir) / "synthetic" / f"{preset}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return write_synthetic_dit_checkpoint(path, preset=preset, seed=0)


def _seconds(value: np.ndarray) -> float:
    # The FP32 a client sent for "0.1" is 0.100000001...; read it back as the decimal it
    # stands for, so that 0.1 s is 5 frames and not ceil(5.0000001) = 6.
    return float(str(np.float32(value)))


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.name = args["model_name"]
        params = config_parameters(self.model_config)
        model_dir = Path(args["model_repository"])
        self.device = instance_device(args["model_instance_kind"], args["model_instance_device_id"])

        dtype_name = params.get("dtype", "") or "auto"
        if dtype_name not in DTYPES:
            raise ValueError(f"config parameter dtype is {dtype_name!r}; use one of {sorted(DTYPES)}")
        self.max_steps = int_parameter(params, "max_steps", DEFAULT_MAX_STEPS, 1)
        self.max_frames = int_parameter(params, "max_frames", DEFAULT_MAX_FRAMES, 1)
        max_graphs = int_parameter(params, "max_graphs", DEFAULT_MAX_GRAPHS, 0)
        graphs = bool_parameter(params, "enable_cuda_graphs", True)

        checkpoint = checkpoint_path(params, model_dir)
        if not checkpoint:
            preset = os.environ.get("AUK_PRESET") or DEFAULT_PRESET
            log("warn", f"no checkpoint configured (AUK_CHECKPOINT or the checkpoint parameter): "
                         f"serving the synthetic '{preset}' preset")
            log("warn", f"*** {SYNTHETIC_DIT_WARNING} ***")
            checkpoint = synthetic_dit_checkpoint(cache_dir_path(params, model_dir), preset)

        began = time.perf_counter()
        # A missing auk.safetensors (or config.json) fails the load with the file's name.
        self.sampler = load_sampler(
            checkpoint, self.device, DTYPES[dtype_name], max_frames=self.max_frames,
            max_graphs=max_graphs if graphs else 0,
        )
        self._check_io_config()
        log("info", f"{self.name}: loaded {checkpoint} ({self.sampler.variant}, {self.sampler.dtype}, "
                     f"CUDA graphs {'on' if self.sampler.graphs else 'off'}) on {self.device} "
                     f"in {time.perf_counter() - began:.1f} s")

    def _check_io_config(self) -> None:
        """The config's tensor widths must be the checkpoint's: a mismatch would leave the
        model READY with every request failing, so it fails the load instead."""
        widths = {
            "PROMPT_EMBEDS": ("text width (dit.text_hidden_dim)", self.sampler.text_dim),
            "REF_LATENTS": ("latent_dim", self.sampler.latent_dim),
            "LATENTS": ("latent_dim", self.sampler.latent_dim),
        }
        for entry in self.model_config.get("input", []) + self.model_config.get("output", []):
            name = entry.get("name")
            dims = [int(d) for d in entry.get("dims", [])]
            if name not in widths or len(dims) != 2:
                continue
            what, width = widths[name]
            if dims[1] not in (-1, width):
                raise RuntimeError(
                    f"config.pbtxt declares {name} dims {dims}, but the checkpoint's {what} is {width}: "
                    f"set dims to [-1, {width}] to serve this checkpoint"
                )

    def _input(self, request, name: str, dtype, shape_rank: int, required: bool = True):
        array = input_array(request, name)
        if array is None:
            if required:
                raise RequestError(f"the request has no {name} input")
            return None
        if array.dtype != dtype:
            raise RequestError(f"{name} is {array.dtype.name}; this model takes {np.dtype(dtype).name}")
        if shape_rank == 0:
            if array.size != 1:
                raise RequestError(f"{name} must hold one value, got shape {list(array.shape)}")
            return array.reshape(-1)[0]
        if array.ndim != shape_rank:
            raise RequestError(f"{name} must have {shape_rank} dimensions, got shape {list(array.shape)}")
        return array

    def _request(self, request) -> Request:
        text = self._input(request, "PROMPT_EMBEDS", np.float32, 2)
        seconds = self._input(request, "GEN_SECONDS", np.float32, 0)
        seed = self._input(request, "SEED", np.int64, 0)
        steps = self._input(request, "NUM_STEPS", np.int32, 0, required=False)
        guidance = self._input(request, "GUIDANCE", np.float32, 0, required=False)
        sway = self._input(request, "SWAY", np.float32, 0, required=False)
        ref = self._input(request, "REF_LATENTS", np.float32, 2, required=False)
        # A flash checkpoint runs its fixed recipe whatever NUM_STEPS says: no step count to limit.
        if steps is not None and steps > self.max_steps and self.sampler.variant != "flash":
            raise RequestError(f"NUM_STEPS is {int(steps)}; this model runs at most {self.max_steps} (max_steps)")
        return Request(
            prompt_embeds=torch.from_numpy(np.ascontiguousarray(text)),
            gen_seconds=_seconds(seconds),
            seed=int(seed),
            num_steps=None if steps is None else int(steps),
            guidance=None if guidance is None else float(guidance),
            sway=None if sway is None else float(sway),
            ref_latents=None if ref is None else torch.from_numpy(np.ascontiguousarray(ref)),
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                latents = self.sampler.generate(self._request(request)).to("cpu", torch.float32)
                responses.append(pb_utils.InferenceResponse(output_tensors=[output_tensor("LATENTS", latents)]))
            except RequestError as err:
                responses.append(error_response(str(err)))
            except Exception as err:
                log("error", f"{self.name}: generation failed: {type(err).__name__}: {err}")
                responses.append(error_response(f"generation failed: {type(err).__name__}: {err}"))
        return responses

    def finalize(self):
        self.sampler = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
