"""benchmarks/bench_dit_step.py runs on a CPU with tiny dims (its smoke test; the figures are no measurement)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_dit_step import busy_and_idle  # noqa: E402


def test_the_step_benchmark_prints_a_row_per_batch_and_step_with_the_compiled_step_on_the_eager_ones_numbers():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_dit_step.py"), "--small", "--frames", "8", "--tokens", "4",
         "--batches", "2", "--iters", "1", "--fp8",
         "--compare-without", "block_kernels", "compile_edges"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| 2 |")]
    assert [row[1].strip() for row in rows] == ["eager, per-step modulation", "eager, table", "compiled, table",
                                                "compiled, table, FP8 linears",
                                                "compiled, table, without block_kernels",
                                                "compiled, table, without compile_edges"]
    # Dynamo's eager backend runs the eager step's own ops (a CPU has no norm and RoPE kernel):
    # the same velocity, to the bit.
    assert float(rows[2][4]) == float(rows[4][4]) == float(rows[5][4]) == 0.0
    assert float(rows[0][4]) < 1e-5, "the table holds what the step computed (fp32)"
    assert 0.0 < float(rows[3][4]) < 0.2, "FP8's rounding shows, within reason"


def test_the_profiles_busy_time_counts_overlapping_kernels_once_and_idle_time_only_between_kernels():
    # Two streams: the second kernel runs inside the first, the third starts before the first
    # ends; then 2 us with none, and a last kernel.
    spans = [(0.0, 10.0), (2.0, 5.0), (8.0, 12.0), (14.0, 15.0)]
    assert busy_and_idle(spans) == (13.0, 2.0)
    assert busy_and_idle(list(reversed(spans))) == (13.0, 2.0)  # in any order
    assert busy_and_idle([]) == (0.0, 0.0)
