"""`auk_dit`'s sampling thread: requests join the runs in progress between steps.

`execute` checks each request, hands the valid ones to this thread with their
response senders, and returns. Triton's dynamic batcher then calls it again for
the requests that arrive meanwhile (the model stays non-decoupled: one response
per request, over HTTP `/infer` too), so a request joins a run at its next step
(diffusion/joined.py) instead of waiting for the runs before it to end. The thread
steps while it holds requests, answers each one as it leaves its run, and waits
for the next request when it holds none.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Callable

import torch

from auk_triton.diffusion.joined import JoinedRuns

# How often an idle thread looks whether it is being stopped.
IDLE_WAIT_S = 0.1
# How often a thread holding requests that `admit` refuses asks again, while it has no step to queue.
ADMIT_POLL_S = 0.002


class SamplingThread:
    """Steps `runs` on a thread of its own. `answer(tag, result)` is called there once for each
    request (its latents or its error), and `after_step(idle)` after each step, idle when it
    holds no request any more; neither may raise. With `stream`, the thread queues its GPU work
    there (the submissions' copies and the steps). With `admit`, a request joins the runs only
    once `admit()` says yes, asked before each; until then it waits, in order, with the
    requests after it (a stage after this one has work enough)."""

    def __init__(self, runs: JoinedRuns, answer: Callable[[object, object], None],
                 after_step: Callable[[bool], None] = lambda idle: None, name: str = "auk-dit-sampling",
                 stream: torch.cuda.Stream | None = None, admit: Callable[[], bool] | None = None):
        self._runs, self._answer, self._after_step, self._stream = runs, answer, after_step, stream
        self._admit = admit
        self._held: deque = deque()  # taken from the inbox, waiting for `admit`
        self._holding_back = False  # whether `admit` refused the next of them, as of the last look
        self._holding = False  # whether `runs` holds a request, as of this thread's last look
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, plan, tag, should_stop: Callable[[], bool] | None = None) -> None:
        """Queue a checked plan; it joins its run before that run's next step."""
        self._inbox.put((plan, tag, should_stop))

    @property
    def busy(self) -> bool:
        """Whether the runs hold a request, or one is on its way in; not one that `admit` holds
        back (read from any thread: a moment's view)."""
        return self._holding or not self._inbox.empty()

    @property
    def holding_back(self) -> bool:
        """Whether `admit` holds requests back: the stage after this one has work enough (read
        from any thread: a moment's view)."""
        return self._holding_back

    def stop(self, timeout_s: float = 30.0) -> list:
        """Stop after the step in progress; the tags of the requests never answered."""
        self._stopping.set()
        self._thread.join(timeout_s)
        held = [*self._held, *self._take_inbox()]
        self._held.clear()
        self._holding_back = False
        self._holding = False  # what it held is handed back: the GPU has nothing more from it
        return [tag for _, tag, _ in held] + self._runs.drain()

    def _take_inbox(self, wait_s: float = 0.0) -> list:
        items = []
        try:
            items.append(self._inbox.get(timeout=wait_s) if wait_s else self._inbox.get_nowait())
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            return items

    def _loop(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self._stream.device)
            torch.cuda.set_stream(self._stream)  # this thread's
        while not self._stopping.is_set():
            wait_s = 0.0 if len(self._runs) else ADMIT_POLL_S if self._held else IDLE_WAIT_S
            self._held.extend(self._take_inbox(wait_s))
            while self._held and (self._admit is None or self._admit()):
                self._holding = True
                plan, tag, should_stop = self._held.popleft()
                try:
                    self._runs.submit(plan, tag, should_stop)
                except Exception as err:  # its grid's modulation table could not be computed
                    self._answer(tag, err)
            self._holding_back = bool(self._held)
            self._holding = bool(len(self._runs))
            if not self._holding:
                continue
            for tag, result in self._runs.step():
                self._answer(tag, result)
            self._holding = bool(len(self._runs))
            self._after_step(not self._holding)
