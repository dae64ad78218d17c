"""The start-up artifacts: the compile caches of one GPU type, torch build and version of the code.

A GPU start compiles the decode's buckets and the DiT's step (Inductor's generated code,
Triton's kernels, the fused activation kernel). Their caches live in the artifacts folder
(`config.artifacts_dir_path`), one subfolder per build key: the torch, Triton and CUDA
versions, the GPU model and a hash of the model code (the codec and the diffusion model).
Each subfolder's `build.json` says what it was built for. A server uses the subfolder of
its own key, and says in the log whether it found one or why it compiles anew: the folder
holds only others' (another torch, GPU or code, each named), or nothing. One folder can so
hold the artifacts of several GPU types and releases side by side, on a volume every
replica shares, and a stale one is never used.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from .config import use_compile_cache

MODEL_CODE = Path(__file__).resolve().parents[1]
MODEL_CODE_PARTS = ("codec", "diffusion")
MANIFEST = "build.json"


@dataclass(frozen=True)
class BuildKey:
    """What a compile cache depends on beyond what Inductor and Triton key their own entries by."""

    torch: str
    triton: str
    cuda: str
    gpu: str
    code: str

    def folder_name(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def differences(self, other: "BuildKey") -> list[str]:
        """Where `other` (found in the folder) differs from this key (the running server's):
        "torch 2.11.0 (here 2.13.0)"."""
        ours, theirs = asdict(self), asdict(other)
        return [f"{name} {theirs[name]} (here {ours[name]})" for name in ours if ours[name] != theirs[name]]


def code_fingerprint(root: Path = MODEL_CODE, parts: tuple[str, ...] = MODEL_CODE_PARTS) -> str:
    """SHA-256 over the model code's Python sources: a change to what gets compiled changes it."""
    digest = hashlib.sha256()
    for part in parts:
        for path in sorted((root / part).glob("*.py")):
            digest.update(f"{part}/{path.name}".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"


def build_key(device: torch.device) -> BuildKey:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return BuildKey(torch=torch.__version__, triton=triton_version, cuda=str(torch.version.cuda),
                    gpu=device_name(device), code=code_fingerprint())


def read_key(folder: Path) -> BuildKey | None:
    """The key a subfolder's manifest records; None where it has none or it cannot be read."""
    try:
        return BuildKey(**json.loads((folder / MANIFEST).read_text()))
    except (OSError, TypeError, ValueError):
        return None


def find_artifacts(artifacts_dir: Path, key: BuildKey) -> tuple[Path, str | None]:
    """The subfolder for `key`, and None where it holds artifacts built for exactly this key;
    else why there are none (what the folder holds instead)."""
    folder = Path(artifacts_dir) / key.folder_name()
    found = read_key(folder)
    if found == key:
        return folder, None
    if found is not None or (folder / MANIFEST).exists():
        return folder, f"{folder / MANIFEST} does not describe this build"
    others = []
    for sibling in sorted(Path(artifacts_dir).glob(f"*/{MANIFEST}")):
        other = read_key(sibling.parent)
        if other is None:
            others.append(f"{sibling} cannot be read")
        else:
            others.append(f"{sibling.parent.name} was built for {', '.join(key.differences(other))}")
    if others:
        return folder, "; ".join(others)
    return folder, f"none in {artifacts_dir}"


def _traced_key(checkpoint: Path, options: dict) -> str:
    """What a saved trace's guards do not check: the options it was traced with and the
    checkpoint's architecture (its config.json; the weights are read live)."""
    try:
        architecture = (Path(checkpoint) / "config.json").read_text()
    except OSError:
        architecture = ""
    text = json.dumps({name: repr(value) for name, value in sorted(options.items())})
    return hashlib.sha256((text + architecture).encode()).hexdigest()[:16]


def precompiled_decode_path(folder: Path, checkpoint: Path, decoder_options: dict) -> Path:
    """Where a build's subfolder keeps the traced decode (codec/precompiled.py) of this decoder,
    keyed by its options (precision, fused kernel, layout) and architecture."""
    return Path(folder) / f"decode-{_traced_key(checkpoint, decoder_options)}.bin"


def precompiled_blocks_dir(folder: Path, checkpoint: Path, options: dict) -> Path:
    """Where a build's subfolder keeps the DiT blocks' traces (diffusion/precompiled.py), keyed by
    the options they were compiled with (dtype, compile options) and the architecture."""
    return Path(folder) / f"dit-blocks-{_traced_key(checkpoint, options)}"


def use_artifacts(artifacts_dir: Path, device: torch.device, log: Callable[[str], None]) -> Path:
    """Point this process's compile caches at the artifacts of its own build key (unless
    TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR are set), saying whether they were found and,
    where not, why; return the subfolder. Its manifest is written before anything compiles into it."""
    key = build_key(device)
    folder, missing = find_artifacts(artifacts_dir, key)
    if missing is None:
        processor = "GPU" if device.type == "cuda" else "CPU"
        log(f"start-up artifacts: {folder} (built for this {processor}, torch and code)")
    else:
        log(f"start-up artifacts: compiling into {folder} ({missing})")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            scratch = folder / f".{MANIFEST}.{os.getpid()}"
            scratch.write_text(json.dumps(asdict(key), indent=1) + "\n")
            os.replace(scratch, folder / MANIFEST)
        except OSError as err:  # a read-only folder: the compile caches say so themselves
            log(f"start-up artifacts: cannot write {folder} ({err})")
    use_compile_cache(folder)
    return folder
