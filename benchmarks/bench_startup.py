r"""How long a real tritonserver takes to become READY, with cold compile caches and warm.

Starts the server `--starts` times in a row, one after another, on one compile-cache
folder (`--cache-dir`; by default a new empty one, so the first start is cold and the
rest warm), serving `--models` on `--device`'s configs, and times each start from the
process's launch to every model READY. After each, the model's start-up lines from the
server log (Triton loading it, the Python backend starting its instance, the model's
own lines) are printed with their offsets, so the table's totals can be read apart.
Weights are a seeded synthetic checkpoint (not real audio).

    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_startup.py
    PYTHONPATH=.:client:benchmarks python3 benchmarks/bench_startup.py \
        --device cpu --preset small --starts 1   # a check that it runs
"""

import argparse
import tempfile
import time
from pathlib import Path

from common import MODEL, heading, say, start_server, synthetic_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=2, help="server starts in a row on one cache (default 2)")
    parser.add_argument("--models", nargs="+", default=[MODEL], help=f"models to load (default {MODEL})")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="the models' configs (default gpu)")
    parser.add_argument("--preset", default="auk", help="synthetic checkpoint preset (default auk)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="compile caches and the checkpoint (default: a new empty folder: the first start is cold)")
    args = parser.parse_args()

    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="auk-startup-"))
    cache.mkdir(parents=True, exist_ok=True)
    cold = not (cache / "inductor").exists()
    checkpoint = synthetic_checkpoint(cache / "checkpoint", args.preset)
    say(heading(f"Start-up to READY: {', '.join(args.models)}, preset {args.preset}",
                "cuda" if args.device == "gpu" else "cpu", f", cache {cache}"))
    rows = []
    for start in range(args.starts):
        caches = "cold" if cold and start == 0 else "warm"
        say(f"start {start + 1} ({caches} compile cache):")
        began = time.perf_counter()
        process, *_ = start_server(checkpoint, cache, cache / f"server-{start + 1}.log", models=args.models,
                                   device=args.device)
        rows.append((start + 1, caches, time.perf_counter() - began))
        process.terminate()
        process.wait(timeout=60)
    say()
    say("| start | compile cache | READY (s) |")
    say("| --- | --- | --- |")
    for start, caches, seconds in rows:
        say(f"| {start} | {caches} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
