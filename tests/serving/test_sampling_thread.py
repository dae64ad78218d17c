"""auk_dit's sampling thread, with stand-in runs: it answers every request once, from its own
thread, and a stop hands back the requests it never answered."""

import threading
import time

from auk_triton.serving.sampling_thread import SamplingThread


class StandInRuns:
    """JoinedRuns' contract: a request takes `steps` of its own; a plan of None cannot be submitted."""

    def __init__(self, steps: int = 3):
        self.steps, self.held = steps, {}

    def __len__(self):
        return len(self.held)

    def submit(self, plan, tag, should_stop=None):
        if plan is None:
            raise ValueError("no modulation table for this grid")
        self.held[tag] = self.steps

    def step(self):
        done = []
        for tag in list(self.held):
            self.held[tag] -= 1
            if not self.held[tag]:
                del self.held[tag]
                done.append((tag, f"latents of {tag}"))
        return done

    def drain(self):
        tags, self.held = list(self.held), {}
        return tags


def _wait_for(answers, count):
    deadline = time.monotonic() + 10
    while len(answers) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_every_request_is_answered_once_from_the_sampling_thread_and_a_failed_submit_gets_its_error():
    answers, idle = [], []
    def answer(tag, result):
        answers.append((tag, result, threading.current_thread()))

    thread = SamplingThread(StandInRuns(), answer, after_step=idle.append)
    thread.submit("plan", "a")
    thread.submit(None, "broken")
    thread.submit("plan", "b")
    _wait_for(answers, 3)
    assert thread.stop() == []
    assert sorted((tag, str(result)) for tag, result, _ in answers) == [
        ("a", "latents of a"), ("b", "latents of b"), ("broken", "no modulation table for this grid")]
    assert all(where.name == "auk-dit-sampling" for _, _, where in answers)
    assert idle[-1] is True and idle.count(True) >= 1, "the last step leaves it idle"


def test_a_stop_returns_after_the_step_in_progress_with_the_requests_never_answered():
    runs = StandInRuns(steps=10**9)
    answers = []
    thread = SamplingThread(runs, lambda tag, result: answers.append(tag))
    thread.submit("plan", "long")
    deadline = time.monotonic() + 10
    while not len(runs) and time.monotonic() < deadline:
        time.sleep(0.01)
    began = time.monotonic()
    assert thread.stop(timeout_s=5) == ["long"] and answers == []
    assert time.monotonic() - began < 1


def test_requests_wait_in_order_while_admit_refuses_and_join_once_it_agrees():
    answers, admitted = [], threading.Event()
    runs = StandInRuns(steps=1)
    thread = SamplingThread(runs, lambda tag, result: answers.append(tag), admit=admitted.is_set)
    for tag in ("a", "b", "c"):
        thread.submit("plan", tag)
    time.sleep(0.2)
    assert answers == [] and len(runs) == 0, "nothing joins while admit refuses"
    admitted.set()
    _wait_for(answers, 3)
    assert answers == ["a", "b", "c"]
    assert thread.stop() == []


def test_a_stop_hands_back_the_requests_admit_held():
    thread = SamplingThread(StandInRuns(), lambda tag, result: None, admit=lambda: False)
    thread.submit("plan", "a")
    thread.submit("plan", "b")
    time.sleep(0.1)
    assert thread.stop() == ["a", "b"]


def test_it_is_busy_while_its_runs_hold_a_request_and_not_for_one_admit_holds_back():
    runs, admitted = StandInRuns(steps=10**9), threading.Event()
    thread = SamplingThread(runs, lambda tag, result: None, admit=admitted.is_set)
    assert not thread.busy
    thread.submit("plan", "held back")
    time.sleep(0.2)
    assert len(runs) == 0 and not thread.busy, "a request admit holds back gives the GPU no work"
    admitted.set()
    deadline = time.monotonic() + 10
    while not len(runs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread.busy
    assert thread.stop(timeout_s=5) == ["held back"]


def test_it_says_it_holds_back_only_while_admit_refuses_a_request_it_has():
    runs, admitted = StandInRuns(steps=10**9), threading.Event()
    thread = SamplingThread(runs, lambda tag, result: None, admit=admitted.is_set)
    time.sleep(0.1)
    assert not thread.holding_back, "nothing to hold back"
    thread.submit("plan", "held back")
    deadline = time.monotonic() + 10
    while not thread.holding_back and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread.holding_back and len(runs) == 0
    admitted.set()
    while thread.holding_back and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not thread.holding_back and len(runs) == 1, "admitted: it joined, and nothing is held back"
    assert thread.stop(timeout_s=5) == ["held back"]


def test_it_is_idle_again_once_its_last_request_has_left():
    answers = []
    thread = SamplingThread(StandInRuns(steps=3), lambda tag, result: answers.append(tag))
    thread.submit("plan", "a")
    _wait_for(answers, 1)
    deadline = time.monotonic() + 10
    while thread.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answers == ["a"] and not thread.busy
    assert thread.stop() == []
