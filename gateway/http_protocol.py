"""uvicorn's httptools protocol, with a deadline on a request's head.

uvicorn times out a connection only while it is idle between requests (--timeout-keep-alive, armed
once a response is done): a connection that opens and sends nothing, or sends a request's head a
byte at a time, is kept for ever. Anyone who can reach the port could hold connections (and the
process's file descriptors) until no one else gets one. Here a connection must have sent a whole
request head within KVGATE_CLIENT_READ_TIMEOUT_S of opening, or of its next request's first byte;
otherwise it is closed (there is no request yet to answer). The body's own deadline is in
gateway/body_limit.py. `kvgate gateway` serves with this class when httptools is installed (it is
uvicorn's default then); h11 (KVGATE_HTTP_PARSER=h11) keeps uvicorn's behaviour.

It also puts the connection's transport in the request's scope (TRANSPORT), so a client let go for
not reading (gateway/client_writes.py) is reset: closed, the connection would keep its unsent bytes,
its descriptor and the kernel's send buffer for as long as the client's window stays shut.
"""
from __future__ import annotations

import asyncio
import functools

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

TRANSPORT = "kvgate.transport"  # the scope's key for the connection's transport


@functools.cache
def head_timeout_s() -> float:
    """This process's setting (each gateway process builds the protocol in its own)."""
    from shared.settings import GatewaySettings

    return GatewaySettings().client_read_timeout_s


class HeadDeadlineProtocol(HttpToolsProtocol):
    _head_by: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        self._arm()  # a kept-alive connection's next request: its head from its first byte
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._disarm()
        self.scope[TRANSPORT] = self.transport  # type: ignore[typeddict-unknown-key]
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

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
