"""Triton Python-backend model: AuK latents in, waveform out, one response per tile.

Both `model_repository/auk_vae_decode` (decoupled: streams one response per
tile, the last one with the final flag) and `model_repository/auk_vae_decode_offline`
(one response with the whole waveform) import this class; the loaded config's
transaction policy picks the mode. The two modes run the same tiled decode, so
the concatenated stream equals the offline waveform.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import triton_python_backend_utils as pb_utils

from auk_triton.decode_graph import AuKVAEDecodeGraph
from auk_triton.pcm16 import to_pcm16
from auk_triton.serving.backend import error_response, input_array, instance_device, log, output_tensor
from auk_triton.serving.settings import (
    DEFAULT_PRESET,
    DecodeSettings,
    RequestError,
    require_finite,
    synthetic_checkpoint,
    validate_latents,
)
from auk_triton.synthetic import SYNTHETIC_WARNING
from auk_triton.vae import AuKVAE

TIERS = ("compiled", "graph", "eager")
WAVEFORM, WAVEFORM_PCM16 = "WAVEFORM", "WAVEFORM_PCM16"


def wants_pcm16(request) -> bool:
    """Whether to send WAVEFORM_PCM16 (int16) instead of WAVEFORM (float32).

    Only when the request names WAVEFORM_PCM16 among its outputs and not WAVEFORM:
    a request that names no outputs asks, to Triton, for all of them, and gets the
    float32 waveform alone, as before the int16 output existed.
    """
    names = set(request.requested_output_names())
    return WAVEFORM_PCM16 in names and WAVEFORM not in names


class DecodeMetrics:
    """The model's counters on Triton's metrics port; no-ops where the backend has no MetricFamily.

    Every counter update is a round trip to the server process, about a tenth of
    a millisecond. Made inline, a request's updates delayed the offline model's
    response (its `execute` returns it) and a streaming client's next request.
    So `record` only adds to sums in this process, and a reporter thread sends
    them REPORT_DELAY_S after a request ends (on a GPU, the next request is
    decoding by then), each counter once however many tiles and requests it
    covers. The counters trail the responses by about that much; `close` sends
    what is left.
    """

    REPORT_DELAY_S = 0.005

    def __init__(self, labels: dict[str, str]):
        self._families = []
        self._tiles = self._audio = self._captures = self._retired = self._send = None
        self._seconds: dict[str, object] = {}
        self._lock = threading.Lock()
        self._pending = self._nothing_pending()
        self._seen_captures = self._seen_retired = 0
        self._wake = threading.Event()
        self._closing = False
        self._reporter = None
        family_cls = getattr(pb_utils, "MetricFamily", None)
        if family_cls is None:
            log("warn", "this Python backend has no MetricFamily: the model exports no metrics")
            return
        try:

            def counter(name: str, description: str):
                family = family_cls(name=name, description=description, kind=family_cls.COUNTER)
                self._families.append(family)
                return family

            self._tiles = counter("auk_vae_tiles_sent_total", "Decoded tiles sent (streamed or concatenated)").Metric(
                labels=labels
            )
            self._audio = counter("auk_vae_audio_seconds_total", "Seconds of audio decoded and sent").Metric(
                labels=labels
            )
            seconds = counter(
                "auk_vae_decode_seconds_total",
                "Time launching tile decodes and waiting for their samples, by tier (compiled, graph, eager)",
            )
            self._seconds = {tier: seconds.Metric(labels={**labels, "tier": tier}) for tier in TIERS}
            self._send = counter(
                "auk_vae_send_seconds_total",
                "Wall time the streaming model waits in response sends (each returns once the server "
                "has written the response to the client's connection)",
            ).Metric(labels=labels)
            self._captures = counter("auk_vae_graph_captures_total", "Plain CUDA graphs captured").Metric(
                labels=labels
            )
            self._retired = counter(
                "auk_vae_graph_generations_retired_total", "Generations of plain CUDA graphs retired"
            ).Metric(labels=labels)
        except Exception as err:  # metrics disabled on the server, or an older backend
            log("warn", f"custom metrics are unavailable ({err}); the model exports none")
            self._families, self._seconds = [], {}
            self._tiles = self._audio = self._captures = self._retired = self._send = None
            return
        self._reporter = threading.Thread(target=self._report_until_closed, name="auk-metrics", daemon=True)
        self._reporter.start()

    @staticmethod
    def _nothing_pending() -> dict:
        return {"tiles": 0, "audio": 0.0, "send": 0.0, "captures": 0, "retired": 0,
                "seconds": dict.fromkeys(TIERS, 0.0)}

    def record(self, decoded: list, send_seconds: float, graph: AuKVAEDecodeGraph) -> None:
        """Add one request's tiles ((tier, seconds, audio seconds) each), send time and the
        graph wrapper's capture counts to what the reporter sends next."""
        if self._reporter is None:
            return
        with self._lock:
            pending = self._pending
            for tier, seconds, audio_seconds in decoded:
                pending["tiles"] += 1
                pending["audio"] += audio_seconds
                pending["seconds"][tier or "eager"] += seconds
            pending["send"] += send_seconds
            pending["captures"] += graph.captures - self._seen_captures
            pending["retired"] += graph.generations_retired - self._seen_retired
            self._seen_captures, self._seen_retired = graph.captures, graph.generations_retired
        self._wake.set()

    def _report_until_closed(self) -> None:
        # `_closing` is checked after every report too: `_report` clears `_wake`, so a
        # `close` during the delay would otherwise leave this thread waiting forever.
        while not self._closing:
            self._wake.wait()
            if self._closing:
                return
            time.sleep(self.REPORT_DELAY_S)  # let the response reach its client first
            self._report()

    def _report(self) -> None:
        with self._lock:
            self._wake.clear()
            pending, self._pending = self._pending, self._nothing_pending()
        increments = [
            (self._tiles, pending["tiles"]),
            (self._audio, pending["audio"]),
            (self._send, pending["send"]),
            (self._captures, pending["captures"]),
            (self._retired, pending["retired"]),
        ] + [(self._seconds[tier], seconds) for tier, seconds in pending["seconds"].items()]
        try:
            for metric, amount in increments:
                if amount > 0:
                    metric.increment(amount)
        except Exception as err:  # the server is shutting down
            log("warn", f"could not update the model's metrics: {err}")

    def close(self) -> None:
        """Stop the reporter and send what it has not."""
        if self._reporter is None:
            return
        self._closing = True
        self._wake.set()
        self._reporter.join()
        self._reporter = None
        self._report()


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.model_config)
        model_dir = Path(args["model_repository"])
        self.settings = settings = DecodeSettings.from_model_config(self.model_config, model_dir)
        settings.use_compile_cache()
        self.device = instance_device(args["model_instance_kind"], args["model_instance_device_id"])

        checkpoint = settings.checkpoint
        if not checkpoint:
            preset = os.environ.get("AUK_PRESET") or DEFAULT_PRESET
            log("warn", f"no checkpoint configured (AUK_CHECKPOINT or the checkpoint parameter): "
                         f"serving the synthetic '{preset}' preset")
            log("warn", f"*** {SYNTHETIC_WARNING} ***")
            checkpoint = synthetic_checkpoint(settings.cache_dir, preset)
        began = time.perf_counter()
        try:
            self.vae = AuKVAE.from_pretrained(checkpoint, device=self.device)
        except (OSError, ValueError) as err:
            where = "" if str(checkpoint) in str(err) else f" {checkpoint}"
            raise RuntimeError(f"cannot load the AuK checkpoint{where}: {err}") from err
        self._check_io_config()
        log("info", f"{self.name}: loaded {checkpoint} on {self.device} in {time.perf_counter() - began:.1f} s")
        if settings.fused_activation and self.device.type == "cuda":
            self._use_fused_activation()
        if settings.channels_last and self.device.type == "cuda":
            # Before the graphs are built: converting the weights moves them.
            self.vae.use_channels_last(True)
            log("info", f"{self.name}: decoding channels-last (cuDNN's NHWC convolutions, no transposes)")

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

    def _use_fused_activation(self) -> None:
        """The one-kernel anti-aliased activation (fused_activation.py); eager if Triton is missing."""
        try:
            import auk_triton.fused_activation  # noqa: F401  (needs the triton package)
        except ImportError as err:
            log("warn", f"{self.name}: fused_activation is on but its kernel cannot load ({err}); "
                        "decoding with the eager activations")
            return
        self.vae.use_fused_activation(True)
        log("info", f"{self.name}: anti-aliased activations run as one fused Triton kernel")

    def _check_io_config(self) -> None:
        """The config's LATENTS width must be the checkpoint's latent_dim."""
        for entry in self.model_config.get("input", []):
            dims = [int(d) for d in entry.get("dims", [])]
            if entry.get("name") == "LATENTS" and len(dims) == 2 and dims[1] not in (-1, self.vae.latent_dim):
                raise RuntimeError(
                    f"config.pbtxt declares LATENTS dims {dims}, but the checkpoint decodes "
                    f"latent_dim {self.vae.latent_dim}: set dims to [-1, {self.vae.latent_dim}]"
                )

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
        except RequestError as err:
            return error_response(str(err))
        except Exception as err:
            log("error", f"{self.name}: decode failed: {type(err).__name__}: {err}")
            return error_response(f"decode failed: {type(err).__name__}: {err}")
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
        except RequestError as err:
            self._send_error(sender, str(err))
        except Exception as err:
            log("error", f"{self.name}: decode failed: {type(err).__name__}: {err}")
            if not finished:
                self._send_error(sender, f"decode failed: {type(err).__name__}: {err}")
        finally:
            self.metrics.record(decoded, send_seconds, self.graph)

    def _send_error(self, sender, message: str) -> None:
        """End the stream with an error response; a client that is gone must not fail `execute`."""
        try:
            sender.send(error_response(message), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as send_err:  # the client is gone
            log("error", f"{self.name}: could not send the error response: {send_err}")

    def finalize(self):
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        self.graph = self.vae = self.metrics = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
