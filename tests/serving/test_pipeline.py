"""auk_dit and auk_pipeline (both stages in one process) on a real tritonserver (CPU, small synthetic weights)."""

from __future__ import annotations

import json
import shutil
import wave

import numpy as np
import pytest
from triton_harness import REPO_ROOT, checkpoint_with_dit, closed_port, copy_model_repository, start_triton

pytest.importorskip("tritonclient.grpc")
from auk_client.cli import main as auk_client_main  # noqa: E402
from auk_client.pipeline import generate_latents, random_prompt_embeds, stream_pipeline  # noqa: E402
from auk_client.stream import AuKClientError, assemble, stream_decode  # noqa: E402

HOP = 480
DIT_MODELS = ("auk_dit", "auk_pipeline")


@pytest.fixture(scope="module")
def pipeline_server(tmp_path_factory, small_checkpoint):
    """The streaming decoder (small tiles), auk_dit and auk_pipeline on one server."""
    workdir = tmp_path_factory.mktemp("pipeline")
    checkpoint = checkpoint_with_dit(small_checkpoint, workdir / "checkpoint")
    repository = copy_model_repository(workdir / "model_repository", models=("auk_vae_decode", "auk_pipeline"))
    shutil.copytree(REPO_ROOT / "model_repository" / "auk_dit", repository / "auk_dit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # A gRPC stream left open after its requests keeps its model "live" for the whole exit
    # timeout at shutdown (Triton 2.51): do not wait the default 30 s.
    server = start_triton(workdir, repository, checkpoint, extra_args=["--exit-timeout-secs=3"])
    yield server
    server.stop()


def _stitch(tiles):
    starts = [t.start_sample for t in tiles]
    assert starts == sorted(starts) and starts[0] == 0
    assert starts[1:] == [t.end_sample for t in tiles[:-1]], "each tile starts where the previous one ended"
    return assemble(tiles)


def test_pipeline_streams_the_decode_of_the_dit_latents(pipeline_server):
    url = pipeline_server.grpc_url
    embeds = random_prompt_embeds(9, seed=0)
    request = dict(prompt_embeds=embeds, seconds=6.0, seed=11, num_steps=4)  # CFG on: the default 2.0

    tiles = list(stream_pipeline(**request, url=url))  # returns only after the final flag
    assert len(tiles) >= 3, "300 frames in 128-frame tiles span several responses"
    audio = _stitch(tiles)

    latents = generate_latents(**request, url=url)
    assert latents.shape == (300, 64) and latents.dtype == np.float32 and np.isfinite(latents).all()
    expected = assemble(list(stream_decode(latents, url=url, timeout=600)))
    assert audio.shape == (300 * HOP,)
    np.testing.assert_array_equal(audio, expected)

    # Same seed, same latents; another seed, others.
    np.testing.assert_array_equal(generate_latents(**request, url=url), latents)
    assert not np.array_equal(generate_latents(**{**request, "seed": 12}, url=url), latents)
    assert "auk_pipeline: no short first window while the DiT holds requests back" in pipeline_server.log(), \
        "first_tile_at_saturation is off as shipped"


def test_optional_inputs_reach_the_dit_through_the_pipeline(pipeline_server):
    url = pipeline_server.grpc_url
    embeds = random_prompt_embeds(4, seed=1)
    ref = np.random.default_rng(0).standard_normal((20, 64)).astype(np.float32)
    knobs = dict(num_steps=2, guidance=0.0, sway=0.0, ref_latents=ref)
    latents = generate_latents(embeds, 0.1, 3, url=url, **knobs)
    assert latents.shape == (5, 64)  # 0.1 s sent as FP32 is still 5 frames
    assert not np.array_equal(latents, generate_latents(embeds, 0.1, 3, url=url, num_steps=2))
    audio = assemble(list(stream_pipeline(embeds, 0.1, 3, url=url, **knobs)))
    np.testing.assert_array_equal(audio, assemble(list(stream_decode(latents, url=url, timeout=600))))


def test_dit_over_http(pipeline_server):
    import tritonclient.http as httpclient

    from auk_client.pipeline import pipeline_inputs

    embeds = random_prompt_embeds(3, seed=2)
    client = httpclient.InferenceServerClient(pipeline_server.http_url, network_timeout=120)
    try:
        result = client.infer("auk_dit", pipeline_inputs(httpclient, embeds, 0.2, 4, num_steps=2, batch_axis=True))
    finally:
        client.close()
    np.testing.assert_array_equal(
        result.as_numpy("LATENTS")[0], generate_latents(embeds, 0.2, 4, url=pipeline_server.grpc_url, num_steps=2)
    )


BAD_REQUESTS = [
    (dict(seconds=0.0), "positive number of seconds"),
    (dict(seconds=-2.0), "positive number of seconds"),
    (dict(seconds=float("nan")), "positive number of seconds"),
    (dict(num_steps=0), "at least 1"),
    (dict(num_steps=5000), "max_steps"),
    (dict(sway=-5.0), "strictly increase"),
    (dict(guidance=float("inf")), "guidance must be finite"),
    (dict(prompt_embeds=np.full((2, 2048), np.nan, np.float32)), "finite"),
    (dict(prompt_embeds=np.zeros((2, 1024), np.float32)), "PROMPT_EMBEDS"),  # Triton's shape check
    (dict(ref_latents=np.zeros((65536, 64), np.float32)), "MAX_LATENT_FRAMES"),
    (dict(seconds=3600.0), "180000 target frames exceed this model's max_frames of 30000"),
]


@pytest.mark.parametrize("model", ["auk_pipeline", "auk_dit"])
def test_bad_inputs_get_errors_and_the_server_keeps_serving(pipeline_server, model):
    url = pipeline_server.grpc_url
    base = dict(prompt_embeds=random_prompt_embeds(2, seed=3), seconds=0.2, seed=0, num_steps=2)
    for change, message in BAD_REQUESTS:
        request = {**base, **change}
        with pytest.raises(AuKClientError, match=message):
            if model == "auk_pipeline":
                list(stream_pipeline(**request, url=url, check=False, timeout=60))
            else:
                generate_latents(**request, url=url, check=False, timeout=60)
    assert pipeline_server.is_ready()
    tiles = list(stream_pipeline(**base, url=url))
    assert _stitch(tiles).shape == (10 * HOP,)


def test_missing_inputs_are_refused(pipeline_server):
    import tritonclient.grpc as grpcclient

    from auk_client.pipeline import pipeline_inputs

    inputs = pipeline_inputs(grpcclient, random_prompt_embeds(2, seed=0), 0.2, 0, batch_axis=True)
    client = grpcclient.InferenceServerClient(pipeline_server.grpc_url)
    try:
        with pytest.raises(Exception, match="SEED"):
            client.infer("auk_dit", [i for i in inputs if i.name() != "SEED"])
    finally:
        client.close()


# What a client gets for a mistake of its own and for a failure of the model, per protocol.
INVALID = {"grpc": "StatusCode.INVALID_ARGUMENT", "http": "400"}
INTERNAL = {"grpc": "StatusCode.INTERNAL", "http": "500"}
# Prompt embeddings at the float32 limit pass every request check (they are finite) and
# overflow the DiT's attention: the sampler's own check of its output fails the generation.
OVERFLOWING_EMBEDS = np.full((2, 2048), 3e38, np.float32)
OVERFLOW_FAILURE = "generation failed: NonFiniteLatents: the DiT produced non-finite latents"


def dit_inputs(module, prompt_embeds, seconds, seed, num_steps=None, guidance=None, sway=None, ref_latents=None,
               batch_axis=True):
    """auk_dit's inputs (each with its batch axis of 1), or with `batch_axis=False` auk_pipeline's,
    as `module` (tritonclient.grpc or .http) builds them."""
    from tritonclient.utils import np_to_triton_dtype

    arrays = {
        "PROMPT_EMBEDS": prompt_embeds,
        "GEN_SECONDS": None if seconds is None else np.array([seconds], np.float32),
        "SEED": np.array([seed], np.int64),
        "NUM_STEPS": None if num_steps is None else np.array([num_steps], np.int32),
        "GUIDANCE": None if guidance is None else np.array([guidance], np.float32),
        "SWAY": None if sway is None else np.array([sway], np.float32),
        "REF_LATENTS": ref_latents,
    }
    inputs = []
    for name, array in arrays.items():
        if array is not None:
            array = array[None] if batch_axis else array
            inputs.append(module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)))
            inputs[-1].set_data_from_numpy(array)
    return inputs


