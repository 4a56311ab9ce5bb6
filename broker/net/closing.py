"""Closing a connection so that the client reads our last packet.

A client that is still writing when the broker closes (a 5.0 client past its Receive Maximum,
told DISCONNECT 0x93) used to read a connection reset instead of the DISCONNECT: closing a TCP
socket with unread input makes the kernel send RST, and the peer's kernel drops the bytes it
had not delivered yet (RFC 1122 s4.2.2.13). So a close is graceful where the transport can do
it: the queued bytes, then FIN (half-close, ``write_eof``), then the input is read and dropped
(the protocol ignores it once closing) until the client closes its side or
:data:`LINGER_SECONDS` pass; only then is the socket closed. TLS and WebSocket carriers, which
cannot half-close, close as before (after their queued bytes).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.net.context import EdgeContext

#: Seconds a closing connection waits for the client to close its side, reading and dropping
#: its input meanwhile (the bound on the drain).
LINGER_SECONDS = 2.0


def close_gracefully(
    transport: asyncio.WriteTransport,
    edge: EdgeContext[Any],
    linger: float = LINGER_SECONDS,
) -> None:
    """Half-close ``transport`` after its queued bytes and close it when the client has
    closed its side (the protocol's ``eof_received`` returns False) or after ``linger``
    seconds. Call from the loop's thread."""
    try:
        half = transport.can_write_eof()
    except NotImplementedError:  # a carrier without half-close
        half = False
    if not half:
        transport.close()
        return
    transport.write_eof()
    edge.loop.call_later(linger, transport.close)  # a no-op when it closed before
