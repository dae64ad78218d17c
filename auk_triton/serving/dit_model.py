"""Triton Python-backend model `auk_dit`: text condition in, normalized AuK latents out.

One response per request (not decoupled). Triton's dynamic batcher hands `execute`
requests together, so every input has a leading batch axis of 1 (one clip per
request). Inputs, after that axis:

- PROMPT_EMBEDS FP32 [tokens, 2048]: the fused text condition of AuK's encoder stage
  (the encoder itself is not served here);
- GEN_SECONDS FP32 [1]: target duration (> 0);
- SEED INT64 [1]: the same seed gives the same latents on the same device;
- optional NUM_STEPS INT32 [1], GUIDANCE FP32 [1], SWAY FP32 [1] (checkpoint
  defaults otherwise; a flash checkpoint ignores them), and REF_LATENTS FP32
  [frames, 64]: a source clip's normalized latents, for editing.

Output LATENTS FP32 [1, ceil(50 * GEN_SECONDS), 64]. With `join_between_steps` (the
default), `execute` hands each checked request to a sampling thread and returns: the
request joins the run of its bucket and guidance mode at the run's next step, at its own
time on its own grid (diffusion/joined.py), and its response is sent as it leaves. Without
it, the requests of one `execute` whose sampling can share a run (one time grid, guided
or not; on a GPU, one shape bucket) are sampled together in whole runs, oldest run first,
each run's responses sent as soon as it ends. Either way a run holds at most
`max_batch_requests` requests (on a GPU, as many as the bucket's `max_batch_tokens`
hold). On a GPU the step is compiled and the buckets' step graphs captured in
`initialize`: with `defer_graphs`, the largest
bucket of each reference size before the model is ready and the others after,
on a thread beside `execute` (each bucket's single-request graph first, and
first of all what a run lacked), whose runs meanwhile take the smallest built
bucket that holds them (counted, `kind="larger_bucket"`), or run one request at
a time on their own bucket until its batched graphs are built (`kind="split"`).
A run that finds no graph (a request past the largest bucket) is logged and counted too
(`auk_dit_fallback_runs_total`). A request that breaks a limit (duration, steps,
MAX_LATENT_FRAMES, shapes, non-finite values) gets an error response of its own
(INVALID_ARG) before any sampling and its batch runs without it. A request whose
client is gone stops before sampling or at an Euler step (CANCELLED): each row's client is
asked at most every CANCEL_CHECK_S (requests.py), a round trip that the steps would wait for.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils

from auk_triton.cuda_graph import BuildReport
from auk_triton.diffusion import CompileOptions, SamplingStopped, load_sampler
from auk_triton.diffusion.compiled import INDUCTOR_OPTIONS, traces_note
from auk_triton.diffusion.joined import JoinedRuns
from auk_triton.diffusion.padded_attention import attention_kernel, masked_attention

from .checkpoints import resolve_checkpoint
from .artifacts import precompiled_blocks_dir, use_artifacts
from .config import DiTSettings
from .metrics import DiTMetrics
from .readiness import BUILD_AFTER_READY, BUILT_AFTER_READY, begun_note, server_ready_condition
from .errors import RequestCancelled
from .requests import dit_plan, one_row, throttled_check
from .sampling_thread import SamplingThread
from .triton_common import failure_response, freeze_heap, log
from .triton_io import check_tensor_widths, input_array, instance_device, output_tensor

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


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
        # Buckets and the compiled step serve the CUDA graphs: a CPU pads to the longest row, eagerly.
        graphs = settings.enable_cuda_graphs and self.device.type == "cuda"
        compiled = graphs and settings.compile_step
        options = None
        if compiled:
            artifacts = use_artifacts(settings.artifacts_dir, self.device,
                                      lambda text: log("info", f"{self.name}: {text}"))
            # The blocks' traces are kept beside the compile caches, keyed by what they were traced with.
            traced_with = {"dtype": settings.dtype, "compile": CompileOptions(), "inductor": INDUCTOR_OPTIONS,
                           "fp8_linears": settings.fp8_linears, "attention": attention_kernel(self.device)}
            options = CompileOptions(traces_dir=precompiled_blocks_dir(artifacts, checkpoint, traced_with))
        # A missing auk.safetensors (or config.json) fails the load with the file's name.
        self.sampler = load_sampler(
            checkpoint, self.device, DTYPES[settings.dtype], max_frames=settings.max_frames,
            max_graphs=settings.max_graphs if settings.enable_cuda_graphs else 0,
            buckets=settings.shape_buckets() if graphs else None,
            compile=options, fp8_linears=settings.fp8_linears,
        )
        check_tensor_widths(self.model_config, {
            "PROMPT_EMBEDS": ("text width (dit.text_hidden_dim)", self.sampler.text_dim),
            "REF_LATENTS": ("latent_dim", self.sampler.latent_dim),
            "LATENTS": ("latent_dim", self.sampler.latent_dim),
        })
        fp8 = f", {self.sampler.fp8_linear_count} token linears in FP8" if self.sampler.fp8_linear_count else ""
        log("info", f"{self.name}: loaded {checkpoint} ({self.sampler.variant}, {self.sampler.dtype}{fp8}, "
                     f"CUDA graphs {'on' if self.sampler.graphs else 'off'}, up to "
                     f"{settings.max_batch_requests} requests a run) on {self.device} "
                     f"in {time.perf_counter() - began:.1f} s")
        self.metrics = DiTMetrics({"model": self.name, "version": str(args["model_version"])})
        deferred = self._warm_up(compiled)
        freeze_heap()
        # Built once the whole server is READY: beside another model's warm-up they slow it.
        self.sampler.start_deferred(deferred, on_done=self._deferred_built, begin_when=server_ready_condition())
        self.sampling = None
        if settings.join_between_steps:
            self._seen = self._fallbacks()
            self.joined = JoinedRuns(self.sampler, settings.max_batch_requests, keep_on_device=self._keeps_latents())
            self.sampling = SamplingThread(self.joined, self._answer, after_step=self._after_step,
                                           stream=self._sampling_stream(), admit=self._admission())

    def _sampling_stream(self):
        """The stream the sampling thread queues its steps on; None: its thread's default. A model
        alone in its process has the GPU's queue to itself (the pipeline's DiT does not)."""
        return None

    def _keeps_latents(self):
        """When a lone request's latents may stay on the GPU as it leaves its run (JoinedRuns'
        `keep_on_device`), for a stage in this process; None: never. Alone, this model answers
        with them."""
        return None

    def _admission(self):
        """What a request waits for before it joins the runs (SamplingThread's `admit`); None:
        nothing. Alone, this model answers each request as it leaves; the pipeline's DiT hands
        it to a decoder that may be behind."""
        return None

    def _warm_up(self, compiled: bool) -> list:
        """Capture the buckets' step graphs (compiling the step first, when on) before READY:
        all of them, or with `defer_graphs` the `ready_buckets`, returning the others."""
        if self.sampler.buckets is None or self.sampler.graphs is None:
            return []
        began = time.perf_counter()

        def on_bucket(shape, guided, graphs, seconds):
            log("verbose", f"{self.name}: bucket {shape.text} tokens, {shape.frames} frames, "
                           f"{shape.ref or 'no'} reference frames, {'guided' if guided else 'unguided'}: "
                           f"{graphs} graphs in {seconds:.2f} s")

        deferred = self.sampler.warmup(on_bucket, defer=self.settings.defer_graphs)
        graphs = self.sampler.graphs
        failures = ""
        if graphs.compile_failures:
            failures = f", {graphs.compile_failures} compiled captures FAILED (plain graphs serve them)"
        later = ""
        if deferred:
            later = (f"; {len({(item.shape, item.guided) for item in deferred})} buckets "
                     f"({sum(len(item.requests) for item in deferred)} graphs) {BUILD_AFTER_READY}")
        traces = traces_note(graphs.blocks)
        if traces:
            log("info", f"{self.name}: compiled blocks: {traces}")
        if graphs.blocks.kernels:  # their module imports triton, there when the kernels are
            from auk_triton.diffusion.swiglu_kernel import product_kernel

            log("info", f"{self.name}: padded runs' attention: {masked_attention(self.device)}; "
                        f"feed-forward products: {product_kernel(self.device)}")
        log("warn" if graphs.compile_failures else "info",
            f"{self.name}: {graphs.captures} step graphs of {len(self.sampler.buckets.shapes())} buckets "
            f"{'compiled and ' if compiled else ''}captured in {time.perf_counter() - began:.1f} s{failures}{later}")
        return deferred

    def _deferred_built(self, report: BuildReport) -> None:
        log("warn" if report.failed else "info",
            f"{self.name}: {report.graphs} {BUILT_AFTER_READY} {report.seconds:.1f} s after READY "
            f"({report.built} parts of buckets: a single-request graph, or a bucket's batched ones; "
            f"{report.preferred} built ahead of their turn for a run that lacked them)"
            f"{begun_note(report.waited_s, report.condition_held)}"
            f"{f', {report.failed} FAILED (their runs stay on a larger bucket)' if report.failed else ''}")

    def execute(self, requests):
        """Plan every request; hand the plans to the sampling thread (`join_between_steps`), or
        sample them here in whole runs, sending each run's responses as it ends.

        Responses go through each request's sender (execute returns None), so a run's
        latents reach the pipeline's decoder without waiting for the runs after it."""
        began = time.monotonic()
        senders = [request.get_response_sender() for request in requests]
        planned = []  # (request index, plan)
        for index, request in enumerate(requests):
            try:
                read = one_row(partial(input_array, request))
                planned.append((index, dit_plan(self.sampler, read, self.settings.max_steps,
                                                self.settings.max_prompt_tokens)))
            except Exception as err:
                senders[index].send(failure_response(self.name, "generation", err, request), flags=FINAL)
        if self.sampling is not None:
            for index, plan in planned:
                self.sampling.submit(plan, (senders[index], requests[index]),
                                     throttled_check(requests[index].is_cancelled, began))
            return None
        split = self.sampler.split_runs
        runs = self.sampler.runs([plan for _, plan in planned], self.settings.max_batch_requests)
        if self.sampler.split_runs > split:
            self.metrics.fallback("split", self.sampler.split_runs - split)
        for run in runs:
            rows = [planned[i] for i in run]
            before = self._fallbacks()
            try:
                checks = [throttled_check(requests[index].is_cancelled, began) for index, _ in rows]
                results = self.sampler.generate_batch([plan for _, plan in rows], checks)
            except Exception as err:  # the run itself failed (out of memory): every row of it
                results = [err] * len(rows)
            for (index, _), result in zip(rows, results):
                senders[index].send(self._response(result, requests[index]), flags=FINAL)
            self._count_fallbacks(before, [plan for _, plan in rows])
        return None

    def _answer(self, tag, result) -> None:
        """Send a request's response from the sampling thread."""
        sender, request = tag
        try:
            sender.send(self._response(result, request), flags=FINAL)
        except Exception as err:  # its client is gone; the thread serves the others
            log("warn", f"{self.name}: a response could not be sent: {type(err).__name__}: {err}")

    def _after_step(self, idle: bool) -> None:
        """After each joined step: the step counters, and what the batches built since the last
        step fell back to."""
        self.metrics.steps(self.joined.steps, self.joined.stepped_rows, now=idle)
        before, self._seen = self._seen, self._fallbacks()
        if self._seen != before:
            self._count_fallbacks(before, None)

    def _fallbacks(self) -> dict[str, int]:
        graphs = self.sampler.graphs
        if graphs is None:
            return {}
        return {"capture": graphs.request_captures, "eager": graphs.eager_runs,
                "larger_bucket": self.sampler.pending_runs}

    def _count_fallbacks(self, before: dict[str, int], plans) -> None:
        """Count a run that found no graph of its own bucket (GPU only); log one that found
        none at all (a larger bucket's, while its own is built after READY, is expected)."""
        for kind, count in self._fallbacks().items():
            if count > before[kind]:
                self.metrics.fallback(kind, count - before[kind])
                if kind == "larger_bucket":
                    continue
                if plans is None:
                    log("warn", f"{self.name}: requests joined a run whose shape has no graph captured at load: "
                                f"{'captured now' if kind == 'capture' else 'stepped eagerly'} "
                                f"({count} such runs since load)")
                    continue
                plan = max(plans, key=lambda p: p.frames)
                ref = 0 if plan.ref is None else plan.ref.shape[0]
                log("warn", f"{self.name}: a run of {len(plans)} request(s) up to {plan.text.shape[0]} tokens, "
                            f"{plan.frames} frames, {ref} reference frames has no graph captured at load: "
                            f"{'captured now' if kind == 'capture' else 'stepped eagerly'} "
                            f"({count} such runs since load)")

    def _response(self, result, request):
        if isinstance(result, SamplingStopped):
            return failure_response(self.name, "generation", RequestCancelled(f"request cancelled {result}"), request)
        if isinstance(result, Exception):
            return failure_response(self.name, "generation", result, request)
        latents = result.to("cpu", torch.float32)[None]  # the batch axis of one clip
        return pb_utils.InferenceResponse(output_tensors=[output_tensor("LATENTS", latents)])

    def finalize(self):
        if getattr(self, "sampling", None) is not None:
            for tag in self.sampling.stop():
                self._answer(tag, RuntimeError(f"{self.name} is unloading"))
        if getattr(self, "sampler", None) is not None:
            self.sampler.stop_deferred()
        if getattr(self, "sampler", None) is not None and self.sampler.graphs is not None:
            self.sampler.graphs.clear()
        self.sampler = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
