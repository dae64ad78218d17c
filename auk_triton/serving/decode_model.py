"""Triton Python-backend model `auk_vae_decode`: AuK latents in, waveform out, one response per tile.

Decoupled: each tile goes out as soon as it is decoded, the last one with the final flag
(its config must say `decoupled: true`; the load fails otherwise). HTTP /infer clients use
`auk_vae_decode_offline` (`offline_model.py`), which forwards each request here and
gathers the tiles, so one process holds the weights and graphs for both.

`execute` checks each request, hands it to the instance's tile scheduler
(`scheduler.py`) and returns; the scheduler's thread decodes and sends through the
request's response sender. A request's `StreamSink` turns its tiles into Triton responses.
A request that carries config.CANCEL_CALL_PARAMETER cancels the forwarded request that
carries its token (config.CALL_TOKEN_PARAMETER): Triton 2.51 has no way to cancel a
forwarded request itself.
"""

from __future__ import annotations

import contextlib
import json
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from auk_triton.codec import AuKVAE, AuKVAEDecodeGraph, activation_kernel_for
from auk_triton.codec.cudnn_timing import time_convolutions
from auk_triton.codec.pcm16 import to_pcm16
from auk_triton.cuda_graph import BuildReport

from .checkpoints import resolve_checkpoint
from .artifacts import precompiled_decode_path, use_artifacts
from .config import CALL_TOKEN_PARAMETER, CANCEL_CALL_PARAMETER, GPU_DECODE_PRECISION, DecodeSettings
from .metrics import DecodeMetrics
from .readiness import BUILD_AFTER_READY, BUILT_AFTER_READY, begun_note, server_ready_condition
from .requests import require_finite, validate_latents
from .scheduler import Iteration, Job, TileScheduler
from .triton_common import (
    START_SAMPLE,
    WAVEFORM,
    WAVEFORM_PCM16,
    failure_response,
    freeze_heap,
    log,
    request_parameters,
    wants_pcm16,
)
from .triton_io import check_tensor_widths, input_array, instance_device, output_tensor

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Cancellations whose forwarded request has not arrived (yet, or ever): remembered, the
# oldest forgotten first, so a request that comes after its cancellation is stopped at once.
EARLY_CANCELS_KEPT = 1024


def tile_outputs(samples: torch.Tensor, start_sample: int, pcm16: bool) -> list:
    return [
        output_tensor(WAVEFORM_PCM16 if pcm16 else WAVEFORM, samples),
        output_tensor(START_SAMPLE, torch.tensor([start_sample], dtype=torch.int64)),
    ]


# Asking a request (or its sender: the same answer) whether it is cancelled is a round
# trip to the server, about 30 us on the CPU. Seen on Triton 2.51, it answers True within
# milliseconds once a gRPC client cancels its stream or call, once a gRPC call's deadline
# passes, and once an HTTP generate_stream client closes its connection. `execute` returns at
# once, so a request waits in the scheduler's own queue, not Triton's, and is asked before its
# first window when it has waited there.
# It stays False for an HTTP /infer whose client closed its connection (the HTTP server
# does not read a connection while its request runs: triton-inference-server/server#7077),
# so on a bare tritonserver such a request is decoded in full; the front door answers
# /infer over gRPC and cancels the call instead. Inside an ensemble a step never sees its
# client's cancellation, nor does a request another model forwards here (BLS): the offline
# model cancels those itself (`TritonPythonModel._cancel_call`).


class StreamSink:
    """A streamed request: one response per tile, the last one with the final flag.

    A separate empty final response would cost every request one more round trip
    to the server and one more gRPC message, on the critical path of a one-tile
    clip. Only a stream that stops before its last tile (cancelled) ends with an
    empty final response; an error response carries the flag itself.

    A cancelled stream gets no CANCELLED error: its client cannot read one. Seen on
    Triton 2.51, a tritonclient stream cancelled by its client reports a CANCELLED of
    its own ("Locally cancelled by application!") at once, and nothing the server
    sends afterwards reaches it; the empty final response only completes the request.
    """

    def __init__(self, model: str, request, pcm16: bool):
        self.model, self.pcm16, self.request = model, pcm16, request
        self.sender = request.get_response_sender()
        self.last_start: int | None = None  # the start sample of the last tile sent

    def cancelled(self) -> bool:
        return self.sender.is_cancelled()

    def tile(self, start_sample: int, samples: torch.Tensor, last: bool) -> None:
        response = pb_utils.InferenceResponse(output_tensors=tile_outputs(samples, start_sample, self.pcm16))
        self.sender.send(response, flags=FINAL if last else 0)
        self.last_start = start_sample

    def fail(self, error: Exception, action: str = "decode") -> None:
        try:
            self.sender.send(failure_response(self.model, action, error, self.request), flags=FINAL)
        except Exception as send_err:  # the client is gone: nothing to tell
            log("error", f"{self.model}: could not send the error response: {send_err}")

    def stop(self, where: str | None = None) -> None:
        """End the stream of a client that has gone; `where` it had got (default: by its tiles)."""
        log("info", f"{self.model}: request cancelled {where or self.where()}")
        self.sender.send(flags=FINAL)

    def where(self) -> str:
        """How far the request had got, for a cancellation's notice."""
        return "before its first tile" if self.last_start is None else f"after the tile at sample {self.last_start}"


