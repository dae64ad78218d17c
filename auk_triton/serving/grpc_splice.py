"""The front door's gRPC port: each client's HTTP/2 connection spliced to a connection of
its own to tritonserver. Frames pass on as they come; every inference message is read as it
passes, and only what could harm the server is held back.

A gRPC server and channel in Python (grpc.aio) cost about a millisecond per call in front of
Triton; passing the connection's frames on costs a fraction of that
(benchmarks/studies/front-door.md). What the splice reads, and does:

- Each message's 5-byte prefix (a compressed flag, the length): a message longer than any
  model takes ends its call RESOURCE_EXHAUSTED, in grpc-core's words, before a byte of it
  goes on.
- A ModelInfer / ModelStreamInfer message's head, the fields before its tensor bytes
  (raw_input_contents, field 7, which protobuf writers put last), is held until whole and
  checked by `request_limits.check_grpc_infer`, and the message's length against its
  model's own limit. Then the head and the tensor bytes go on as they come. A field other
  than raw_input_contents after them ends the call: it could carry inputs not checked.
- A refused message of a stream gets Triton's stream error (a response with
  `error_message`, between two of the server's messages) and the stream goes on; a refused
  unary call ends with its status.
- Header blocks are decoded (HPACK) and encoded again for the other side without a dynamic
  table, so the splice can drop, rename and add headers and frames and the compression
  state of the two sides never drifts apart.
- `triton_grpc_error: true` (a stream that wants statuses) reaches tritonserver renamed to
  config.STATUS_IN_MESSAGE_PARAMETER, which it forwards to each request as a parameter
  (`--grpc-header-forward-pattern`, set by the launcher): the models open their error
  messages with the status, and the splice ends the stream with it at the first error.
  Triton 2.51's own handling of that header crashed the server.
- Flow control stays exact: bytes the splice swallows are given back to their sender
  (WINDOW_UPDATE), and the window its own messages take is taken out of the client's
  updates before they go on.

While tritonserver is down, or the server is stopping, a new call ends UNAVAILABLE with why.
"""

from __future__ import annotations

import asyncio
import re
import sys
from functools import partial
from typing import Mapping
from urllib.parse import quote

from . import config
from .request_limits import ModelLimits, Refused, check_grpc_infer, max_message_bytes
from .upstream import STOPPING_MESSAGE

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, CANCEL = 0x0, 0x8
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x1, 0x4, 0x5
DEFAULT_WINDOW = 65_535  # every HTTP/2 window starts here
DEFAULT_FRAME_BYTES = 16_384
# Each side's bytes are received into a buffer of the splice's own (no copy until they go on):
# room for at least this much per receive.
RECEIVE_BYTES = 256 * 1024
# The most of a message's head the splice holds before its tensor bytes. Held bytes do not
# reach the server, which gives no window back for them, so this stays well under the
# 65,535 bytes of window every HTTP/2 stream starts with. A tensor sent in typed contents
# (InferTensorContents, inside the head) fits only up to this.
HEAD_BYTES = 32 * 1024
# The most of one response the splice holds to read a stream error's status from it (an
# error response is its message, a few hundred bytes).
ERROR_RESPONSE_BYTES = 16 * 1024
SERVICE = "/inference.GRPCInferenceService/"
INFER = SERVICE + "ModelInfer"
STREAM_INFER = SERVICE + "ModelStreamInfer"
RAW_INPUT_CONTENTS_TAG = 0x3A  # field 7, length-delimited
ERROR_MESSAGE_TAG = 0x0A  # ModelStreamInferResponse's field 1, which proto3 leaves out when empty
STATUS_HEADER = b"triton_grpc_error"
FORWARDED_STATUS_HEADER = config.STATUS_IN_MESSAGE_PARAMETER.encode()
STATUS_IN_MESSAGE = re.compile(r"\[(" + "|".join(config.STATUS_NAMES) + r")\] ")
CODES = {"OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "RESOURCE_EXHAUSTED": 8,
         "INTERNAL": 13, "UNAVAILABLE": 14}
