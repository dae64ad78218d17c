"""The decode models served on a GPU: a real tritonserver serving auk_vae_decode's
configs/gpu.pbtxt (KIND_GPU) with the small synthetic checkpoint and compiled
buckets of 96 and 128 frames (the first window and the tile), so clips are
tiled, and the offline model, which forwards to it, from its one config.pbtxt.

On a GPU a request's latents reach the device through pinned memory and are
checked for NaN and infinite values while the first window decodes. These
tests hold that path to the library's decode and to the CPU-served models'
errors, and check that a refused request's decode leaves nothing behind.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch

from triton_harness import DecodeStream, copy_model_repository, start_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUCKETS = "96,128"  # the first window and the tile
BATCH_FRAMES = "512"  # so windows of several streams share a replay (up to 4 rows here)
CLIP = np.random.default_rng(3).standard_normal((300, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def gpu_triton(tmp_path_factory, small_checkpoint):
    workdir = tmp_path_factory.mktemp("gpu-triton")
    repository = copy_model_repository(workdir / "model_repository")
    for config in repository.glob("*/configs/gpu.pbtxt"):
        text = config.read_text()
        for key, value in (("compile_shapes", BUCKETS), ("batch_frames", BATCH_FRAMES)):
            text, count = re.subn(rf'(key: "{key}", value: \{{ string_value: )"[^"]*"', rf'\1"{value}"', text)
            assert count == 1, f"no {key} parameter in {config}"
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


def test_the_gpu_served_offline_model_refuses_nan_latents_by_name_and_then_decodes_bit_for_bit_as_the_stream_does(
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
    streamed = stream.collect()["clip"].waveform()
    assert offline.shape == streamed.shape
    # Bit for bit: the offline model forwards to the streaming one, whose process holds the one
    # set of weights, graphs and cuDNN algorithms (each decoded alone: not in one replay).
    assert np.array_equal(offline, streamed), f"{np.count_nonzero(offline != streamed)} samples differ"


def test_sixteen_concurrent_gpu_streams_each_stitch_to_the_library_decode(gpu_triton, reference_vae):
    import threading

    clips = [np.random.default_rng(100 + n).standard_normal((40 + 23 * n, 64)).astype(np.float32) for n in range(16)]
    outcomes, failures = {}, []

    def run(n: int) -> None:
        stream = DecodeStream(gpu_triton.grpc_url)
        try:
            stream.send(clips[n], request_id=str(n))
            outcomes[n] = stream.collect(timeout=120)[str(n)]
        except Exception as err:  # reported on the test's thread
            failures.append(f"stream {n}: {err!r}")
        finally:
            stream.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not failures, failures
    for n, latents in enumerate(clips):
        assert outcomes[n].error is None, outcomes[n].error
        with torch.no_grad():
            whole = reference_vae.decode(torch.from_numpy(latents)[None])[0].numpy()
        served = outcomes[n].waveform()
        assert served.shape == whole.shape
        relative = np.linalg.norm(served - whole) / np.linalg.norm(whole)
        assert relative < 1e-2, f"stream {n}: relative L2 {relative:.2e} from the eager decode"


def _server_memory(server) -> tuple[int, int]:
    """(GPU MiB used by the server's processes, their resident KiB)."""
    import subprocess

    pids = {server.process.pid}
    children = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True).stdout
    pids |= {int(pid) for pid in children.split()}
    gpu = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    used = sum(int(mib) for pid, mib in (line.split(",") for line in gpu.strip().splitlines()) if int(pid) in pids)
    rss = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as status:
            rss += next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
    return used, rss


def test_gpu_memory_and_host_memory_stay_flat_over_a_thousand_streams_with_random_cancels(gpu_triton):
    rng = np.random.default_rng(7)

    def burst(count: int, cancel: bool) -> None:
        """`count` requests on one stream, collected, or cancelled while they decode."""
        stream = DecodeStream(gpu_triton.grpc_url)
        try:
            for n in range(count):
                frames = int(rng.integers(20, 400))
                stream.send(rng.standard_normal((frames, 64)).astype(np.float32), request_id=str(n))
            if not cancel:
                outcomes = stream.collect(timeout=300)
                assert all(outcome.error is None for outcome in outcomes.values())
        finally:
            stream.close(cancel=cancel)

    burst(50, cancel=False)  # warm: every graph the traffic needs is captured
    time.sleep(1)
    gpu_before, rss_before = _server_memory(gpu_triton)
    for _ in range(19):
        burst(50, cancel=bool(rng.random() < 0.3))
    burst(10, cancel=False)  # the server still decodes, and every cancelled request has left
    time.sleep(1)
    gpu_after, rss_after = _server_memory(gpu_triton)
    assert gpu_triton.is_ready()
    assert abs(gpu_after - gpu_before) <= 0.05 * gpu_before, (gpu_before, gpu_after)
    assert abs(rss_after - rss_before) <= 0.05 * rss_before, (rss_before, rss_after)
