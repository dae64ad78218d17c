"""The one place a request's error is made: which status each kind of failure gets, and how a
forwarded request's error comes back with its status, in this process with a stand-in for the
Triton stub (the served statuses are checked against a real server in test_bad_input.py,
test_queue_limits.py and test_pipeline.py)."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from auk_triton.serving.errors import RequestCancelled, RequestError, ServerBusy, ServerStopping, relayed_error


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = UNKNOWN):
        self.message, self.code = message, code


class InferenceResponse:
    def __init__(self, output_tensors, error=None):
        self.output_tensors, self.error = output_tensors, error


@pytest.fixture
def failure_response(monkeypatch):
    backend = types.ModuleType("triton_python_backend_utils")
    backend.TritonError, backend.InferenceResponse, backend.Logger = TritonError, InferenceResponse, None
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", backend)
    monkeypatch.delitem(sys.modules, "auk_triton.serving.triton_common", raising=False)
    yield importlib.import_module("auk_triton.serving.triton_common").failure_response
    sys.modules.pop("auk_triton.serving.triton_common", None)


def test_a_request_the_model_refuses_is_invalid_arg_with_its_own_message(failure_response):
    error = failure_response("m", "decode", RequestError("LATENTS has zero frames")).error
    assert (error.code, error.message) == (TritonError.INVALID_ARG, "LATENTS has zero frames")


def test_a_request_whose_client_is_gone_is_cancelled(failure_response):
    error = failure_response("m", "decode", RequestCancelled("request cancelled before its first tile")).error
    assert (error.code, error.message) == (TritonError.CANCELLED, "request cancelled before its first tile")


def test_a_request_the_model_cannot_finish_before_it_stops_is_unavailable(failure_response):
    error = failure_response("m", "decode", ServerStopping("the model is shutting down")).error
    assert (error.code, error.message) == (TritonError.UNAVAILABLE, "the model is shutting down")


def test_any_other_failure_is_internal_naming_the_action_and_the_exception(failure_response, capsys):
    error = failure_response("m", "decode", RuntimeError("CUDA error: out of memory")).error
    assert error.code == TritonError.INTERNAL
    assert error.message == "decode failed: RuntimeError: CUDA error: out of memory"
    assert "m: decode failed: RuntimeError: CUDA error: out of memory" in capsys.readouterr().out


class Request:
    """A stand-in for pb_utils.InferenceRequest: its parameters as Triton hands them over (JSON)."""

    def __init__(self, parameters: str):
        self._parameters = parameters

    def parameters(self) -> str:
        return self._parameters


@pytest.mark.parametrize(
    "err, status",
    [(RequestError("LATENTS has zero frames"), "INVALID_ARGUMENT"), (RequestCancelled("request cancelled"), "CANCELLED"),
     (ServerStopping("the model is shutting down"), "UNAVAILABLE"), (RuntimeError("boom"), "INTERNAL")],
)
def test_a_request_that_asks_for_it_gets_its_status_at_the_head_of_the_message(failure_response, err, status):
    from auk_triton.serving.config import STATUS_IN_MESSAGE_PARAMETER

    plain = failure_response("m", "decode", err).error
    # A bool parameter, or the header tritonserver forwards as a string parameter.
    for ask in ("true", '"true"', '"True "'):
        asked = failure_response("m", "decode", err, Request(f'{{"{STATUS_IN_MESSAGE_PARAMETER}": {ask}}}')).error
        assert asked.code == plain.code and asked.message == f"[{status}] {plain.message}"
    for parameters in ("{}", f'{{"{STATUS_IN_MESSAGE_PARAMETER}": "false"}}', f'{{"{STATUS_IN_MESSAGE_PARAMETER}": 1}}',
                       "not json"):
        assert failure_response("m", "decode", err, Request(parameters)).error.message == plain.message


@pytest.mark.parametrize(
    "err, code",
    [(RequestError("LATENTS has zero frames"), TritonError.INVALID_ARG),
     (ServerBusy("the model is at its limit (1 requests decoding, 1 waiting)"), TritonError.UNAVAILABLE),
     (RuntimeError("CUDA error: out of memory"), TritonError.INTERNAL)],
)
def test_a_forwarded_request_s_error_reaches_its_client_with_the_decode_model_s_status_and_message(
    failure_response, err, code
):
    from auk_triton.serving.config import STATUS_IN_MESSAGE_PARAMETER

    # What the decode model answers a forwarded request, which always asks for the status in
    # the message; Triton 2.51 hands it back with that message alone (and the status INTERNAL).
    forwarded = failure_response("auk_vae_decode", "decode", err, Request(f'{{"{STATUS_IN_MESSAGE_PARAMETER}": true}}'))
    plain = failure_response("auk_vae_decode", "decode", err).error
    relayed = relayed_error(forwarded.error.message, "UNAVAILABLE", "auk_vae_decode")
    error = failure_response("auk_vae_decode_offline", "forwarding", relayed).error
    assert (error.code, error.message) == (code, plain.message) == (plain.code, plain.message)
    # A client that asked for the status in the message (the front door's streams) gets it once.
    asked = failure_response("auk_vae_decode_offline", "forwarding", relayed,
                             Request(f'{{"{STATUS_IN_MESSAGE_PARAMETER}": true}}')).error
    assert asked.message == forwarded.error.message


def test_a_forwarded_request_that_triton_itself_refuses_is_unavailable_naming_the_decode_model(failure_response):
    relayed = relayed_error("Model auk_vae_decode - Error when running inference: Failed for execute the inference "
                            "request. Model 'auk_vae_decode' is not ready.", "UNAVAILABLE", "auk_vae_decode")
    error = failure_response("auk_vae_decode_offline", "forwarding", relayed).error
    assert error.code == TritonError.UNAVAILABLE
    assert error.message.startswith("auk_vae_decode could not take the request: Model auk_vae_decode")