# How long a connection waits for tritonserver's port while the server runs (it may be
# between a restart and listening), and how long a connection that answered UNAVAILABLE
# stays open after its GOAWAY, for the answers to leave.
CONNECT_WAIT_S = 2.0
GOAWAY_LINGER_S = 1.0


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def varint(buffer, at: int):
    """(value, the index after it) of the protobuf varint at `at`, or None if it is cut short."""
    value = shift = 0
    while at < len(buffer):
        byte = buffer[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise Refused("the request is not a protobuf message (a varint runs past 64 bits)")
    return None


def settings(payload):
    """(identifier, value) of each setting in a SETTINGS frame's payload."""
    for at in range(0, len(payload) - 5, 6):
        yield int.from_bytes(payload[at:at + 2], "big"), int.from_bytes(payload[at + 2:at + 6], "big")


# grpc-message is percent-encoded UTF-8: every printable ASCII character but % stays as it is.
MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def grpc_message(text: str) -> bytes:
    return quote(text, safe=MESSAGE_SAFE).encode()


def status_of(error_message: str) -> tuple[str, str]:
    """A stream error's status name and its message without it: the status the models put
    in it (config.STATUS_IN_MESSAGE_PARAMETER), anywhere (an ensemble may put words before
    its step's message), else UNKNOWN (an error of Triton's own)."""
    found = STATUS_IN_MESSAGE.search(error_message)
    if found is None:
        return "UNKNOWN", error_message
    return found.group(1), error_message[: found.start()] + error_message[found.end():]


class Refusal(Exception):
    """A message the splice does not pass on. `whole_call`: part of it went on already, or
    the protocol leaves no other way (grpc-core's own RESOURCE_EXHAUSTED), so its call ends."""

    def __init__(self, code: str, message: str, whole_call: bool = False):
        super().__init__(message)
        self.code, self.message, self.whole_call = code, message, whole_call


# Where a call's reader of request bytes stands.
PREFIX, HEAD, TENSORS, PASS, SWALLOW = range(5)


class Call:
    """One HTTP/2 stream of a spliced connection."""

    def __init__(self, stream_id: int, method: str, statuses: bool, window: int):
        self.id = stream_id
        self.infer = method in (INFER, STREAM_INFER)
        self.streaming = method == STREAM_INFER
        self.statuses = statuses  # ends at its first error with that error's status
        self.client_done = False  # the client sent END_STREAM
        self.upstream_closed = False  # the splice sent END_STREAM upstream for a stop
        self.half_close_pending = False  # ... at the end of the message being read
        self.headers_sent = False  # response headers went to the client
        self.own_headers = False  # ... and the splice sent them itself
        self.out_window = window  # what the client lets this stream receive
        self.owed = 0  # window the client will give back for the splice's own messages
        self.pending: list[bytes] = []  # the splice's responses, waiting for a message boundary
        self.flight = None
        # The request reader: phase, bytes held, bytes left of the message (or of its head).
        self.phase, self.held, self.left = PREFIX, bytearray(), 0
        self.walked = 0  # in HEAD: where in `held` the next field starts
        self.field_left = 0  # in TENSORS: bytes left of the raw_input_contents entry
        # The response reader (streams): bytes left of the server's message; its prefix.
        self.out_left, self.out_held = 0, bytearray()
        self.own_headers_answered = False  # the server's own response headers came, and were dropped


class Connection:
    """A client's connection and, while tritonserver can be reached, the splice's own to it.

    Both are asyncio protocols that receive into buffers of their own (Side); what a side's
    bytes make is gathered in `to_client` / `to_server` and written once per receive."""

    def __init__(self, front: "GrpcSplice", client: "Side"):
        import hpack

        self.front, self.state = front, front.state
        self.client, self.server = client, None  # Sides; `server` None: no tritonserver behind
        self.client_decoder, self.server_decoder = hpack.Decoder(), hpack.Decoder()
        # Encoders without a dynamic table (size 0): every block stands alone.
        self.to_client_encoder, self.to_server_encoder = hpack.Encoder(), hpack.Encoder()
        self.to_client_encoder.header_table_size = self.to_server_encoder.header_table_size = 0
        self.calls: dict[int, Call] = {}
        self.last_stream = 0
        self.server_frame_bytes = self.client_frame_bytes = DEFAULT_FRAME_BYTES
        self.client_initial_window = DEFAULT_WINDOW
        self.out_window = DEFAULT_WINDOW  # what the client lets the connection receive
        self.owed = 0
        self.to_client, self.to_server = bytearray(), bytearray()
        self.preface_left = len(PREFACE)
        self.blocks = {"client": {}, "server": {}}  # header blocks being gathered
        self.goaway_sent = self.closed = False

    # ---- the two sides ------------------------------------------------------------------

    async def connect(self) -> None:
        """Open the splice's connection to tritonserver while it runs, else answer alone."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_WAIT_S
        while self.state.running and not self.state.stopping and not self.closed:
            try:
                await loop.create_connection(lambda: Side(self, "server"), *self.front.upstream)
                break
            except OSError:
                if loop.time() > deadline:
                    break
                await asyncio.sleep(0.1)
        if self.closed:  # the client left while the splice connected
            if self.server is not None:
                self.server.transport.close()
            return
        if self.server is None:
            self._to_client(frame(SETTINGS, 0, 0))  # no server behind: the splice answers as one
        self.client.transport.resume_reading()
        self.flush()

    def received(self, side: "Side", view) -> int:
        """Frames of `side` in `view`: how many bytes they took (a partial frame waits)."""
        at = 0
        if side.name == "client":
            if self.preface_left:
                take = min(self.preface_left, len(view))
                if bytes(view[:take]) != PREFACE[len(PREFACE) - self.preface_left:][:take]:
                    raise ConnectionError("not an HTTP/2 connection")
                self.preface_left -= take
                if self.server is not None:
                    self.to_server += view[:take]
                at = take
            at = self._frames(view, at, self._client_frame, self._client_data_passes, "to_server",
                              self.blocks["client"])
        else:
            at = self._frames(view, at, self._server_frame, self._server_data_passes, "to_client",
                              self.blocks["server"])
        self.flush()
        return at

    def _frames(self, view, at: int, handle, passes, onward: str, block: dict) -> int:
        """Handle the whole frames in `view` from `at`. A DATA frame that `passes` unchanged
        joins a run of such frames that goes on as one slice; any other goes to `handle`."""
        run, end = at, len(view)
        while end - at >= 9:
            length = (view[at] << 16) | (view[at + 1] << 8) | view[at + 2]
            if end - at < 9 + length:
                break
            kind, flags = view[at + 3], view[at + 4]
            stream = int.from_bytes(view[at + 5:at + 9], "big") & 0x7FFFFFFF
            if kind == DATA and passes(flags, stream, view, at, length):
                at += 9 + length
                continue
            if run < at:
                getattr(self, onward).extend(view[run:at])
            whole = view[at:at + 9 + length]
            if kind in (HEADERS, PUSH_PROMISE, CONTINUATION):
                self._gather_block(block, kind, flags, stream, whole[9:], handle)
            else:
                handle(kind, flags, stream, whole)
            whole.release()
            at = run = at + 9 + length
        if run < at:
            getattr(self, onward).extend(view[run:at])
        return at

    def flush(self) -> None:
        # Each buffer is handed over whole and replaced: nothing the transport may still hold
        # is written to again.
        if self.to_server and self.server is not None:
            self.server.transport.write(self.to_server)
        self.to_server = bytearray()
        if self.to_client and not self.client.transport.is_closing():
            self.client.transport.write(self.to_client)
        self.to_client = bytearray()

    def side_lost(self, side: "Side") -> None:
        if side.name == "server":
            self.server = None
            self._lose_upstream("tritonserver closed the connection")
            self.flush()
            return
        self.closed = True
        for call in list(self.calls.values()):
            self._land(call)
        self.calls.clear()
        if self.server is not None:
            self.server.transport.close()
        self.front.connections.discard(self)

    def _client_data_passes(self, flags: int, stream: int, view, at: int, length: int) -> bool:
        """Whether a client DATA frame goes on as it came: inside a message's tensor bytes,
        or a message the splice does not read, and not its end."""
        call = self.calls.get(stream)
        if call is None or call.client_done or flags & (PADDED | END_STREAM) or self.server is None:
            return False
        if call.phase == PASS and call.left > length:
            call.left -= length
            return True
        if call.phase == TENSORS and call.field_left >= length and call.left > length:
            call.left -= length
            call.field_left -= length
            return True
        return False

    def _server_data_passes(self, flags: int, stream: int, view, at: int, length: int) -> bool:
        """Whether a server DATA frame goes on as it came: any but the end of a call, one
        of a stream with statuses (whose error responses the splice reads), or one that
        the splice's own responses wait for."""
        call = self.calls.get(stream)
        if call is None or call.statuses or call.pending or flags & (PADDED | END_STREAM):
            return False
        self.out_window -= length
        call.out_window -= length
        if call.streaming:
            if call.out_left >= length:
                call.out_left -= length
            else:
                self._track_responses(call, view[at + 9:at + 9 + length])
        return True

    def _gather_block(self, block: dict, kind: int, flags: int, stream: int, payload, handle) -> None:
        """A header block is a HEADERS (or PUSH_PROMISE) frame and its CONTINUATIONs."""
        if kind != CONTINUATION:
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if kind == HEADERS and flags & PRIORITY_FLAG:
                payload = payload[5:]
            elif kind == PUSH_PROMISE:
                payload = payload[4:]
            block.update(kind=kind, flags=flags, stream=stream, parts=[bytes(payload)])
        else:
            block["parts"].append(bytes(payload))
        if flags & END_HEADERS:
            handle(block["kind"], block["flags"] | END_HEADERS, block["stream"], b"".join(block["parts"]))
            block.clear()

    # ---- frames from the client ---------------------------------------------------------

    def _client_frame(self, kind: int, flags: int, stream: int, whole) -> None:
        if kind == HEADERS:
            self._client_headers(stream, flags, self.client_decoder.decode(whole, raw=True))
        elif kind == DATA:
            self._client_data(stream, flags, whole)
        elif kind == WINDOW_UPDATE:
            self._client_window_update(stream, whole)
        elif kind == RST_STREAM:
            call = self.calls.pop(stream, None)
            if call is not None:
                self._upstream(bytes(whole))
                self._land(call)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._client_settings(whole[9:])
            if self.server is not None:
                self._upstream(bytes(whole))
            elif not flags & ACK:  # no server behind: the splice answers for it
                self._to_client(frame(SETTINGS, ACK, 0))
        elif kind == PING:
            if self.server is not None:
                self._upstream(bytes(whole))
            elif not flags & ACK:
                self._to_client(frame(PING, ACK, 0, bytes(whole[9:])))
        elif kind == PUSH_PROMISE:  # a client does not push: its block is decoded for the table
            self.client_decoder.decode(whole, raw=True)
        elif self.server is not None:  # PRIORITY, GOAWAY, extensions
            self._upstream(bytes(whole))

    def _client_settings(self, payload) -> None:
        for key, value in settings(payload):
            if key == SETTINGS_MAX_FRAME_SIZE:
                self.client_frame_bytes = value
            elif key == SETTINGS_HEADER_TABLE_SIZE:
                self.server_decoder.max_allowed_table_size = max(self.server_decoder.max_allowed_table_size, value)
            elif key == SETTINGS_INITIAL_WINDOW_SIZE:
                for call in self.calls.values():
                    call.out_window += value - self.client_initial_window
                self.client_initial_window = value

    def _client_headers(self, stream: int, flags: int, headers) -> None:
        call = self.calls.get(stream)
        if call is None:
            if stream <= self.last_stream:
                return  # a call the splice ended: its block was decoded, for the table
            self.last_stream = stream
            path = next((value for name, value in headers if name == b":path"), b"").decode(errors="replace")
            statuses = path == STREAM_INFER and any(
                name == STATUS_HEADER and value.strip().lower() == b"true" for name, value in headers)
            call = Call(stream, path, statuses, self.client_initial_window)
            if self.state.stopping or self.server is None:
                why = STOPPING_MESSAGE if self.state.stopping else f"tritonserver is not reachable ({self.state.why})"
                self._answer(call, "UNAVAILABLE", why, client_done=bool(flags & END_STREAM))
                if self.server is None:
                    self._goaway()
                return
            self.calls[stream] = call
            # Only the splice asks a model for statuses in its messages: it takes them out again.
            headers = [(name, value) for name, value in headers if name not in (STATUS_HEADER, FORWARDED_STATUS_HEADER)]
            if statuses:
                headers.append((FORWARDED_STATUS_HEADER, b"true"))
            call.flight = self.state.take_off(
                partial(self._cut, call), half_close=partial(self._half_close, call) if call.streaming else None)
        if flags & END_STREAM:
            call.client_done = True
        self._headers(self._upstream, self.to_server_encoder, self.server_frame_bytes, stream, headers,
                      bool(flags & END_STREAM))

    def _client_data(self, stream: int, flags: int, whole) -> None:
        start, stop = (10, len(whole) - whole[9]) if flags & PADDED else (9, len(whole))
        call = self.calls.get(stream)
        if call is None or call.client_done:
            self._credit_client(None, len(whole) - 9)
            return
        # A frame inside a message's bytes went on as it came (_client_data_passes); this one is
        # made anew. (So a padded frame goes on unpadded: tritonserver's grpc-core resets a
        # stream with a padded DATA frame, PROTOCOL_ERROR.)
        payload = whole[start:stop]
        end = bool(flags & END_STREAM)
        try:
            parts, swallowed = self._request_bytes(call, payload)
        except Refusal as refusal:
            self._credit_client(None, len(whole) - 9)
            return self._refuse(call, refusal)
        if end:
            call.client_done = True
            if call.phase in (PREFIX, HEAD) and call.held:
                parts.append(bytes(call.held))  # cut short inside a message: the server says so
            if call.upstream_closed:
                end = False  # the stop's END_STREAM went up already
        self._data_frames(self._upstream, self.server_frame_bytes, stream, b"".join(parts), end)
        swallowed += len(whole) - 9 - len(payload)  # the padding of a frame made anew
        self._credit_client(None if call.client_done else call, swallowed)
        if call.half_close_pending:
            self._half_close(call)

    def _client_window_update(self, stream: int, whole) -> None:
        increment = int.from_bytes(whole[9:13], "big") & 0x7FFFFFFF
        holder = self if stream == 0 else self.calls.get(stream)
        if holder is None:
            return  # a call the splice ended
        holder.out_window += increment
        passed = increment - min(increment, holder.owed)
        holder.owed -= increment - passed
        if passed:
            self._upstream(frame(WINDOW_UPDATE, 0, stream, passed.to_bytes(4, "big")))
        for call in ([holder] if stream else list(self.calls.values())):
            self._send_pending(call)

    # ---- reading requests ---------------------------------------------------------------

    def _request_bytes(self, call: Call, data) -> tuple[list[bytes], int]:
        """The bytes of `data` (request bytes of `call`) to pass on now, and how many the
        splice swallows. A message refused within its stream is swallowed here; Refusal
        for one that ends its call."""
        parts, swallowed, at, end = [], 0, 0, len(data)
        while at < end:
            if call.phase in (PASS, SWALLOW, TENSORS):
                step = min(call.left, end - at)
                chunk = data[at:at + step]
                if call.phase == SWALLOW:
                    swallowed += step
                else:
                    if call.phase == TENSORS:
                        self._walk_tensors(call, chunk)
                    parts.append(bytes(chunk))
                call.left -= step
                at += step
                if not call.left:
                    self._message_done(call)
                continue
            # PREFIX or HEAD: held until the message's head is whole and checked.
            take = min(5 - len(call.held) if call.phase == PREFIX else call.left, end - at)
            call.held += data[at:at + take]
            at += take
            try:
                if call.phase == PREFIX:
                    if len(call.held) == 5:
                        self._read_prefix(call)
                        if call.phase == PASS:  # not a message the splice reads
                            parts.append(bytes(call.held))
                            call.held = bytearray()
                else:
                    call.left -= take
                    released = self._read_head(call)
                    if released is not None:
                        parts.append(released)
            except Refusal as refusal:
                if refusal.whole_call or not call.streaming or call.statuses:
                    raise
                self._refuse(call, refusal)
                swallowed += len(call.held)
                call.phase, call.held = SWALLOW, bytearray()
            if call.phase != HEAD and call.phase != PREFIX and not call.left:
                self._message_done(call)
        return parts, swallowed

    def _message_done(self, call: Call) -> None:
        call.phase, call.held, call.field_left = PREFIX, bytearray(), 0

    def _read_prefix(self, call: Call) -> None:
        compressed, length = call.held[0], int.from_bytes(call.held[1:5], "big")
        call.left = length
        most = self.front.max_message_bytes
        if length > most:
            raise Refusal("RESOURCE_EXHAUSTED", f"Received message larger than max ({length} vs. {most})", whole_call=True)
        if call.upstream_closed:
            raise Refusal("UNAVAILABLE", STOPPING_MESSAGE)
        if not call.infer or length == 0:
            call.phase = PASS
        elif compressed:
            raise Refusal("INVALID_ARGUMENT", "the front door reads each inference request as it passes: send it "
                          "uncompressed")
        else:
            call.phase, call.walked = HEAD, 5

    def _read_head(self, call: Call):
        """Once the head is whole (the fields before raw_input_contents, or the whole message)
        and checked, the held bytes to pass on; None while it is not."""
        held, at, whole = call.held, call.walked, call.left == 0
        while True:
            if at - 5 > HEAD_BYTES:
                break
            tag = varint(held, at)
            if tag is None:
                break
            if tag[0] == RAW_INPUT_CONTENTS_TAG:
                return self._release(call, head_end=at)
            field, wire = tag[0] >> 3, tag[0] & 7
            if wire == 0:
                value = varint(held, tag[1])
                next_at = None if value is None else value[1]
            elif wire == 1:
                next_at = tag[1] + 8
            elif wire == 5:
                next_at = tag[1] + 4
            elif wire == 2:
                size = varint(held, tag[1])
                next_at = None if size is None else size[1] + size[0]
            else:
                raise Refusal("INVALID_ARGUMENT", f"the request is not a ModelInferRequest (field {field}, wire type {wire})")
            if next_at is None or next_at > len(held):
                break
            at = call.walked = next_at
        if max(at, len(held) if not whole else at) - 5 > HEAD_BYTES:
            raise Refusal("INVALID_ARGUMENT", f"the request's inputs take over {HEAD_BYTES} bytes before its tensor "
                          "bytes: send tensors as raw_input_contents (as tritonclient does)")
        return self._release(call, head_end=len(held)) if whole else None

    def _release(self, call: Call, head_end: int) -> bytes:
        from tritonclient.grpc import service_pb2

        held, length = call.held, int.from_bytes(call.held[1:5], "big")
        try:
            request = service_pb2.ModelInferRequest.FromString(bytes(held[5:head_end]))
        except Exception as err:
            raise Refusal("INVALID_ARGUMENT", f"the request is not a ModelInferRequest: {err}") from None
        try:
            check_grpc_infer(self.front.limits, request)
        except Refused as err:
            raise Refusal("INVALID_ARGUMENT", str(err)) from None
        most = self.front.limits[request.model_name].max_bytes()
        if most and length > most:
            raise Refusal("RESOURCE_EXHAUSTED", f"the request is {length} bytes; model '{request.model_name}' takes "
                          f"at most {most}")
        released = bytes(held)
        call.phase, call.held, call.field_left = TENSORS, bytearray(), 0
        self._walk_tensors(call, released[head_end:])
        return released

    def _walk_tensors(self, call: Call, chunk) -> None:
        """Follow the raw_input_contents entries of a checked message (`call.held` keeps a
        tag cut between two frames): any other field after them could carry what the splice
        has not checked."""
        at, end = 0, len(chunk)
        while at < end:
            if call.field_left:
                step = min(call.field_left, end - at)
                call.field_left -= step
                at += step
                continue
            call.held.append(chunk[at])
            at += 1
            tag = varint(call.held, 0)
            if tag is None:
                continue
            if tag[0] != RAW_INPUT_CONTENTS_TAG:
                raise Refusal("INVALID_ARGUMENT", f"the request has field {tag[0] >> 3} after its tensor bytes: the "
                              "front door checks a request's inputs before their data, in the order protobuf writes "
                              "them", whole_call=True)
            size = varint(call.held, tag[1])
            if size is not None:
                call.field_left, call.held = size[0], bytearray()

    # ---- frames from tritonserver -------------------------------------------------------

    def _server_frame(self, kind: int, flags: int, stream: int, whole) -> None:
        if kind == HEADERS:
            self._server_headers(stream, flags, self.server_decoder.decode(whole, raw=True))
        elif kind == DATA:
            self._server_data(stream, flags, whole)
        elif kind == RST_STREAM:
            call = self.calls.pop(stream, None)
            if call is not None:
                self._to_client(bytes(whole))
                self._land(call)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._server_settings(whole[9:])
            self._to_client(bytes(whole))
        elif kind == WINDOW_UPDATE:
            if stream == 0 or stream in self.calls:
                self._to_client(bytes(whole))
        elif kind == PUSH_PROMISE:  # gRPC does not push: the block is decoded for the table
            self.server_decoder.decode(whole, raw=True)
        else:  # PING, GOAWAY, extensions
            self._to_client(bytes(whole))

    def _server_settings(self, payload) -> None:
        for key, value in settings(payload):
            if key == SETTINGS_MAX_FRAME_SIZE:
                self.server_frame_bytes = value
            elif key == SETTINGS_HEADER_TABLE_SIZE:
                self.client_decoder.max_allowed_table_size = max(self.client_decoder.max_allowed_table_size, value)

    def _server_headers(self, stream: int, flags: int, headers) -> None:
        call = self.calls.get(stream)
        if call is None:
            return  # a call the splice ended: its block was decoded, for the table
        end = bool(flags & END_STREAM)
        if call.own_headers and not call.own_headers_answered:
            call.own_headers_answered = True
            if not end:
                return  # the client has its response headers from the splice
            headers = [(n, v) for n, v in headers if not n.startswith(b":") and n != b"content-type"]
        if call.statuses and end and call.pending:
            self._send_pending(call, force=True)
        call.headers_sent = True
        self._headers(self._to_client, self.to_client_encoder, self.client_frame_bytes, stream, headers, end)
        if end:
            self.calls.pop(stream, None)
            self._land(call)

    def _server_data(self, stream: int, flags: int, whole) -> None:
        call = self.calls.get(stream)
        size = len(whole) - 9
        if call is None:  # a call the splice ended: the server gets its window back
            self._credit_server(size)
            return
        self.out_window -= size
        call.out_window -= size
        if not call.statuses:
            if call.streaming:
                self._track_responses(call, whole[10:len(whole) - whole[9]] if flags & PADDED else whole[9:])
            self._to_client(bytes(whole))
        else:
            start, stop = (10, len(whole) - whole[9]) if flags & PADDED else (9, len(whole))
            held_before = len(call.out_held)
            parts, error = self._read_responses(call, whole[start:stop])
            data = b"".join(parts)
            # The client's window shrinks by what it is sent: bytes held now go later.
            self.out_window += size - len(data)
            call.out_window += size - len(data)
            if error is not None:
                self._data_frames(self._to_client, self.client_frame_bytes, stream, data, False)
                self._credit_server(size - len(data) + held_before)  # the error response, swallowed
                self._end(call, *status_of(error))
                return
            self._data_frames(self._to_client, self.client_frame_bytes, stream, data, bool(flags & END_STREAM))
            self._credit_server(size - (stop - start), stream)  # the padding of a frame made anew
        self._send_pending(call)
        if flags & END_STREAM:
            self.calls.pop(stream, None)
            self._land(call)

    def _track_responses(self, call: Call, data) -> None:
        """Follow a stream's response messages, for the boundaries between them (where the
        splice's own responses go)."""
        at, end = 0, len(data)
        while at < end:
            if call.out_left:
                step = min(call.out_left, end - at)
                call.out_left -= step
                at += step
                continue
            take = min(5 - len(call.out_held), end - at)
            call.out_held += data[at:at + take]
            at += take
            if len(call.out_held) == 5:
                call.out_left, call.out_held = int.from_bytes(call.out_held[1:5], "big"), bytearray()

    def _read_responses(self, call: Call, data) -> tuple[list[bytes], str | None]:
        """For a stream with statuses: the response bytes to pass on now, and an error
        response's text once one is read whole. Each message's prefix and first byte are
        held until they tell whether it is an error response (field 1 first)."""
        parts, at, end = [], 0, len(data)
        while at < end:
            if call.out_left and not call.out_held:  # inside a message that is not an error
                step = min(call.out_left, end - at)
                parts.append(bytes(data[at:at + step]))
                call.out_left -= step
                at += step
                continue
            held = call.out_held
            need = 5 - len(held) if len(held) < 5 else (1 if len(held) == 5 else call.out_left)
            take = min(need, end - at)
            held += data[at:at + take]
            at += take
            if len(held) == 5:
                call.out_left = int.from_bytes(held[1:5], "big")
                if not call.out_left or call.out_left > ERROR_RESPONSE_BYTES:  # not an error response
                    parts.append(bytes(held))
                    call.out_held = bytearray()
                continue
            call.out_left -= take
            if len(held) == 6 and need == 1 and held[5] != ERROR_MESSAGE_TAG:  # not an error response
                parts.append(bytes(held))
                call.out_held = bytearray()
                continue
            if not call.out_left:
                from tritonclient.grpc import service_pb2

                return parts, service_pb2.ModelStreamInferResponse.FromString(bytes(held[5:])).error_message
        return parts, None

    # ---- what the splice sends itself ---------------------------------------------------

    def _to_client(self, data: bytes) -> None:
        self.to_client += data

    def _upstream(self, data: bytes) -> None:
        if self.server is not None:
            self.to_server += data

    @staticmethod
    def _headers(send, encoder, frame_bytes: int, stream: int, headers, end: bool) -> None:
        block = encoder.encode(headers, huffman=False)
        first, block = block[:frame_bytes], block[frame_bytes:]
        send(frame(HEADERS, (END_STREAM if end else 0) | (0 if block else END_HEADERS), stream, first))
        while block:
            part, block = block[:frame_bytes], block[frame_bytes:]
            send(frame(CONTINUATION, 0 if block else END_HEADERS, stream, part))

    @staticmethod
    def _data_frames(send, frame_bytes: int, stream: int, data: bytes, end: bool) -> None:
        if not data and not end:
            return
        for at in range(0, max(len(data), 1), frame_bytes):
            last = at + frame_bytes >= len(data)
            send(frame(DATA, END_STREAM if end and last else 0, stream, data[at:at + frame_bytes]))

    def _credit_server(self, size: int, stream: int = 0) -> None:
        """Give the server back the window of bytes the client never got (0: the connection's only)."""
        if size:
            self._upstream(frame(WINDOW_UPDATE, 0, 0, size.to_bytes(4, "big")))
            if stream:
                self._upstream(frame(WINDOW_UPDATE, 0, stream, size.to_bytes(4, "big")))

    def _credit_client(self, call: Call | None, size: int) -> None:
        """Give the client back the window of bytes the server never saw."""
        if size:
            self._to_client(frame(WINDOW_UPDATE, 0, 0, size.to_bytes(4, "big")))
            if call is not None:
                self._to_client(frame(WINDOW_UPDATE, 0, call.id, size.to_bytes(4, "big")))

    def _status_headers(self, call: Call, code: str, message: str):
        trailers = [(b"grpc-status", str(CODES[code]).encode()), (b"grpc-message", grpc_message(message))]
        if call.headers_sent:
            return trailers
        return [(b":status", b"200"), (b"content-type", b"application/grpc"), *trailers]

    def _answer(self, call: Call, code: str, message: str, client_done: bool) -> None:
        """End a call the server never saw (trailers only)."""
        self._headers(self._to_client, self.to_client_encoder, self.client_frame_bytes, call.id,
                      self._status_headers(call, code, message), True)
        if not client_done:
            self._to_client(frame(RST_STREAM, 0, call.id, NO_ERROR.to_bytes(4, "big")))

    def _end(self, call: Call, code: str, message: str) -> None:
        """End a call the server has: reset it upstream, its status to the client."""
        if self.calls.pop(call.id, None) is None:
            return
        self._upstream(frame(RST_STREAM, 0, call.id, CANCEL.to_bytes(4, "big")))
        self._answer(call, code, message, call.client_done)
        self._land(call)

    def _refuse(self, call: Call, refusal: Refusal) -> None:
        _log(f"refused {'a ModelStreamInfer request' if call.streaming else 'ModelInfer'}: {refusal.message}")
        if refusal.whole_call or not call.streaming or call.statuses:
            self._end(call, refusal.code, refusal.message)
            return
        from tritonclient.grpc import service_pb2

        message = service_pb2.ModelStreamInferResponse(error_message=refusal.message).SerializeToString()
        call.pending.append(b"\x00" + len(message).to_bytes(4, "big") + message)
        self._send_pending(call)

    def _send_pending(self, call: Call, force: bool = False) -> None:
        """The splice's own responses go between two of the server's, within the client's window."""
        while call.pending and call.id in self.calls and (force or not (call.out_left or call.out_held)):
            size = len(call.pending[0])
            if size > min(self.out_window, call.out_window):
                return
            if not call.headers_sent:
                self._headers(self._to_client, self.to_client_encoder, self.client_frame_bytes, call.id,
                              [(b":status", b"200"), (b"content-type", b"application/grpc")], False)
                call.headers_sent = call.own_headers = True
            self._data_frames(self._to_client, self.client_frame_bytes, call.id, call.pending.pop(0), False)
            self.out_window -= size
            call.out_window -= size
            self.owed += size
            call.owed += size

    def _half_close(self, call: Call) -> None:
        """A stop: no more requests of this stream go upstream (Triton ends it once those sent are done)."""
        if call.id not in self.calls or call.client_done or call.upstream_closed:
            return
        if call.phase == PREFIX and not call.held:
            call.upstream_closed, call.half_close_pending = True, False
            self._upstream(frame(DATA, END_STREAM, call.id))
            self.flush()  # a stop calls this outside the sides' receiving
        else:
            call.half_close_pending = True

    def _cut(self, call: Call) -> None:
        self._end(call, "UNAVAILABLE", call.flight.cut or STOPPING_MESSAGE)
        self.flush()  # a stop calls this outside the sides' receiving

    def _land(self, call: Call) -> None:
        if call.flight is not None:
            self.state.land(call.flight)
            call.flight = None

    def _lose_upstream(self, why: str) -> None:
        """tritonserver's connection is gone: what was open on it ends UNAVAILABLE."""
        for call in list(self.calls.values()):
            reason = why if self.state.running else self.state.why
            self._end(call, "UNAVAILABLE", f"tritonserver is not reachable ({reason})")
        if self.server is not None:
            self.server.transport.close()
            self.server = None
        self._goaway()

    def _goaway(self) -> None:
        """No new calls on this connection: the client opens a new one, which finds the server
        again once it is back."""
        if self.goaway_sent:
            return
        self.goaway_sent = True
        self._to_client(frame(GOAWAY, 0, 0, self.last_stream.to_bytes(4, "big") + NO_ERROR.to_bytes(4, "big")))
        asyncio.get_running_loop().call_later(GOAWAY_LINGER_S, self.client.transport.close)

    def close_upstream(self) -> None:
        if self.server is not None:
            self.server.transport.close()


class Side(asyncio.BufferedProtocol):
    """One side of a spliced connection ("client" or "server"): receives into a buffer of its
    own, hands whole frames to the connection, and holds the other side back while its own
    transport cannot take more (flow control between the two sockets)."""

    def __init__(self, connection: Connection | None, name: str, front: "GrpcSplice | None" = None):
        self.connection, self.name, self.front = connection, name, front
        self.buffer = bytearray(RECEIVE_BYTES)
        self.start = self.filled = 0  # taken, and received, bytes of `buffer`
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.name == "client":
            transport.pause_reading()  # until the splice knows what is behind it
            self.connection = Connection(self.front, self)
            self.front.connections.add(self.connection)
            # Held here: the loop keeps only a weak reference to a task.
            self.connection.task = asyncio.ensure_future(self.connection.connect())
        else:
            self.connection.server = self

    def get_buffer(self, sizehint: int):
        if self.start:  # what was taken leaves the buffer (no view of it is alive here)
            del self.buffer[:self.start]
            self.filled -= self.start
            self.start = 0
            self.buffer.extend(bytes(max(0, RECEIVE_BYTES - len(self.buffer))))
        if len(self.buffer) - self.filled < RECEIVE_BYTES // 4:
            self.buffer.extend(bytes(RECEIVE_BYTES))
        return memoryview(self.buffer)[self.filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        with memoryview(self.buffer) as whole:
            view = whole[self.start:self.filled]
            try:
                self.start += self.connection.received(self, view)
            except Exception as err:  # a protocol error of either side: the connection ends
                _log(f"a gRPC connection ended: {type(err).__name__}: {err}")
                self.connection.client.transport.close()
            finally:
                view.release()

    def pause_writing(self) -> None:  # the peer does not read as fast: hold the other side
        other = self._other()
        if other is not None:
            other.transport.pause_reading()

    def resume_writing(self) -> None:
        other = self._other()
        if other is not None and not other.transport.is_closing():
            other.transport.resume_reading()

    def _other(self):
        return self.connection.server if self.name == "client" else self.connection.client

    def connection_lost(self, exc) -> None:
        if self.connection is not None:
            self.connection.side_lost(self)


class GrpcSplice:
    """The listening gRPC port: a Connection per client."""

    def __init__(self, limits: Mapping[str, ModelLimits], upstream_port: int, state):
        self.limits, self.state = limits, state
        self.upstream = ("127.0.0.1", upstream_port)
        self.max_message_bytes = max_message_bytes(limits)
        self.connections: set[Connection] = set()
        self.server = None

    async def start(self, address: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: Side(None, "client", self), address, port, reuse_address=True)

    def close_upstream(self) -> None:
        """A stop's end: the splice's connections to tritonserver close (Triton 2.51 waits out
        its exit timeout for an open stream); a call still open ends UNAVAILABLE."""
        for connection in list(self.connections):
            connection.close_upstream()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for connection in list(self.connections):
                connection.client.transport.close()
            await self.server.wait_closed()


def _log(text: str) -> None:
    print(f"auk_triton.serving.grpc_splice: {text}", file=sys.stderr, flush=True)
