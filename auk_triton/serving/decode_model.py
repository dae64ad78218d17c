"""Triton Python-backend model: AuK latents in, waveform out, one response per tile.

Both `model_repository/auk_vae_decode` (decoupled: streams one response per
tile, the last one with the final flag) and `model_repository/auk_vae_decode_offline`
(one response with the whole waveform) import this class; the loaded config's
transaction policy picks the mode. The two modes run the same tiled decode, so
the concatenated stream equals the offline waveform.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch
import triton_python_backend_utils as pb_utils

from auk_triton.codec import ActivationKernel, AuKVAE, AuKVAEDecodeGraph
from auk_triton.codec.pcm16 import to_pcm16

from .checkpoints import resolve_checkpoint
from .config import DecodeSettings, use_compile_cache
from .metrics import DecodeMetrics
from .requests import require_finite, validate_latents
from .triton_io import (
    check_tensor_widths,
    failure_response,
    input_array,
    instance_device,
    log,
    output_tensor,
)

WAVEFORM, WAVEFORM_PCM16 = "WAVEFORM", "WAVEFORM_PCM16"


def wants_pcm16(request) -> bool:
    """Whether to send WAVEFORM_PCM16 (int16) instead of WAVEFORM (float32).

    Only when the request names WAVEFORM_PCM16 among its outputs and not WAVEFORM:
    a request that names no outputs asks, to Triton, for all of them, and gets the
    float32 waveform alone, as before the int16 output existed.
    """
    names = set(request.requested_output_names())
    return WAVEFORM_PCM16 in names and WAVEFORM not in names


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.model_config)
        self.settings = settings = DecodeSettings.from_model_config(self.model_config, Path(args["model_repository"]))
        use_compile_cache(settings.cache_dir)
        self.device = instance_device(args["model_instance_kind"], args["model_instance_device_id"])

        checkpoint = resolve_checkpoint(settings.checkpoint, settings.cache_dir, lambda text: log("warn", text))
        began = time.perf_counter()
        try:
            self.vae = AuKVAE.from_pretrained(checkpoint, device=self.device, **self._decoder_options())
        except (OSError, ValueError) as err:
            where = "" if str(checkpoint) in str(err) else f" {checkpoint}"
            raise RuntimeError(f"cannot load the AuK checkpoint{where}: {err}") from err
        check_tensor_widths(self.model_config, {"LATENTS": ("latent_dim", self.vae.latent_dim)})
        log("info", f"{self.name}: loaded {checkpoint} on {self.device} in {time.perf_counter() - began:.1f} s")

        self.graph = AuKVAEDecodeGraph(
            self.vae,
            enabled=settings.enable_cuda_graphs,
            frame_alignment=settings.frame_alignment,
            max_graphs=settings.max_graphs,
            compile_shapes=settings.compile_shapes,
            tile_frames=settings.tile_frames,
            first_tile_frames=settings.first_window_frames(),
        )

        def on_bucket(frames: int, seconds: float, ok: bool) -> None:
            state = "compiled and captured" if ok else "FAILED (plain graphs serve it)"
            log("info" if ok else "warn", f"{self.name}: bucket of {frames} frames {state} in {seconds:.1f} s")

        began = time.perf_counter()
        self.graph.warmup(self.device, on_bucket=on_bucket)
        self.metrics = DecodeMetrics({"model": self.name, "version": str(args["model_version"])})
        self.metrics.record([], 0.0, self.graph)  # the warm-up's captures
        self.frame_rate = self.vae.sample_rate / self.vae.hop_size
        log(
            "info",
            f"{self.name}: ready ({'decoupled, one response per tile' if self.decoupled else 'one response per request'}; "
            f"tiles of {self.graph.tile_frames or 'unlimited'} frames; warmup {time.perf_counter() - began:.1f} s)",
        )

    def _decoder_options(self) -> dict:
        """`AuKVAE.configure_decoder`'s options for this device: on a GPU the fused activation
        kernel (eager where Triton cannot load) and channels-last signals, as configured."""
        if self.device.type != "cuda":
            return {}
        kernel = None
        if self.settings.fused_activation:
            try:
                import auk_triton.codec.activation_kernel  # noqa: F401  (needs the triton package)

                kernel = ActivationKernel()
                log("info", f"{self.name}: anti-aliased activations run as one fused Triton kernel")
            except ImportError as err:
                log("warn", f"{self.name}: fused_activation is on but its kernel cannot load ({err}); "
                            "decoding with the eager activations")
        if self.settings.channels_last:
            log("info", f"{self.name}: decoding channels-last (cuDNN's NHWC convolutions, no transposes)")
        return {"activation_kernel": kernel, "channels_last": self.settings.channels_last}

    # ---- requests -------------------------------------------------------------------------

    def execute(self, requests):
        if not self.decoupled:
            return [self._respond(request) for request in requests]
        for request in requests:
            self._stream(request)
        return None

    def _latents(self, request) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """The request's LATENTS on the model's device as [1, frames, dim], and their check
        for NaN and infinite values where it is still to run (None where it has run).

        On a GPU they go through pinned memory: a copy from pageable memory is
        staged by the driver and waited for, one from pinned memory is a DMA the
        host does not wait for (PyTorch keeps the pinned block until it is done).
        There the check is left to `_tiles`, which runs it while the first window
        decodes; on a CPU, where a decode is not asynchronous, it runs here first.
        """
        on_gpu = self.device.type == "cuda"
        array = validate_latents(
            input_array(request, "LATENTS"),
            self.vae.latent_dim,
            self.settings.max_frames,
            self.frame_rate,
            check_finite=not on_gpu,
        )
        latents = torch.from_numpy(array)
        if not on_gpu:
            return latents.unsqueeze(0), None
        pinned = torch.empty(latents.shape, dtype=latents.dtype, pin_memory=True)
        latents = pinned.copy_(latents).to(self.device, non_blocking=True)
        return latents.unsqueeze(0), lambda: require_finite(array)

    def _tiles(self, latents: torch.Tensor, check: Callable[[], None] | None, decoded: list, pcm16: bool = False):
        """Yield (start_sample, waveform on the host) per decoded tile, in order: float32,
        or int16 (`to_pcm16`, converted on the device before the copy) when `pcm16`.

        On a GPU the next tile's decode is launched before a tile is yielded, so the
        GPU decodes it while this one is sent (a send waits for the server to write
        the response to the client's socket). `check` (from `_latents`) runs while
        the first window decodes, before any tile is yielded. Appends (tier,
        seconds, audio seconds) per tile to `decoded`; the caller records them for
        the metrics once the response is complete.
        """
        hop, rate = self.vae.hop_size, self.vae.sample_rate
        convert = to_pcm16 if pcm16 else None
        for tile in self.graph.host_tiles(latents, convert, look_ahead=latents.is_cuda, while_decoding=check):
            decoded.append((tile.mode, tile.seconds, tile.samples.numel() / rate))
            yield tile.start_frame * hop, tile.samples

    def _respond(self, request):
        decoded = []
        try:
            pcm16 = wants_pcm16(request)
            parts = [wave for _, wave in self._tiles(*self._latents(request), decoded, pcm16)]
            waveform = parts[0] if len(parts) == 1 else torch.cat(parts)
            return pb_utils.InferenceResponse(
                output_tensors=[
                    output_tensor(WAVEFORM_PCM16 if pcm16 else WAVEFORM, waveform),
                    output_tensor("START_SAMPLE", torch.zeros(1, dtype=torch.int64)),
                ]
            )
        except Exception as err:
            return failure_response(self.name, "decode", err)
        finally:
            self.metrics.record(decoded, 0.0, self.graph)

    def _stream(self, request) -> None:
        """Send one response per tile, the last one with the final flag.

        A separate empty final response would cost every request one more round
        trip to the server and one more gRPC message, on the critical path of a
        one-tile clip. Only a stream that stops before its last tile (cancelled)
        ends with an empty final response; an error response carries the flag itself.
        """
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        decoded = []
        send_seconds = 0.0  # in the tiles' sends
        finished = False  # the final flag has been sent
        try:
            latents, check = self._latents(request)
            total = latents.shape[1] * self.vae.hop_size
            pcm16 = wants_pcm16(request)
            for start, wave in self._tiles(latents, check, decoded, pcm16):
                last = start + wave.numel() >= total
                began = time.perf_counter()
                sender.send(
                    pb_utils.InferenceResponse(
                        output_tensors=[
                            output_tensor(WAVEFORM_PCM16 if pcm16 else WAVEFORM, wave),
                            output_tensor("START_SAMPLE", torch.tensor([start], dtype=torch.int64)),
                        ]
                    ),
                    flags=final if last else 0,
                )
                send_seconds += time.perf_counter() - began
                if last:
                    finished = True
                    break
                # Asking about cancellation is a round trip to the server: ask only
                # where another tile would follow, so a one-tile clip never waits on it.
                if sender.is_cancelled():
                    log("info", f"{self.name}: request cancelled after the tile at sample {start}")
                    break
            if not finished:  # stopped before the last tile
                sender.send(flags=final)
        except Exception as err:
            if finished:
                log("error", f"{self.name}: after the final response: {type(err).__name__}: {err}")
            else:
                self._send_error(sender, failure_response(self.name, "decode", err))
        finally:
            self.metrics.record(decoded, send_seconds, self.graph)

    def _send_error(self, sender, response) -> None:
        """End the stream with an error response; a client that is gone must not fail `execute`."""
        try:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as send_err:  # the client is gone
            log("error", f"{self.name}: could not send the error response: {send_err}")

    def finalize(self):
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        self.graph = self.vae = self.metrics = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

