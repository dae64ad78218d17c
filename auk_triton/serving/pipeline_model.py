"""Triton Python-backend model `auk_pipeline`: text condition in, waveform tiles out, both stages in one process.

Decoupled: one response per decoded tile (WAVEFORM, or WAVEFORM_PCM16 where the request asks
for it, and START_SAMPLE), the last with the final flag, as `auk_vae_decode` streams them. The
inputs are `auk_dit`'s, without its batch axis: one clip per request.

The model holds the two stages that `auk_dit` and `auk_vae_decode` serve, built by their code
from this model's config parameters (each stage reads its own names; a name both read, such as
`checkpoint` or `max_frames`, means the same to both): the DiT's sampling thread, where a
request joins its bucket's run between Euler steps (diffusion/joined.py), and the decoder's
tile scheduler (scheduler.py). A request's latents go from the one to the other inside this
process: no response, no hop through Triton. They go through the host, checked there for NaN,
except a lone request's on a GPU while the decoder has nothing else: those stay on the GPU,
handed over as the DiT queues its last step, and the decoder queues the first window behind
that step (its stream waits for the step's event), checking them before the first tile leaves.

On a GPU the two stages share one CUDA context, where in two processes their work would take
turns in time slices. The decoder queues on a stream of the device's highest priority, its
graphs captured at that priority (a replay keeps its capture's: cuda_graph.capture), and the
DiT on one of its lowest, the default its graphs are captured at. The DiT also admits a
request only while the decoder keeps up (`_DiT._admission`): at saturation a request then
waits before its first audio rather than between its tiles (measured before the decoder's
graphs kept its priority: benchmarks/studies/dit-joined-steps.md). The graph builders after
READY take turns (cuda_graph.GraphBuilder).

With `decode_look_ahead_during_dit` off, the decoder hands each replay's tiles over before it
picks the next while the DiT holds requests (unless a stream's next window is due soon): the
first windows of the DiT's requests are then picked as they come, not queued behind a later
window already launched.

With `decode_yields_to_dit`, the decoder's later windows wait a little while the DiT holds
requests (scheduler.yields): a new request's steps then run without other clips' decoding
ahead of them on the GPU, first windows still going first
(benchmarks/studies/pipeline-open-loop-tail.md).

Unless `first_tile_at_saturation` is on, a request's short first window is planned away while
the DiT holds requests back for the decoder (scheduler.TileScheduler.saturated): at saturation
the decoder then does each clip's work once.

A request that breaks the DiT's limits gets its error before sampling, for that request
alone; a client that goes away stops its request at the DiT's next step or at the decoder's
next window.
"""

from __future__ import annotations

import json
import time
from functools import partial

from auk_triton.codec.pcm16 import to_pcm16
from auk_triton.cuda_graph import priority_stream
from auk_triton.diffusion import NonFiniteLatents, SamplingStopped
from auk_triton.diffusion.joined import DeviceLatents

from .config import PipelineSettings
from .decode_model import StreamSink, require_decoupled
from .decode_model import TritonPythonModel as DecodeModel
from .dit_model import TritonPythonModel as DiTModel
from .requests import dit_plan, throttled_check
from .scheduler import Job
from .triton_common import log, wants_pcm16
from .triton_io import input_array


class _Decoder(DecodeModel):
    """auk_vae_decode's stage: its decodes go ahead of the DiT's steps on the GPU."""

    def _decode_stream(self):
        return priority_stream(self.device, first=True) if self.device.type == "cuda" else None


class _Sink(StreamSink):
    """A request's stream: what fails it is its generation or its decode."""

    def fail(self, error: Exception, action: str = "decode") -> None:
        super().fail(error, "generation" if isinstance(error, NonFiniteLatents) else action)


