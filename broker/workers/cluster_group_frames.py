"""The frames of the shared groups across a cluster's nodes and their workers (the home and
its checks: broker.workers.cluster_groups).

A member is addressed by its node and the worker of that node holding its session
(:func:`member_address`), as the home's router knows it (``RemoteMember.worker``). Only the
worker hosting ``$sessions`` on each node (:attr:`ClusterGroupFrames.index`, the owner of
``$sessions``: broker.workers.mesh.owner_of) speaks for its node on the node transport: its
Raft transport is linked to the same worker of every other node (worker ``i`` dials the
members' Raft port ``+ i``, broker.cluster.nodesettings), and it alone knows the
``$sessions`` leader, the home. The other workers of a node reach the home through it over
the mesh, with broker.workers.groups' frames (they see it as every group's home):

* a JOIN, LEAVE or DONE of a member on worker ``w`` goes over the mesh to this node's
  ``$sessions`` worker, which handles it as the home or sends it on, naming ``w``;
* a DELIVER or JOINED for a member on worker ``w`` goes to its node's ``$sessions`` worker,
  which hands it to ``w`` over the mesh (the home's own node: at once);
* a worker of a node that dies is reported to the home (:data:`LEFT`), which gives what its
  members had outstanding to the others, as it does for a node it lost the link to; a
  ``$sessions`` worker that dies closes its node's links, which covers its node's members.

Why relay rather than link every worker to the home: the cross-node links join workers of
one index (those hosting the same Raft groups), only the ``$sessions`` worker follows the
leader, and the mesh already carries these frames between the workers of a node; a relay
adds one local hop and no new connection or leader tracking.

Bodies in JSON, as broker.workers.groups', the node transport's with the worker they are
from or for last. Called only from the worker's event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from broker.cluster.node import FIRST_APP_KIND, ClusterNode
from broker.cluster.placement import group_id_of
from broker.commitlog.keys import PartitionKey
from broker.router.state import SESSIONS
from broker.workers.groups import MeshGroupPeers

if TYPE_CHECKING:
    from broker.router.router import Router

#: Transport kinds JOIN, LEAVE, DELIVER, DONE, JOINED (``FIRST_APP_KIND`` .. + 5 are the
#: forwards', leadership's and remote reads'), then :data:`REJOIN` and :data:`LEFT`.
FIRST_KIND = FIRST_APP_KIND + 6
#: Home to a node whose members it let go while it had no link to it, once the link is back:
#: join again (that node's own link to the home may never have closed).
REJOIN = FIRST_KIND + MeshGroupPeers.KINDS
#: A node to the home: its worker named in the body died (its members leave their groups).
LEFT = REJOIN + 1
#: ``$sessions``' Raft group: its leader's worker hosting it is the home.
SESSIONS_GROUP = group_id_of(SESSIONS)
#: Bits of a member's address that name the worker (``[router] workers`` is at most 256).
WORKER_BITS = 8


def member_address(node: int, worker: int) -> int:
    """How the home names a member: its node's Raft id and the worker holding its session."""
    return node << WORKER_BITS | worker


def node_of(address: int) -> int:
    return address >> WORKER_BITS


def worker_of(address: int) -> int:
    return address & ((1 << WORKER_BITS) - 1)


