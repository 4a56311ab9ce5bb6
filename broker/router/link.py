"""What the router needs from a client connection (rumqttd's "link").

The router talks to connections only through this interface, so it stays synchronous,
free of sockets, and testable with a recording fake.
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

    def can_write(self) -> bool:
        """True while the output buffer is below its high-water mark."""
        ...

    def output_room(self) -> int:
        """Bytes the link may still queue in this loop iteration (0 when it cannot write)."""
        ...

    def close(self, reason_code: int | None = None, reason: str = "") -> None:
        """Send DISCONNECT (5.0, when a reason code is given) and close the connection."""


class GroupPeers(Protocol):
    """How the router reaches shared groups held by other workers (several workers; see
    broker.workers.groups). A group lives on one worker, its *home*, which keeps its
    positions and spreads its records; members whose session is elsewhere get them through
    this interface. Called from the router's loop thread; every method only queues."""

    def home(self, group: str) -> int | None:
        """The worker holding ``group`` (the full ``$share/...`` filter); None for this one."""
        ...

    def join(
        self,
        home: int,
        group: str,
        client_id: str,
        qos: int,
        identifier: int | None,
        version: int,
        window: int,
        username: str | None,
    ) -> None:
        """A session here is a member; ``window``: records it may have outstanding;
        ``username``: the user it logged in as (its ACL rules)."""

    def leave(
        self, home: int, group: str, client_id: str, orphans: list[tuple[tuple[str, int], int]]
    ) -> None:
        """It is a member no more (or could not take a record); ``orphans`` (partition,
        offset) go back to the group for another member."""

    def deliver(
        self, worker: int, group: str, client_id: str, key: tuple[str, int], offset: int, qos: int
    ) -> None:
        """Home to member: deliver this record of the group to ``client_id`` at ``qos``."""

    def done(
        self, home: int, group: str, client_id: str, key: tuple[str, int], offset: int
    ) -> None:
        """Member to home: that delivery is complete (sent at QoS 0, or acknowledged)."""
