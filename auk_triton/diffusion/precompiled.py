"""The DiT's compiled blocks kept across restarts: each specialisation traced once, saved, and
loaded by later starts.

`torch.compile` traces a block function with Dynamo on every start (only Inductor's
generated code is cached), once for each set of guards its calls need: a single row or
several, a reference or none, guided or not. torch's ahead-of-time compile (`aot_compile`)
traces one call into a function that can be saved; a later start loads it and traces
nothing. Here a call is served by the first saved or traced function whose guards accept
its arguments, and a call that none accepts is traced ahead of time, saved to the folder
as a file of its own, and served from then on. The files hold traced programs and their
guards, not the weights: a block's parameters are arguments of every call. Their kernels
are Inductor's, from the compile caches beside them (serving/artifacts.py).

What the guards do not check (the compile options, the code, the architecture) is for the
folder to carry: the caller keys it by them. A file that cannot be loaded (another torch, a
broken file) is removed, and the reason kept for the log; its specialisation is traced anew
when a call needs it. Where the ahead-of-time trace itself fails (a torch without it, an op
it cannot save), the calls no saved trace accepts go through `torch.compile` as before,
traced on every start, and the log says why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

SUFFIX = ".aot"


def trace_ahead(fn: Callable, args: tuple, compile_kw: dict):
    """`fn` traced ahead of time on `args` with `torch.compile(fn, **compile_kw)`'s options."""
    # Off by default in torch 2.11. A float that the trace turns into a tensor restarts Dynamo's
    # analysis, which torch.compile does by itself and aot_compile does not: floats (a norm's
    # epsilon) are kept as constants instead.
    with torch._dynamo.config.patch(enable_aot_compile=True, specialize_float=True):
        return torch.compile(fn, **compile_kw).aot_compile((args, {}))


def _refusal(trace, args: tuple) -> str:
    """The guard of `trace` that refuses `args`, as Dynamo words it (for the log)."""
    try:
        failed = trace._artifacts.guard_manager.check_verbose(trace.prepare_f_locals(*args))
        reason = "; ".join(failed.verbose_code_parts) or str(failed)
    except Exception as err:  # a stand-in or another torch: no words for it
        reason = f"unknown ({type(err).__name__})"
    return " ".join(reason.split())[:300]  # one line


class PrecompiledFunction:
    """`fn` through its saved ahead-of-time traces in `folder` (module docstring); call it as `fn`."""

    def __init__(self, fn: Callable, folder: Path, compile_kw: dict):
        self.fn, self.folder, self.compile_kw = fn, Path(folder), dict(compile_kw)
        self.name = getattr(fn, "__name__", "function")
        self._traces: list = []
        self._lock = threading.Lock()  # the warm-up's and the deferred builder's threads both call
        self.loaded = self.traced = 0
        self.refused: list[str] = []  # saved traces not used (not loaded, guards that raised), each with why
        self.unsaved: str | None = None  # why a trace could not be saved (a read-only folder)
        self.failed: str | None = None  # why the ahead-of-time trace failed: torch.compile serves
        self.missed: str | None = None  # the first call traced although traces were loaded: the guard that refused it
        self._compiled: Callable | None = None  # that torch.compile, made on the failure
        self._saved_read = False

    def _read_saved(self) -> None:
        """Load the folder's traces, on the first call: a loaded trace's guards take the
        dispatch state (inference mode, autocast) of the thread loading it as their own, so
        they are made in the calls' state; loaded at construction, they refused every call."""
        self._saved_read = True
        for path in sorted(self.folder.glob(f"{self.name}-*{SUFFIX}")):
            try:
                with open(path, "rb") as file:
                    self._traces.append(torch.compiler.load_compiled_function(file))
                self.loaded += 1
            except Exception as err:  # another torch or Python, a broken or foreign file
                self.refused.append(f"{path.name}, removed ({type(err).__name__}: {err})")
                path.unlink(missing_ok=True)

    def __call__(self, *args):
        if not self._saved_read:
            with self._lock:
                if not self._saved_read:
                    self._read_saved()
        trace = self._accepting(args)
        if trace is None:
            with self._lock:
                trace = self._accepting(args)  # traced meanwhile by the other thread
                if trace is None:
                    if self.loaded and self.missed is None:
                        self.missed = _refusal(self._traces[0], args) if self._traces else "all dropped"
                    trace = self._trace(args)
        return trace(*args)

    def _accepting(self, args: tuple) -> Callable | None:
        """The first trace whose guards accept `args`, or None."""
        for trace in list(self._traces):
            try:
                if trace.guard_check(*args):
                    return trace
            except Exception as err:  # guards that cannot be checked here: that trace is dropped
                self._traces.remove(trace)
                self.refused.append(f"a trace whose guards raised, dropped ({type(err).__name__}: {err})")
        return None

    def _trace(self, args: tuple) -> Callable:
        """A new trace for `args`, saved; torch.compile once the ahead-of-time trace has failed."""
        if self._compiled is None:
            try:
                trace = trace_ahead(self.fn, args, self.compile_kw)
            except Exception as err:
                self.failed = f"{type(err).__name__}: {err}"
                log.warning("%s: the ahead-of-time trace failed, torch.compile serves: %s", self.name, self.failed)
                self._compiled = torch.compile(self.fn, **self.compile_kw)
            else:
                self.traced += 1
                self._save(trace)
                self._traces.append(trace)
                return trace
        return self._compiled

    def _save(self, trace) -> None:
        path = self.folder / f"{self.name}-{uuid.uuid4().hex[:16]}{SUFFIX}"  # unique among replicas and starts
        scratch = path.with_name(f".{path.name}")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            trace.save_compiled_function(str(scratch))
            os.replace(scratch, path)  # whole or not at all, for replicas sharing the folder
        except Exception as err:  # a read-only folder, a trace that cannot be written: it still serves here
            with contextlib.suppress(OSError):
                scratch.unlink(missing_ok=True)
            self.unsaved = f"{type(err).__name__}: {err}"
            log.warning("%s: a trace not saved to %s: %s", self.name, self.folder, err)

    def note(self) -> str:
        """What this start loaded and traced, for the log."""
        text = f"{self.name}: {self.loaded} saved traces loaded, {self.traced} traced"
        if self.refused:
            text += f"; refused: {', '.join(self.refused)}"
        if self.missed:
            text += f"; a call none of the saved traces accepted (the first's guard: {self.missed})"
        if self.unsaved:
            text += f"; not saved ({self.unsaved})"
        if self.failed:
            text += f"; the ahead-of-time trace failed, torch.compile traces the rest ({self.failed})"
        return text
