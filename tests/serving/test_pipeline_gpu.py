"""auk_pipeline served on a GPU (skipped without one): both stages in one process, from its
configs/gpu.pbtxt (KIND_GPU), the small synthetic checkpoint and small buckets, the DiT
capturing some of its graphs after READY. Beside it, auk_dit and auk_vae_decode in processes
of their own give each request's reference: the decode of the latents auk_dit samples for it."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from triton_harness import checkpoint_with_dit, copy_model_repository, start_triton

from auk_triton.serving.readiness import BUILD_AFTER_READY, BUILT_AFTER_READY

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("tritonclient.grpc")
from auk_client.pipeline import generate_latents, random_prompt_embeds, stream_pipeline  # noqa: E402
from auk_client.stream import assemble, stream_decode  # noqa: E402

MODELS = ("auk_vae_decode", "auk_dit", "auk_pipeline")
# Two target sizes per stage, so each stage defers some of its graphs past READY.
PARAMETERS = {"compile_shapes": "96,128", "text_buckets": "16", "frame_buckets": "64,128", "ref_buckets": "none",
              "max_batch_requests": "4"}
BUILT_S = 600.0
REQUESTS = [dict(prompt_embeds=random_prompt_embeds(5 + i, seed=70 + i), seconds=secs, seed=80 + i, num_steps=3)
            for i, secs in enumerate([1.0, 2.5, 0.7, 2.0, 1.3, 2.4])]


@pytest.fixture(scope="module")
def gpu_pipeline(tmp_path_factory, small_checkpoint):
    workdir = tmp_path_factory.mktemp("gpu-pipeline")
    checkpoint = checkpoint_with_dit(small_checkpoint, workdir / "checkpoint")
    repository = copy_model_repository(workdir / "model_repository", models=MODELS)
    for config in repository.glob("*/configs/gpu.pbtxt"):
        text = config.read_text()
        for key, value in PARAMETERS.items():
            text = re.sub(rf'(key: "{key}", value: \{{ string_value: )"[^"]*"', rf'\1"{value}"', text)
        config.write_text(text)
    server = start_triton(workdir, repository, checkpoint, device="gpu", extra_args=["--exit-timeout-secs=3"])
    yield server
    server.stop()


def _built_lines(server) -> list[str]:
    """auk_pipeline's reports of its stages' builds after READY, once each stage that left graphs
    for after READY has reported."""
    deadline = time.monotonic() + BUILT_S
    while time.monotonic() < deadline:
        lines = [line for line in server.log().splitlines() if "auk_pipeline:" in line]
        deferring = [line for line in lines if BUILD_AFTER_READY in line]
        built = [line for line in lines if BUILT_AFTER_READY in line]
        if deferring and len(built) == len(deferring):
            return built
        time.sleep(1.0)
    raise AssertionError(f"auk_pipeline's stages did not report their builds within {BUILT_S:.0f} s")


def test_the_stages_build_their_deferred_graphs_in_one_process_and_none_fails(gpu_pipeline):
    lines = _built_lines(gpu_pipeline)
    assert not [line for line in lines if "FAILED" in line], lines


def test_concurrent_gpu_pipeline_streams_are_each_the_decode_of_their_own_latents_and_capture_nothing(
    gpu_pipeline,
):
    _built_lines(gpu_pipeline)
    url = gpu_pipeline.grpc_url
    captures = gpu_pipeline.metric("auk_dit_fallback_runs_total", model="auk_pipeline", kind="capture")
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        streamed = list(pool.map(lambda r: assemble(list(stream_pipeline(**r, url=url))), REQUESTS))
    for request, audio in zip(REQUESTS, streamed):
        expected = assemble(list(stream_decode(generate_latents(**request, url=url), url=url, timeout=600)))
        assert audio.shape == expected.shape
        # Another process, another batch: the same bf16 graphs of the bucket, and fp16 decodes.
        error = np.linalg.norm(audio - expected) / np.linalg.norm(expected)
        assert error < 2e-2, error
    assert gpu_pipeline.metric("auk_dit_fallback_runs_total", model="auk_pipeline", kind="capture") == captures
