"""What the network edge needs of the worker it serves, and nothing more.

The protocols of :mod:`broker.net` (TCP, TLS, WebSocket) and the CONNECT admission are handed
an :class:`EdgeContext` instead of the worker itself (:class:`broker.server.Server`, which
satisfies it structurally): the edge sees the router, the metrics, the auth service, the
link registry and the event loop, and cannot reach anything else. ``broker.net`` never
imports ``broker.server``; tests pass a small fake of this surface.

Every member is read from the worker's event-loop thread.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import asyncio

    from broker.auth import AuthService
    from broker.commitlog.keys import PartitionKey
    from broker.config import Config
    from broker.net.keepalive import KeepaliveWheel
    from broker.net.parking import ParkingLot
    from broker.router.router import Router

T = TypeVar("T")
#: The edge's connection type (:class:`broker.net.transport.MQTTProtocol`): a parameter, so
#: that this module does not import the transport that imports it.
L = TypeVar("L")

#: Answers to a session claim (:meth:`SessionClaims.claim`): no session anywhere (start a new
#: one), the claimant holds it already, or the state handed over (follows the tag).
NEW = b"N"
HERE = b"H"
STATE = b"S"


class Counters(Protocol):
    """The counters the edge increments (:class:`broker.metrics.collector.Metrics`): plain
    integers, one increment per event on the hot path."""

    bytes_in: int
    bytes_out: int
    connections_opened: int
    connections_closed: int
    #: PUBLISHes received from clients and sent to them, per QoS.
    messages_in: list[int]
    messages_out: list[int]
    #: Deliveries dropped for exceeding the client's maximum packet size [MQTT-3.1.2-25].
    oversize_dropped: int


class SessionClaims(Protocol):
    """Where each session lives when several workers share the clients
    (:class:`broker.workers.sessions.SessionDirectory`)."""

    def claim(self, client_id: str, adopt: Callable[[bytes], T]) -> Coroutine[Any, Any, T]:
        """Make this worker the holder of ``client_id``'s session; returns what
        ``adopt(answer)`` returns, ``adopt`` having run on the loop before any release of
        that session is handled here."""
        ...


class EdgeContext(Protocol[L]):
    """The worker as the edge sees it (read-only members; the worker owns them)."""

    @property
    def config(self) -> Config:
        """Limits and listener settings (``[router]``, ``[server]``)."""
        ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The worker's loop: timers (TLS handshake), thread results, claim tasks."""
        ...

    @property
    def router(self) -> Router:
        """Where validated packets go; calls back through each link (broker.router.link)."""
        ...

    @property
    def metrics(self) -> Counters:
        """Counters the edge increments (bytes, messages, connections)."""
        ...

    @property
    def auth(self) -> AuthService:
        """Login decisions on CONNECT (:mod:`broker.net.admission`)."""
        ...

    @property
    def links(self) -> set[L]:
        """Every open MQTT connection; a link adds itself on connect, removes itself on loss."""
        ...

    @property
    def keepalive(self) -> KeepaliveWheel[L]:
        """The keepalive wheel a link files its next deadline in."""
        ...

    @property
    def parking(self) -> ParkingLot:
        """Where idle links park (broker.net.parking)."""
        ...

    @property
    def session_claims(self) -> SessionClaims | None:
        """Where a CONNECT's session is claimed: the session directory when several workers
        share the clients, the cluster's owners on a cluster node, else None."""
        ...

    @property
    def handoff(self) -> Callable[[L, PartitionKey], None] | None:
        """Told that ``link`` publishes to partition ``key`` now (its new plain topic's):
        the link may move to the worker owning it (broker.workers.handoff); None: never
        (one worker, a cluster, or ``[router] handoff = false``)."""
        ...

    def monotonic(self) -> float:
        """Seconds of the monotonic clock (injected in tests)."""
        ...

    def want_flush(self, link: L) -> None:
        """``link`` queued output: call its ``flush_output`` at the end of this iteration."""
        ...

    def flush_peers(self) -> None:
        """Write this iteration's frames to the other workers now, before a link's output
        (broker.server.Server._flush_links says why); nothing with one worker."""
        ...
