"""The decode models on a real tritonserver, through the real tritonclient gRPC and HTTP clients."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from auk_triton.codec.decode_graph import DEFAULT_COMPILE_SHAPES, plan_tiles
from triton_harness import documented_pcm16, library_tiles, unregister_shared_memory

HOP = 480
STREAM_MODEL = "auk_vae_decode"
OFFLINE_MODEL = "auk_vae_decode_offline"


def make_latents(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((frames, 64)).astype(np.float32)


def httpclient_input(latents: np.ndarray):
    import tritonclient.http as httpclient

    inp = httpclient.InferInput("LATENTS", list(latents.shape), "FP32")
    inp.set_data_from_numpy(latents)
    return inp


def assert_tiles_match(got: list[tuple[int, np.ndarray]], expected: list[tuple[int, np.ndarray]]) -> None:
    assert [start for start, _ in got] == [start for start, _ in expected]
    for (start, wave), (_, reference) in zip(got, expected):
        assert wave.dtype == np.float32 and wave.shape == reference.shape, f"tile at sample {start}"
        np.testing.assert_allclose(wave, reference, rtol=0, atol=1e-6, err_msg=f"tile at sample {start}")


def test_a_clip_longer_than_several_tiles_streams_one_response_per_tile_that_stitch_to_the_library_decode(
    triton, open_stream, reference_vae
):
    latents = make_latents(300, seed=1)
    expected = library_tiles(reference_vae, latents, triton)
    assert len(expected) >= 4, "the clip should span several tiles"

    stream = open_stream()
    stream.send(latents, request_id="long")
    outcome = stream.collect()["long"]

    assert outcome.error is None
    assert outcome.events == ["tile"] * (len(expected) - 1) + ["tile+final"], "the final flag on the last tile"
    assert_tiles_match(outcome.tiles, expected)
    # The first tile is the short first window (the smallest bucket, less the right context).
    _, right = reference_vae.decode_context_frames()
    assert outcome.tiles[0][1].size == (triton.first_tile_frames - right) * reference_vae.hop_size
    # Each tile starts where the previous one ended.
    ends = [start + wave.size for start, wave in outcome.tiles]
    assert [start for start, _ in outcome.tiles] == [0] + ends[:-1]
    waveform = outcome.waveform()
    assert waveform.shape == (300 * HOP,)
    # The whole-clip decode differs from the tiled one only in float rounding order.
    with torch.no_grad():
        whole = reference_vae.decode(torch.from_numpy(latents)[None])[0].numpy()
    np.testing.assert_allclose(waveform, whole, rtol=0, atol=1e-5)


def test_a_cpu_server_asked_for_fp16_decodes_in_fp32_and_says_so(triton, http_client, reference_vae):
    # The shared server's config asks for fp16 (triton_harness.copy_model_repository).
    assert 'key: "precision", value: { string_value: "fp16" }' in (
        triton.model_repository / STREAM_MODEL / "config.pbtxt").read_text()
    assert f"{STREAM_MODEL}: precision fp16 is for a GPU; cpu decodes in fp32" in triton.log()
    latents = make_latents(40, seed=11)
    waveform = http_client.infer(OFFLINE_MODEL, [httpclient_input(latents)]).as_numpy("WAVEFORM")
    with torch.no_grad():
        expected = reference_vae.decode(torch.from_numpy(latents)[None])[0].numpy()
    np.testing.assert_allclose(waveform, expected, rtol=0, atol=1e-6)


def test_a_one_tile_clip_arrives_as_a_single_response_that_carries_the_final_flag(
    triton, open_stream, reference_vae
):
    latents = make_latents(20, seed=2)
    stream = open_stream()
    stream.send(latents, request_id="short")
    outcome = stream.collect()["short"]

    assert outcome.error is None
    assert outcome.events == ["tile+final"], "no empty final response after the only tile"
    assert_tiles_match(outcome.tiles, library_tiles(reference_vae, latents, triton))


def test_several_concurrent_streams_each_get_their_own_tiles_in_order(triton, open_stream, reference_vae):
    # Three streams at once; the last one carries two requests whose responses interleave on it.
    jobs = {
        0: {"a": make_latents(140, seed=10)},
        1: {"b": make_latents(130, seed=11)},
        2: {"c": make_latents(70, seed=12), "d": make_latents(9, seed=13)},
    }
    streams = {index: open_stream() for index in jobs}
    outcomes, failures = {}, []

    def run(index: int) -> None:
        try:
            for request_id, latents in jobs[index].items():
                streams[index].send(latents, request_id=request_id)
            outcomes.update(streams[index].collect(timeout=300))
        except Exception as err:  # reported below, on the test's thread
            failures.append(f"stream {index}: {err!r}")

    threads = [threading.Thread(target=run, args=(index,)) for index in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=360)
    assert not failures, failures
    assert sorted(outcomes) == ["a", "b", "c", "d"]
    for index, requests in jobs.items():
        for request_id, latents in requests.items():
            outcome = outcomes[request_id]
            expected = library_tiles(reference_vae, latents, triton)
            assert outcome.error is None, outcome.error
            assert outcome.events == ["tile"] * (len(expected) - 1) + ["tile+final"], request_id
            assert_tiles_match(outcome.tiles, expected)


def test_a_cancelled_stream_ends_early_and_the_server_keeps_serving(triton, open_stream, reference_vae):
    labels = {"model": STREAM_MODEL}
    tiles_before = triton.metric("auk_vae_tiles_sent_total", **labels)
    notice = "cancelled after the tile"
    notices_before = triton.log().count(notice)
    latents = make_latents(4000, seed=20)  # about 60 tiles of 128 frames: many seconds on the CPU
    left, right = reference_vae.decode_context_frames()
    total_tiles = len(
        plan_tiles(latents.shape[0], triton.tile_frames, left, right, DEFAULT_COMPILE_SHAPES, triton.first_tile_frames)
    )

    stream = open_stream()
    stream.send(latents, request_id="cancel-me")
    request_id, outcome = stream.next_event(timeout=120)
    assert outcome.events == ["tile"], outcome.error
    stream.close(cancel=True)

    # The model notices between tiles, logs it, and stops: the tile counter ends well short of the clip.
    deadline = time.monotonic() + 120
    while triton.log().count(notice) == notices_before:
        assert time.monotonic() < deadline, "the server never reported the cancellation"
        time.sleep(0.2)
    sent = triton.metric("auk_vae_tiles_sent_total", **labels) - tiles_before
    assert sent < total_tiles / 2, f"{sent} of {total_tiles} tiles were decoded"
    assert triton.is_ready()

    fresh = open_stream()
    fresh.send(make_latents(20, seed=21), request_id="after")
    after = fresh.collect()["after"]
    assert after.error is None and after.events == ["tile+final"]


@pytest.mark.parametrize("frames", [20, 129, 300], ids=["one-window", "first-window-and-a-tile", "several-tiles"])
def test_the_offline_model_gives_the_bit_identical_audio_of_the_stream_for_the_same_latents(
    triton, http_client, open_stream, frames
):
    import tritonclient.http as httpclient

    latents = make_latents(frames, seed=30 + frames)
    tensor = httpclient.InferInput("LATENTS", list(latents.shape), "FP32")
    tensor.set_data_from_numpy(latents, binary_data=True)
    result = http_client.infer(OFFLINE_MODEL, [tensor])
    waveform = result.as_numpy("WAVEFORM")
    assert waveform.dtype == np.float32 and waveform.shape == (frames * HOP,)
    assert result.as_numpy("START_SAMPLE").tolist() == [0]

    # Decoded alone after it (a replay of several windows may round differently).
    stream = open_stream()
    stream.send(latents, request_id="same")
    streamed = stream.collect()["same"]
    assert streamed.error is None
    assert (len(streamed.tiles) > 1) == (frames > triton.first_tile_frames), "the short first window, then tiles"
    # The offline model forwards to the streaming one: the same process, graphs and weights.
    assert np.array_equal(waveform, streamed.waveform())


def test_a_stream_asking_for_pcm16_gets_int16_tiles_that_are_the_documented_conversion_of_the_float_tiles(
    triton, open_stream
):
    latents = make_latents(260, seed=50)
    stream = open_stream()
    stream.send(latents, request_id="float")  # no outputs named: all of them, so float32
    stream.send(latents, request_id="pcm16", outputs=["WAVEFORM_PCM16", "START_SAMPLE"])
    outcomes = stream.collect()
    floats, pcm = outcomes["float"], outcomes["pcm16"]
    assert floats.error is None and pcm.error is None
    assert all(wave.dtype == np.float32 for _, wave in floats.tiles)
    assert all(wave.dtype == np.int16 for _, wave in pcm.tiles)
    assert pcm.events == floats.events and len(pcm.tiles) > 1
    assert [start for start, _ in pcm.tiles] == [start for start, _ in floats.tiles]
    for (start, samples), (_, wave) in zip(pcm.tiles, floats.tiles):
        np.testing.assert_array_equal(samples, documented_pcm16(wave), err_msg=f"tile at sample {start}")


def test_the_offline_model_sends_pcm16_only_when_asked_for_it_and_not_for_the_float_waveform(http_client):
    import tritonclient.http as httpclient

    latents = make_latents(90, seed=51)
    tensor = httpclient.InferInput("LATENTS", list(latents.shape), "FP32")
    tensor.set_data_from_numpy(latents, binary_data=True)

    def infer(*names):
        outputs = [httpclient.InferRequestedOutput(name, binary_data=True) for name in names] or None
        return http_client.infer(OFFLINE_MODEL, [tensor], outputs=outputs)

    everything = infer()
    assert everything.as_numpy("WAVEFORM_PCM16") is None, "all outputs requested: the float32 waveform alone"
    waveform = everything.as_numpy("WAVEFORM")
    pcm = infer("WAVEFORM_PCM16", "START_SAMPLE")
    assert pcm.as_numpy("WAVEFORM") is None
    samples = pcm.as_numpy("WAVEFORM_PCM16")
    assert samples.dtype == np.int16 and samples.shape == (90 * HOP,)
    np.testing.assert_array_equal(samples, documented_pcm16(waveform))
    both = infer("WAVEFORM", "WAVEFORM_PCM16")
    np.testing.assert_array_equal(both.as_numpy("WAVEFORM"), waveform)
    assert both.as_numpy("WAVEFORM_PCM16") is None


def test_http_generate_stream_on_the_decoupled_model_takes_a_flat_array_and_streams_every_tile(
    triton, reference_vae
):
    latents = make_latents(150, seed=40)
    body = json.dumps({"LATENTS": latents.reshape(-1).tolist()}).encode()
    request = urllib.request.Request(
        f"http://{triton.http_url}/v2/models/{STREAM_MODEL}/generate_stream",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=300) as reply:
        assert reply.status == 200
        for raw in reply:
            line = raw.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:") :]))
    assert events and all("error" not in event for event in events), events[:1]
    tiles = [
        (int(np.ravel(event["START_SAMPLE"])[0]), np.asarray(event["WAVEFORM"], dtype=np.float32))
        for event in events
        if "WAVEFORM" in event
    ]
    assert_tiles_match(tiles, library_tiles(reference_vae, latents, triton))


def counts_of_earlier_requests_reported() -> None:
    """The decode model reports its counters a few milliseconds after a request ends, the
    offline model's requests' among them: a test that counts its own waits for the earlier
    tests' to arrive first."""
    time.sleep(0.2)