class ClusterGroupFrames:
    """:class:`~broker.router.hooks.GroupPeers` of the worker hosting ``$sessions`` on a
    cluster node: a group's home is a node id, a member an address (:func:`member_address`).
    Which node is the home is :class:`~broker.workers.cluster_groups.ClusterGroupPeers`'."""

    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        self.router: Router | None = None
        #: The node holding every group (None: not known yet).
        self.home_node: int | None = None
        #: This worker's index on its node; with several workers, the mesh's group frames
        #: to the others (:meth:`join_workers`).
        self.index = 0
        self.local: MeshGroupPeers | None = None
        #: Tells the node's other workers to join the home again (it moved, or was out of
        #: reach): set by :meth:`join_workers`.
        self.rejoin_workers: Callable[[], None] = lambda: None
        #: Frames to the home received while this node leads ``$sessions`` but is not the
        #: home yet: handled once it is, in order (kind, from node, from worker, body).
        self.early: list[tuple[int, int, int, list[Any]]] = []
        self.JOIN, self.LEAVE, self.DELIVER, self.DONE, self.JOINED = range(
            FIRST_KIND, FIRST_KIND + MeshGroupPeers.KINDS
        )
        for kind in (self.JOIN, self.LEAVE, self.DONE, LEFT):
            self.node.handlers[kind] = self._from_node(kind)
        for kind in (self.DELIVER, self.JOINED):
            self.node.handlers[kind] = self._for_member(kind)

    def join_workers(
        self, index: int, local: MeshGroupPeers, rejoin_workers: Callable[[], None]
    ) -> None:
        """Several workers on this node: this one (``index``) hosts ``$sessions`` and
        relays the others' frames, ``local`` the mesh's group frames (module docstring)."""
        self.index, self.local, self.rejoin_workers = index, local, rejoin_workers
        assert local.mesh is not None
        for kind in (local.JOIN, local.LEAVE, local.DONE):
            local.mesh.handlers[kind] = self._from_worker(kind - local.JOIN + self.JOIN)

    def worker_down(self, worker: int) -> None:
        """Worker ``worker`` of this node died: its members leave their groups."""
        self._to_home(LEFT, self.node.id, worker, [])

    def check(self) -> None:
        """Follow the home (:class:`~broker.workers.cluster_groups.ClusterGroupPeers`)."""

    # ------------------------------------------------------------ GroupPeers

    def home(self, group: str) -> int | None:
        home = self.home_node
        return None if home is None or home == self.node.id else home

    def _send(self, node: int, kind: int, body: list[Any]) -> None:
        # A lost frame is recovered by the checks: a member joins again when the link to
        # the home is back, a home gives back what a lost node's members had outstanding.
        self.node.send(node, kind, orjson.dumps(body))

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
        body = [group, client_id, token, qos, identifier, version, window, username, self.index]
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
        self._send(home, self.LEAVE, [group, client_id, token, back, self.index])

    def done(self, home: int, group: str, client_id: str, key: PartitionKey, offset: int) -> None:
        self._send(home, self.DONE, [group, client_id, key[0], key[1], offset, self.index])

    def deliver(
        self,
        member: int,
        group: str,
        client_id: str,
        token: int,
        key: PartitionKey,
        offset: int,
        qos: int,
    ) -> None:
        node, worker = node_of(member), worker_of(member)
        if node != self.node.id:
            body = [group, client_id, token, key[0], key[1], offset, qos, worker]
            self._send(node, self.DELIVER, body)
        elif self.local is not None:  # another worker of the home's node
            self.local.deliver(worker, group, client_id, token, key, offset, qos)

    def joined(self, member: int, group: str, client_id: str) -> None:
        node, worker = node_of(member), worker_of(member)
        if node != self.node.id:
            self._send(node, self.JOINED, [group, client_id, worker])
        elif self.local is not None:
            self.local.joined(worker, group, client_id)

    # ------------------------------------------------------------ received

    def _from_node(self, kind: int) -> Callable[[int, memoryview], None]:
        def handle(frm: int, body: memoryview) -> None:
            *args, worker = orjson.loads(body)
            self._to_home(kind, frm, worker, args)

        return handle

    def _from_worker(self, kind: int) -> Callable[[int, int, memoryview], None]:
        def handle(peer: int, request: int, body: memoryview) -> None:
            self._to_home(kind, self.node.id, peer, orjson.loads(body))

        return handle

    def _to_home(self, kind: int, node: int, worker: int, args: list[Any]) -> None:
        """A frame for the home from a member on ``worker`` of ``node``: handled here if
        this is the home, held if it is about to be, sent on to the home if it came from
        a worker of this node, else dropped (its sender's view is older: it joins the
        home it learns of)."""
        if self.router is None:
            # Not serving yet: a restarted worker may be elected before it serves (its
            # term is new, so the others joined it as the new home).
            if self.node.is_leader(SESSIONS_GROUP):
                self.early.append((kind, node, worker, args))
            return
        if self.home_node != self.node.id:
            self.check()  # elected a moment ago?
        if self.home_node == self.node.id:
            self._at_home(kind, member_address(node, worker), args)
        elif self.node.is_leader(SESSIONS_GROUP):
            self.early.append((kind, node, worker, args))  # home in a moment
        elif node == self.node.id and self.home_node is not None:
            self._send(self.home_node, kind, [*args, worker])

    def handle_early(self) -> None:
        """This node became the home: the frames held for it, in order."""
        early, self.early = self.early, []
        for kind, node, worker, args in early:
            self._at_home(kind, member_address(node, worker), args)

    def _at_home(self, kind: int, member: int, args: list[Any]) -> None:
        router = self.router
        assert router is not None
        if kind == self.JOIN:
            router.remote_join(member, *args)
        elif kind == self.LEAVE:
            group, client_id, token, orphans = args
            back = [((s, p), off) for s, p, off in orphans]
            router.remote_leave(member, group, client_id, token, back)
        elif kind == self.DONE:
            group, client_id, stream, partition, offset = args
            router.remote_done(group, client_id, (stream, partition), offset)
        elif kind == LEFT:
            router.worker_left(member)

    def _for_member(self, kind: int) -> Callable[[int, memoryview], None]:
        def handle(frm: int, body: memoryview) -> None:
            router = self.router
            if router is None:
                return
            *args, worker = orjson.loads(body)
            if kind == self.DELIVER:
                group, client_id, token, stream, partition, offset, qos = args
                key = (stream, partition)
                if worker == self.index:
                    router.remote_deliver(group, client_id, token, key, offset, qos)
                elif self.local is not None:
                    self.local.deliver(worker, group, client_id, token, key, offset, qos)
            elif worker == self.index:
                router.group_joined(*args)
            elif self.local is not None:
                self.local.joined(worker, *args)

        return handle
