"""The start-up artifacts folder: the compile caches of each build key, found or refused with a reason."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from auk_triton.serving.artifacts import MANIFEST, build_key, code_fingerprint, find_artifacts, use_artifacts

CPU = torch.device("cpu")


@pytest.fixture
def no_cache_variables(monkeypatch):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
                 "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "QUACK_CACHE_DIR"):
        monkeypatch.setenv(name, "")  # so that the undo removes what use_artifacts sets
        monkeypatch.delenv(name)


def write_manifest(folder: Path, key) -> None:
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text(json.dumps(asdict(key)))


def test_a_first_start_compiles_into_its_own_subfolder_and_the_next_finds_it(tmp_path, no_cache_variables):
    lines = []
    folder = use_artifacts(tmp_path, CPU, lines.append)
    assert folder == tmp_path / build_key(CPU).folder_name()
    assert lines == [f"start-up artifacts: compiling into {folder} (none in {tmp_path})"]
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(folder / "flash4")
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert os.environ["QUACK_CACHE_DIR"] == str(folder / "quack")
    assert find_artifacts(tmp_path, build_key(CPU)) == (folder, None)
    lines.clear()
    assert use_artifacts(tmp_path, CPU, lines.append) == folder
    assert lines == [f"start-up artifacts: {folder} (built for this CPU, torch and code)"]


def test_artifacts_of_another_torch_and_gpu_are_not_used_and_the_log_names_the_differences(tmp_path,
                                                                                         no_cache_variables):
    foreign = replace(build_key(CPU), torch="2.0.0", gpu="NVIDIA A100 (sm_80)")
    write_manifest(tmp_path / foreign.folder_name(), foreign)
    lines = []
    folder = use_artifacts(tmp_path, CPU, lines.append)
    assert folder != tmp_path / foreign.folder_name()
    assert lines == [f"start-up artifacts: compiling into {folder} ({foreign.folder_name()} was built for "
                     f"torch 2.0.0 (here {torch.__version__}), gpu NVIDIA A100 (sm_80) (here cpu))"]
    assert json.loads((tmp_path / foreign.folder_name() / MANIFEST).read_text())["torch"] == "2.0.0", "left as it was"


def test_artifacts_of_older_code_are_not_used(tmp_path):
    stale = replace(build_key(CPU), code="0123456789abcdef")
    write_manifest(tmp_path / stale.folder_name(), stale)
    folder, missing = find_artifacts(tmp_path, build_key(CPU))
    assert f"was built for code 0123456789abcdef (here {code_fingerprint()})" in missing


def test_a_subfolder_whose_manifest_is_not_its_build_is_not_used(tmp_path):
    key = build_key(CPU)
    write_manifest(tmp_path / key.folder_name(), replace(key, cuda="11.0"))
    folder, missing = find_artifacts(tmp_path, key)
    assert missing == f"{folder / MANIFEST} does not describe this build"
    (folder / MANIFEST).write_text("{ half a manifest")
    assert find_artifacts(tmp_path, key)[1] == f"{folder / MANIFEST} does not describe this build"


def test_a_folder_that_cannot_be_written_is_said_so_and_the_start_goes_on(tmp_path, no_cache_variables):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    lines = []
    use_artifacts(blocked, CPU, lines.append)
    assert lines[1].startswith(f"start-up artifacts: cannot write {blocked / build_key(CPU).folder_name()}")


def test_the_code_fingerprint_changes_when_the_codec_or_the_diffusion_model_changes(tmp_path):
    package = Path(__file__).resolve().parents[2] / "auk_triton"
    for part in ("codec", "diffusion"):
        shutil.copytree(package / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    assert code_fingerprint(tmp_path) == code_fingerprint()
    with open(tmp_path / "diffusion" / "transformer.py", "a") as source:
        source.write("\n# a change\n")
    assert code_fingerprint(tmp_path) != code_fingerprint()


def test_the_saved_decode_is_named_by_the_decoder_options_and_architecture_its_guards_do_not_check(tmp_path):
    from auk_triton.serving.artifacts import precompiled_decode_path

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"vae": {"latent_dim": 64}}')
    fp16 = {"channels_last": True, "dtype": torch.float16}
    path = precompiled_decode_path(tmp_path, checkpoint, fp16)
    assert path.parent == tmp_path and path.name.startswith("decode-") and path.suffix == ".bin"
    assert precompiled_decode_path(tmp_path, checkpoint, dict(fp16)) == path
    assert precompiled_decode_path(tmp_path, checkpoint, {**fp16, "channels_last": False}) != path
    (checkpoint / "config.json").write_text('{"vae": {"latent_dim": 32}}')
    assert precompiled_decode_path(tmp_path, checkpoint, fp16) != path


def test_the_dits_saved_block_traces_are_foldered_by_the_options_and_architecture_their_guards_do_not_check(
        tmp_path):
    from auk_triton.diffusion import CompileOptions
    from auk_triton.serving.artifacts import precompiled_blocks_dir

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"dit": {"dim": 64}}')
    bf16 = {"dtype": "bfloat16", "compile": CompileOptions()}
    folder = precompiled_blocks_dir(tmp_path, checkpoint, bf16)
    assert folder.parent == tmp_path and folder.name.startswith("dit-blocks-")
    assert precompiled_blocks_dir(tmp_path, checkpoint, dict(bf16)) == folder
    assert precompiled_blocks_dir(tmp_path, checkpoint, {**bf16, "dtype": "float32"}) != folder
    assert precompiled_blocks_dir(tmp_path, checkpoint, {**bf16, "compile": CompileOptions(dynamic=False)}) != folder
    (checkpoint / "config.json").write_text('{"dit": {"dim": 32}}')
    assert precompiled_blocks_dir(tmp_path, checkpoint, bf16) != folder