def wait_for_metric(triton, name: str, at_least: float, timeout: float = 30, **labels) -> float:
    """The model reports its counters a few milliseconds after a request ends: poll until `name` gets there."""
    deadline = time.monotonic() + timeout
    while (value := triton.metric(name, **labels)) < at_least:
        assert time.monotonic() < deadline, f"{name} stayed at {value}, short of {at_least}"
        time.sleep(0.05)
    return value


def test_metrics_count_tiles_audio_seconds_decode_and_send_time(triton, open_stream):
    counts_of_earlier_requests_reported()
    labels = {"model": STREAM_MODEL}
    names = ("auk_vae_tiles_sent_total", "auk_vae_audio_seconds_total", "auk_vae_send_seconds_total")
    before = {name: triton.metric(name, **labels) for name in names}
    eager_before = triton.metric("auk_vae_decode_seconds_total", tier="eager", **labels)

    # Three requests back to back: their counters may be reported together, and must add up.
    lengths = {"counted-1": 140, "counted-2": 20, "counted-3": 75}
    stream = open_stream()
    for request_id, frames in lengths.items():
        stream.send(make_latents(frames, seed=50 + frames), request_id=request_id)
    outcomes = stream.collect()
    assert all(outcome.error is None for outcome in outcomes.values())
    tiles = sum(len(outcome.tiles) for outcome in outcomes.values())
    assert tiles > len(lengths)  # the 140-frame clip takes more than one tile

    wait_for_metric(triton, names[0], before[names[0]] + tiles, **labels)
    time.sleep(0.2)  # nothing more arrives after the last report
    assert triton.metric("auk_vae_tiles_sent_total", **labels) - before[names[0]] == tiles
    audio = triton.metric("auk_vae_audio_seconds_total", **labels) - before[names[1]]
    assert audio == pytest.approx(sum(lengths.values()) * HOP / 24000, rel=1e-6)
    # On the CPU every tile is eager.
    assert triton.metric("auk_vae_decode_seconds_total", tier="eager", **labels) > eager_before
    assert triton.metric("auk_vae_send_seconds_total", **labels) > before[names[2]]
    text = triton.metrics()
    for name in ("auk_vae_graph_captures_total", "auk_vae_graph_generations_retired_total"):
        assert re.search(rf'^{name}{{model="{STREAM_MODEL}"', text, re.MULTILINE), name
    # Triton's own metrics are still there, next to ours.
    assert "nv_inference_request_success" in text