@pytest.fixture(params=["grpc", "http"])
def dit_client(request, pipeline_server):
    """(protocol, tritonclient module, client) for the pipeline server."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    if request.param == "grpc":
        module, client = grpcclient, grpcclient.InferenceServerClient(pipeline_server.grpc_url)
    else:
        module, client = httpclient, httpclient.InferenceServerClient(pipeline_server.http_url, network_timeout=120)
    yield request.param, module, client
    client.close()


def dit_base():
    return dict(prompt_embeds=random_prompt_embeds(2, seed=3), seconds=0.2, seed=0, num_steps=2)


@pytest.mark.parametrize("change, message", BAD_REQUESTS, ids=[str(change) for change, _ in BAD_REQUESTS])
def test_a_bad_dit_request_is_a_client_error_naming_the_problem(dit_client, change, message):
    import re

    from tritonclient.utils import InferenceServerException

    protocol, module, client = dit_client
    with pytest.raises(InferenceServerException) as caught:
        client.infer("auk_dit", dit_inputs(module, **{**dit_base(), **change}))
    assert caught.value.status() == INVALID[protocol], caught.value
    assert re.search(message, caught.value.message()), caught.value.message()


def test_a_dit_generation_that_fails_is_an_internal_error_and_the_model_keeps_serving(dit_client):
    from tritonclient.utils import InferenceServerException

    protocol, module, client = dit_client
    with pytest.raises(InferenceServerException) as caught:
        client.infer("auk_dit", dit_inputs(module, **{**dit_base(), "prompt_embeds": OVERFLOWING_EMBEDS}))
    assert caught.value.status() == INTERNAL[protocol], caught.value
    assert OVERFLOW_FAILURE in caught.value.message()
    assert client.infer("auk_dit", dit_inputs(module, **dit_base())).as_numpy("LATENTS").shape == (1, 10, 64)


def pipeline_stream_error(url: str, parameters: dict | None = None, **request) -> str:
    """The error an auk_pipeline gRPC stream ends with: its message (a stream's error carries no
    status; see test_bad_input.py). `parameters`: the request's."""
    import queue

    import tritonclient.grpc as grpcclient

    events = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: events.put(error))
        client.async_stream_infer("auk_pipeline", dit_inputs(grpcclient, **request, batch_axis=False),
                                  parameters=parameters)
        error = events.get(timeout=120)
        client.stop_stream()
    finally:
        client.close()
    assert error is not None, "the pipeline sent a tile"
    return error.message()


