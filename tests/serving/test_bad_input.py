"""Bad requests get an error that names the problem, and the server goes on serving."""

from __future__ import annotations

import numpy as np
import pytest

GOOD = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
MAX_FRAMES = 30000  # the max_frames parameter in model_repository/*/config.pbtxt


def with_value(value: float) -> np.ndarray:
    latents = GOOD.copy()
    latents[3, 5] = value
    return latents


# (id, latents, datatype sent, words the error must contain)
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


def assert_names_problem(message: str, words: list[str]) -> None:
    for word in words:
        assert word in message, f"{word!r} not in error {message!r}"


@pytest.mark.parametrize("latents, datatype, words", [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
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


@pytest.mark.parametrize("latents, datatype, words", [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_a_bad_http_request_to_the_offline_model_gets_an_error_naming_the_problem_and_the_next_succeeds(
    http_client, latents, datatype, words
):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    def request(array, dtype):
        tensor = httpclient.InferInput("LATENTS", list(array.shape), dtype)
        tensor.set_data_from_numpy(array, binary_data=True)
        return http_client.infer("auk_vae_decode_offline", [tensor])

    with pytest.raises(InferenceServerException) as caught:
        request(latents, datatype)
    assert_names_problem(str(caught.value), words)

    assert request(GOOD, "FP32").as_numpy("WAVEFORM").shape == (8 * 480,)
