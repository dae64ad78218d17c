#!/usr/bin/env python3
"""Load-test the AuK decode models with Triton's perf_analyzer.

    python benchmarks/run_perf_analyzer.py                  # 2, 10, 60 s clips; concurrency 1, 4, 16
    python benchmarks/run_perf_analyzer.py --seconds 1,5 --concurrency 1,2 --out-dir perf/cpu

What it does:

1. Finds a perf_analyzer that starts here (--perf-analyzer, $PERF_ANALYZER,
   PATH, this Python's bin/, or the project cache), or installs one into
   `.cache/perf_analyzer/` (pip --target, nothing added to the environment
   itself): the `tritonclient==2.50.0` wheel's binary, which needs libb64
   (`apt-get install libb64-0d`, done here when missing and running as root)
   and libcudart 12 (`nvidia-cuda-runtime-cu12`, put on LD_LIBRARY_PATH). If
   that binary does not start and glibc is 2.38 or newer, the `perf-analyzer`
   wheel is tried. `--wheel-dir` installs from local wheels only.
2. Writes one JSON input file per clip length: seeded random latents
   [frames, dim] (50 frames per second; the width comes from the served
   model), a stand-in for real diffusion-model output.
3. Runs, for every clip length and concurrency:
   - `auk_vae_decode` with `-i grpc --streaming` (decoupled: one response
     per tile). The latency perf_analyzer 2.50 reports for it is the time to
     the LAST response (the whole clip), despite its "using the first
     response" banner, so a second, short pass (`--first-audio-requests`) exports
     every response's timestamp (`--profile-export-file`) and the time to
     first audio is computed from those.
   - `auk_vae_decode_offline` over HTTP (one response with the whole clip).
   Each run writes perf_analyzer's CSV (`-f`) and log; the server's success
   and failure counters for the model are read before and after each run.
4. Writes `summary.csv` (one row per model, clip length and concurrency) and
   prints it as a table. Exit status is non-zero if any run failed or the
   server counted a failed request.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_RATE = 24000
HOP = 480
STREAM_MODEL = "auk_vae_decode"
OFFLINE_MODEL = "auk_vae_decode_offline"
TRITONCLIENT_PIN = "tritonclient==2.50.0"
CUDART_PKG = "nvidia-cuda-runtime-cu12"
NEW_PA_PKG = "perf-analyzer"

SUMMARY_FIELDS = [
    "model", "protocol", "clip_seconds", "frames", "concurrency",
    "requests_per_s", "audio_seconds_per_s", "responses_per_s",
    "latency_p50_ms", "latency_p90_ms", "latency_p95_ms", "latency_p99_ms", "latency_avg_ms",
    "first_audio_p50_ms", "first_audio_p99_ms", "clip_done_p50_ms", "clip_done_p99_ms", "first_audio_requests",
    "server_queue_us", "server_compute_infer_us",
    "server_success", "server_failed", "status",
]


def log(msg: str) -> None:
    print(f"[perf] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    base = os.environ.get("AUK_CACHE_DIR") or PROJECT_ROOT / ".cache"
    return Path(base).absolute() / "perf_analyzer"


# -- finding / installing perf_analyzer -----------------------------------

def _glibc_version() -> tuple[int, int]:
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION") or ""
        major, minor = re.findall(r"(\d+)\.(\d+)", name)[0]
        return int(major), int(minor)
    except (ValueError, IndexError, OSError):
        return (0, 0)


def _cudart_lib_dirs(extra_roots: list[Path]) -> list[str]:
    roots = [Path(p) for p in sys.path if p] + extra_roots
    found = []
    for root in roots:
        lib = root / "nvidia" / "cuda_runtime" / "lib"
        if (lib / "libcudart.so.12").exists() and str(lib) not in found:
            found.append(str(lib))
    return found


def _env_for(binary: Path) -> dict:
    env = dict(os.environ)
    roots = [cache_root() / "pkgs", binary.parent.parent]
    dirs = _cudart_lib_dirs(roots)
    if dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(dirs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    return env


def _starts(binary: Path) -> tuple[bool, str]:
    """Whether the binary runs here; the reason when it does not."""
    try:
        proc = subprocess.run(
            [str(binary), "--version"], env=_env_for(binary), capture_output=True, text=True, timeout=60
        )
    except OSError as exc:
        return False, str(exc)
    except subprocess.TimeoutExpired:
        return False, "timed out running --version"
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode == 0:
        return True, out
    return False, out.splitlines()[-1] if out else f"exit status {proc.returncode}"


def _candidates(explicit: str | None) -> list[Path]:
    cands = []
    for p in (explicit, os.environ.get("PERF_ANALYZER")):
        if p:
            cands.append(Path(p))
    on_path = shutil.which("perf_analyzer")
    if on_path:
        cands.append(Path(on_path))
    cands.append(Path(sys.prefix) / "bin" / "perf_analyzer")
    cands.append(cache_root() / "pkgs" / "bin" / "perf_analyzer")
    cands.append(cache_root() / "pkgs-new" / "perf_analyzer" / "bin" / "perf_analyzer")
    seen, out = set(), []
    for c in cands:
        key = str(c.absolute())
        if key not in seen and c.is_file():
            seen.add(key)
            out.append(c.absolute())
    return out


def _pip_target(target: Path, packages: list[str], wheel_dir: str | None) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--quiet",
           "--no-deps", "--upgrade", "--target", str(target)]
    if wheel_dir:
        cmd += ["--no-index", "--find-links", wheel_dir]
    cmd += packages
    log("installing: " + " ".join(packages) + f" -> {target}")
    subprocess.run(cmd, check=True)


def _has_libb64() -> bool:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        return False
    return "libb64.so.0d" in out


def _ensure_libb64() -> None:
    if _has_libb64():
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        log("libb64.so.0d is missing; install it with: apt-get install -y libb64-0d")
        return
    log("installing libb64-0d with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "libb64-0d"]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        subprocess.run(install, env=env, capture_output=True)


def find_or_install_perf_analyzer(explicit: str | None = None, install: bool = True,
                                  wheel_dir: str | None = None) -> Path:
    reasons = []
    for cand in _candidates(explicit):
        ok, why = _starts(cand)
        if ok:
            return cand
        reasons.append(f"{cand}: {why}")
    if explicit:
        raise SystemExit(f"perf_analyzer at {explicit} does not start: {'; '.join(reasons)}")
    if not install:
        raise SystemExit("no working perf_analyzer found (" + "; ".join(reasons or ["none found"]) + ")")

    target = cache_root() / "pkgs"
    try:
        _pip_target(target, [TRITONCLIENT_PIN, CUDART_PKG], wheel_dir)
    except subprocess.CalledProcessError as exc:
        reasons.append(f"pip install {TRITONCLIENT_PIN} failed ({exc.returncode})")
    else:
        _ensure_libb64()
        binary = target / "bin" / "perf_analyzer"
        ok, why = _starts(binary) if binary.is_file() else (False, "not in the wheel")
        if ok:
            return binary
        reasons.append(f"{binary}: {why}")

    if _glibc_version() >= (2, 38):
        target = cache_root() / "pkgs-new"
        try:
            _pip_target(target, [NEW_PA_PKG], wheel_dir)
        except subprocess.CalledProcessError as exc:
            reasons.append(f"pip install {NEW_PA_PKG} failed ({exc.returncode})")
        else:
            binary = target / "perf_analyzer" / "bin" / "perf_analyzer"
            ok, why = _starts(binary) if binary.is_file() else (False, "not in the wheel")
            if ok:
                return binary
            reasons.append(f"{binary}: {why}")
    raise SystemExit("could not install a working perf_analyzer: " + "; ".join(reasons))


# -- server queries -------------------------------------------------------

def _http_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def latent_dim(http_url: str, model: str) -> int:
    meta = _http_json(f"http://{http_url}/v2/models/{model}")
    for inp in meta.get("inputs", []):
        if inp["name"] == "LATENTS" and int(inp["shape"][-1]) > 0:
            return int(inp["shape"][-1])
    return 64


def server_counts(http_url: str, model: str) -> tuple[int, int]:
    """(successful, failed) inference requests the server has counted for `model`."""
    stats = _http_json(f"http://{http_url}/v2/models/{model}/stats")
    success = failed = 0
    for entry in stats.get("model_stats", []):
        inf = entry.get("inference_stats", {})
        success += int(inf.get("success", {}).get("count", 0))
        failed += int(inf.get("fail", {}).get("count", 0))
    return success, failed


# -- input data -----------------------------------------------------------

def write_input_file(path: Path, seconds: float, dim: int, seed: int) -> int:
    import numpy as np

    frames = max(1, int(round(seconds * SAMPLE_RATE / HOP)))
    latents = np.random.default_rng(seed).standard_normal((frames, dim)).astype(np.float32)
    payload = {"data": [{"LATENTS": {"content": [float(v) for v in latents.reshape(-1)],
                                     "shape": [frames, dim]}}]}
    path.write_text(json.dumps(payload))
    return frames


# -- profile export: time to first response -------------------------------

_TS = re.compile(rb'"(timestamp|response_timestamps)"\s*:\s*(\d+|\[[^\]]*\])')


def response_latencies_ms(profile_path: Path, chunk_size: int = 1 << 23) -> list[tuple[float, float]]:
    """Per request, (ms to its first response, ms to its last), read from a profile export.

    The export also holds every input and output tensor as JSON text (it is
    large), so it is scanned in chunks for the two timestamp keys instead of
    being parsed whole.
    """
    out: list[tuple[float, float]] = []
    pending_start = None
    tail = b""
    with open(profile_path, "rb") as f:
        while True:
            chunk = f.read(chunk_size)
            if not chunk:
                break
            buf = tail + chunk
            pos = 0
            for m in _TS.finditer(buf):
                if m.end() == len(buf):
                    break  # the number may go on in the next chunk
                key, value = m.group(1), m.group(2)
                if key == b"timestamp":
                    pending_start = int(value)
                else:
                    stamps = [int(v) for v in re.findall(rb"\d+", value)]
                    if pending_start is not None and stamps:
                        out.append(((min(stamps) - pending_start) / 1e6, (max(stamps) - pending_start) / 1e6))
                    pending_start = None
                pos = m.end()
            rest = buf[pos:]
            starts = [i for i in (rest.find(b'"timestamp"'), rest.find(b'"response_timestamps"')) if i >= 0]
            tail = rest[min(starts):] if starts else rest[-64:]
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# -- running --------------------------------------------------------------

def run_perf(binary: Path, args: list[str], log_path: Path, timeout: float) -> int:
    cmd = [str(binary)] + args
    with open(log_path, "w") as logf:
        logf.write("$ " + " ".join(cmd) + "\n")
        logf.flush()
        try:
            proc = subprocess.run(cmd, env=_env_for(binary), stdout=logf, stderr=subprocess.STDOUT,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            logf.write(f"\n[perf] killed after {timeout:g} s\n")
            return 124
    return proc.returncode


def _read_csv_row(path: Path) -> dict:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path} has no rows")
    return rows[-1]


def _f(row: dict, key: str, scale: float = 1.0):
    value = row.get(key)
    if value in (None, ""):
        return ""
    return round(float(value) * scale, 3)


def measurement_args(ns) -> list[str]:
    args = ["--verbose-csv", "--measurement-mode", ns.measurement_mode,
            "--stability-percentage", str(ns.stability_percentage),
            "--max-trials", str(ns.max_trials)]
    if ns.measurement_mode == "count_windows":
        args += ["--measurement-request-count", str(ns.measurement_request_count)]
    else:
        args += ["--measurement-interval", str(ns.measurement_interval_ms)]
    return args


def profile_one(ns, binary: Path, model: str, seconds: float, frames: int, concurrency: int,
                input_file: Path, out_dir: Path) -> dict:
    streaming = model == ns.stream_model
    tag = f"{'stream' if streaming else 'offline'}_{seconds:g}s_c{concurrency}"
    if streaming:
        base = ["-m", model, "-i", "grpc", "--streaming", "-u", ns.grpc_url]
    else:
        base = ["-m", model, "-i", "http", "-u", ns.http_url]
    base += ["--input-data", str(input_file), "--concurrency-range", str(concurrency)]
    row = {"model": model, "protocol": "grpc-stream" if streaming else "http",
           "clip_seconds": seconds, "frames": frames, "concurrency": concurrency}

    before = server_counts(ns.http_url, model)
    csv_path = out_dir / f"{tag}.csv"
    rc = run_perf(binary, base + measurement_args(ns) + ["-f", str(csv_path)] + ns.extra,
                  out_dir / f"{tag}.log", ns.run_timeout)
    status = "ok" if rc == 0 and csv_path.is_file() else f"perf_analyzer exit {rc}, see {tag}.log"
    if csv_path.is_file():
        pa = _read_csv_row(csv_path)
        rps = float(pa["Inferences/Second"])
        row.update({
            "requests_per_s": round(rps, 3),
            "audio_seconds_per_s": round(rps * frames * HOP / SAMPLE_RATE, 3),
            "responses_per_s": _f(pa, "Response Throughput") or round(rps, 3),
            "latency_p50_ms": _f(pa, "p50 latency", 1e-3),
            "latency_p90_ms": _f(pa, "p90 latency", 1e-3),
            "latency_p95_ms": _f(pa, "p95 latency", 1e-3),
            "latency_p99_ms": _f(pa, "p99 latency", 1e-3),
            "latency_avg_ms": _f(pa, "Avg latency", 1e-3),
            "server_queue_us": _f(pa, "Server Queue"),
            "server_compute_infer_us": _f(pa, "Server Compute Infer"),
        })

    if streaming and ns.first_audio_requests > 0 and status == "ok":
        export = out_dir / f"{tag}_profile.json"
        count = max(ns.first_audio_requests, 2 * concurrency)
        rc2 = run_perf(binary, base + ["--request-count", str(count), "--profile-export-file", str(export)]
                       + ns.extra, out_dir / f"{tag}_first_audio.log", ns.run_timeout)
        if rc2 == 0 and export.is_file():
            pairs = response_latencies_ms(export)
            if pairs:
                firsts, lasts = [p[0] for p in pairs], [p[1] for p in pairs]
                row.update({"first_audio_p50_ms": round(statistics.median(firsts), 3),
                            "first_audio_p99_ms": round(percentile(firsts, 99), 3),
                            "clip_done_p50_ms": round(statistics.median(lasts), 3),
                            "clip_done_p99_ms": round(percentile(lasts, 99), 3),
                            "first_audio_requests": len(firsts)})
        else:
            status = f"first-audio pass: perf_analyzer exit {rc2}, see {tag}_first_audio.log"
        if not ns.keep_profile_export and export.is_file():
            export.unlink()

    after = server_counts(ns.http_url, model)
    row["server_success"] = after[0] - before[0]
    row["server_failed"] = after[1] - before[1]
    if row["server_failed"] and status == "ok":
        status = f"server counted {row['server_failed']} failed requests"
    row["status"] = status
    return row


def print_table(rows: list[dict]) -> None:
    cols = ["model", "clip_seconds", "concurrency", "requests_per_s", "audio_seconds_per_s",
            "latency_p50_ms", "latency_p99_ms", "first_audio_p50_ms", "first_audio_p99_ms",
            "clip_done_p50_ms", "server_failed", "status"]
    table = [cols] + [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    for line in table:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip())


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grpc-url", default="127.0.0.1:8001")
    p.add_argument("--http-url", default="127.0.0.1:8000")
    p.add_argument("--stream-model", default=STREAM_MODEL)
    p.add_argument("--offline-model", default=OFFLINE_MODEL)
    p.add_argument("--models", default="stream,offline", help="which to run: stream, offline or both")
    p.add_argument("--seconds", type=_floats, default=[2.0, 10.0, 60.0], help="clip lengths, comma separated")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16], help="concurrency values, comma separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="default: .cache/perf_results/<date-time>")
    p.add_argument("--measurement-mode", choices=["time_windows", "count_windows"], default="time_windows")
    p.add_argument("--measurement-interval-ms", type=int, default=5000)
    p.add_argument("--measurement-request-count", type=int, default=50)
    p.add_argument("--stability-percentage", type=float, default=10)
    p.add_argument("--max-trials", type=int, default=10)
    p.add_argument("--first-audio-requests", type=int, default=32,
                   help="requests in the streaming time-to-first-audio pass (at least 2x concurrency); "
                        "0 skips it. Its profile export holds every output sample as JSON text: "
                        "about 35 MB per request of a 60 s clip")
    p.add_argument("--keep-profile-export", action="store_true")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds allowed for one perf_analyzer run")
    p.add_argument("--perf-analyzer", default=None, help="path to a perf_analyzer binary to use")
    p.add_argument("--no-install", action="store_true", help="fail rather than install perf_analyzer")
    p.add_argument("--wheel-dir", default=None, help="install perf_analyzer from wheels in this folder only")
    p.add_argument("--install-only", action="store_true", help="find or install perf_analyzer, print its path, exit")
    p.add_argument("extra", nargs="*", help="after --: extra arguments passed to every perf_analyzer run")
    return p.parse_args(argv)


def main(argv=None) -> int:
    ns = parse_args(argv)
    binary = find_or_install_perf_analyzer(ns.perf_analyzer, install=not ns.no_install, wheel_dir=ns.wheel_dir)
    log(f"perf_analyzer: {binary}")
    if ns.install_only:
        print(binary)
        return 0

    models = []
    for name in [m.strip() for m in ns.models.split(",") if m.strip()]:
        if name not in ("stream", "offline"):
            raise SystemExit(f"--models takes stream and/or offline, not {name!r}")
        models.append(ns.stream_model if name == "stream" else ns.offline_model)

    out_dir = Path(ns.out_dir or cache_root().parent / "perf_results" / time.strftime("%Y%m%d-%H%M%S"))
    (out_dir / "inputs").mkdir(parents=True, exist_ok=True)
    try:
        dim = latent_dim(ns.http_url, models[0])
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"cannot read model metadata from http://{ns.http_url}: {exc}")

    inputs = {}
    for seconds in ns.seconds:
        path = out_dir / "inputs" / f"latents_{seconds:g}s.json"
        inputs[seconds] = (path, write_input_file(path, seconds, dim, ns.seed))
        log(f"input {path.name}: {inputs[seconds][1]} frames x {dim}")

    rows = []
    for model in models:
        for seconds in ns.seconds:
            path, frames = inputs[seconds]
            for concurrency in ns.concurrency:
                log(f"{model}: {seconds:g} s clip, concurrency {concurrency}")
                rows.append(profile_one(ns, binary, model, seconds, frames, concurrency, path, out_dir))
                with open(out_dir / "summary.csv", "w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
                    writer.writeheader()
                    writer.writerows(rows)
    print_table(rows)
    log(f"wrote {out_dir / 'summary.csv'}")
    bad = [r for r in rows if r["status"] != "ok"]
    for r in bad:
        log(f"FAILED {r['model']} {r['clip_seconds']:g} s c{r['concurrency']}: {r['status']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