def test_an_offline_request_s_tiles_are_counted_once_by_the_decode_model_that_decoded_them(
    triton, http_client, reference_vae
):
    import tritonclient.http as httpclient

    counts_of_earlier_requests_reported()
    labels = {"model": STREAM_MODEL}
    before = triton.metric("auk_vae_tiles_sent_total", **labels)
    audio_before = triton.metric("auk_vae_audio_seconds_total", **labels)
    served_before = triton.metric("nv_inference_request_success", model=OFFLINE_MODEL)
    frames = 150
    latents = make_latents(frames, seed=60)
    tiles = len(library_tiles(reference_vae, latents, triton))
    assert tiles > 1
    tensor = httpclient.InferInput("LATENTS", [frames, 64], "FP32")
    tensor.set_data_from_numpy(latents)
    assert http_client.infer(OFFLINE_MODEL, [tensor]).as_numpy("WAVEFORM").shape == (frames * HOP,)

    wait_for_metric(triton, "auk_vae_tiles_sent_total", before + tiles, **labels)
    time.sleep(0.2)  # nothing more arrives after the last report
    assert triton.metric("auk_vae_tiles_sent_total", **labels) - before == tiles
    audio = triton.metric("auk_vae_audio_seconds_total", **labels) - audio_before
    assert audio == pytest.approx(frames * HOP / 24000, rel=1e-6)
    # Not counted a second time under the offline model, which Triton counts as one request.
    assert not re.search(rf'^auk_vae_tiles_sent_total{{model="{OFFLINE_MODEL}"', triton.metrics(), re.MULTILINE)
    assert triton.metric("nv_inference_request_success", model=OFFLINE_MODEL) - served_before == 1


