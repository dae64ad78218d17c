"""benchmarks/run_perf_analyzer.py: a short real perf_analyzer pass against the fixture's server (CPU, small preset)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "run_perf_analyzer.py"
SECONDS = (0.5, 3.0)  # 3 s spans two tiles at the fixture's tile size
# Two streams at once, the harder case; one concurrency keeps the pass short (each run is a
# perf_analyzer process or two).
CONCURRENCY = (2,)
STREAM_MODEL, OFFLINE_MODEL = "auk_vae_decode", "auk_vae_decode_offline"
# The script's default --models runs both, each for every clip length and concurrency.
RUNS_PER_MODEL = len(SECONDS) * len(CONCURRENCY)


@pytest.fixture(scope="module")
def perf_analyzer_binary() -> str:
    """Find or install perf_analyzer once; skip (with the reason) only if that is impossible here."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--install-only"], capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"perf_analyzer could not be found or installed: {reason}")
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def perf_run(triton, perf_analyzer_binary, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("perf")
    proc = subprocess.run(
        [
            sys.executable, str(SCRIPT),
            "--perf-analyzer", perf_analyzer_binary,
            "--grpc-url", triton.grpc_url,
            "--http-url", triton.http_url,
            "--seconds", ",".join(f"{s:g}" for s in SECONDS),
            "--concurrency", ",".join(map(str, CONCURRENCY)),
            # Windows of a fixed request count, not of time: a busy two-core machine
            # may not finish a request within a short time window.
            "--measurement-mode", "count_windows",
            "--measurement-request-count", "2",
            # Three windows and no stability demand: this pass checks that everything
            # completes and counts, not how steady a shared CPU is.
            "--stability-percentage", "10000",
            "--max-trials", "3",
            "--first-audio-requests", "4",
            "--out-dir", str(out_dir),
        ],
        capture_output=True, text=True, timeout=1200,
    )
    rows = []
    if (out_dir / "summary.csv").exists():
        with open(out_dir / "summary.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    return proc, out_dir, rows


def test_every_model_and_clip_length_completes_with_throughput_and_no_failed_requests(perf_run):
    proc, out_dir, rows = perf_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(rows) == 2 * RUNS_PER_MODEL, rows
    combos = {(r["model"], float(r["clip_seconds"]), int(r["concurrency"])) for r in rows}
    assert combos == {
        (model, s, c)
        for model in (STREAM_MODEL, OFFLINE_MODEL)
        for s in SECONDS
        for c in CONCURRENCY
    }
    for r in rows:
        label = f"{r['model']} {r['clip_seconds']} s c{r['concurrency']}"
        assert r["status"] == "ok", label
        assert float(r["requests_per_s"]) > 0, label
        assert float(r["audio_seconds_per_s"]) == pytest.approx(
            float(r["requests_per_s"]) * float(r["clip_seconds"]), rel=1e-2
        ), label
        assert int(r["server_failed"]) == 0, label
        assert int(r["server_success"]) > 0, label
        assert float(r["latency_p50_ms"]) > 0, label


def test_perf_analyzer_writes_its_own_csv_for_every_run(perf_run):
    _, out_dir, rows = perf_run
    assert len(rows) == 2 * RUNS_PER_MODEL, "summary.csv is missing or short"
    for r in rows:
        kind = "stream" if r["model"] == STREAM_MODEL else "offline"
        path = out_dir / f"{kind}_{float(r['clip_seconds']):g}s_c{r['concurrency']}.csv"
        with open(path, newline="") as f:
            pa_rows = list(csv.DictReader(f))
        assert len(pa_rows) == 1 and int(pa_rows[0]["Concurrency"]) == int(r["concurrency"])
        assert float(pa_rows[0]["Inferences/Second"]) > 0
    assert sorted(p.name for p in (out_dir / "inputs").iterdir()) == ["latents_0.5s.json", "latents_3s.json"]


def test_streaming_rows_carry_time_to_first_audio_measured_before_the_clip_is_done(perf_run):
    _, _, rows = perf_run
    assert sum(r["model"] == STREAM_MODEL for r in rows) == RUNS_PER_MODEL
    assert sum(r["model"] == OFFLINE_MODEL for r in rows) == RUNS_PER_MODEL
    for r in rows:
        if r["model"] != STREAM_MODEL:
            assert r["first_audio_p50_ms"] == ""
            continue
        # perf_analyzer exports the requests it counted in its window: on a busy
        # machine that can be fewer than it sent, never none.
        assert int(r["first_audio_requests"]) >= 1
        first, done = float(r["first_audio_p50_ms"]), float(r["clip_done_p50_ms"])
        assert 0 < first <= done, r
        if float(r["clip_seconds"]) >= 3:
            # Two tiles, so the first audio comes one tile's decode before the end.
            assert first < done, r


def test_the_profile_export_scanner_pairs_each_request_with_its_first_and_last_response(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    from run_perf_analyzer import response_latencies_ms

    export = tmp_path / "profile.json"
    filler = ", ".join(["0.125"] * 200000)  # output tensors dwarf the timestamps
    export.write_text(
        '{"experiments": [{"experiment": {"mode": "concurrency", "value": 1}, "requests": ['
        f'{{"timestamp": 1000000, "request_inputs": {{"LATENTS": [{filler}]}}, '
        f'"response_timestamps": [3000000, 9000000], "response_outputs": [{{"WAVEFORM": [{filler}]}}]}}, '
        f'{{"timestamp": 20000000, "request_inputs": {{}}, "response_timestamps": [20500000], '
        '"response_outputs": []}], "window_boundaries": [1, 2]}], "version": "x"}'
    )
    expected = [(2.0, 8.0), (0.5, 0.5)]
    assert response_latencies_ms(export) == expected
    # Keys and numbers split across read boundaries are still found whole.
    for chunk in (7, 64, 1000, 4096):
        assert response_latencies_ms(export, chunk_size=chunk) == expected, chunk
