"""An optional kernel package's import (auk_triton/diffusion/checked_kernel.py): absent, it is
passed over in silence; installed but unable to load, the log carries its error. Stand-in
packages on a temporary path, so these run on any machine."""

from __future__ import annotations

import sys

import pytest
import torch

from auk_triton.diffusion import padded_attention
from auk_triton.diffusion.checked_kernel import import_kernel


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """Write a package `name` whose __init__ holds `body`, first on the path; returns the writer."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, body: str) -> None:
        for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            monkeypatch.delitem(sys.modules, module)  # an installed one is put back afterwards
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(body)

    return write


def test_a_kernel_package_that_is_not_installed_is_passed_over_without_a_reason():
    assert import_kernel("auk_no_such_kernels.op", "auk_no_such_kernels") == (None, "")


def test_an_installed_kernel_package_that_cannot_load_its_library_is_refused_with_the_error(packages):
    packages("auk_stand_in_kernels", 'raise OSError("libcuda.so.13: cannot open shared object file")\n')
    module, why_not = import_kernel("auk_stand_in_kernels.op", "auk_stand_in_kernels")
    assert module is None
    assert why_not == "it did not load: OSError: libcuda.so.13: cannot open shared object file"


def test_an_installed_kernel_package_missing_a_dependency_names_the_dependency(packages):
    packages("auk_stand_in_kernels", "import auk_stand_in_dependency\n")
    module, why_not = import_kernel("auk_stand_in_kernels", "auk_stand_in_kernels")
    assert module is None
    assert why_not == "it did not load: ModuleNotFoundError: No module named 'auk_stand_in_dependency'"


def test_a_cutlass_dsl_on_the_path_without_its_pth_folder_is_named_as_the_cause(packages, monkeypatch):
    packages("nvidia_cutlass_dsl", "")  # the package's folder is found, its dsl_packages are not
    monkeypatch.setitem(sys.modules, "cutlass", None)  # `import cutlass` fails as it does then
    packages("auk_stand_in_kernels", "import cutlass\n")
    module, why_not = import_kernel("auk_stand_in_kernels", "auk_stand_in_kernels")
    assert module is None
    assert why_not.startswith("it did not load: ModuleNotFoundError: import of cutlass halted")
    assert why_not.endswith("(nvidia_cutlass_dsl is on the path but its .pth file was not read, as in a "
                            "PYTHONPATH folder: install it, or put its dsl_packages folder on PYTHONPATH too)")


def test_an_installed_kernel_package_that_loads_is_returned(packages):
    packages("auk_stand_in_kernels", "ARCHITECTURES = (9,)\n")
    module, why_not = import_kernel("auk_stand_in_kernels", "auk_stand_in_kernels")
    assert module.ARCHITECTURES == (9,) and why_not == ""


def test_a_cudnn_package_that_cannot_load_leaves_the_key_biases_and_the_log_gives_its_error(
        packages, monkeypatch):
    packages("cudnn", 'raise ImportError("libcudnn.so.9: cannot open shared object file")\n')
    monkeypatch.setattr(padded_attention, "_registered", None)
    monkeypatch.setattr(padded_attention, "_cudnn_refused", "")
    monkeypatch.setattr(padded_attention, "_flash4", False)  # FlashAttention 4 not installed
    monkeypatch.setattr(padded_attention, "_flash4_refused", "")
    assert not padded_attention.cudnn_sdpa_registered()
    assert padded_attention.attention_kernel(torch.device("cuda")) == "key_bias"
    log = padded_attention.masked_attention(torch.device("cuda"))
    assert log.startswith("additive key biases (neither flash-attn-4 nor cudnn serves")
    assert log.endswith("; cudnn: it did not load: ImportError: libcudnn.so.9: cannot open shared object file)")