def pipeline_over_http(url: str, **request) -> tuple[int, str]:
    """(status, body) of auk_pipeline over HTTP generate_stream (flat arrays, scalars as numbers)."""
    import json
    import urllib.error
    import urllib.request

    body = {"PROMPT_EMBEDS": request["prompt_embeds"].reshape(-1).tolist(), "GEN_SECONDS": request["seconds"],
            "SEED": request["seed"], "NUM_STEPS": request["num_steps"]}
    post = urllib.request.Request(f"http://{url}/v2/models/auk_pipeline/generate_stream", json.dumps(body).encode())
    try:
        with urllib.request.urlopen(post, timeout=120) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_a_bad_request_through_the_pipeline_is_a_400_naming_the_problem_and_a_failing_one_names_the_failure(
    pipeline_server,
):
    refused = {**dit_base(), "num_steps": 5000}
    status, body = pipeline_over_http(pipeline_server.http_url, **refused)
    assert status == 400 and "max_steps" in body, (status, body)
    message = pipeline_stream_error(pipeline_server.grpc_url, **refused)
    assert "max_steps" in message and "failed" not in message, message
    message = pipeline_stream_error(pipeline_server.grpc_url, **{**dit_base(), "prompt_embeds": OVERFLOWING_EMBEDS})
    assert OVERFLOW_FAILURE in message, message