def test_a_same_host_client_gets_the_waveform_through_system_shared_memory(triton, http_client):
    """Triton's system shared-memory extension, as a client on the server's host uses it: the
    latents read from one region, the PCM16 waveform written into another, nothing of either in
    the gRPC messages. The offline model (one response) and a one-window stream both fill the output
    region with the samples the HTTP path returns; a region too small is an error naming the output
    and the size it needs."""
    from multiprocessing import shared_memory

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    frames = triton.first_tile_frames  # a clip no longer than the first window is one response
    latents = make_latents(frames, seed=61)
    samples = frames * HOP
    tensor = httpclient.InferInput("LATENTS", list(latents.shape), "FP32")
    tensor.set_data_from_numpy(latents, binary_data=True)
    reference = http_client.infer(
        OFFLINE_MODEL, [tensor], outputs=[httpclient.InferRequestedOutput("WAVEFORM_PCM16", binary_data=True)]
    ).as_numpy("WAVEFORM_PCM16")

    tag = f"auk_test_{os.getpid()}"
    regions = {
        "in": shared_memory.SharedMemory(name=f"{tag}_in", create=True, size=latents.nbytes),
        "out": shared_memory.SharedMemory(name=f"{tag}_out", create=True, size=2 * samples),
    }
    np.ndarray(latents.shape, np.float32, buffer=regions["in"].buf)[:] = latents
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        for key, region in regions.items():
            client.register_system_shared_memory(f"{tag}_{key}", f"/{tag}_{key}", region.size)
        inputs = [grpcclient.InferInput("LATENTS", list(latents.shape), "FP32")]
        inputs[0].set_shared_memory(f"{tag}_in", latents.nbytes)

        def outputs(size: int):
            wave = grpcclient.InferRequestedOutput("WAVEFORM_PCM16")
            wave.set_shared_memory(f"{tag}_out", size)
            return [wave, grpcclient.InferRequestedOutput("START_SAMPLE")]

        def region_samples() -> np.ndarray:
            return np.ndarray((samples,), np.int16, buffer=regions["out"].buf).copy()

        result = client.infer(OFFLINE_MODEL, inputs, outputs=outputs(2 * samples))
        assert [len(raw) for raw in result.get_response().raw_output_contents] == [0, 8], "START_SAMPLE alone travels"
        np.testing.assert_array_equal(region_samples(), reference)

        np.ndarray((samples,), np.int16, buffer=regions["out"].buf)[:] = 0
        responses = []
        client.start_stream(callback=lambda result, error: responses.append((result, error)))
        client.async_stream_infer(STREAM_MODEL, inputs, outputs=outputs(2 * samples))
        client.stop_stream()  # waits for the stream to finish
        assert len(responses) == 1 and responses[0][1] is None
        np.testing.assert_array_equal(region_samples(), reference)

        with pytest.raises(Exception, match=rf"output 'WAVEFORM_PCM16' .*at least {2 * samples} bytes"):
            client.infer(OFFLINE_MODEL, inputs, outputs=outputs(samples))
        assert triton.is_ready()
    finally:
        try:
            unregister_shared_memory(client, [f"{tag}_{key}" for key in regions])
        finally:
            client.close()
            for region in regions.values():
                region.close()
                region.unlink()


