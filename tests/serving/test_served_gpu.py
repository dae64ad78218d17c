"""The decode models served on a GPU: a real tritonserver serving their
configs/gpu.pbtxt (KIND_GPU) with the small synthetic checkpoint and compiled
buckets of 96 and 128 frames (the first window and the tile), so clips are
tiled.

On a GPU a request's latents reach the device through pinned memory and are
checked for NaN and infinite values while the first window decodes. These
tests hold that path to the library's decode and to the CPU-served models'
errors, and check that a refused request's decode leaves nothing behind.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from triton_harness import DecodeStream, copy_model_repository, start_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUCKETS = "96,128"  # the first window and the tile
CLIP = np.random.default_rng(3).standard_normal((300, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def gpu_triton(tmp_path_factory, small_checkpoint):
    workdir = tmp_path_factory.mktemp("gpu-triton")
    repository = copy_model_repository(workdir / "model_repository")
    for config in repository.glob("*/configs/gpu.pbtxt"):
        text, count = re.subn(r'(key: "compile_shapes", value: \{ string_value: )"[^"]*"', rf'\1"{BUCKETS}"',
                              config.read_text())
        assert count == 1, f"no compile_shapes parameter in {config}"
        config.write_text(text)
    server = start_triton(workdir, repository, small_checkpoint, device="gpu")
    yield server
    server.stop()


@pytest.fixture
def stream(gpu_triton):
    stream = DecodeStream(gpu_triton.grpc_url)
    yield stream
    stream.close()


def with_value(value: float) -> np.ndarray:
    latents = CLIP.copy()
    latents[3, 5] = value
    return latents


def test_a_gpu_served_stream_is_the_library_decode_within_the_fast_paths_tolerance(stream, reference_vae):
    stream.send(CLIP, request_id="clip")
    outcome = stream.collect()["clip"]
    assert outcome.error is None
    assert len(outcome.tiles) > 1, "the clip spans several windows"
    assert [start for start, _ in outcome.tiles] == list(np.cumsum([0] + [len(w) for _, w in outcome.tiles[:-1]]))
    with torch.no_grad():
        whole = reference_vae.decode(torch.from_numpy(CLIP)[None])[0].numpy()
    served = outcome.waveform()
    assert served.shape == whole.shape
    # Compiled, channels-last and fused-activation decodes sit about 1e-3 from eager fp32.
    relative = np.linalg.norm(served - whole) / np.linalg.norm(whole)
    assert relative < 1e-2, f"relative L2 {relative:.2e} from the eager decode"


@pytest.mark.parametrize("value, words", [(np.nan, ["NaN", "frame 3"]), (np.inf, ["infinite", "frame 3"])])
def test_a_gpu_served_stream_refuses_non_finite_latents_by_name_and_then_decodes_as_before(stream, value, words):
    stream.send(CLIP, request_id="before")
    stream.collect()
    stream.send(with_value(value), request_id="bad")
    bad = stream.collect()["bad"]
    assert bad.events == ["error"] and bad.tiles == [], "no tile of a refused clip is sent"
    for word in ["LATENTS", *words]:
        assert word in bad.error, f"{word!r} not in {bad.error!r}"
    stream.send(CLIP, request_id="after")
    outcomes = stream.collect()
    np.testing.assert_array_equal(outcomes["after"].waveform(), outcomes["before"].waveform())


def test_the_gpu_served_offline_model_refuses_nan_latents_by_name_and_then_sends_the_streams_samples(
    gpu_triton, stream
):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(gpu_triton.http_url, network_timeout=300)

    def infer(latents: np.ndarray) -> np.ndarray:
        tensor = httpclient.InferInput("LATENTS", list(latents.shape), "FP32")
        tensor.set_data_from_numpy(latents)
        return client.infer("auk_vae_decode_offline", [tensor]).as_numpy("WAVEFORM")

    try:
        with pytest.raises(InferenceServerException, match="LATENTS holds 1 NaN .* frame 3"):
            infer(with_value(np.nan))
        offline = infer(CLIP)
    finally:
        client.close()
    stream.send(CLIP, request_id="clip")
    np.testing.assert_array_equal(offline, stream.collect()["clip"].waveform())