def test_a_pipeline_request_without_a_duration_needs_a_reference(pipeline_server):
    message = pipeline_stream_error(pipeline_server.grpc_url, **{**dit_base(), "seconds": None})
    assert "no GEN_SECONDS input; only a request with REF_LATENTS may leave it out" in message, message


def test_a_pipeline_request_that_asks_for_the_status_in_its_error_message_gets_its_step_s_status(pipeline_server):
    # What the front door asks for on a stream whose client wants statuses: the ensemble passes
    # the request's parameters on to its steps, and a step's error opens with its status.
    from auk_triton.serving.config import STATUS_IN_MESSAGE_PARAMETER

    asks = {STATUS_IN_MESSAGE_PARAMETER: True}
    message = pipeline_stream_error(pipeline_server.grpc_url, parameters=asks, **{**dit_base(), "num_steps": 5000})
    assert message.count("[INVALID_ARGUMENT] ") == 1 and "max_steps" in message, message
    message = pipeline_stream_error(pipeline_server.grpc_url, parameters=asks,
                                    **{**dit_base(), "prompt_embeds": OVERFLOWING_EMBEDS})
    assert "[INTERNAL] " in message and OVERFLOW_FAILURE in message, message


def _stopped_at_step(server, model: str, log_from: int) -> tuple[int, int]:
    """The (step, of steps) at which `model` logged, after `log_from`, that it stopped a cancelled
    request; waits up to 60 s for it."""
    import re
    import time

    deadline = time.monotonic() + 60
    while not (stopped := re.search(rf"{model}: request cancelled before step (\d+) of (\d+)",
                                    server.log()[log_from:])):
        assert time.monotonic() < deadline, f"{model} never stopped the abandoned request"
        time.sleep(0.1)
    return int(stopped.group(1)), int(stopped.group(2))


def test_a_dit_request_whose_client_gave_up_stops_at_its_next_step_and_the_next_request_is_served(
    pipeline_server,
):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    steps = 200  # about 10 s of sampling for 20 s of audio on the CPU
    client = grpcclient.InferenceServerClient(pipeline_server.grpc_url)
    try:
        log_before = len(pipeline_server.log())
        long = dit_inputs(grpcclient, random_prompt_embeds(4, seed=5), 20.0, 0, num_steps=steps)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("auk_dit", long, client_timeout=1.0)
        assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        step, of = _stopped_at_step(pipeline_server, "auk_dit", log_before)
        assert of == steps and step < steps / 2, (step, of)
        assert client.infer("auk_dit", dit_inputs(grpcclient, **dit_base())).as_numpy("LATENTS").shape == (1, 10, 64)
    finally:
        client.close()


def test_a_pipeline_request_whose_client_gave_up_stops_at_its_next_step_and_the_next_request_is_served(
    pipeline_server,
):
    url, steps = pipeline_server.grpc_url, 200  # about 10 s of sampling for 20 s of audio on the CPU
    log_before = len(pipeline_server.log())
    with pytest.raises(AuKClientError):
        list(stream_pipeline(random_prompt_embeds(4, seed=5), 20.0, 0, num_steps=steps, url=url, timeout=1.0))
    step, of = _stopped_at_step(pipeline_server, "auk_pipeline", log_before)
    assert of == steps and step < steps / 2, (step, of)
    tiles = list(stream_pipeline(random_prompt_embeds(3, seed=6), 0.3, 1, num_steps=2, url=url))
    assert _stitch(tiles).shape == (15 * HOP,)


def auk_client_pipeline(argv: list[str]) -> int:
    """`auk-client pipeline ARGV` in this process: its stderr goes to capsys."""
    return auk_client_main(["pipeline", *argv])


def test_cli_writes_the_streamed_audio(pipeline_server, tmp_path, capsys):
    out = tmp_path / "gen.wav"
    status = auk_client_pipeline([
        "--random-tokens", "5", "--seconds", "0.5", "--seed", "2", "--steps", "2",
        "--url", pipeline_server.grpc_url, "-o", str(out),
    ])
    assert status == 0
    with wave.open(str(out)) as wav:
        assert wav.getframerate() == 24000 and wav.getnchannels() == 1 and wav.getnframes() == 25 * HOP
    assert "stand-in" in capsys.readouterr().err


