"""uvicorn's httptools protocol, with a deadline and a size bound on a request's head.

uvicorn times out a connection only while it is idle between requests (--timeout-keep-alive, armed
once a response is done): a connection that opens and sends nothing, or sends a request's head a
byte at a time, is kept for ever. Anyone who can reach the port could hold connections (and the
process's file descriptors) until no one else gets one. Here a connection must have sent a whole
request head within KVGATE_CLIENT_READ_TIMEOUT_S of opening, or of its next request's first byte;
otherwise it is closed (there is no request yet to answer). The body's own deadline is in
gateway/body_limit.py.

Nor did anything bound a head's size: uvicorn's httptools protocol keeps the URL and every header as
they come (llhttp counts nothing), so one anonymous connection sending headers at loopback speed
took a gateway from 95 MB to 1.1 GB in a second, and a URL sent in pieces was joined piece by piece
(quadratic: 200 MB kept the loop busy for 11 s). Here a head may be KVGATE_MAX_HEAD_BYTES long (64
KiB, as Envoy's 60 KiB and above Node's 16): beyond, the connection is answered 431 and closed. With
h11 uvicorn bounds it itself (h11_max_incomplete_event_size, given the same setting).

Two more things a connection cannot make the gateway keep or do: more than MAX_PIPELINED requests
waiting behind the one being answered (uvicorn parsed and queued every request a piece held), and a
chunked body in thousands of tiny chunks (a Python callback each).

`kvgate gateway` serves with this class when httptools is installed (it is uvicorn's default then);
h11 (KVGATE_HTTP_PARSER=h11) keeps uvicorn's behaviour.

It also puts the connection's transport in the request's scope (TRANSPORT), so a client let go for
not reading (gateway/client_writes.py) is reset: closed, the connection would keep its unsent bytes,
its descriptor and the kernel's send buffer for as long as the client's window stays shut.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.metrics import CONNECTIONS_REFUSED

TRANSPORT = "kvgate.transport"  # the scope's key for the connection's transport


@functools.cache
def _settings():
    """This process's settings (each gateway process builds the protocol in its own)."""
    from shared.settings import GatewaySettings

    return GatewaySettings()


def head_timeout_s() -> float:
    return _settings().client_read_timeout_s


def max_head_bytes() -> int:
    return _settings().max_head_bytes


MAX_PIPELINED = 32  # requests a connection may have waiting behind the one being answered
FREE_CHUNKS = 1024  # a chunked body's pieces beyond these must come to CHUNK_BYTES each on average
CHUNK_BYTES = 1024


def _error(status: bytes, message: str, code: str) -> bytes:
    """A refusal in the OpenAI error shape, written before any app saw the request; then closed."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, len(body), body))


class _QuietWhenRefused(logging.Filter):
    """uvicorn logs a WARNING "Invalid HTTP request received." for whatever a parser callback raises;
    ours is a refusal, counted in kvgate_gateway_connections_refused_total (a client refused in a
    millisecond reconnects: a line each would let it fill the operator's log)."""
    refusing = False  # set while the callback that refused unwinds through uvicorn's handler

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.refusing and record.getMessage() == "Invalid HTTP request received.")


_quiet = _QuietWhenRefused()
logging.getLogger("uvicorn.error").addFilter(_quiet)


class _Refused(Exception):
    """Raised from a parser callback: llhttp stops at once (the piece may hold 40,000 more)."""


