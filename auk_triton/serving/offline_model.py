"""Triton Python-backend model `auk_vae_decode_offline`: AuK latents in, the whole waveform
out, in one response (HTTP /infer).

It decodes nothing itself. Each request goes on to the decode model (its `decode_model`,
`auk_vae_decode`) as a decoupled BLS call with its LATENTS tensor as it came, its
parameters and the waveform it asks for; the tiles that come back are checked to follow
one another (START_SAMPLE) and sent as one response, START_SAMPLE 0. The decode model's
process holds the only weights and graphs, and a clip is decoded by the same tiled decode
either way: the offline waveform is the stream's, bit for bit. This model imports no
torch, holds no GPU memory and reads no checkpoint.

Requests. `execute` hands each request to one of `max_active_requests` worker threads and
returns; the worker forwards it, gathers its tiles and sends the response through the
request's response sender (a model that is not decoupled may answer that way). Past them a
request waits for a worker, first come, first served; past `max_queued_requests` more it
is refused at once (UNAVAILABLE). The decode model's own limits apply to what is forwarded.

Errors keep the decode model's status and message. Triton 2.51's Python backend hands a
forwarded request's error back as INTERNAL whatever its status (release 25.04 keeps it), so
each forwarded request asks for the status at the head of its error messages
(config.STATUS_IN_MESSAGE_PARAMETER) and `errors.relayed_error` reads it back; the client's
own request gets the message as it asked for it.

Cancellation. Triton 2.51 does not cancel a forwarded request when its caller's client
goes, and its Python backend has no way to (the response iterator's `cancel()` came with
release 25.04). So a watcher thread asks every forwarded request, each CANCEL_SWEEP_S,
whether its client has gone, and cancels the call through the decode model: a request
carrying the call's token (config.CANCEL_CALL_PARAMETER), which stops it at the decode
scheduler's next iteration, whether it is decoding or waiting there. A request that waited
for a worker is asked before it is forwarded.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

from .config import CALL_TOKEN_PARAMETER, CANCEL_CALL_PARAMETER, STATUS_IN_MESSAGE_PARAMETER, OfflineSettings
from .errors import BUSY_MESSAGE, STOPPING_MESSAGE, RequestCancelled, ServerBusy, ServerStopping, relayed_error
from .metrics import OfflineMetrics
from .triton_common import (
    START_SAMPLE,
    WAVEFORM,
    WAVEFORM_PCM16,
    array_tensor,
    failure_response,
    log,
    request_parameters,
    wants_pcm16,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# How often the watcher asks the forwarded requests whether their clients have gone: each
# question is a round trip to the server, about 30 us.
CANCEL_SWEEP_S = 0.02
# A request that waited longer than this for a worker is asked whether its client is still
# there before it is forwarded (the decode scheduler asks a first window the same way).
STALE_S = 0.02
FINALIZE_WAIT_S = 2.0


@dataclass(eq=False)
class Forward:
    """One request on its way through the decode model."""

    request: object
    token: str  # its call's config.CALL_TOKEN_PARAMETER
    latent_width: int
    cancelled: bool = False  # its client went, and its call was cancelled
    # Asking the request about its client, and ending its forwarding, one at a time (_client_gone).
    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: bool = False  # its call has returned: it is about to be answered


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        self.settings = OfflineSettings.from_model_config(json.loads(args["model_config"]))
        self.metrics = OfflineMetrics({"model": self.name, "version": str(args["model_version"])})
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)  # a request waits, or the model closes
        self.forwarding = threading.Condition(self.lock)  # a forwarded request to watch, or the model closes
        self.waiting: deque = deque()  # (request, when it arrived), first come first served
        self.active = 0
        self.forwarded: set[Forward] = set()
        self.closing = False
        self.threads = [
            threading.Thread(target=self._work, name=f"auk-offline-{index}", daemon=True)
            for index in range(self.settings.max_active_requests)
        ]
        self.threads.append(threading.Thread(target=self._watch, name="auk-offline-cancel", daemon=True))
        for thread in self.threads:
            thread.start()
        log("info", f"{self.name}: ready (forwards each request to {self.settings.decode_model}; "
                    f"{self.settings.max_active_requests} at once, {self.settings.max_queued_requests} more waiting)")

    # ---- requests -------------------------------------------------------------------------

    def execute(self, requests):
        """Hand each request to a worker (or refuse it at once) and return."""
        for request in requests:
            try:
                self._admit(request)
            except Exception as err:
                request.get_response_sender().send(failure_response(self.name, "forwarding", err, request),
                                                   flags=FINAL)
        return None

    def _admit(self, request) -> None:
        limit = self.settings.max_active_requests + self.settings.max_queued_requests
        with self.lock:
            if self.closing:
                raise ServerStopping(STOPPING_MESSAGE)
            if self.active + len(self.waiting) >= limit:
                raise ServerBusy(BUSY_MESSAGE.format(active=self.active, queued=len(self.waiting)))
            self.waiting.append((request, time.monotonic()))
            self.work.notify()
            self._report()

    def _work(self) -> None:
        """A worker: the oldest waiting request, forwarded and answered, then the next."""
        while True:
            with self.lock:
                while not self.waiting and not self.closing:
                    self.work.wait()
                if self.closing:
                    return
                request, arrived = self.waiting.popleft()
                self.active += 1
                self._report()
            try:
                self._answer(request, waited=time.monotonic() - arrived)
            finally:
                with self.lock:
                    self.active -= 1
                    self._report()

    def _answer(self, request, waited: float) -> None:
        try:
            if waited > STALE_S and request.is_cancelled():
                raise RequestCancelled("request cancelled before it was forwarded")
            name, waveform = self._forward(request)
            response = pb_utils.InferenceResponse(output_tensors=[
                array_tensor(name, waveform), array_tensor(START_SAMPLE, np.zeros(1, np.int64))])
        except Exception as err:
            response = failure_response(self.name, "forwarding", err, request)
        try:
            request.get_response_sender().send(response, flags=FINAL)
        except Exception as err:  # the client is gone: nothing to tell
            log("error", f"{self.name}: could not send the response: {err}")

    def _forward(self, request) -> tuple[str, np.ndarray]:
        """The request decoded by the decode model: its waveform's output name and samples."""
        name = WAVEFORM_PCM16 if wants_pcm16(request) else WAVEFORM
        latents = pb_utils.get_input_tensor_by_name(request, "LATENTS")
        forward = Forward(request, secrets.token_hex(16), latents.shape()[-1])
        # The client's parameters go on, so the decode model writes its messages as asked; the
        # status always heads them, to be read back (relayed_error).
        parameters = {key: value for key, value in request_parameters(request).items()
                      if isinstance(value, (bool, int, str)) and key != CANCEL_CALL_PARAMETER}
        parameters.update({STATUS_IN_MESSAGE_PARAMETER: True, CALL_TOKEN_PARAMETER: forward.token})
        call = pb_utils.InferenceRequest(
            request_id=request.request_id(), model_name=self.settings.decode_model, inputs=[latents],
            requested_output_names=[name, START_SAMPLE],
            parameters=parameters, preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0),
        )
        with self.lock:
            self.forwarded.add(forward)
            self.forwarding.notify()
        try:
            tiles, complete = self._gather(call.exec(decoupled=True), name)
        finally:
            with forward.lock:  # after a question in progress, before the answer (_client_gone)
                forward.ended = True
            with self.lock:
                self.forwarded.discard(forward)
        if forward.cancelled:
            raise RequestCancelled(f"request cancelled after {len(tiles)} of its tiles")
        if not complete:
            raise RuntimeError(f"{self.settings.decode_model} stopped the request after {len(tiles)} tiles")
        # One copy, out of the shared memory the tiles arrived in (held until the calls' end).
        return name, np.concatenate(tiles)

    def _gather(self, responses, name: str) -> tuple[list[np.ndarray], bool]:
        """A forwarded request's tiles, in order, and whether its last one came (a stopped
        request ends with an empty response instead); its error as a RelayedError."""
        tiles, complete, expected = [], False, 0
        for response in responses:
            if response.has_error():
                raise relayed_error(response.error().message(), "UNAVAILABLE", self.settings.decode_model)
            start = pb_utils.get_output_tensor_by_name(response, START_SAMPLE)
            complete = start is not None
            if start is None:
                continue
            start = int(np.from_dlpack(start)[0])
            if start != expected:
                raise RuntimeError(f"{self.settings.decode_model} sent the tile at sample {start} where the "
                                   f"one at sample {expected} was due")
            tiles.append(np.from_dlpack(pb_utils.get_output_tensor_by_name(response, name)))
            expected += tiles[-1].size
        return tiles, complete

    # ---- cancellation -------------------------------------------------------------------------

    def _watch(self) -> None:
        """Ask the forwarded requests whether their clients have gone; cancel the calls of those
        that have."""
        while True:
            with self.lock:
                while not self.forwarded and not self.closing:
                    self.forwarding.wait()
                if self.closing:
                    return
                watched = [forward for forward in self.forwarded if not forward.cancelled]
            for forward in watched:
                if self._client_gone(forward):
                    forward.cancelled = True
                    self._cancel(forward)
            time.sleep(CANCEL_SWEEP_S)

    def _client_gone(self, forward: Forward) -> bool:
        """Whether a forwarded request's client has gone, asked only until its call has ended.

        Triton frees a request's response factory with its final response: asking a request
        answered a moment before crashed tritonserver (seen on Triton 2.51, a SIGSEGV in
        TRITONBACKEND_ResponseFactoryIsCancelled). Its worker marks it ended under its own
        lock before answering it, so a question is over before the answer, or not asked. The
        lock is the request's own: a slow round trip holds up no other worker."""
        with forward.lock:
            if forward.ended:
                return False
            try:
                return forward.request.is_cancelled()
            except Exception:  # the request cannot be asked: its client is not waiting on it
                return False

    def _cancel(self, forward: Forward) -> None:
        """Cancel a forwarded request's call: the decode model stops it at its next iteration.
        The cancellation itself is a request to it, with no latents."""
        cancel = pb_utils.InferenceRequest(
            model_name=self.settings.decode_model,
            inputs=[array_tensor("LATENTS", np.zeros((0, forward.latent_width), np.float32))],
            requested_output_names=[START_SAMPLE], parameters={CANCEL_CALL_PARAMETER: forward.token},
        )
        try:
            for response in cancel.exec(decoupled=True):
                if response.has_error():
                    log("warn", f"{self.name}: cancelling a forwarded request failed: {response.error().message()}")
        except Exception as err:  # the decode model is going away: so is the call
            log("warn", f"{self.name}: cancelling a forwarded request failed: {type(err).__name__}: {err}")

    # ---- the end ------------------------------------------------------------------------------

    def _report(self) -> None:
        """The counts to the gauges (under the lock, so the last update has the last counts)."""
        self.metrics.update(self.active, len(self.waiting))

    def finalize(self):
        """Answer the requests still waiting (UNAVAILABLE: send it again) and stop the threads.
        Triton calls this once the requests it handed over have ended, or at its exit timeout."""
        with self.lock:
            self.closing = True
            waiting, self.waiting = list(self.waiting), deque()
            self.work.notify_all()
            self.forwarding.notify_all()
        for request, _ in waiting:
            response = failure_response(self.name, "forwarding", ServerStopping(STOPPING_MESSAGE), request)
            request.get_response_sender().send(response, flags=FINAL)
        deadline = time.monotonic() + FINALIZE_WAIT_S
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.metrics.close()