def one_pipeline_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {lines}"
    assert lines[0].startswith("auk-client pipeline: error: "), lines[0]
    return lines[0]


def test_cli_leaves_no_wav_behind_when_the_server_refuses_the_request(pipeline_server, tmp_path, capsys):
    out = tmp_path / "never.wav"
    status = auk_client_pipeline([
        "--random-tokens", "2", "--seconds", "0.2", "--steps", "5000", "--url", pipeline_server.grpc_url, "-o", str(out),
    ])
    assert status == 1
    assert "max_steps" in one_pipeline_error_line(capsys)
    assert not out.exists()


def test_cli_reports_an_unwritable_output_path_in_one_line_as_a_usage_error(tmp_path, capsys):
    out = tmp_path / "no_such_folder" / "gen.wav"
    status = auk_client_pipeline([
        "--random-tokens", "2", "--seconds", "0.2", "--url", f"127.0.0.1:{closed_port()}", "-o", str(out),
    ])
    assert status == 2
    assert f"cannot write {out}" in one_pipeline_error_line(capsys)


def test_cli_refuses_a_negative_seed_in_one_line_naming_the_option(tmp_path, capsys):
    out = tmp_path / "never.wav"
    status = auk_client_pipeline([
        "--random-tokens", "2", "--seconds", "0.2", "--seed", "-1", "--url", f"127.0.0.1:{closed_port()}", "-o", str(out),
    ])
    assert status == 2
    assert "--seed" in one_pipeline_error_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize("seconds", ["-1", "0", "nan"])
def test_cli_refuses_a_duration_that_is_not_positive_before_asking_the_server(tmp_path, capsys, seconds):
    out = tmp_path / "never.wav"
    status = auk_client_pipeline([
        "--random-tokens", "2", "--seconds", seconds, "--url", f"127.0.0.1:{closed_port()}", "-o", str(out),
    ])
    assert status == 2
    assert "--seconds must be a positive number" in one_pipeline_error_line(capsys)
    assert not out.exists()