class _DiT(DiTModel):
    """auk_dit's stage: each request's latents go to the decoder, not into a response."""

    def __init__(self, decoder: _Decoder):
        self.decoder = decoder

    def _keeps_latents(self):
        """A lone request's latents stay on the GPU while the decoder has no other stream: under
        load, handed over before their last step had run, they held back its batching."""
        scheduler = self.decoder.scheduler
        return lambda: scheduler.idle

    def _sampling_stream(self):
        """The device's lowest priority: CUDA's default, the one the DiT's graphs are captured at."""
        return priority_stream(self.device, first=False) if self.device.type == "cuda" else None

    def _admission(self):
        """A request joins the DiT's runs only while the requests being sampled and the decoder's
        streams with windows left number fewer than a full run and a full decoder replay hold.
        At saturation the wait then comes before a request's first audio, not between its tiles:
        a stream that has begun keeps ahead of its playback. A stream whose next window waits for
        the DiT (`decode_yields_to_dit`) is ahead of it already, and does not count."""
        limit = self.settings.max_batch_requests + max(self.decoder.settings.batch_sizes)
        scheduler = self.decoder.scheduler
        return lambda: len(self.joined) + scheduler.active - scheduler.yielding + scheduler.queued < limit

    def _answer(self, tag, result) -> None:
        """Called on the sampling thread (it must not raise): hand a request's latents to the
        decoder, or end its stream with the error that ended its sampling."""
        sink, pcm16 = tag
        try:
            if isinstance(result, SamplingStopped):  # its client has gone: nothing to read an error
                sink.stop(str(result))
            elif isinstance(result, Exception):
                sink.fail(result, "generation")
            else:
                convert = to_pcm16 if pcm16 else None
                if isinstance(result, DeviceLatents):
                    job = Job(result.latents.unsqueeze(0), sink, convert=convert, ready=result.ready,
                              verify=result.check)
                else:
                    job = Job(self.decoder.on_device(result), sink, convert=convert)
                self.decoder.scheduler.submit(job)
        except Exception as err:  # the decoder refused it (busy, stopping), or the client is gone
            sink.fail(err)  # it logs a send that fails


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        require_decoupled(self.name, json.loads(args["model_config"]))
        # The decoder first: on a GPU it names cuDNN's errata file before the process's first
        # convolution (codec/cudnn_timing.py), which the DiT's position embedding would make.
        self.decoder = _Decoder()
        self.decoder.initialize(args)
        self.dit = _DiT(self.decoder)
        self.dit.initialize(args)
        if self.dit.sampling is None:
            raise RuntimeError(f"{self.name} samples each request on its sampling thread: "
                               "its config must leave join_between_steps on")
        self.settings = self.dit.settings
        pipeline = PipelineSettings.from_model_config(json.loads(args["model_config"]))
        sampling = self.dit.sampling
        if pipeline.decode_yields_to_dit:
            self.decoder.scheduler.yield_to = lambda: sampling.busy
            log("info", f"{self.name}: the decoder's later windows wait while the DiT holds requests")
        if not pipeline.decode_look_ahead_during_dit:
            self.decoder.scheduler.hold_look_ahead = lambda: sampling.busy
            log("info", f"{self.name}: the decoder hands its tiles over before each pick while the DiT holds requests")
        if not pipeline.first_tile_at_saturation:
            self.decoder.scheduler.saturated = lambda: sampling.holding_back
            log("info", f"{self.name}: no short first window while the DiT holds requests back for the decoder")

    def execute(self, requests):
        """Check each request and hand it to the DiT's sampling thread; return at once. The
        decoder's thread sends its tiles."""
        began = time.monotonic()
        for request in requests:
            pcm16 = wants_pcm16(request)
            sink = _Sink(self.name, request, pcm16)
            try:
                plan = dit_plan(self.dit.sampler, partial(input_array, request), self.settings.max_steps,
                                self.settings.max_prompt_tokens)
            except Exception as err:
                sink.fail(err, "generation")
                continue
            self.dit.sampling.submit(plan, (sink, pcm16), throttled_check(sink.cancelled, began))
        return None

    def finalize(self):
        for stage in ("dit", "decoder"):
            if getattr(self, stage, None) is not None:
                getattr(self, stage).finalize()
        self.dit = self.decoder = None
