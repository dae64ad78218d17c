"""benchmarks/common.py: what the benchmark scripts read back from a server's log, and an
earlier revision served by its own code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from auk_triton.serving.readiness import BUILD_AFTER_READY, BUILT_AFTER_READY  # noqa: E402
from common import (  # noqa: E402
    REPO_ROOT,
    builds_pending,
    revision_commit,
    revision_tree,
    start_launcher,
    startup_lines,
    synthetic_checkpoint,
)

in_a_git_checkout = pytest.mark.skipif(revision_commit("HEAD") is None, reason="not a git checkout")

LOG = """\
W1202 23:59:58.500000 674 pinned_memory_manager.cc:273] "Unable to allocate pinned system memory"
I1202 23:59:59.000000 674 model_lifecycle.cc:472] "loading: auk_vae_decode:1"
+------------------+------+
I1203 00:00:04.700000 674 python_be.cc:2249] "TRITONBACKEND_ModelInstanceInitialize: auk_vae_decode_0_0 (GPU device 0)"
I1203 00:00:06.600000 674 triton_common.py:37] "auk_vae_decode: loaded /tmp/ck on cuda:0 in 1.9 s"
I1203 00:01:30.000000 674 triton_common.py:37] "auk_vae_decode: bucket of 32 frames compiled and captured in 75.2 s"
I1203 00:01:30.100000 674 grpc_server.cc:2558] "Started GRPCInferenceService at 127.0.0.1:8001"
"""


def test_startup_lines_are_the_models_lines_with_their_seconds_since_the_log_began(tmp_path):
    log = tmp_path / "tritonserver.log"
    log.write_text(LOG)
    assert startup_lines(log) == [
        "    0.5 s loading: auk_vae_decode:1",
        "    6.2 s TRITONBACKEND_ModelInstanceInitialize: auk_vae_decode_0_0 (GPU device 0)",
        "    8.1 s auk_vae_decode: loaded /tmp/ck on cuda:0 in 1.9 s",
        "   91.5 s auk_vae_decode: bucket of 32 frames compiled and captured in 75.2 s",
    ]


def test_a_model_is_still_building_from_its_line_that_leaves_graphs_for_after_ready_to_its_line_that_ends_them():
    line = 'I1204 13:49:{:02d}.000000 627 triton_common.py:37] "{}"\n'.format
    log = (line(1, f"auk_vae_decode: ready (one response per tile; warmup 9.1 s; 9 graphs {BUILD_AFTER_READY})")
           + line(2, f"auk_dit: 25 step graphs of 36 buckets captured in 6.3 s; 66 buckets (553 graphs) "
                     f"{BUILD_AFTER_READY}")
           + line(3, "auk_dit: bucket 64 tokens, 256 frames, no reference frames, guided: 16 graphs in 4.1 s"))
    assert builds_pending(log) == {"auk_vae_decode", "auk_dit"}
    log += line(30, f"auk_vae_decode: 9 {BUILT_AFTER_READY} 24.2 s after READY, begun once the server was READY")
    assert builds_pending(log) == {"auk_dit"}
    log += line(59, f"auk_dit: 553 {BUILT_AFTER_READY} 150.0 s after READY (118 parts of buckets)")
    assert builds_pending(log) == set()
    assert builds_pending(LOG) == set(), "a model that left nothing for after READY is not waited for"


def test_a_model_with_two_building_stages_is_still_building_until_both_have_said_they_are_done():
    line = 'I1205 05:00:{:02d}.000000 627 triton_common.py:37] "{}"\n'.format
    log = (line(1, f"auk_pipeline: ready (one response per tile; warmup 9.1 s; 9 graphs {BUILD_AFTER_READY})")
           + line(2, f"auk_pipeline: 25 step graphs of 36 buckets captured in 6.3 s; 66 buckets (553 graphs) "
                     f"{BUILD_AFTER_READY}")
           + line(30, f"auk_pipeline: 9 {BUILT_AFTER_READY} 24.2 s after READY"))
    assert builds_pending(log) == {"auk_pipeline"}
    log += line(59, f"auk_pipeline: 553 {BUILT_AFTER_READY} 150.0 s after READY (118 parts of buckets)")
    assert builds_pending(log) == set()


@in_a_git_checkout
def test_a_revision_tree_holds_that_commit_s_files_and_an_unknown_revision_is_named_in_its_error(tmp_path):
    tree = revision_tree("HEAD", tmp_path / "tree")
    for path in ("benchmarks/common.py", "model_repository/auk_pipeline/configs/gpu.pbtxt"):
        committed = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"HEAD:{path}"], capture_output=True,
                                   check=True).stdout
        assert (tree / path).read_bytes() == committed
    assert revision_commit("no-such-revision") is None
    with pytest.raises(RuntimeError, match="git archive no-such-revision"):
        revision_tree("no-such-revision", tmp_path / "none")


@in_a_git_checkout
def test_the_launcher_of_a_revision_tree_serves_that_tree_s_code_in_the_launcher_and_the_model(tmp_path):
    """Today's checkout is on the module path too (installed, or PYTHONPATH): the tree's package
    must come first, in the launcher and in the Python backend's model process alike."""
    pytest.importorskip("tritonclient.grpc")
    tree = revision_tree("HEAD", tmp_path / "tree")
    package = tree / "auk_triton" / "__init__.py"
    marker = "\nimport os as _os\nprint('auk_triton of the tree in', _os.getpid(), flush=True)\n"
    package.write_text(package.read_text() + marker)
    launcher = pytest.importorskip("auk_triton.front_door.launcher")
    try:
        launcher.tritonserver_executable()
    except launcher.TritonNotFound as err:
        pytest.skip(f"tritonserver is not available: {err}")
    log = tmp_path / "launcher.log"
    checkpoint = synthetic_checkpoint(tmp_path / "checkpoint", "small")
    process, _, _ = start_launcher(checkpoint, tmp_path / "cache", log, device="cpu", ready_timeout_s=300,
                                   project_root=tree)
    process.terminate()
    process.wait(timeout=60)
    text = log.read_text(errors="replace")
    processes = {line.split()[-1] for line in text.splitlines() if line.startswith("auk_triton of the tree in")}
    assert len(processes) == 2, text[-3000:]  # the launcher, and the model's stub process
    assert f"--model-repository={tree / 'model_repository'}" in text
