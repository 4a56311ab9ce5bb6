"""What the router needs from a client connection (rumqttd's "link").

The router talks to connections only through this interface, so it stays synchronous,
free of sockets, and testable with a recording fake. What it needs from the other workers
is in broker.router.hooks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from broker.mqtt.packets import Packet


class Link(Protocol):
    """One live network connection of a client. Called from the router's loop thread."""

    client_id: str
    version: int

    def send(self, packet: Packet) -> None:
        """Queue a packet; bytes leave at the end of this loop iteration."""

    def send_publish(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        dup: bool,
        packet_id: int | None,
        properties: dict[int, Any] | None,
    ) -> bool:
        """Queue a PUBLISH; False if it exceeded the client's maximum packet size and was
        discarded as the spec requires [MQTT-3.1.2-25]."""
        ...

    def send_publish_run(
        self,
        topics: Sequence[str],
        payloads: Sequence[bytes],
        retains: Sequence[bool] | None,
        qos: int,
        first_packet_id: int | None,
    ) -> bool:
        """Queue PUBLISHes without properties for a run of messages (not DUP; packet ids
        consecutive from ``first_packet_id`` for QoS 1; ``retains`` None: none retained).
        False, with nothing queued, when the connection needs them one by one
        (:meth:`send_publish`): topic aliases, or the client's maximum packet size."""
        ...

    def hold(self) -> None:
        """Keep everything queued from now on, in order, until as many :meth:`release` calls
        (an outgoing QoS 2 PUBLISH waits so for its session state: see
        broker.router.delivery). A :meth:`close` meanwhile drops what was held."""

    def release(self) -> None:
        """End one :meth:`hold`; with none left, what was queued leaves this iteration."""

    def can_write(self) -> bool:
        """True while the output buffer is below its high-water mark."""
        ...

    def output_room(self) -> int:
        """Bytes the link may still queue in this loop iteration (0 when it cannot write)."""
        ...

    def close(self, reason_code: int | None = None, reason: str = "") -> None:
        """Send DISCONNECT (5.0, when a reason code is given) and close the connection."""
