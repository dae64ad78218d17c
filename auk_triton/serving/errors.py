"""The ways a request can fail, and the status each reaches its client with.

Neither torch nor the Triton stub is needed here: the scheduler, the request checks, the
offline model (which imports no torch) and the front door all use it.

A request's error message can open with its status ("[INVALID_ARGUMENT] ..."): the models
write it there when the request asks (config.STATUS_IN_MESSAGE_PARAMETER), and
`relayed_error` reads it back where a model forwards a request to another. Triton 2.51's
Python backend hands a forwarded (BLS) request's error back with its message alone and the
status INTERNAL, whatever status the other model gave it.
"""

from __future__ import annotations

import re

from .config import STATUS_NAMES

STOPPING_MESSAGE = (
    "the model is shutting down (its server stops or unloads it) before the end of this request: "
    "send it again"
)
BUSY_MESSAGE = (
    "the model is at its limit ({active} requests decoding, {queued} waiting): send the request again later "
    "or to another server"
)
# A status at the head of an error message, as the models write it.
STATUS_TAG = re.compile(r"\[(" + "|".join(STATUS_NAMES) + r")\] ")


class RequestError(ValueError):
    """A request the model refuses; its message goes back to the client."""


class RequestCancelled(Exception):
    """The request's client is gone (it cancelled, or timed out): the model stops its work."""


class ServerBusy(RuntimeError):
    """The model holds as many requests as it may, decoding and waiting: the client may send
    the request again later, or to another server."""


class ServerStopping(RuntimeError):
    """The model goes away (the server stops, or unloads it) before the request's end: the
    client may send it again, to another server."""


class RelayedError(Exception):
    """The error another model answered a forwarded request with: its status and message go
    back to the client unchanged (the model that made it has logged it)."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def status_of(err: Exception) -> str:
    """The status `err` reaches its client with (one of config.STATUS_NAMES)."""
    if isinstance(err, RelayedError):
        return err.status
    if isinstance(err, RequestError):
        return "INVALID_ARGUMENT"
    if isinstance(err, RequestCancelled):
        return "CANCELLED"
    if isinstance(err, (ServerBusy, ServerStopping)):
        return "UNAVAILABLE"
    return "INTERNAL"


def relayed_error(message: str, untagged: str, forwarded_to: str) -> RelayedError:
    """The error of a forwarded request whose answer was `message`: the status at its head, and
    the message without it. An untagged message is Triton's own about the forwarded call (the
    model `forwarded_to` is not loaded, say): status `untagged`, the message naming that model."""
    found = STATUS_TAG.match(message)
    if found is None:
        return RelayedError(untagged, f"{forwarded_to} could not take the request: {message}")
    return RelayedError(found.group(1), message[found.end():])
