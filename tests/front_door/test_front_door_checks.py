"""The front door's checks, without a server: limits read from the model configs, declared
shapes against them and against the data sent, and the launcher's restart back-off and
what a dead server does to the requests in flight."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from auk_triton.front_door import grpc_front, launcher, request_limits, settings, upstream
from auk_triton.serving import config
from auk_triton.front_door.request_limits import Refused
from auk_triton.serving.errors import RequestError
from auk_triton.serving.requests import dit_plan

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def limits():
    return request_limits.repository_limits(REPO_ROOT / "model_repository")


def latents_header(shape, data=None, **parameters) -> dict:
    tensor = {"name": "LATENTS", "datatype": "FP32", "shape": shape}
    if data is not None:
        tensor["data"] = data
    if parameters:
        tensor["parameters"] = parameters
    return {"inputs": [tensor]}


def test_each_model_s_limits_come_from_its_own_settings_and_an_ensemble_s_from_its_steps(limits):
    assert limits["auk_vae_decode"].inputs["LATENTS"].bounds == (config.DEFAULT_MAX_FRAMES, 64)
    assert limits["auk_vae_decode_offline"].max_bytes() == request_limits.HEADER_ALLOWANCE + 30000 * 64 * 4
    # auk_dit batches requests itself: each request carries a batch axis of 1, which the ensembles add.
    assert limits["auk_dit"].inputs["PROMPT_EMBEDS"].bounds == (1, config.DEFAULT_PROMPT_TOKENS, 2048)
    assert limits["auk_dit"].inputs["SEED"].bounds == (1, 1)
    assert limits["auk_pipeline"].inputs["PROMPT_EMBEDS"].bounds == (config.DEFAULT_PROMPT_TOKENS, 2048)
    assert limits["auk_pipeline"].inputs["REF_LATENTS"].bounds == (config.DEFAULT_MAX_FRAMES, 64)
    assert limits["auk_vae_encode"].inputs["AUDIO"].bounds == (config.DEFAULT_MAX_FRAMES * 480,)
    assert limits["auk_edit"].inputs["AUDIO"].bounds == (config.DEFAULT_MAX_FRAMES * 480,)
    assert limits["auk_edit"].inputs["PROMPT_EMBEDS"].bounds == (config.DEFAULT_PROMPT_TOKENS, 2048)
    assert request_limits.max_message_bytes(limits) == max(limits[name].max_bytes() for name in limits)


def test_a_max_frames_set_in_a_config_is_the_limit_the_front_door_applies(tmp_path):
    from triton_harness import copy_model_repository

    repository = copy_model_repository(tmp_path / "repo", parameters={"max_frames": 512})
    limits = request_limits.repository_limits(repository)
    assert limits["auk_vae_decode"].inputs["LATENTS"].bounds == (512, 64)
    # The offline model has no max_frames of its own: it takes what the model it forwards to takes.
    assert 'key: "max_frames"' not in (repository / "auk_vae_decode_offline" / "config.pbtxt").read_text()
    assert limits["auk_vae_decode_offline"].inputs["LATENTS"].bounds == (512, 64)
    assert request_limits.max_message_bytes(limits) == request_limits.HEADER_ALLOWANCE + 512 * 64 * 4


def test_the_offline_model_takes_the_limits_of_the_decode_model_its_config_names(tmp_path):
    from triton_harness import copy_model_repository

    repository = copy_model_repository(tmp_path / "repo", parameters={"max_frames": 512})
    renamed = repository / "my_decoder"
    (repository / "auk_vae_decode").rename(renamed)
    config = renamed / "config.pbtxt"
    config.write_text(config.read_text().replace('"auk_vae_decode"', '"my_decoder"').replace('"512"', '"700"'))
    offline = repository / "auk_vae_decode_offline" / "config.pbtxt"
    offline.write_text(offline.read_text().replace('{ key: "decode_model", value: { string_value: "" } }',
                                                   '{ key: "decode_model", value: { string_value: "my_decoder" } }'))
    limits = request_limits.repository_limits(repository)
    assert limits["auk_vae_decode_offline"].inputs["LATENTS"].bounds == (700, 64)


def test_a_declared_shape_past_the_model_s_limit_is_refused_naming_the_shape_and_the_limit(limits):
    model = limits["auk_vae_decode_offline"]
    with pytest.raises(Refused, match=r"declares shape \[2000000000, 64\]; this model takes at most \[30000, 64\] \(max_frames\)"):
        request_limits.check_http_infer(model, latents_header([2000000000, 64], [0.0] * 192), None)
    for shape in ([3, 64, 1], [-1, 64], [3, 65], "3,64"):
        with pytest.raises(Refused):
            request_limits.check_http_infer(model, latents_header(shape, [0.0] * 192), None)
    request_limits.check_http_infer(model, latents_header([30000, 64], [[0.0] * 64] * 30000), None)


def test_a_json_shape_that_does_not_match_its_data_is_refused_naming_both_counts(limits):
    model = limits["auk_vae_decode_offline"]
    with pytest.raises(Refused, match=r"declares shape \[3, 64\] \(192 values\) but its data holds 190"):
        request_limits.check_http_infer(model, latents_header([3, 64], [0.5] * 190), None)
    request_limits.check_http_infer(model, latents_header([3, 64], [[0.5] * 64] * 3), None)  # nested
    request_limits.check_http_infer(model, latents_header([3, 64], [0.5] * 192), None)  # flat


def test_binary_sizes_must_match_the_declared_shape_and_the_body(limits):
    model = limits["auk_vae_decode_offline"]
    request_limits.check_http_infer(model, latents_header([3, 64], binary_data_size=768), 768)
    with pytest.raises(Refused, match="binary_data_size 700"):
        request_limits.check_http_infer(model, latents_header([3, 64], binary_data_size=700), 700)
    with pytest.raises(Refused, match="declare 768 bytes of binary data; the request sends 100"):
        request_limits.check_http_infer(model, latents_header([3, 64], binary_data_size=768), 100)


def test_a_wrong_datatype_or_an_unknown_input_or_model_is_refused_in_triton_s_words(limits):
    model = limits["auk_vae_decode"]
    header = {"inputs": [{"name": "LATENTS", "datatype": "FP64", "shape": [1, 64], "data": [0.0] * 64}]}
    with pytest.raises(Refused, match="data-type is 'FP64', but model 'auk_vae_decode' expects 'FP32'"):
        request_limits.check_http_infer(model, header, None)
    header["inputs"][0].update(name="LATENTZ", datatype="FP32")
    with pytest.raises(Refused, match="unexpected inference input 'LATENTZ'"):
        request_limits.check_http_infer(model, header, None)
    with pytest.raises(Refused, match="unknown model: 'nope'"):
        request_limits._model(limits, "nope")


def test_generate_inputs_are_counted_against_the_limit(limits):
    model = limits["auk_vae_decode"]
    request_limits.check_http_generate(model, {"LATENTS": [0.0] * (30000 * 64)})
    with pytest.raises(Refused, match="holds 1920064 values; it takes at most 1920000 \\(max_frames\\)"):
        request_limits.check_http_generate(model, {"LATENTS": [0.0] * (30001 * 64)})


def test_a_grpc_request_s_declared_shape_is_checked_against_its_model(limits):
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="auk_dit")
    tensor = request.inputs.add(name="PROMPT_EMBEDS", datatype="FP32")
    tensor.shape.extend([1, 513, 2048])
    with pytest.raises(Refused, match=r"declares shape \[1, 513, 2048\]; this model takes at most \[1, 512, 2048\] "
                                      r"\(max_prompt_tokens\)"):
        request_limits.check_grpc_infer(limits, request)
    tensor.shape[1] = 512
    request_limits.check_grpc_infer(limits, request)
    tensor.shape[0] = 16  # several clips in one request: the model batches requests, not clips
    with pytest.raises(Refused, match=r"declares shape \[16, 512, 2048\]"):
        request_limits.check_grpc_infer(limits, request)


def test_auk_dit_itself_refuses_more_prompt_tokens_than_max_prompt_tokens():
    inputs = {"PROMPT_EMBEDS": np.zeros((5, 2048), np.float32)}
    with pytest.raises(RequestError, match="PROMPT_EMBEDS has 5 tokens; this model takes at most 4 \\(max_prompt_tokens\\)"):
        dit_plan(None, inputs.get, max_steps=10, max_prompt_tokens=4)


def test_restarts_back_off_doubling_up_to_the_cap_and_exits_are_described():
    first, cap = settings.RESTART_BACKOFF_S
    assert [launcher.restart_delay(n) for n in (1, 2, 3)] == [first, 2 * first, 4 * first]
    assert launcher.restart_delay(50) == cap
    assert launcher.describe_exit(-signal.SIGKILL) == "was killed by signal 9 (SIGKILL)"
    assert launcher.describe_exit(1) == "exited with status 1"


def test_a_server_that_dies_cuts_the_requests_in_flight_upstream_naming_how_it_died():
    """A request sent just before the supervisor sees the death waits for a connection
    (wait_for_ready) that only the restart would give it: it is cut instead. The server is
    a stand-in that kills itself; the launcher does not restart it here."""
    state = upstream.UpstreamState()
    cancelled = []
    flight = state.take_off(lambda: cancelled.append(True))
    command = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    supervisor = launcher.Supervisor(command, dict(os.environ), state, restart=False)
    assert asyncio.run(supervisor.run()) == 1
    assert cancelled == [True] and not state.running
    assert flight.cut == "tritonserver stopped with the request in flight (it was killed by signal 9 (SIGKILL)): send it again"
    assert state.why == "it was killed by signal 9 (SIGKILL)"


def test_a_stop_drains_for_the_exit_timeout_less_its_margin_which_is_at_most_half_of_it():
    assert settings.exit_timeout_seconds([]) == settings.TRITON_EXIT_TIMEOUT_S
    assert settings.exit_timeout_seconds(["--exit-timeout-secs=5", "--log-verbose=1", "--exit-timeout-secs", "60"]) == 60
    with pytest.raises(ValueError, match="--exit-timeout-secs is 'soon'"):
        settings.exit_timeout_seconds(["--exit-timeout-secs=soon"])
    assert settings.stop_drain_seconds(60) == 60 - settings.STOP_MARGIN_S
    assert settings.stop_drain_seconds(10) == 5
    assert all(0 <= settings.stop_drain_seconds(t) < t for t in (1, 5, 10, 20, 30, 60, 600))


def test_json_data_of_a_type_triton_reads_otherwise_is_left_to_triton_s_http_endpoint():
    from tritonclient.grpc import service_pb2

    from auk_triton.front_door import http_infer

    assert http_infer.json_tensor_bytes("INT16", [[1, -2], [70000, 3]]) == np.array([1, -2, 70000 - 65536, 3], np.int16).tobytes()
    assert http_infer.json_tensor_bytes("BYTES", ["ab", ""]) == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"
    for datatype, data in (("FP32", [1.0, True]), ("FP32", ["1.0"]), ("FP16", [1.0]), ("INT32", [1.5]), ("UINT8", [-1]),
                           ("BOOL", [1]), ("INT64", [2**64])):
        with pytest.raises(http_infer.Untranslatable):
            http_infer.json_tensor_bytes(datatype, data)
    header = {"inputs": [{"name": "LATENTS", "datatype": "FP32", "shape": [1, 1], "data": [0.5]}],
              "parameters": {"binary_data_output": True, "priority": 2, "note": "x"}}
    request, plan = http_infer.grpc_request("m", "", header, b"", service_pb2)
    assert set(request.parameters) == {"priority", "note"} and request.parameters["priority"].uint64_param == 2
    assert plan.kind("ANY") == "binary"
    with pytest.raises(http_infer.Untranslatable, match="triton_"):
        http_infer.grpc_request("m", "", dict(header, parameters={"triton_x": 1}), b"", service_pb2)


def test_the_answer_s_encoding_is_the_one_triton_picks_from_accept_encoding():
    from auk_triton.front_door.http_infer import response_encoding

    assert response_encoding(None) == response_encoding("br") == "identity"
    assert response_encoding("gzip, deflate") == "gzip"  # the first of equals
    assert response_encoding("deflate;q=0.9, gzip;q=0.5") == "deflate"
    assert response_encoding("gzip;q=0.2, identity;q=0.5") == "identity"


def test_a_stream_error_s_status_is_read_from_its_message_and_taken_out_of_it():
    status_of = grpc_front.status_of
    assert status_of("[INVALID_ARGUMENT] LATENTS holds 1 NaN") == ("INVALID_ARGUMENT", "LATENTS holds 1 NaN")
    assert status_of("in ensemble 'auk_pipeline', [INTERNAL] generation failed: x") == (
        "INTERNAL", "in ensemble 'auk_pipeline', generation failed: x")
    # An error of Triton's own carries none; a bracket in the message is not a status.
    assert status_of("[request id: 7] expected 1 inputs but got 0") == ("UNKNOWN", "[request id: 7] expected 1 inputs but got 0")
