"""`make artifacts` (`python -m auk_triton.front_door.prepare`): one server start to READY, then stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def skip_without_tritonserver() -> None:
    launcher = pytest.importorskip("auk_triton.front_door.launcher")
    try:
        launcher.tritonserver_executable()
    except launcher.TritonNotFound as err:
        pytest.skip(f"tritonserver is not available: {err}")


def prepare(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "auk_triton.front_door.prepare", "--exit-timeout-secs=5"],
                          env=env, capture_output=True, text=True, timeout=300)


def test_prepare_builds_the_artifacts_a_restart_then_finds_passing_over_foreign_ones(small_checkpoint, tmp_path):
    skip_without_tritonserver()
    artifacts = tmp_path / "artifacts"
    foreign = artifacts / "0123456789abcdef"
    foreign.mkdir(parents=True)
    (foreign / "build.json").write_text(json.dumps(
        {"torch": "2.0.0", "triton": "none", "cuda": "None", "gpu": "cpu", "code": "0123456789abcdef"}))
    env = dict(os.environ, AUK_CHECKPOINT=str(small_checkpoint), AUK_DEVICE="cpu", AUK_MODELS="auk_vae_decode",
               AUK_CACHE_DIR=str(tmp_path / "cache"), AUK_ARTIFACTS_DIR=str(artifacts))
    first = prepare(env)
    assert first.returncode == 0, first.stdout + first.stderr
    lines = first.stdout.splitlines()
    assert lines[0] == "auk_triton.front_door.prepare: building the start-up artifacts of auk_vae_decode"
    compiling = [line for line in lines if "auk_vae_decode: start-up artifacts: compiling into" in line]
    assert len(compiling) == 1 and "(0123456789abcdef was built for torch 2.0.0 (here " in compiling[0]
    assert any("auk_vae_decode: ready (" in line for line in lines)  # the model's own warm-up line
    assert lines[-1].startswith("auk_triton.front_door.prepare: READY after ")
    # Its server and the model's stub are gone: nothing left running with its cache folder.
    stray = subprocess.run(["pgrep", "-f", str(tmp_path / "cache")], capture_output=True, text=True)
    assert stray.stdout == ""

    again = prepare(env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert any("auk_vae_decode: start-up artifacts: " in line and "(built for this CPU, torch and code)" in line
               for line in again.stdout.splitlines()), again.stdout


def test_prepare_fails_with_the_server_s_log_when_the_server_cannot_become_ready(tmp_path):
    skip_without_tritonserver()
    broken = tmp_path / "checkpoint"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    env = dict(os.environ, AUK_CHECKPOINT=str(broken), AUK_DEVICE="cpu", AUK_MODELS="auk_vae_decode",
               AUK_CACHE_DIR=str(tmp_path / "cache"))
    done = prepare(env)
    assert done.returncode == 1
    assert "cannot load the AuK checkpoint" in done.stderr
    assert "the server was not READY" in done.stderr
