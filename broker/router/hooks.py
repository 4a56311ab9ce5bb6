"""What the router needs from the other workers of a broker: :class:`WorkerHooks`.

One worker is the whole broker; several share it (broker.workers). The router is the same
in both: what differs is passed in as a :class:`WorkerHooks` at construction, and
:class:`SingleWorker` is the one-worker answer to each question (every session and group is
held here, nobody else has clients). broker.workers.runtime.WorkerRuntime implements it for
a worker among several.

Called from the router's loop thread; every method only queues (no I/O happens here).
"""

from __future__ import annotations

from typing import Protocol

from broker.commitlog.keys import PartitionKey
from broker.mqtt.packets import Will


class WorkerHooks(Protocol):
    """The router's view of the other workers."""

    @property
    def group_peers(self) -> GroupPeers | None:
        """How shared groups held by other workers are reached; None: every group is held
        here (one worker)."""
        ...

    def is_home(self, name: str) -> bool:
        """Whether this worker loads the session or shared group ``name`` (client id or
        ``$share/...`` filter) from ``$sessions`` at start."""
        ...

    def session_ended(self, client_id: str) -> None:
        """A session held here ended: its home forgets where it was."""

    def will_now(self, client_id: str, will: Will) -> bool:
        """The will of ``client_id`` is due: whether the router publishes it now (False: a
        cluster publishes it once ``$sessions`` confirms the owner, or not at all)."""
        ...

    def connections_changed(self, count: int) -> None:
        """This worker's connected clients are now ``count``."""

    def connected_elsewhere(self) -> int:
        """Clients connected to the other workers, as they last said (``max_connections``
        holds for the broker, a few milliseconds late)."""
        ...


class SingleWorker:
    """:class:`WorkerHooks` of a broker of one worker: everything is held here."""

    group_peers: GroupPeers | None = None

    def is_home(self, name: str) -> bool:
        return True

    def session_ended(self, client_id: str) -> None:
        pass

    def will_now(self, client_id: str, will: Will) -> bool:
        return True

    def connections_changed(self, count: int) -> None:
        pass

    def connected_elsewhere(self) -> int:
        return 0


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
        token: int,
        qos: int,
        identifier: int | None,
        version: int,
        window: int,
        username: str | None,
    ) -> None:
        """A session here is a member, by the membership ``token`` names (the session's
        ``group_token``: the same session joining again is the same membership);
        ``window``: records it may have outstanding; ``username``: the user it logged in as
        (its ACL rules)."""

    def leave(
        self,
        home: int,
        group: str,
        client_id: str,
        token: int,
        orphans: list[tuple[PartitionKey, int]],
    ) -> None:
        """Its membership ``token`` names is no more (or could not take a record);
        ``orphans`` (partition, offset) go back to the group for another member."""

    def deliver(
        self,
        worker: int,
        group: str,
        client_id: str,
        token: int,
        key: PartitionKey,
        offset: int,
        qos: int,
    ) -> None:
        """Home to member: deliver this record of the group to ``client_id`` at ``qos``
        (sent to its membership ``token`` names)."""

    def done(self, home: int, group: str, client_id: str, key: PartitionKey, offset: int) -> None:
        """Member to home: that delivery is complete (sent at QoS 0, or acknowledged)."""

    def joined(self, worker: int, group: str, client_id: str) -> None:
        """Home to member: ``client_id`` is a member of ``group``, whose positions are stored
        (its SUBACK may leave)."""
