"""The traced decode kept across restarts (codec/precompiled.py), its policy on the CPU with a
stand-in for torch's ahead-of-time compile: a good file is loaded and nothing traced; a broken,
foreign or refusing file is traced anew and saved over, with the reason for the log."""

import pytest
import torch

from auk_triton.codec import precompiled

EXAMPLES = {32: torch.zeros(1, 32, 4), 512: torch.zeros(1, 512, 4)}


class StandInCompiled:
    """What aot_compile and load_compiled_function return: guards, a call, a save."""

    def __init__(self, refuses=(), content=b"traced"):
        self.refuses, self.content = set(refuses), content

    def guard_check(self, module, x):
        return x.shape[1] not in self.refuses

    def __call__(self, module, x):
        return x + 1

    def save_compiled_function(self, path):
        with open(path, "wb") as file:
            file.write(self.content)


@pytest.fixture
def traced(monkeypatch):
    calls = []

    def trace(vae, example):
        calls.append(example.shape[1])
        return StandInCompiled()

    monkeypatch.setattr(precompiled, "trace_decode", trace)
    return calls


def test_a_saved_decode_that_serves_every_bucket_is_loaded_and_nothing_is_traced(tmp_path, traced, monkeypatch):
    path = tmp_path / "decode.bin"
    path.write_bytes(b"saved")
    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda file: StandInCompiled())
    decode, note = precompiled.precompiled_decode(torch.nn.Identity(), path, EXAMPLES)
    assert note == f"loaded {path}: nothing traced" and traced == []
    assert torch.equal(decode(torch.zeros(2)), torch.ones(2))


def test_without_a_saved_decode_it_is_traced_on_the_first_bucket_and_saved(tmp_path, traced):
    path = tmp_path / "artifacts" / "decode.bin"
    decode, note = precompiled.precompiled_decode(torch.nn.Identity(), path, EXAMPLES)
    assert traced == [32] and path.read_bytes() == b"traced"
    assert note == f"traced and saved to {path} (none at {path})"
    assert [p.name for p in path.parent.iterdir()] == ["decode.bin"], "no scratch file left"


def test_a_broken_or_foreign_file_is_refused_with_the_reason_and_traced_anew(tmp_path, traced):
    path = tmp_path / "decode.bin"
    path.write_bytes(b"not a compiled function")
    _, note = precompiled.precompiled_decode(torch.nn.Identity(), path, EXAMPLES)
    assert note.startswith(f"traced and saved to {path} ({path} cannot be loaded (")
    assert traced == [32] and path.read_bytes() == b"traced"


def test_a_saved_decode_whose_guards_refuse_a_bucket_is_traced_anew(tmp_path, traced, monkeypatch):
    path = tmp_path / "decode.bin"
    path.write_bytes(b"saved")
    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda file: StandInCompiled(refuses={512}))
    _, note = precompiled.precompiled_decode(torch.nn.Identity(), path, EXAMPLES)
    assert note == f"traced and saved to {path} ({path} refuses buckets of [512] frames)"
    assert traced == [32]


def test_a_trace_that_does_not_serve_every_bucket_is_an_error_for_the_caller(tmp_path, monkeypatch):
    monkeypatch.setattr(precompiled, "trace_decode", lambda vae, example: StandInCompiled(refuses={512}))
    with pytest.raises(RuntimeError, match=r"traced on 32 frames does not serve \[512\] frames"):
        precompiled.precompiled_decode(torch.nn.Identity(), tmp_path / "decode.bin", EXAMPLES)
    assert not (tmp_path / "decode.bin").exists()