def test_the_scheduler_reports_replays_first_audio_and_active_requests(triton, open_stream):
    counts_of_earlier_requests_reported()
    labels = {"model": STREAM_MODEL}
    replays_before = triton.metric("auk_vae_windows_per_replay_count", **labels)
    windows_before = triton.metric("auk_vae_windows_per_replay_sum", **labels)
    first_before = triton.metric("auk_vae_first_audio_seconds_count", **labels)
    stream = open_stream()
    lengths = {"m-1": 150, "m-2": 40, "m-3": 20}
    for request_id, frames in lengths.items():
        stream.send(make_latents(frames, seed=70 + frames), request_id=request_id)
    outcomes = stream.collect()
    tiles = sum(len(outcome.tiles) for outcome in outcomes.values())
    wait_for_metric(triton, "auk_vae_windows_per_replay_sum", windows_before + tiles, **labels)
    time.sleep(0.2)  # nothing more arrives after the last report
    assert triton.metric("auk_vae_windows_per_replay_sum", **labels) - windows_before == tiles
    assert triton.metric("auk_vae_first_audio_seconds_count", **labels) - first_before == len(lengths)
    replays = triton.metric("auk_vae_windows_per_replay_count", **labels) - replays_before
    assert 1 <= replays <= tiles
    assert triton.metric("auk_vae_active_requests", **labels) == 0, "every request has left the scheduler"
    assert re.search(rf'^auk_vae_underruns_total{{model="{STREAM_MODEL}"', triton.metrics(), re.MULTILINE)
