"""The DiT blocks' traces kept across restarts (diffusion/precompiled.py): the policy with a
stand-in for torch's ahead-of-time compile, then the small DiT's blocks traced for real
(the aot_eager backend: Dynamo's trace and its guards, no generated code) and a restart
that loads them and traces nothing."""

import pytest
import torch
from torch._dynamo.utils import counters

from auk_triton.diffusion import CompileOptions, precompiled
from auk_triton.diffusion.compiled import compiled_blocks, traces_note
from auk_triton.diffusion.precompiled import PrecompiledFunction
from auk_triton.diffusion.synthetic import synthetic_transformer
from auk_triton.diffusion.transformer import EAGER_BLOCKS


def add(x, y):
    return x + y


class StandInTrace:
    """What aot_compile and load_compiled_function return: guards, a call, a save. This one
    accepts calls whose first argument has `rows` rows."""

    def __init__(self, rows: int):
        self.rows = rows

    def guard_check(self, x, y):
        return x.shape[0] == self.rows

    def __call__(self, x, y):
        return x + y

    def save_compiled_function(self, path):
        with open(path, "w") as file:
            file.write(str(self.rows))


@pytest.fixture
def traced(monkeypatch):
    """The rows of each call traced; files load as the stand-in they hold."""
    calls = []

    def trace(fn, args, compile_kw):
        calls.append(args[0].shape[0])
        return StandInTrace(args[0].shape[0])

    def load(file):
        return StandInTrace(int(file.read()))

    monkeypatch.setattr(precompiled, "trace_ahead", trace)
    monkeypatch.setattr(torch.compiler, "load_compiled_function", load)
    return calls


def files(folder):
    return sorted(path.read_text() for path in folder.iterdir())


def test_a_call_no_trace_accepts_is_traced_saved_and_served_and_the_next_like_it_is_not_traced(tmp_path, traced):
    function = PrecompiledFunction(add, tmp_path / "traces", {})
    assert torch.equal(function(torch.ones(2, 3), torch.ones(2, 3)), torch.full((2, 3), 2.0))
    function(torch.zeros(2, 5), torch.zeros(2, 5))  # the same guards: served by the first trace
    function(torch.zeros(1, 3), torch.zeros(1, 3))  # a single row: a trace of its own
    assert traced == [2, 1] and function.traced == 2 and function.loaded == 0
    assert files(tmp_path / "traces") == ["1", "2"]
    assert not [p for p in (tmp_path / "traces").iterdir() if p.name.startswith(".")], "no scratch file left"


def test_a_later_start_loads_the_saved_traces_and_traces_nothing_for_the_calls_they_accept(tmp_path, traced):
    first = PrecompiledFunction(add, tmp_path, {})
    first(torch.ones(2, 3), torch.ones(2, 3))
    first(torch.ones(1, 3), torch.ones(1, 3))
    traced.clear()
    restarted = PrecompiledFunction(add, tmp_path, {})
    restarted(torch.ones(1, 4), torch.ones(1, 4))
    restarted(torch.ones(2, 4), torch.ones(2, 4))
    assert traced == [] and restarted.loaded == 2 and restarted.traced == 0
    assert restarted.note() == "add: 2 saved traces loaded, 0 traced"
    restarted(torch.ones(3, 4), torch.ones(3, 4))  # what no saved trace accepts is traced and saved
    assert traced == [3] and files(tmp_path) == ["1", "2", "3"]


def test_a_file_that_cannot_be_loaded_is_refused_with_the_reason_removed_and_its_calls_traced_anew(tmp_path, traced):
    (tmp_path / f"add-broken{precompiled.SUFFIX}").write_text("not a compiled function")
    (tmp_path / f"other-1{precompiled.SUFFIX}").write_text("2")  # another function's: not read
    function = PrecompiledFunction(add, tmp_path, {})
    function(torch.ones(2, 3), torch.ones(2, 3))  # the folder is read at the first call
    assert function.loaded == 0 and len(function.refused) == 1
    assert function.note().startswith(f"add: 0 saved traces loaded, 1 traced; refused: "
                                      f"add-broken{precompiled.SUFFIX}, removed (ValueError: ")
    assert not (tmp_path / f"add-broken{precompiled.SUFFIX}").exists()
    assert traced == [2] and function.traced == 1


def test_a_saved_trace_whose_guards_raise_is_dropped_and_its_calls_traced_anew(tmp_path, traced, monkeypatch):
    class Raising(StandInTrace):
        def guard_check(self, x, y):
            raise KeyError("a global the guards look up")

    (tmp_path / f"add-1{precompiled.SUFFIX}").write_text("2")
    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda file: Raising(2))
    function = PrecompiledFunction(add, tmp_path, {})
    assert torch.equal(function(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))
    function(torch.ones(2), torch.ones(2))
    assert function.loaded == 1 and traced == [2], "dropped once, traced once"
    assert "; refused: a trace whose guards raised, dropped (KeyError: " in function.note()


@pytest.mark.parametrize("blocked", ["a read-only folder", "a trace that cannot be written"])
def test_a_trace_that_cannot_be_saved_still_serves_and_the_note_says_why(tmp_path, traced, monkeypatch, blocked):
    folder = tmp_path / "traces"
    if blocked == "a read-only folder":
        folder = tmp_path / "file" / "traces"
        (tmp_path / "file").write_text("a file where the folder would be")
    else:
        def refuse(self, path):
            with open(path, "w") as file:
                file.write("half")
            raise TypeError("cannot pickle a guard's object")

        monkeypatch.setattr(StandInTrace, "save_compiled_function", refuse)
    function = PrecompiledFunction(add, folder, {})
    assert torch.equal(function(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))
    function(torch.ones(2), torch.ones(2))
    assert function.traced == 1 and "; not saved (" in function.note()
    assert not folder.exists() or list(folder.iterdir()) == [], "nothing half written left"


