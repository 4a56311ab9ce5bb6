"""Client lifecycle log lines, worded as Mosquitto words them (operators grep for these).

``New client connected from 127.0.0.1:52811 as sensor-7 (p2, c1, k60, u'alice').``: ``p`` is
Mosquitto's protocol number (1 = MQTT 3.1, 2 = 3.1.1, 5 = 5.0), ``c`` the clean session /
clean start flag, ``k`` the keep alive the client asked for, ``u`` the authenticated user (left
out when anonymous). And one line when the connection ends: ``Client sensor-7 disconnected.``
after the client's DISCONNECT, ``Client sensor-7 closed its connection.`` when the socket
closed without one, ``Client sensor-7 disconnected: <reason> (0x93).`` when the broker closed
it with a reason code. Logged at INFO unless ``[server] connection_messages = false``.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from broker.mqtt.packets import Connect

log = logging.getLogger("broker.net.connections")

#: Mosquitto's protocol numbers by MQTT protocol level.
_MOSQUITTO_PROTOCOL = {3: 1, 4: 2, 5: 5}

#: How the connection ended, when no reason code says it.
CLIENT_DISCONNECTED = "."
PEER_CLOSED = " closed its connection."


def log_connected(peer: str, client_id: str, packet: Connect, username: str | None) -> None:
    user = f", u'{username}'" if username is not None else ""
    log.info(
        "New client connected from %s as %s (p%d, c%d, k%d%s).",
        peer,
        client_id,
        _MOSQUITTO_PROTOCOL.get(packet.protocol_level, packet.protocol_level),
        int(packet.clean_start),
        packet.keepalive,
        user,
    )


def closed_by_broker(reason_code: int | None, reason: str) -> str:
    """The ending of "Client X disconnected..." for a close the broker decided."""
    if reason_code is None:
        return f": {reason or 'closed by the broker'}."
    return f": {reason or 'closed by the broker'} (0x{reason_code:02X})."


def log_disconnected(client_id: str, ending: str) -> None:
    """``ending``: :data:`CLIENT_DISCONNECTED`, :data:`PEER_CLOSED` or
    :func:`closed_by_broker`'s answer."""
    if ending == PEER_CLOSED:
        log.info("Client %s%s", client_id, ending)
    else:
        log.info("Client %s disconnected%s", client_id, ending)


def peer_address(link: Any, host_only: bool = False) -> str:
    """The client's ``host:port`` (or host) of ``link`` (a ``MQTTProtocol``), asked of its
    transport when a log line or a login names it, not kept as two strings per connection
    (uvloop keeps it, also after the close); of its socket while it is parked
    (broker.net.parking); "?" when neither answers."""
    transport = link.transport
    if transport is not None:
        peer = transport.get_extra_info("peername")
    elif link._parked > 0:
        peer = _socket_peer(link._parked)
    else:
        peer = None
    if peer is None:
        return "?"
    if not isinstance(peer, tuple):
        return str(peer)
    return str(peer[0]) if host_only else f"{peer[0]}:{peer[1]}"


def _socket_peer(fd: int) -> Any:
    """``getpeername`` of the socket ``fd`` (left open), or None if it has no peer now."""
    sock = socket.socket(fileno=fd)
    try:
        return sock.getpeername()
    except OSError:
        return None
    finally:
        sock.detach()
