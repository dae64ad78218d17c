"""The offline model in this process, with a stand-in for the Triton stub: what it imports, and
how it reads the tiles a forwarded request gets back. Served, it is tested against the real
server in test_streaming.py (the stream's audio, bit for bit), test_bad_input.py and
test_queue_limits.py (statuses), and test_abandoned_requests.py (cancellation)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# Enough of triton_python_backend_utils for the model to import, start and stop.
STAND_IN_STUB = """
import sys, types
stub = types.ModuleType("triton_python_backend_utils")
stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
stub.Logger = None
sys.modules["triton_python_backend_utils"] = stub
"""


def test_the_offline_model_loads_and_stops_without_torch_so_its_stub_holds_no_gpu():
    script = STAND_IN_STUB + """
import json
from auk_triton.serving.offline_model import TritonPythonModel
model = TritonPythonModel()
config = {"parameters": {"decode_model": {"string_value": ""}, "max_active_requests": {"string_value": "2"}}}
model.initialize({"model_name": "auk_vae_decode_offline", "model_version": "1", "model_config": json.dumps(config)})
model.finalize()
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "torch"
                        or m.startswith(("auk_triton.codec", "auk_triton.diffusion")))))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "forwards each request to auk_vae_decode; 2 at once, 64 more waiting" in done.stdout
    assert json.loads(done.stdout.splitlines()[-1]) == []


class Tensor:
    def __init__(self, array: np.ndarray):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class Response:
    """A forwarded request's response: a tile (START_SAMPLE and a waveform), or the empty final."""

    def __init__(self, start: int | None = None, samples: int = 0):
        self.outputs = {} if start is None else {
            "START_SAMPLE": Tensor(np.array([start], np.int64)),
            "WAVEFORM": Tensor(np.full(samples, start, np.float32)),
        }

    def has_error(self) -> bool:
        return False


@pytest.fixture
def model(monkeypatch):
    stub = types.ModuleType("triton_python_backend_utils")
    stub.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    stub.Logger = None
    stub.get_output_tensor_by_name = lambda response, name: response.outputs.get(name)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    modules = ("auk_triton.serving.offline_model", "auk_triton.serving.metrics", "auk_triton.serving.triton_common")
    for name in modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
    from auk_triton.serving.config import OfflineSettings
    from auk_triton.serving.offline_model import TritonPythonModel

    model = TritonPythonModel()
    model.settings = OfflineSettings()
    yield model
    for name in modules:
        sys.modules.pop(name, None)


def test_the_tiles_of_a_forwarded_request_are_gathered_in_order_until_its_last(model):
    tiles, complete = model._gather(iter([Response(0, 3), Response(3, 5), Response(8, 2)]), "WAVEFORM")
    assert complete and [tile.tolist() for tile in tiles] == [[0] * 3, [3] * 5, [8] * 2]


def test_a_forwarded_request_stopped_before_its_last_tile_is_not_complete(model):
    tiles, complete = model._gather(iter([Response(0, 3), Response()]), "WAVEFORM")
    assert not complete and len(tiles) == 1


def test_a_tile_that_does_not_follow_the_last_one_fails_the_request_naming_both_samples(model):
    with pytest.raises(RuntimeError, match="the tile at sample 4 where the one at sample 3 was due"):
        model._gather(iter([Response(0, 3), Response(4, 3)]), "WAVEFORM")


class AskedRequest:
    """A forwarded request that records, whenever it is asked about its client, whether its
    forward's lock was held."""

    def __init__(self, answer: bool):
        self.answer, self.asked, self.forward = answer, [], None

    def is_cancelled(self) -> bool:
        self.asked.append(self.forward.lock.locked())
        return self.answer


def test_a_forwarded_request_is_asked_about_its_client_under_its_own_lock_and_never_once_its_call_ended(model):
    from auk_triton.serving.offline_model import Forward

    request = AskedRequest(answer=True)
    forward = request.forward = Forward(request, "token", 64)
    assert model._client_gone(forward) and request.asked == [True]
    # Its worker marks it ended (under that lock) before answering it: Triton frees what
    # is_cancelled reads with the answer, so it is never asked again.
    forward.ended = True
    assert not model._client_gone(forward) and request.asked == [True]