def test_where_the_ahead_of_time_trace_fails_torch_compile_serves_and_the_note_says_why(
        tmp_path, traced, monkeypatch):
    def fail(fn, args, compile_kw):
        traced.append("failed")
        raise RuntimeError("cannot trace ahead of time here")

    compiled = []
    monkeypatch.setattr(precompiled, "trace_ahead", fail)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    function = PrecompiledFunction(add, tmp_path, {"dynamic": True})
    assert torch.equal(function(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))
    function(torch.ones(3), torch.ones(3))
    assert traced == ["failed"] and compiled == [{"dynamic": True}], "tried once, then torch.compile"
    assert function.note() == ("add: 0 saved traces loaded, 0 traced; the ahead-of-time trace failed, "
                               "torch.compile traces the rest (RuntimeError: cannot trace ahead of time here)")
    assert list(tmp_path.iterdir()) == []


def test_saved_traces_are_used_only_for_dynamic_shapes_and_a_backend_that_saves(tmp_path):
    for options, kept in ((CompileOptions(backend="aot_eager", traces_dir=tmp_path), True),
                          (CompileOptions(backend="aot_eager"), False),
                          (CompileOptions(backend="aot_eager", dynamic=False, traces_dir=tmp_path), False),
                          (CompileOptions(backend="eager", traces_dir=tmp_path), False)):
        blocks = compiled_blocks(options)
        assert isinstance(blocks.single, PrecompiledFunction) is kept, options
        assert (traces_note(blocks) is not None) is kept


# ---- the small DiT's blocks, traced for real --------------------------------------------------


@pytest.fixture(scope="module")
def small_dit():
    return synthetic_transformer("small", seed=0).eval()


def velocity_inputs(model, rows: int, ref_frames: int, seed: int):
    """A step's inputs for `rows` requests of 12 target frames and 5 prompt tokens."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(rows, 5, 2048, generator=g)
    ref = torch.randn(rows, ref_frames, 64, generator=g) if ref_frames else None
    ctx = model.prepare(text, 12, ref=ref)
    x = torch.randn(rows, 12, 64, generator=g)
    return x, model.modulation_at(torch.tensor(0.3)), ctx


def test_the_small_dits_blocks_traced_ahead_of_time_give_the_eager_step_and_a_restart_traces_nothing(
        tmp_path, small_dit):
    options = CompileOptions(backend="aot_eager", traces_dir=tmp_path / "traces")
    torch._dynamo.reset()
    # The blocks are made at load, outside inference mode; the warm-up, the builds and the runs
    # call them inside it (a loaded trace's guards once took the loading thread's dispatch state
    # and refused those calls: the restart traced again).
    first = compiled_blocks(options)
    with torch.inference_mode():
        cases = [velocity_inputs(small_dit, 2, 4, seed=1), velocity_inputs(small_dit, 1, 0, seed=2)]
        eager = [small_dit.velocity(x, mod, ctx, EAGER_BLOCKS) for x, mod, ctx in cases]
        traced = [small_dit.velocity(x, mod, ctx, first) for x, mod, ctx in cases]
    # The double blocks are compiled off the kernels' path only (compiled.py).
    compiled = [first.single, first.audio_embedding, first.output]
    compiled += [] if first.kernels else [first.double]
    assert [runner.traced for runner in compiled] == [2] * len(compiled)  # several rows (a reference); one
    assert len(list((tmp_path / "traces").iterdir())) == 2 * len(compiled)
    torch._dynamo.reset()  # a new process, as far as Dynamo knows
    graphs_before = counters["stats"]["unique_graphs"]
    restarted = compiled_blocks(options)
    with torch.inference_mode():
        again = [small_dit.velocity(x, mod, ctx, restarted) for x, mod, ctx in cases]
    assert counters["stats"]["unique_graphs"] == graphs_before, f"the restart traced: {traces_note(restarted)}"
    compiled = [restarted.single, restarted.audio_embedding]
    compiled += [] if restarted.kernels else [restarted.double]
    assert [(runner.loaded, runner.traced) for runner in compiled] == [(2, 0)] * len(compiled)
    for e, t, a in zip(eager, traced, again):
        torch.testing.assert_close(t, e, rtol=1e-5, atol=1e-5)  # aot_eager runs the eager ops, reordered
        assert torch.equal(a, t), "the loaded traces differ from the traced ones"


def test_a_call_no_loaded_trace_accepts_is_traced_and_the_log_names_the_guard_that_refused_it(
        tmp_path, small_dit):
    options = CompileOptions(backend="aot_eager", traces_dir=tmp_path / "traces")
    torch._dynamo.reset()
    first = compiled_blocks(options)
    with torch.inference_mode():
        small_dit.velocity(*velocity_inputs(small_dit, 2, 4, seed=1), first)  # several rows, a reference
    torch._dynamo.reset()
    restarted = compiled_blocks(options)
    with torch.inference_mode():
        small_dit.velocity(*velocity_inputs(small_dit, 1, 0, seed=2), restarted)  # one row, none: not saved
    note = traces_note(restarted)
    assert restarted.single.loaded == 1 and restarted.single.traced == 1
    assert "a call none of the saved traces accepted (the first's guard: " in note
    assert "guard: unknown (" not in note and "\n" not in note, note  # Dynamo's words, on one line
