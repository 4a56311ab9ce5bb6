"""Remote partitions with several workers per node: a worker's reads of, and publishes to, a
partition another worker of its node owns and the node holds no replica of (issue 20).

With ``replication_factor`` below the node count, a node outside a partition's Raft group
serves it through forwards and remote reads (``broker.workers.remote_partition``). With
several workers per node, the group's links are its owning worker's alone (worker ``i`` of a
node dials the workers ``i`` of the others, ``broker.cluster.node``), and the node's other
workers read a partition from the owner's files (``broker.workers.partitions``), which a node
outside the group does not have. So there every worker of the node has a
:class:`~broker.workers.remote_partition.RemotePartition` of its own for the partition, whose
``owner`` is the owning worker:

* its publishes go to the owner over the mesh (the ``FORWARD`` of ``broker.workers.partitions``,
  as to any partition another worker owns); the owner's remote partition forwards them to the
  group's leader and answers once the leader's quorum committed them [MQTT-4.3.2-2]; an
  outcome the owner cannot know (the leader changed, the owner died) closes the publisher's
  connection so that it publishes again, as on one worker;
* its fetches (the long poll, history reads) leave through the owner (:data:`RELAY_FETCH`),
  which sends them on its links to a replica under an id of its own (top bit set, never one
  of its own polls') and passes the answer back as it came (:data:`RELAYED`). The asking
  worker verifies it itself (``broker.cluster.fetch.verified_records``: CRC, continuity, never
  past the high-water mark the replica states): the relay adds nothing to trust.

Why this design. Two others were weighed. (a) Worker ``j`` could fetch from the workers ``j``
of the replica nodes, which would answer from their read-only view of the files up to the
mark their owner announces: each of them would then have to know whether its node hosts the
group and whether that mark is the group's commit index, through the promotions and
demotions that set a copy aside and make one anew under its reader: a second answering side,
whose safety rests on an announced view of the group. (b) The owner could pass the records
its own remote partition fetched to the other workers: a read protocol of its own over the
mesh, reads parked at the owner, one cache shared by every worker's readers. The relay keeps
the one answering side there is (the replica's host, from its storage: committed batches
only) and the one asking side per worker; the owner passes opaque messages.

Which partitions are remote is the owner's to say: it places its groups
(``RemoteFetches.place``), and hosts or gives one up as leaders change the groups
(``broker.cluster.reshape``). It tells the other workers each partition's state (:meth:`state`)
once it placed them and at every change (:meth:`RemoteRelay.changed`): hosted here, with its
marks (the others read its files from there), or remote, with the replicas to ask and the
leader known. A worker that starts asks each peer for all of them before it serves.

Called only from the worker's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from typing import TYPE_CHECKING, Any

from broker.cluster.fetch import UNAVAILABLE, encode_answer
from broker.commitlog import Record
from broker.commitlog.keys import PartitionKey
from broker.router.partition import Partition
from broker.router.state import RETAINED, SESSIONS
from broker.workers.mesh import PeerDown
from broker.workers.remote_fetches import ANSWER_TIMEOUT, FETCH, FETCHED
from broker.workers.remote_partition import Ack, RemotePartition
from broker.workers.runtime import CALL

if TYPE_CHECKING:
    from broker.workers.replicated import ClusterService
    from broker.workers.runtime import WorkerRuntime

log = logging.getLogger("broker.cluster")

#: Mesh kinds: a fetch for the owner to send (``<I node>`` and the request), and the answer
#: it passes back (``<I node>``, the node that answered, and the answer).
RELAY_FETCH = CALL + 1
RELAYED = CALL + 2
_NODE = struct.Struct("<I")
#: Set in the ids of the fetches an owner relays (its own polls count up from 1).
RELAY_BIT = 1 << 63
#: Seconds an owner remembers a relayed fetch: the asker has given it up by then.
RELAYED_SECONDS = 2 * ANSWER_TIMEOUT
#: Seconds a starting worker waits for a peer to have placed its groups.
PLACED_WAIT_SECONDS = 30.0


class RemoteRelay:
    """One worker's side of the module docstring: its reads of the other workers' remote
    partitions, and the relay of their fetches for its own."""

    def __init__(self, runtime: WorkerRuntime, cluster: ClusterService) -> None:
        self.runtime = runtime
        self.cluster = cluster
        self.mesh = runtime.mesh
        self.groups = {key: g for g, key in cluster.every.items()}
        #: The other workers' partitions read remotely by this one, by key.
        self.parts: dict[PartitionKey, RemotePartition] = {}
        #: What the other workers told last of their partitions: key -> (owner, state).
        self.told: dict[PartitionKey, tuple[int, list[Any]]] = {}
        self._placed = asyncio.Event()
        #: Fetches relayed for the other workers: id sent -> (worker, its id, node, sent at).
        self.relayed: dict[int, tuple[int, bytes, int, float]] = {}
        self._next = 1
        self.mesh.handlers[RELAY_FETCH] = self._on_relay_fetch
        self.mesh.handlers[RELAYED] = self._on_relayed
        runtime.actions["partition_states"] = self._states
        runtime.actions["partition_state"] = self.heard
        cluster.hosting_changed = self.changed
        cluster.relay_forward = self._forward
        cluster.placed = self.placed
        cluster.remote.relay = self._relay
        cluster.node.handlers[FETCHED] = self._on_fetched

    # -- which partitions are remote ------------------------------------------------------

    def state(self, key: PartitionKey) -> list[Any]:
        """``[stream, partition, hosted, log start, high-water mark, replicas, leader]`` of a
        partition this worker owns (the marks when hosted; replicas and leader when remote)."""
        remote = self.cluster.remote_parts.get(key)
        if remote is not None:
            return [*key, False, 0, 0, remote.replicas, remote.leader_hint]
        part = self.runtime.partitions.owned.get(key)
        if part is None:
            return [*key, True, 0, 0, [], None]
        return [*key, True, part.log.log_start_offset, part.end_offset, [], None]

    def _own(self) -> list[list[Any]]:
        return [
            self.state(k) for k in self.cluster.groups.values() if k not in (RETAINED, SESSIONS)
        ]

    def changed(self, key: PartitionKey) -> None:
        """This worker's partition ``key`` became remote here, or hosted: MARKS answers for a
        hosted one only (its marks are the group's commit index), and, once placed, the
        other workers are told."""
        partitions = self.runtime.partitions
        router = self.cluster.router
        part = router.partitions.get(key) if router is not None else None
        if key in self.cluster.remote_parts:
            partitions.owned.pop(key, None)
        elif isinstance(part, Partition):
            partitions.adopt(part)
        if self._placed.is_set():
            self.runtime.tell_all("partition_state", [self.runtime.index, [self.state(key)]])

    async def placed(self) -> None:
        """This worker placed its groups: it tells the others which are remote, then learns
        theirs (each answers once it placed its own) and reads theirs accordingly."""
        self._placed.set()
        for owner, state in list(self.told.values()):  # told before this worker placed
            self._follow(owner, state)
        runtime = self.runtime
        runtime.tell_all("partition_state", [runtime.index, self._own()])
        for peer in sorted(runtime.mesh.peers):
            try:
                states = await asyncio.wait_for(
                    runtime.call(peer, "partition_states", None), PLACED_WAIT_SECONDS
                )
            except (PeerDown, TimeoutError):
                log.warning("cluster: worker %d did not say which partitions are remote", peer)
                continue
            self.heard([peer, states])

    async def _states(self, argument: Any) -> list[list[Any]]:
        await self._placed.wait()
        return self._own()

    def heard(self, argument: Any) -> None:
        """Worker ``owner`` told the state of some of its partitions: ``[owner, [state]]``."""
        owner, states = argument
        for state in states:
            key = (str(state[0]), int(state[1]))
            self.told[key] = (int(owner), state)
            if self._placed.is_set():
                self._follow(int(owner), state)

    def _follow(self, owner: int, state: list[Any]) -> None:
        """Read the partition as its owner said: remotely, or from the owner's files."""
        stream, partition, hosted, start, end, replicas, leader = state
        key = (str(stream), int(partition))
        cluster, partitions = self.cluster, self.runtime.partitions
        part = self.parts.get(key)
        g = self.groups.get(key)
        if g is None or g in cluster.groups:
            return
        if not hosted:
            if part is not None:
                return
            reader = partitions.remote.pop(key, None)
            if reader is not None:
                reader.log.close()
            partitions.marks.pop(key, None)  # not the group's: a later reader starts anew
            part = self.parts[key] = cluster.remote.serve(g, key, list(replicas), owner)
            part.leader_hint = leader
            return
        if part is None:
            return
        del self.parts[key]
        cluster.remote.drop(g)
        partitions.marks[key] = (int(start), int(end))
        router = cluster.router
        if router is not None:
            new = self.runtime.make_partition(key)
            new.watchers = part.watchers
            router.partitions[key] = new

    # -- publishes and fetches ------------------------------------------------------------

    def _forward(
        self, part: RemotePartition, records: list[Record], acks: list[Ack | None]
    ) -> None:
        assert part.owner is not None
        self.runtime.partitions.forward_to(part.owner, part, records, acks)

    def _relay(self, owner: int, to: int, request: bytes) -> bool:
        """Send a fetch of ``owner``'s partition to node ``to`` through ``owner``."""
        try:
            self.mesh.send(owner, RELAY_FETCH, _NODE.pack(to) + request)
        except PeerDown:
            return False
        return True

    def _on_relay_fetch(self, peer: int, request: int, body: memoryview) -> None:
        """The owner's side: send a peer's fetch on under an id of this worker's."""
        (to,) = _NODE.unpack_from(body)
        fetch = bytes(body[_NODE.size :])
        if len(fetch) < 12:
            return  # a bug of the peer's: it times out and asks again
        now = time.monotonic()
        while self.relayed:
            first = next(iter(self.relayed))
            if now - self.relayed[first][3] < RELAYED_SECONDS:
                break
            del self.relayed[first]
        ident = RELAY_BIT | self._next
        self._next += 1
        if self.cluster.node.send(to, FETCH, ident.to_bytes(8, "little") + fetch[8:]):
            self.relayed[ident] = (peer, fetch[:8], to, now)
            self.cluster.remote.relayed += 1
            return
        group = int.from_bytes(fetch[8:12], "little")
        failed = encode_answer(int.from_bytes(fetch[:8], "little"), group, UNAVAILABLE, None, 0, 0)
        self._pass(peer, to, failed)

    def _on_fetched(self, frm: int, body: memoryview) -> None:
        """A ``FETCHED`` from node ``frm``: passed back if it answers a relayed fetch, else
        this worker's own."""
        if len(body) >= 8:
            ident = int.from_bytes(body[:8], "little")
            if ident & RELAY_BIT:
                entry = self.relayed.get(ident)
                if entry is not None and entry[2] == frm:
                    del self.relayed[ident]
                    self._pass(entry[0], frm, entry[1] + bytes(body[8:]))
                return
        self.cluster.remote.on_fetched(frm, body)

    def _pass(self, peer: int, frm: int, answer: bytes) -> None:
        with contextlib.suppress(PeerDown):
            self.mesh.send(peer, RELAYED, _NODE.pack(frm) + answer)

    def _on_relayed(self, peer: int, request: int, body: memoryview) -> None:
        (frm,) = _NODE.unpack_from(body)
        self.cluster.remote.on_fetched(frm, body[_NODE.size :])