def test_a_model_whose_weights_are_missing_fails_its_load_naming_the_file(tmp_path, small_checkpoint):
    """A codec-only checkpoint (with a dit section but no auk.safetensors): auk_dit's load fails naming the file."""
    import os
    import subprocess

    from auk_triton.front_door.launcher import TritonNotFound, server_command
    from auk_triton.diffusion.synthetic import PRESETS

    repository = tmp_path / "model_repository"
    shutil.copytree(REPO_ROOT / "model_repository" / "auk_dit", repository / "auk_dit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    codec_only = tmp_path / "checkpoint"
    shutil.copytree(small_checkpoint, codec_only)
    assert not (codec_only / "auk.safetensors").exists()
    config = json.loads((codec_only / "config.json").read_text())
    (codec_only / "config.json").write_text(json.dumps({**config, "dit": PRESETS["small"]}))

    env = dict(os.environ, AUK_CHECKPOINT=str(codec_only), AUK_DEVICE="cpu", AUK_CACHE_DIR=str(tmp_path / "cache"))
    try:
        argv, env = server_command(repository, ports={"http": 0, "grpc": 0, "metrics": 0}, env=env,
                                   extra_args=["--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"])
    except TritonNotFound as err:
        pytest.skip(f"tritonserver is not available: {err}")
    # The only model fails to load, so the server exits on its own.
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "failed to load 'auk_dit'" in done.stdout + done.stderr
    assert f"missing {codec_only / 'auk.safetensors'}" in done.stdout + done.stderr


# ---- batching: requests that arrive while auk_dit samples join its runs between steps --------


def dit_steps(server, expect_requests: float | None = None) -> tuple[float, float]:
    """auk_dit's velocity calls so far and the requests they served, summed over them. The
    sampling thread sends them when it goes idle: with `expect_requests`, wait for that total."""
    import time

    deadline = time.monotonic() + 30
    while True:
        counts = server.metric("auk_dit_steps_total"), server.metric("auk_dit_step_requests_total")
        if expect_requests is None or counts[1] >= expect_requests or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def while_busy(server, work, model: str = "auk_dit"):
    """Run `work` while a long request keeps `model`'s sampling thread busy (auk_dit's, or the
    DiT that auk_pipeline holds in its own process), so that what `work` sends to that model
    joins a run in progress; the long request's result comes back too."""
    import threading
    import time

    long_request = dict(prompt_embeds=random_prompt_embeds(4, seed=40), seconds=20.0, seed=0, num_steps=40,
                        guidance=0.0, url=server.grpc_url)
    if model == "auk_pipeline":
        def run():
            return _stitch(list(stream_pipeline(**long_request))).shape == (1000 * HOP,)
    else:
        def run():
            return generate_latents(**long_request).shape == (1000, 64)
    handed_over = server.metric("nv_inference_exec_count", model=model)
    blocker = {}
    thread = threading.Thread(target=lambda: blocker.setdefault("done", run()))
    thread.start()
    try:
        # Until the model's execute has handed the long request to its sampling thread: after a
        # fixed wait, a slow start could still leave `work` to an idle sampler.
        deadline = time.monotonic() + 60
        while server.metric("nv_inference_exec_count", model=model) <= handed_over:
            assert time.monotonic() < deadline and thread.is_alive(), f"the long request never reached {model}"
            time.sleep(0.01)
        return work()
    finally:
        thread.join(timeout=300)
        assert blocker.get("done"), "the long request came back whole"


def concurrently(calls):
    """Each call in its own thread, started together: their results (or exceptions) in order."""
    from concurrent.futures import ThreadPoolExecutor

    def guarded(call):
        try:
            return call()
        except Exception as err:  # noqa: BLE001  (the test looks at it)
            return err

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(guarded, calls))


# Prompts and durations of different lengths, one recipe (CFG 2, BATCHED_STEPS steps): one run,
# padded. Six steps, so that a request that arrives a few of the others' steps late still shares.
BATCHED_STEPS = 6
BATCHED_PIPELINE_REQUESTS = [
    dict(prompt_embeds=random_prompt_embeds(tokens, seed=50 + i), seconds=seconds, seed=60 + i,
         num_steps=BATCHED_STEPS)
    for i, (tokens, seconds) in enumerate([(3, 1.0), (9, 2.6), (5, 0.3), (9, 1.7)])
]


def test_concurrent_pipeline_requests_share_steps_and_each_streams_the_decode_of_its_own_latents(
    pipeline_server,
):
    url = pipeline_server.grpc_url
    steps, requests = dit_steps(pipeline_server)
    streamed = while_busy(pipeline_server, lambda: concurrently(
        [lambda r=r: _stitch(list(stream_pipeline(**r, url=url))) for r in BATCHED_PIPELINE_REQUESTS]),
        model="auk_pipeline")
    # The long request's 40 steps and each request's own: every request counted once a step...
    served = 40 + BATCHED_STEPS * len(BATCHED_PIPELINE_REQUESTS)
    after_steps, after_requests = dit_steps(pipeline_server, expect_requests=requests + served)
    assert after_requests - requests == served
    # ...in fewer velocity calls: the four shared theirs (one guided run beside the long unguided
    # one, joined between its steps as they arrived), at least one request's worth.
    most_calls = 40 + BATCHED_STEPS * (len(BATCHED_PIPELINE_REQUESTS) - 1)
    assert after_steps - steps <= most_calls, (after_steps - steps, served)
    for request, audio in zip(BATCHED_PIPELINE_REQUESTS, streamed):
        alone = generate_latents(**request, url=url)  # sampled alone: nothing else is queued now
        expected = assemble(list(stream_decode(alone, url=url, timeout=600)))
        assert audio.shape == expected.shape == (alone.shape[0] * HOP,)
        # A padded row is its request alone within fp32 rounding (tests/diffusion/test_batching.py);
        # through the decoder the rounding stays at that size.
        np.testing.assert_allclose(audio, expected, rtol=0, atol=1e-4)