def require_decoupled(name: str, model_config: dict) -> None:
    """Fail the load of a config that is not decoupled: this model sends one response per tile."""
    if not pb_utils.using_decoupled_model_transaction_policy(model_config):
        raise RuntimeError(
            f"{name} sends one response per tile: its config must set model_transaction_policy "
            "{ decoupled: true }. For one response per request, serve auk_vae_decode_offline, which "
            "forwards to this model"
        )


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.name = args["model_name"]
        require_decoupled(self.name, self.model_config)
        # Forwarded requests by their token, while they are in the scheduler (config.CALL_TOKEN_PARAMETER).
        self.calls: weakref.WeakValueDictionary[str, Job] = weakref.WeakValueDictionary()
        self.early_cancels: OrderedDict[str, bool] = OrderedDict()
        self.settings = settings = DecodeSettings.from_model_config(self.model_config, Path(args["model_repository"]))
        self.device = instance_device(args["model_instance_kind"], args["model_instance_device_id"])
        artifacts = use_artifacts(settings.artifacts_dir, self.device, lambda text: log("info", f"{self.name}: {text}"))

        checkpoint = resolve_checkpoint(settings.checkpoint, settings.cache_dir, lambda text: log("warn", text))
        began = time.perf_counter()
        options = self._decoder_options()
        try:
            self.vae = AuKVAE.from_pretrained(checkpoint, device=self.device, **options)
        except (OSError, ValueError) as err:
            where = "" if str(checkpoint) in str(err) else f" {checkpoint}"
            raise RuntimeError(f"cannot load the AuK checkpoint{where}: {err}") from err
        check_tensor_widths(self.model_config, {"LATENTS": ("latent_dim", self.vae.latent_dim)})
        log("info", f"{self.name}: loaded {checkpoint} on {self.device} in {time.perf_counter() - began:.1f} s")

        self.stream = self._decode_stream()
        self.graph = AuKVAEDecodeGraph(
            self.vae,
            enabled=settings.enable_cuda_graphs,
            frame_alignment=settings.frame_alignment,
            max_graphs=settings.max_graphs,
            compile_shapes=settings.buckets(),
            tile_frames=settings.tile_frames,
            first_tile_frames=settings.first_window_frames(),
            batch_sizes=settings.batch_sizes,
            batch_frames=settings.batch_frames,
            compile_dynamic=settings.compile_dynamic,
            precompiled=precompiled_decode_path(artifacts, checkpoint, options),
            stream_priority=None if self.stream is None else self.stream.priority,
        )

        def on_bucket(frames: int, seconds: float, ok: bool) -> None:
            state = "compiled and captured" if ok else "FAILED (plain graphs serve it)"
            log("info" if ok else "warn", f"{self.name}: bucket of {frames} frames {state} in {seconds:.1f} s")

        began = time.perf_counter()
        self.metrics = DecodeMetrics({"model": self.name, "version": str(args["model_version"])})
        self.frame_rate = self.vae.sample_rate / self.vae.hop_size
        self.scheduler = TileScheduler(
            self.graph, self.device, self.vae.sample_rate, self.vae.hop_size,
            max_active=settings.max_active_requests, max_queued=settings.max_queued_requests,
            on_iteration=self._on_iteration, short_first_under_load=settings.first_tile_under_load,
        )
        # The scheduler's thread builds the graphs it replays before READY; the deferred ones
        # are built beside it after READY, and it takes each over at its next decode.
        deferred = []
        self.scheduler.start(warmup=lambda: deferred.extend(
            self.graph.warmup(self.device, on_bucket=on_bucket, defer=settings.defer_graphs)), stream=self.stream)
        self.metrics.record([], 0.0, self.graph)  # the warm-up's captures
        if self.graph.compile_note:
            log("info", f"{self.name}: compiled decode {self.graph.compile_note}")
        freeze_heap()
        log(
            "info",
            f"{self.name}: ready (one response per tile; "
            f"tiles of {self.graph.tile_frames or 'unlimited'} frames; warmup {time.perf_counter() - began:.1f} s"
            f"{f'; {len(deferred)} graphs {BUILD_AFTER_READY}' if deferred else ''})",
        )
        # Built once the whole server is READY: beside another model's warm-up they slow it.
        self.graph.start_deferred(deferred, self.device, on_done=self._deferred_built,
                                  begin_when=server_ready_condition())

    def _decode_stream(self) -> torch.cuda.Stream | None:
        """The stream the scheduler queues its decodes on; None: its thread's default. A model
        alone in its process has the GPU's queue to itself (the pipeline's decoder does not)."""
        return None

    def _deferred_built(self, report: BuildReport) -> None:
        log("warn" if report.failed else "info",
            f"{self.name}: {report.built} {BUILT_AFTER_READY} {report.seconds:.1f} s after READY"
            f"{begun_note(report.waited_s, report.condition_held)}"
            f"{f', {report.failed} FAILED (their windows stay on another tier)' if report.failed else ''}")

    def _decoder_options(self) -> dict:
        """`AuKVAE.configure_decoder`'s options for this device: on a GPU the precision, the fused
        activation kernel (eager where Triton cannot load) and channels-last signals, as configured."""
        precision = self.settings.precision
        if self.device.type != "cuda":
            if precision == "fp16":
                log("warn", f"{self.name}: precision fp16 is for a GPU; {self.device} decodes in fp32")
            return {}
        precision = precision or GPU_DECODE_PRECISION
        if precision == "fp16":
            # cuDNN times its algorithms per shape (at load, where the graphs are captured):
            # its heuristics pick a slow direct kernel for some dilated fp16 convolutions.
            errata = time_convolutions()
            log("info", f"{self.name}: decoding in fp16 (fp16 weights and signals, fp32 accumulation "
                        f"and activations; cuDNN benchmarks its convolution algorithms, errata {errata})")
        else:
            log("info", f"{self.name}: decoding in tf32 (fp32 weights and signals, TF32 convolutions)")
        dtype = torch.float16 if precision == "fp16" else torch.float32
        kernel = None
        if self.settings.fused_activation:
            try:
                import auk_triton.codec.activation_kernel  # noqa: F401  (needs the triton package)

                kernel = activation_kernel_for(dtype)
                log("info", f"{self.name}: anti-aliased activations run as one fused Triton kernel "
                            f"({kernel.sine} sine)")
            except ImportError as err:
                log("warn", f"{self.name}: fused_activation is on but its kernel cannot load ({err}); "
                            "decoding with the eager activations")
        if self.settings.channels_last:
            log("info", f"{self.name}: decoding channels-last (cuDNN's NHWC convolutions, no transposes)")
        return {"activation_kernel": kernel, "channels_last": self.settings.channels_last, "dtype": dtype}

    # ---- requests -------------------------------------------------------------------------

    def execute(self, requests):
        """Hand each request to the scheduler and return: its thread sends the tiles."""
        for request in requests:
            parameters = request_parameters(request)
            if CANCEL_CALL_PARAMETER in parameters:
                self._cancel_call(str(parameters[CANCEL_CALL_PARAMETER]))
                request.get_response_sender().send(flags=FINAL)
                continue
            pcm16 = wants_pcm16(request)
            sink = StreamSink(self.name, request, pcm16)
            arrived = time.monotonic()
            token = parameters.get(CALL_TOKEN_PARAMETER)
            try:
                latents, check = self._latents(request)
                job = Job(latents, sink, convert=to_pcm16 if pcm16 else None, check=check, arrived=arrived)
                if token is not None:
                    self.calls[str(token)] = job
                self.scheduler.submit(job)
                if token is not None and self.early_cancels.pop(str(token), False):
                    self.scheduler.cancel(job)
            except Exception as err:
                sink.fail(err)
        return None

    def _cancel_call(self, token: str) -> None:
        """Stop the forwarded request with this token at the scheduler's next iteration, or as
        it arrives (its cancellation may overtake it)."""
        job = self.calls.get(token)
        if job is not None:
            self.scheduler.cancel(job)
            return
        self.early_cancels[token] = True
        while len(self.early_cancels) > EARLY_CANCELS_KEPT:
            self.early_cancels.popitem(last=False)

    def _latents(self, request) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """The request's LATENTS on the model's device as [1, frames, dim], and their check
        for NaN and infinite values where it is still to run (None where it has run).

        On a GPU they go through pinned memory: a copy from pageable memory is
        staged by the driver and waited for, one from pinned memory is a DMA the
        host does not wait for (PyTorch keeps the pinned block until it is done).
        There the check is left to the scheduler, which runs it while the first window
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
        if not on_gpu:
            return torch.from_numpy(array).unsqueeze(0), None
        pinned = torch.empty(array.shape, dtype=torch.float32, pin_memory=True)
        # numpy's copy, not torch's: past 32,768 elements (512 frames) torch's CPU copy runs on
        # its OpenMP team, whose wake-up here cost more than the copy itself.
        np.copyto(pinned.numpy(), array)
        return self.on_device(pinned), lambda: require_finite(array)

    def on_device(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [frames, dim] in pinned host memory as [1, frames, dim] on the model's device:
        a copy queued on the decoder's stream (so ordered before its decodes), not waited for."""
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            return latents.to(self.device, non_blocking=True).unsqueeze(0)

    def _on_iteration(self, report: Iteration) -> None:
        """One scheduler iteration's numbers to the metrics (the reporter sends them later)."""
        share = report.decode_seconds / max(1, len(report.tile_seconds))
        self.metrics.record([(report.mode, share, seconds) for seconds in report.tile_seconds],
                            report.send_seconds, self.graph)
        self.metrics.record_iteration(report.rows, report.first_audio, report.active, report.underruns,
                                      report.queued)

    def finalize(self):
        if getattr(self, "graph", None) is not None:
            self.graph.stop_deferred()
        if getattr(self, "scheduler", None) is not None:
            self.scheduler.close()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        self.graph = self.vae = self.metrics = self.scheduler = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

