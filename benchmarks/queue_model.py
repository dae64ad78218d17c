r"""A model of one GPU serving `auk_pipeline`'s flash requests: where the open loop's tail
comes from, and what would move it. A model, not a measurement: it runs no GPU code.

The GPU's work is what the measured costs say (defaults: today's H200 figures in RESULTS.md);
everything else is left out but one fixed delay per request. What it models:

- The DiT's steps, one at a time, rows joining and leaving between steps (`JoinedRuns`): each
  step serves the waiting rows (oldest first, at most `--max-rows`), and costs the straight
  line through the measured step at batch 1 and at batch 16. With `--steps-queued-ahead 1`,
  as served, a step's rows are those waiting when the step before it began (the sampling
  thread queues one step ahead), so a request that arrives waits for up to two steps to join.
- The decoder's replays, one at a time: a request's first window as soon as its last step
  has run (first windows of several requests in one replay), the rest of its clip after.
- How they share the GPU: the decoder's stream goes first (`decode first`, as served), each
  replay runs whole, and a DiT step waits while one runs. `later windows yield`: the same,
  but the rest of a clip waits while a step is waiting, until its audio would run out within
  the scheduler's YIELD_SLACK_S (`auk_pipeline` with `decode_yields_to_dit`; for a 10 s clip
  the scheduler's other bound, YIELD_WAIT_S after the first tile, is the same moment). `rest after the
  DiT`: the rest of a clip decodes only while no step is waiting, and a step that comes
  meanwhile goes ahead of it, as a replay at a priority below the DiT's would.
- One fixed delay per request: one client's first audio less its GPU work (transport, the
  front door, the run's context, the hand-overs).

First audio is from arrival to the first window's end plus the fixed delay. Capacity: 48
closed-loop clients, each sending its next request when its last clip has decoded. The open
loop: Poisson arrivals at a share of that capacity, as `bench_load.py --mode open --load`.

    PYTHONPATH=. python3 benchmarks/queue_model.py
    PYTHONPATH=. python3 benchmarks/queue_model.py --step-16-ms 27   # the diffusion issue's batch-16 step
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

from auk_triton.serving.scheduler import YIELD_SLACK_S
from common import percentile, poisson

CLOSED_LOOP_CLIENTS = 48
CLOSED_LOOP_S = 60.0
OPEN_LOOP_S = 300.0
SETTLE_S = 2.0  # the closed loop's first seconds, not counted
POLICIES = ("decode first", "later windows yield", "rest after the DiT")


@dataclass(frozen=True)
class Costs:
    """GPU milliseconds, and the fixed delay; defaults from RESULTS.md (H200)."""

    step_1_ms: float = 2.78  # a DiT step of one 10 s row (r56)
    step_16_ms: float = 27.21  # of 16 rows (r56)
    steps: int = 4  # flash
    max_rows: int = 16  # rows a step serves at most (the largest bucket's graphs)
    first_window_ms: float = 2.04  # a replay of the 32-frame window, one row (l15)
    first_window_more_ms: float = 0.42  # each further row of it: 8.28 ms at 16 rows (l15)
    first_window_audio_ms: float = 460.0  # its audio: 23 of its 32 frames (9 are the right context)
    # The rest of a 10 s clip is a window from its frame 0, since the 23 frames its first window
    # emitted are less than the decoder's left context (53 frames): the whole clip's decode, the
    # 512-frame replay (6.29 ms, l15), and the first window's work comes on top of it.
    rest_of_clip_ms: float = 6.29
    rest_per_replay: int = 4  # clips whose rest decodes in one replay
    fixed_ms: float = 8.0  # one client's first audio (21.2 ms, r22) less its GPU work
    # 1: as served, each step's rows are fixed as the step before begins (the sampling thread
    # queues one step ahead, STEPS_QUEUED_AHEAD), so a request that arrives waits for up to two
    # steps to join; 0: it joins the next step.
    steps_queued_ahead: int = 0

    def step_ms(self, rows: int) -> float:
        return self.step_1_ms + (self.step_16_ms - self.step_1_ms) * (rows - 1) / 15

    def alone_ms(self) -> float:
        """One request alone: its first audio."""
        return self.steps * self.step_ms(1) + self.first_window_ms + self.fixed_ms


@dataclass(eq=False)
class _Row:
    arrived: float
    steps: int = 0
    due: float = math.inf  # when its first tile's audio runs out, once sent


@dataclass
class _Work:
    left_ms: float
    rows: list  # the rows it serves
    kind: str = "step"  # "step", "first" or "rest"


def serve(costs: Costs, policy: str, arrivals: list[float] | None = None, clients: int = 0,
          until_ms: float = math.inf) -> tuple[list[float], list[float], int]:
    """Run the model: open loop on `arrivals` (ms), or `clients` closed-loop clients until
    `until_ms`. Returns each request's first audio (ms), the times its clip finished, and the
    clips whose rest finished after their first tile's audio ran out (underruns)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}")
    arrivals = list(arrivals or [])
    now, next_arrival = 0.0, 0
    waiting = [_Row(0.0) for _ in range(clients)]
    firsts: list[_Row] = []
    rests: list[_Row] = []
    step: _Work | None = None
    replay: _Work | None = None
    next_rows: list[_Row] | None = None  # the next step's, once fixed (steps_queued_ahead)
    first_audio: list[float] = []
    finished: list[float] = []
    late = 0
    while True:
        while next_arrival < len(arrivals) and arrivals[next_arrival] <= now:
            waiting.append(_Row(arrivals[next_arrival]))
            next_arrival += 1
        if step is None and waiting:
            rows = [row for row in next_rows or [] if row in waiting]  # less those that finished
            if not rows:
                rows = sorted(waiting, key=lambda row: row.arrived)[: costs.max_rows]
            step = _Work(costs.step_ms(len(rows)), rows)
            next_rows = None
            if costs.steps_queued_ahead:
                going_on = [row for row in sorted(waiting, key=lambda row: row.arrived)
                            if not (row in rows and row.steps + 1 == costs.steps)]
                next_rows = going_on[: costs.max_rows]
        if replay is None and firsts:
            taken, firsts[:] = firsts[:], []
            replay = _Work(costs.first_window_ms + costs.first_window_more_ms * (len(taken) - 1), taken, "first")
        elif replay is None and rests:
            ready = rests if policy == "decode first" or step is None else [
                row for row in rests if policy == "later windows yield" and row.due - now <= YIELD_SLACK_S * 1e3]
            if ready:
                taken = ready[: costs.rest_per_replay]
                rests[:] = [row for row in rests if row not in taken]
                replay = _Work(costs.rest_of_clip_ms * len(taken), taken, "rest")
        running = replay if replay is not None else step
        if replay is not None and replay.kind == "rest" and policy == "rest after the DiT" and step is not None:
            running = step  # the DiT's step goes ahead of a rest replay
        if running is None:
            if next_arrival == len(arrivals):
                return first_audio, finished, late
            now = arrivals[next_arrival]
            continue
        to_arrival = arrivals[next_arrival] - now if next_arrival < len(arrivals) else math.inf
        to_due = math.inf  # a waiting rest's turn (later windows yield)
        if policy == "later windows yield" and replay is None and rests:
            to_due = max(0.0, rests[0].due - YIELD_SLACK_S * 1e3 - now)
        dt = min(running.left_ms, to_arrival, to_due, until_ms - now)
        running.left_ms -= dt
        now += dt
        if now >= until_ms:
            return first_audio, finished, late
        if running.left_ms > 1e-9:
            continue
        if running is step:
            for row in step.rows:
                row.steps += 1
                if row.steps == costs.steps:
                    waiting.remove(row)
                    firsts.append(row)
            step = None
        elif replay.kind == "first":
            first_audio += [now - row.arrived + costs.fixed_ms for row in replay.rows]
            for row in replay.rows:
                row.due = now + costs.first_window_audio_ms
            rests += replay.rows
            replay = None
        else:
            finished += [now] * len(replay.rows)
            late += sum(now > row.due for row in replay.rows)
            waiting += [_Row(now) for _ in replay.rows if clients]  # a closed-loop client's next request
            replay = None