class HeadDeadlineProtocol(HttpToolsProtocol):
    _head_by: asyncio.TimerHandle | None = None
    _head_left: int | None = None  # bytes the head being read may still take; None: reading a body
    _refused = False
    _answering = None  # the request whose app runs (uvicorn's `cycle` is the newest: with requests
    # pipelined behind it, another)
    _chunks = 0  # the body's chunks so far
    _body_bytes = 0  # the body's bytes on the wire so far (chunked: with their framing)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_left = max_head_bytes()
        self._arm()

    def data_received(self, data: bytes) -> None:
        left = self._head_left
        if left is None or len(data) <= left:
            if left is None:
                self._body_bytes += len(data)
            else:
                self._head_left = left - len(data)  # a body's bytes in the same piece count too
            super().data_received(data)
            return
        if self._refused:
            return
        # the head may take only `left` more: feed those, and the rest only if the head ended there
        self._head_left = 0
        view = memoryview(data)
        super().data_received(view[:left])
        if self._head_left == 0 and not self.transport.is_closing():
            limit = max_head_bytes()
            self._refuse(_error(b"431 Request Header Fields Too Large",
                                f"request head (request line and headers) is longer than {limit} "
                                "bytes (KVGATE_MAX_HEAD_BYTES)", "request_head_too_large"),
                         "head_too_large")
        elif not self.transport.is_closing():
            self.data_received(view[left:])

    def on_message_begin(self) -> None:
        self._arm()  # a kept-alive connection's next request: its head from its first byte
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._head_left = None
        self._chunks = self._body_bytes = 0
        self.scope[TRANSPORT] = self.transport  # type: ignore[typeddict-unknown-key]
        super().on_headers_complete()
        if len(self.pipeline) > MAX_PIPELINED:
            # uvicorn parses every request a piece holds and queues those behind the one being
            # answered (~2.5 KB each): 1 MiB of pipelined GETs that are never read was ~75 MB
            self._refuse(None, "too_many_pipelined")  # the ones before are owed theirs first
            self._raise()

    def on_message_complete(self) -> None:
        self._head_left = max_head_bytes()  # what follows is the next request's head
        super().on_message_complete()

    def on_chunk_header(self) -> None:
        """A body sent in tiny chunks costs the loop a callback each (1 MiB in one-byte chunks:
        ~0.2 s, whether the app reads it or has answered already and uvicorn discards it): past
        FREE_CHUNKS, they must average CHUNK_BYTES, or the request is refused and closed."""
        self._chunks += 1
        if self._chunks > FREE_CHUNKS + self._body_bytes // CHUNK_BYTES:
            answered = self.cycle is not None and self.cycle.response_started
            self._refuse(None if answered else _error(
                b"400 Bad Request", f"chunked request body in too many pieces: {self._chunks} in "
                f"{self._body_bytes} bytes (beyond {FREE_CHUNKS}, they must average "
                f"{CHUNK_BYTES} bytes)", "too_many_chunks"), "too_many_chunks")
            self._raise()

    def _raise(self) -> None:
        """Stop the parser; uvicorn's handler runs quietly (its warning and its 400 are not ours)."""
        _quiet.refusing = True  # until uvicorn's handler has logged: it then calls the method below
        raise _Refused

    def send_400_response(self, msg: str) -> None:
        _quiet.refusing = False
        if not self._refused:  # uvicorn's answer to a parser error; ours went already
            super().send_400_response(msg)

    def _refuse(self, response: bytes | None, why: str) -> None:
        self._refused = True
        self._disarm()
        CONNECTIONS_REFUSED.labels(why).inc()
        if response is not None:
            self.transport.write(response)
        self.transport.close()
        self._client_left()

    def _start_asgi_task(self, cycle, app) -> None:
        self._answering = cycle
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)
        self._client_left()

    def _client_left(self) -> None:
        """uvicorn tells only its newest request that the client left; with requests pipelined
        behind it, the one being answered (a stream, say) went on writing to the closed connection:
        uvloop raises there, an ERROR logged for a client that merely left."""
        answering = self._answering
        if answering is not None and not answering.response_complete:
            answering.disconnected = True
            answering.message_event.set()

    def _arm(self) -> None:
        if self._head_by is None:
            self._head_by = self.loop.call_later(head_timeout_s(), self._late)

    def _disarm(self) -> None:
        if self._head_by is not None:
            self._head_by.cancel()
            self._head_by = None

    def _late(self) -> None:
        self._head_by = None
        if not self.transport.is_closing():
            self.transport.close()