def test_a_bad_request_in_a_batch_gets_its_error_and_the_rest_of_the_batch_its_latents(pipeline_server):
    from tritonclient.utils import InferenceServerException

    url = pipeline_server.grpc_url
    good = BATCHED_PIPELINE_REQUESTS[:2]
    bad = [({**good[0], "prompt_embeds": np.full((4, 2048), np.nan, np.float32)}, "finite"),
           ({**good[0], "num_steps": 0}, "at least 1"),
           ({**good[0], "prompt_embeds": OVERFLOWING_EMBEDS}, OVERFLOW_FAILURE)]  # fails in the run
    requests = [good[0], bad[0][0], bad[1][0], good[1], bad[2][0]]
    got = while_busy(pipeline_server, lambda: concurrently(
        [lambda r=r: generate_latents(**r, url=url, check=False) for r in requests]))
    for (_, message), result in zip(bad, (got[1], got[2], got[4])):
        assert isinstance(result, (AuKClientError, InferenceServerException)) and message in str(result), result
    for request, result in zip(good, (got[0], got[3])):
        assert isinstance(result, np.ndarray), result
        np.testing.assert_allclose(result, generate_latents(**request, url=url), rtol=0, atol=1e-5)


def test_a_request_of_more_than_one_clip_is_refused_naming_the_batch_axis(pipeline_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(pipeline_server.grpc_url)
    try:
        inputs = dit_inputs(grpcclient, **dit_base(), batch_axis=False)
        two = []
        for inp, array in zip(inputs, (random_prompt_embeds(2, 0), np.array([0.2], np.float32),
                                        np.array([0], np.int64), np.array([2], np.int32))):
            stacked = np.stack([array, array])
            two.append(grpcclient.InferInput(inp.name(), list(stacked.shape), inp.datatype()))
            two[-1].set_data_from_numpy(stacked)
        with pytest.raises(InferenceServerException, match="one clip, with a batch axis of 1") as caught:
            client.infer("auk_dit", two)
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.close()


def test_with_the_decoder_yielding_to_the_dit_requests_beside_a_long_one_stream_the_decode_of_their_own_latents(
        tmp_path, small_checkpoint):
    """decode_yields_to_dit: while the long request keeps the DiT busy, the others' later windows
    wait (each up to YIELD_WAIT_S: their audio lasts longer than the slack), and every stream
    still ends, each the decode of its own latents. With decode_look_ahead_during_dit off and
    first_tile_at_saturation on too (on a CPU the decoder never looks ahead: that switch is only
    taken)."""
    checkpoint = checkpoint_with_dit(small_checkpoint, tmp_path / "checkpoint")
    repository = copy_model_repository(tmp_path / "model_repository", models=("auk_vae_decode", "auk_pipeline"),
                                       parameters={"decode_yields_to_dit": "true",
                                                   "decode_look_ahead_during_dit": "false",
                                                   "first_tile_at_saturation": "true"})
    shutil.copytree(REPO_ROOT / "model_repository" / "auk_dit", repository / "auk_dit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    server = start_triton(tmp_path, repository, checkpoint, extra_args=["--exit-timeout-secs=3"])
    try:
        url = server.grpc_url
        streamed = while_busy(server, lambda: concurrently(
            [lambda r=r: _stitch(list(stream_pipeline(**r, url=url))) for r in BATCHED_PIPELINE_REQUESTS]),
            model="auk_pipeline")
        for request, audio in zip(BATCHED_PIPELINE_REQUESTS, streamed):
            assert not isinstance(audio, Exception), audio
            alone = generate_latents(**request, url=url)
            expected = assemble(list(stream_decode(alone, url=url, timeout=600)))
            np.testing.assert_allclose(audio, expected, rtol=0, atol=1e-4)
        assert "auk_pipeline: the decoder's later windows wait while the DiT holds requests" in server.log()
        assert "auk_pipeline: the decoder hands its tiles over before each pick while the DiT holds" in server.log()
        assert "auk_pipeline: no short first window while the DiT holds requests back" not in server.log()
    finally:
        server.stop()
