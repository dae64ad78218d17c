"""auk_pipeline's own policy, without a server: which stage a failed request names.
The served model is tested against the real server in `test_pipeline.py`."""

from __future__ import annotations

import sys
import types

import pytest


@pytest.fixture
def pipeline(monkeypatch):
    """The model's module, imported with just enough of triton_python_backend_utils."""
    stub = types.ModuleType("triton_python_backend_utils")
    stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    stub.Logger = None
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    modules = [name for name in sys.modules if name.startswith("auk_triton.serving")]
    for name in modules:
        monkeypatch.delitem(sys.modules, name)
    import auk_triton.serving.pipeline_model as module

    yield module
    for name in [name for name in sys.modules if name.startswith("auk_triton.serving")]:
        sys.modules.pop(name, None)


class Request:
    def get_response_sender(self):
        return self

    def send(self, response, flags=0):
        self.sent = (response, flags)


def test_latents_found_not_finite_on_the_gpu_fail_the_request_as_its_generation_and_anything_else_as_its_decode(
        pipeline, monkeypatch):
    from auk_triton.diffusion import NonFiniteLatents

    actions = []
    monkeypatch.setattr(sys.modules[pipeline.StreamSink.__module__], "failure_response",
                        lambda model, action, error, request: actions.append((action, type(error).__name__)))
    sink = pipeline._Sink("auk_pipeline", Request(), pcm16=False)
    sink.fail(NonFiniteLatents())  # what the scheduler calls when a job's verify raises
    sink.fail(RuntimeError("out of memory"))
    sink.fail(RuntimeError("refused"), "generation")
    assert actions == [("generation", "NonFiniteLatents"), ("decode", "RuntimeError"), ("generation", "RuntimeError")]
