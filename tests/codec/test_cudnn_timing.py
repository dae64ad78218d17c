"""codec/cudnn_timing.py: cuDNN's timing turned on with the decoder's errata file, which the
package carries."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from auk_triton.codec.cudnn_timing import DECODE_ERRATA, ERRATA_ENV, time_convolutions

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cudnn_benchmark():
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    yield
    torch.backends.cudnn.benchmark = saved


def test_the_errata_file_blocks_cudnn_9s_forward_engine_0_and_nothing_else():
    errata = json.loads(DECODE_ERRATA.read_text())
    assert errata["version"] == 1
    (rule,) = errata["rules"]
    # cuDNN's frontend blocks a plan whose tag starts with "<operation>_eng<engine>_"; knobs narrow it.
    assert (rule["operation"], rule["engine"], "knob" in rule) == ("ConvFwd", 0, False)
    assert rule["cudnn_version_start"] == 90000 and rule["cudnn_version_end"] == 100000


def test_timing_is_turned_on_with_the_decoders_errata_file(monkeypatch, cudnn_benchmark):
    monkeypatch.setenv(ERRATA_ENV, "")  # so that the variable is put back as it was afterwards
    monkeypatch.delenv(ERRATA_ENV)
    assert time_convolutions() == str(DECODE_ERRATA)
    assert torch.backends.cudnn.benchmark is True
    assert os.environ[ERRATA_ENV] == str(DECODE_ERRATA)


def test_an_errata_file_the_operator_named_is_kept(monkeypatch, tmp_path, cudnn_benchmark):
    own = tmp_path / "errata.json"
    own.write_text('{"version": 1, "rules": []}')
    monkeypatch.setenv(ERRATA_ENV, str(own))
    assert time_convolutions() == str(own)
    assert torch.backends.cudnn.benchmark is True


def test_the_built_package_carries_the_errata_file(tmp_path):
    pytest.importorskip("setuptools")  # the build backend, used as installed: no network
    # The image installs the package from a wheel, not the source tree. Built from a copy:
    # setuptools leaves its build folders beside the sources.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "auk_triton", source / "auk_triton", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    (built,) = tmp_path.glob("auk_triton-*.whl")
    with zipfile.ZipFile(built) as wheel:
        assert json.loads(wheel.read("auk_triton/codec/cudnn_errata.json")) == json.loads(DECODE_ERRATA.read_text())
