"""Shared subscription groups across workers: the router's
:class:`~broker.router.hooks.GroupPeers` over the mesh.

A group ``$share/<name>/<filter>`` is held by one worker, its home (``crc32(filter) %
workers``, the same rule as for client ids), which keeps the group's positions, persists
them, and spreads its records round robin over all members wherever their sessions are
(exactly as one worker does: each record to exactly one member). A member whose session is
on another worker joins with a window (its receive quota); the home sends it at most that
many records at a time, and the member's worker reports each one done once sent (QoS 0) or
acknowledged, or gives it back when the member leaves before that. When a worker dies, the
homes give what its members had outstanding to the other members.

Frames (bodies in JSON, small and rare next to the records themselves): ``JOIN``, ``LEAVE``
and ``DONE`` go to the home, ``DELIVER`` and ``JOINED`` to the member's worker. ``JOINED``
answers a JOIN once the group's positions are stored (at once, but for a new group): the
member's SUBACK waits for it (broker.router.shared). A JOIN, a LEAVE and a DELIVER name the
membership they are about by its worker and the session's token there
(``Session.group_token``): frames from two workers may arrive in either order, so a session
that moved is matched by membership, never by client id alone: the old worker's late LEAVE
ends the old membership only, and the same membership joining twice is joined once.
Called only from the worker's event loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson

from broker.commitlog.keys import PartitionKey
from broker.workers.mesh import Mesh, PeerDown

if TYPE_CHECKING:
    from broker.router.router import Router


class MeshGroupPeers:
    """Implements :class:`broker.router.hooks.GroupPeers` for worker ``worker``."""

    #: Frame kinds it uses from ``first_kind`` on.
    KINDS = 5

    def __init__(self, worker: int, home_of: Callable[[str], int], first_kind: int) -> None:
        self.worker = worker
        self.home_of = home_of
        self.mesh: Mesh | None = None
        self.router: Router | None = None
        self.JOIN, self.LEAVE, self.DELIVER, self.DONE, self.JOINED = range(
            first_kind, first_kind + self.KINDS
        )
        #: Frames read before the router loaded its groups (:meth:`hold`), or None.
        self._held: list[tuple[Callable[[int, int, memoryview], None], int, int, bytes]] | None
        self._held = None

    def handlers(self) -> dict[int, Callable[[int, int, memoryview], None]]:
        handlers = {
            self.JOIN: self._on_join,
            self.LEAVE: self._on_leave,
            self.DELIVER: self._on_deliver,
            self.DONE: self._on_done,
            self.JOINED: self._on_joined,
        }
        return {kind: partial(self._read, handler) for kind, handler in handlers.items()}

    def hold(self) -> None:
        """Keep the frames read from now on until :meth:`loaded` (a worker starting: its
        peers' members join its groups as soon as the mesh is up, before its router has
        loaded them from ``$sessions``; a JOIN then made a new group at the partitions' ends,
        stored it over the one in the log, and the records the dead home had handed out past
        its last stored positions were never delivered: 316 of one churn run's; a LEAVE
        dropped the records it gave back)."""
        if self._held is None:
            self._held = []

    def loaded(self) -> None:
        """The router has its groups: the frames kept meanwhile are handled, in order."""
        held, self._held = self._held, None
        for handler, peer, request, body in held or ():
            handler(peer, request, memoryview(body))

    def _read(
        self,
        handler: Callable[[int, int, memoryview], None],
        peer: int,
        request: int,
        body: memoryview,
    ) -> None:
        if self._held is not None:
            self._held.append((handler, peer, request, bytes(body)))
        else:
            handler(peer, request, body)

    def home(self, group: str) -> int | None:
        home = self.home_of(group)
        return None if home == self.worker else home

    def _send(self, worker: int, kind: int, body: list[Any]) -> None:
        assert self.mesh is not None
        # A worker being restarted: members join again, deliveries are given back.
        with contextlib.suppress(PeerDown):
            self.mesh.send(worker, kind, orjson.dumps(body))

    # ------------------------------------------------------------ to the home

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
        body = [group, client_id, token, qos, identifier, version, window, username]
        self._send(home, self.JOIN, body)

    def leave(
        self,
        home: int,
        group: str,
        client_id: str,
        token: int,
        orphans: list[tuple[PartitionKey, int]],
    ) -> None:
        back = [[k[0], k[1], off] for k, off in orphans]
        self._send(home, self.LEAVE, [group, client_id, token, back])

    def done(self, home: int, group: str, client_id: str, key: PartitionKey, offset: int) -> None:
        self._send(home, self.DONE, [group, client_id, key[0], key[1], offset])

    # ------------------------------------------------------------ to the member's worker

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
        body = [group, client_id, token, key[0], key[1], offset, qos]
        self._send(worker, self.DELIVER, body)

    def joined(self, worker: int, group: str, client_id: str) -> None:
        self._send(worker, self.JOINED, [group, client_id])

    # ------------------------------------------------------------ received

    def _on_join(self, peer: int, request: int, body: memoryview) -> None:
        assert self.router is not None
        self.router.remote_join(peer, *orjson.loads(body))

    def _on_leave(self, peer: int, request: int, body: memoryview) -> None:
        group, client_id, token, orphans = orjson.loads(body)
        assert self.router is not None
        back = [((s, p), off) for s, p, off in orphans]
        self.router.remote_leave(peer, group, client_id, token, back)

    def _on_done(self, peer: int, request: int, body: memoryview) -> None:
        group, client_id, stream, partition, offset = orjson.loads(body)
        assert self.router is not None
        self.router.remote_done(group, client_id, (stream, partition), offset)

    def _on_deliver(self, peer: int, request: int, body: memoryview) -> None:
        group, client_id, token, stream, partition, offset, qos = orjson.loads(body)
        assert self.router is not None
        self.router.remote_deliver(group, client_id, token, (stream, partition), offset, qos)

    def _on_joined(self, peer: int, request: int, body: memoryview) -> None:
        group, client_id = orjson.loads(body)
        assert self.router is not None
        self.router.group_joined(group, client_id)
