"""Bad requests get an error that names the problem, with the status of a client's mistake
(gRPC INVALID_ARGUMENT, HTTP 400) whether the model or Triton itself refuses them, and the
server goes on serving.

A gRPC stream's error carries its message alone on a bare tritonserver: Triton 2.51 writes a
status into a stream only where the client opened it with the header `triton_grpc_error:
true`, a mode that crashed that server (SIGSEGV after "[INTERNAL] HandleCancellation called
even when the context was not cancelled") in runs of this project's served tests. The front
door serves that mode itself: test_front_door_stream_status.py checks the stream's statuses
there. The offline model forwards each request to the streaming model and passes its refusals on,
status and message: their codes are checked here through it (and, in process, in
test_triton_io.py)."""

from __future__ import annotations

import numpy as np
import pytest

GOOD = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
MAX_FRAMES = 30000  # the max_frames parameter in model_repository/*/config.pbtxt
GRPC_INVALID_ARGUMENT = "StatusCode.INVALID_ARGUMENT"
HTTP_BAD_REQUEST = "400"


def with_value(value: float) -> np.ndarray:
    latents = GOOD.copy()
    latents[3, 5] = value
    return latents


# (id, latents, datatype sent, words the error must contain); the first four Triton refuses
# itself (the config's datatype and dims), the others the model.
BAD_INPUTS = [
    ("width-32", np.zeros((10, 32), np.float32), "FP32", ["LATENTS", "32", "64"]),
    ("rank-3", np.zeros((1, 10, 64), np.float32), "FP32", ["LATENTS", "shape"]),
    ("fp64", GOOD.astype(np.float64), "FP64", ["LATENTS", "FP64", "FP32"]),
    ("int32", GOOD.astype(np.int32), "INT32", ["LATENTS", "INT32", "FP32"]),
    ("nan", with_value(np.nan), "FP32", ["LATENTS", "NaN", "frame 3"]),
    ("inf", with_value(-np.inf), "FP32", ["LATENTS", "infinite", "frame 3"]),
    ("zero-frames", np.zeros((0, 64), np.float32), "FP32", ["LATENTS", "zero frames"]),
    ("too-long", np.zeros((MAX_FRAMES + 1, 64), np.float32), "FP32", ["LATENTS", str(MAX_FRAMES + 1), "max_frames"]),
]
CASES = pytest.mark.parametrize(
    "latents, datatype, words", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS]
)


def assert_names_problem(message: str, words: list[str]) -> None:
    for word in words:
        assert word in message, f"{word!r} not in error {message!r}"


@CASES
def test_a_bad_stream_request_gets_an_error_naming_the_problem_and_the_next_request_succeeds(
    open_stream, latents, datatype, words
):
    stream = open_stream()
    stream.send(latents, request_id="bad", datatype=datatype)
    bad = stream.collect(timeout=60)["bad"]
    assert bad.tiles == [] and bad.events == ["error"]
    assert_names_problem(bad.error, words)

    stream.send(GOOD, request_id="good")
    good = stream.collect()["good"]
    assert good.error is None and good.events == ["tile+final"]
    assert good.waveform().shape == (8 * 480,)


def offline_request(client_module, client, latents, datatype):
    tensor = client_module.InferInput("LATENTS", list(latents.shape), datatype)
    if client_module.__name__.endswith("http"):
        tensor.set_data_from_numpy(latents, binary_data=True)
    else:
        tensor.set_data_from_numpy(latents)
    return client.infer("auk_vae_decode_offline", [tensor])


@CASES
def test_a_bad_http_request_to_the_offline_model_is_a_400_naming_the_problem_and_the_next_succeeds(
    http_client, latents, datatype, words
):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as caught:
        offline_request(httpclient, http_client, latents, datatype)
    assert caught.value.status() == HTTP_BAD_REQUEST, caught.value
    assert_names_problem(str(caught.value), words)

    assert offline_request(httpclient, http_client, GOOD, "FP32").as_numpy("WAVEFORM").shape == (8 * 480,)


@CASES
def test_a_bad_grpc_request_to_the_offline_model_is_invalid_argument_naming_the_problem(
    triton, latents, datatype, words
):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as caught:
            offline_request(grpcclient, client, latents, datatype)
        assert caught.value.status() == GRPC_INVALID_ARGUMENT, caught.value
        assert_names_problem(caught.value.message(), words)
        assert offline_request(grpcclient, client, GOOD, "FP32").as_numpy("WAVEFORM").shape == (8 * 480,)
    finally:
        client.close()


def test_the_offline_model_passes_a_request_s_parameters_on_so_its_error_opens_with_its_status_when_asked(triton):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from auk_triton.serving.config import STATUS_IN_MESSAGE_PARAMETER

    latents = with_value(np.nan)
    tensor = grpcclient.InferInput("LATENTS", list(latents.shape), "FP32")
    tensor.set_data_from_numpy(latents)
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        for asked, head in ((True, "[INVALID_ARGUMENT] LATENTS holds 1 NaN"), (False, "LATENTS holds 1 NaN")):
            with pytest.raises(InferenceServerException) as caught:
                client.infer("auk_vae_decode_offline", [tensor], parameters={STATUS_IN_MESSAGE_PARAMETER: asked})
            assert caught.value.status() == GRPC_INVALID_ARGUMENT, caught.value
            assert caught.value.message().startswith(head), caught.value.message()
    finally:
        client.close()