def capacity(costs: Costs, policy: str) -> float:
    """Requests per second with CLOSED_LOOP_CLIENTS closed-loop clients, past SETTLE_S."""
    _, finished, _ = serve(costs, policy, clients=CLOSED_LOOP_CLIENTS, until_ms=CLOSED_LOOP_S * 1e3)
    counted = [at for at in finished if at >= SETTLE_S * 1e3]
    return len(counted) / (CLOSED_LOOP_S - SETTLE_S)


def arrivals_ms(rate: float, seconds: float, seed: int = 0) -> list[float]:
    """Poisson arrival times (ms) at `rate` requests per second."""
    return [at * 1e3 for at in poisson(rate, seconds, seed)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in vars(Costs()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.3, 0.5, 0.7],
                        help="open-loop rates, as shares of the policy's capacity")
    parser.add_argument("--rates", type=float, nargs="*", default=[],
                        help="open-loop rates in requests per second, besides the shares")
    args = parser.parse_args()
    costs = replace(Costs(), **{name: getattr(args, name) for name in vars(Costs())})
    alone = costs.alone_ms()
    print(f"one client's first audio: {alone:.1f} ms; GPU work per request at 16 rows: "
          f"{costs.steps * costs.step_16_ms / 16 + costs.first_window_ms + costs.rest_of_clip_ms:.1f} ms")
    print("| policy | capacity (req/s) | offered (req/s) | first audio p50 / p99 (ms) | p99 / one client | underruns |")
    print("| --- | --- | --- | --- | --- | --- |")
    for policy in POLICIES:
        most = capacity(costs, policy)
        for rate in [share * most for share in args.loads] + args.rates:
            times, _, late = serve(costs, policy, arrivals=arrivals_ms(rate, OPEN_LOOP_S))
            p99 = percentile(times, 99)
            print(f"| {policy} | {most:.1f} | {rate:.1f} ({rate / most:.2f}) | "
                  f"{percentile(times, 50):.1f} / {p99:.1f} | {p99 / alone:.2f}x | {late} of {len(times)} |")


if __name__ == "__main__":
    main()
