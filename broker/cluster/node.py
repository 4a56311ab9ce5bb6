"""One node of the cluster: the MultiRaft host driven on an event loop, over the node transport.

The host (``broker.cluster.multiraft``) decides; this driver does what it asks, in the order
Raft's safety needs (its ``Ready``):

1. hard states first: each is made durable (``GroupStorage.persist_hard_state``: temp file,
   fsync, rename, directory fsync) before the core is told, so no vote or reply in a newer
   term rests on a term or vote a crash could forget (Raft s5.1, figure 2 "persistent state");
2. frames go to the transport: at most one per peer node per round, every group's messages in
   it, heartbeats coalesced (``broker.cluster.frames``, encoded by ``broker.cluster.wire``);
   the cores hold back any message a hard state not yet durable governs. They leave before
   the flushes: a leader's entries reach its followers while its own disk writes them (Raft
   thesis s10.2.1), and a follower acknowledges new entries once it has flushed them (an
   acknowledgement says what it has flushed, apart from what it holds), so nothing counts
   an entry before it is durable;
3. flushes: each group's log is fsynced once for every entry appended since its last flush
   (appends only write to the page cache, ``GroupStorage.append``) and the core told
   ``flushed``, so the commit index only ever counts what a majority has on disk; the
   acknowledgements this makes leave in the next pass of the round (``broker.cluster.logsync``:
   why on the loop, what a failed fsync means);
4. commits: each group's storage pins its high-water mark (readers never see past it) and
   :attr:`ClusterNode.on_commit` tells the broker, which acknowledges and delivers.

One round runs per event-loop iteration at most (scheduled with ``call_soon`` on the first
input after the last round), so what one iteration gathered (publishes of many clients,
frames from several peers) is appended, persisted and sent together. The clock is a
``call_later`` tick every ``heartbeat_interval``; the cores count ticks (election timeout =
``election_timeout / heartbeat_interval`` ticks, randomized per Raft s5.2).

Formation (``broker.cluster.formation``): worker 0 joins the gossip membership through
``[cluster] seeds``; formed once every seed is a live member (Raft addresses from gossip,
the list kept in ``DATA/cluster/members``); gossip never starts an election. Groups are placed
(``broker.cluster.placement``) and re-placed when members are gone (``broker.cluster.reshape``);
then the metadata group (``broker.cluster.metadata_group``; worker 0 of every node, one that
joined later too: ``broker.cluster.metadata_members``) agrees on the stream definitions.

Several workers per node (``router.workers``): each worker process runs a ``ClusterNode`` of
its own, hosting the groups of the partitions it owns, on ``raft_port + index``, dialling
each member's Raft port ``+ index``: worker ``i`` of every node hosts the same groups (the
owner of a partition is a function of the worker count alone,
``broker.workers.mesh.owner_of``), so its peers are the workers ``i`` of the other nodes, and
the transport refuses a peer with another count (``broker.cluster.peerlink``). Only worker 0
gossips; the others read its member list, then what it tells them (``worker_view``; without
gossip, in unit tests, each keeps its own list, ``members.worker<i>``).

Called only from the owning event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from broker.cluster import formation
from broker.cluster.frames import Frame
from broker.cluster.logsync import LogSyncer
from broker.cluster.membership import Configuration
from broker.cluster.membership_service import GossipFilter, MembershipService
from broker.cluster.messages import HardState
from broker.cluster.metadata import LocalStreams
from broker.cluster.metadata_group import MetadataError, MetadataGroup
from broker.cluster.metadata_members import open_metadata
from broker.cluster.multiraft import MultiRaft
from broker.cluster.nodesettings import NodeSettings
from broker.cluster.options import RaftConfig
from broker.cluster.peers import PeerTransport
from broker.cluster.placement import node_id_of, node_ids, replicas
from broker.cluster.raft import RaftNode, Role
from broker.cluster.repairer import Repairer
from broker.cluster.reshape import Reshaper
from broker.cluster.storage import GroupStorage
from broker.cluster.wire import WireError, decode_frame, encode_frame
from broker.commitlog import CommitLogError

logger = logging.getLogger("broker.cluster")

#: Transport kinds: a Raft frame; kinds from :data:`FIRST_APP_KIND` on belong to the broker
#: (forwarded publishes and their answers, broker.workers.replicated).
RAFT = 1
FIRST_APP_KIND = 16

#: Ticks (heartbeat intervals) between two passes of the leader balancer.
BALANCE_TICKS = 50
#: Seconds the balancer leaves a group alone after an operator moved its leadership (``mqlog
#: cluster transfer-leader``): the operator's choice stands, as long as Kafka's leader
#: imbalance check interval (``leader.imbalance.check.interval.seconds``, 300).
OPERATOR_HOLD_SECONDS = 300.0

#: Seconds between two retention passes over the groups' logs (the log cleaner's interval).
RETENTION_SECONDS = 30.0

#: Seconds between "still waiting for members" log lines while the cluster forms.
FORMATION_LOG_SECONDS = 5.0


@dataclass(slots=True)
class NodeStats:
    leader_changes: int = 0
    #: Times this node became a group's leader.
    elections_won: int = 0
    refused: int = 0
    bad_frames: int = 0
    rounds: int = 0


class ClusterNode:
    """See the module docstring."""

    def __init__(self, settings: NodeSettings, data_dir: Path) -> None:
        self.settings = settings
        self.name = settings.name
        self.id = node_id_of(settings.name)
        self.loop = asyncio.get_running_loop()
        self.state_dir = Path(data_dir) / "cluster"
        index = settings.worker[0]
        self.members_file = self.state_dir / ("members" if index == 0 else f"members.worker{index}")
        ticks = max(2, round(settings.election_timeout / settings.heartbeat_interval))
        self.raft_config = RaftConfig(election_ticks=ticks, heartbeat_ticks=1)
        self.stats = NodeStats()
        #: Called with (group, new commit index) after the storage pinned it.
        self.on_commit: Callable[[int, int], None] = lambda g, c: None
        #: Called with a group whose leader or term changed (after the round's commits).
        self.on_leader: Callable[[int], None] = lambda g: None
        #: Transport kind -> handler of (peer node id, payload), kinds >= FIRST_APP_KIND.
        self.handlers: dict[int, Callable[[int, memoryview], None]] = {}
        #: Group -> loop time until which the balancer leaves it alone (:meth:`hold`).
        self.held: dict[int, float] = {}
        self.names: dict[int, str] = {}
        #: The nodes the cluster formed with and whether this node joined later (formation).
        self.founders: dict[int, str] = {}
        self.joined = False
        #: Groups with a replica on every node (``$retained``, ``$sessions``).
        self.everywhere: set[int] = set()
        self.host: MultiRaft | None = None
        self.storages: dict[int, GroupStorage] = {}
        self._leaders: dict[int, tuple[int | None, int]] = {}
        #: Group id -> its replication factor where a stream overrides ``[cluster]``'s.
        self.replication: dict[int, int] = {}
        #: Group id -> its partition (stream, partition), for views and log lines.
        self.group_keys: dict[int, tuple[str, int]] = {}
        self._scheduled = False
        self.syncer = LogSyncer(
            self.storages, lambda g: "{}/{}".format(*self.group_keys.get(g, ("group", g)))
        )
        self._ticks = 0
        #: Ticks between two retention passes (the log cleaner's 30 s).
        self._retention_ticks = max(1, round(RETENTION_SECONDS / settings.heartbeat_interval))
        self._timer: asyncio.TimerHandle | None = None
        self._formed = asyncio.Event()
        #: This node's stream definitions, checked against the cluster's at start (set by
        #: the broker before :meth:`start`).
        self.local_streams = LocalStreams()
        self.metadata: MetadataGroup | None = None
        #: The gossip membership (worker 0 only, ``broker.cluster.formation``).
        self.membership: MembershipService | None = None
        self.gossip_filter: GossipFilter | None = None  # broker.xdp's, set by the server
        self.transport = PeerTransport(
            settings.name,
            settings.bind,
            settings.seeds,
            settings.secret,
            on_message=self._on_message,
            on_peer=self._on_peer,
            worker=settings.worker,
        )
        #: Corrupt batches of the groups' logs rewritten from another replica (kinds 2 and 3).
        self.repair = Repairer(self)
        self.reshape = Reshaper(self)
        self.repair.on_repaired = lambda g: self.on_commit(g, self.storages[g].commit)

    # -- formation ---------------------------------------------------------------------------

    async def start(self) -> list[int]:
        """Listen, reach the seeds, and return the member ids once the cluster formed."""
        await self.transport.start()
        known = None if self.settings.gossip else formation.load_members(self.members_file)
        if (gossip := self.settings.gossip) is not None:
            if self.settings.worker[0] == 0:  # the node's gossip member (formation's doc)
                self.membership = MembershipService(self.name, gossip, self.settings.secret)
                if self.gossip_filter is not None:
                    self.membership.guard(self.gossip_filter)
            members, self.joined, founders = await formation.by_gossip(
                self.settings,
                self.state_dir,
                self.transport,
                self.membership,
                FORMATION_LOG_SECONDS,
                self.admit,
            )
        elif known is None:
            logger.info("cluster: forming with seeds %s", _addrs(self.settings.seeds))
            while not self._all_seeds_known():
                try:
                    await asyncio.wait_for(self._formed.wait(), FORMATION_LOG_SECONDS)
                except TimeoutError:
                    missing = [a for a in self.settings.seeds if a not in self._seen_addrs()]
                    logger.info("cluster: waiting for %s", _addrs(missing))
                self._formed.clear()
            members = {self.name: self.settings.bind, **self.transport.members}
            formation.save_members(self.members_file, members)
        else:
            members = known[0]
        self.names = node_ids(members)
        self.founders = node_ids(founders) if gossip is not None else dict(self.names)
        logger.info("cluster: %d nodes: %s", len(self.names), ", ".join(sorted(members)))
        if self.settings.worker[0] == 0:  # worker 0 of each node: a metadata group member
            try:
                self.metadata = await open_metadata(self, members)
            except MetadataError:  # its port taken, or a stream defined otherwise: not started
                await self.close()
                raise
        return sorted(self.names)

    def _seen_addrs(self) -> set[tuple[str, int]]:
        return {tuple(a) for a in self.transport.members.values()}  # type: ignore[misc]

    def _all_seeds_known(self) -> bool:
        seen = self._seen_addrs()
        return all(a in seen for a in self.settings.seeds)

    def admit(self, name: str) -> None:
        """Gossip announced ``name`` after formation: frames go to it, placement counts it."""
        i = node_id_of(name)
        if self.names.setdefault(i, name) != name:
            logger.error(
                "cluster: node %s has the id of node %s: not admitted", name, self.names[i]
            )
            return
        if self.host is not None:
            self.host.add_node(i)
        logger.info("cluster: node %s joined", name)

    def _on_peer(self, name: str, addr: tuple[str, int]) -> None:
        self.names.setdefault(node_id_of(name), name)
        self._formed.set()

    # -- groups ------------------------------------------------------------------------------

    def host_groups(self, storages: dict[int, GroupStorage], seed: int | None = None) -> None:
        """Host every group of ``storages`` this node is a replica of (the caller chose them
        with :meth:`replicas_of`), and start the clock."""
        rng = random.Random(seed if seed is not None else time.time_ns() ^ self.id)
        host = self.host = MultiRaft(self.id, self.names, rng, self.raft_config)
        host.on_unknown_group = self.reshape.join
        for g, storage in storages.items():
            peers = sorted({*self.replicas_of(g), self.id})  # hosted: placed, or its log's
            # The configuration in the log wins over placement (module doc of placement).
            membership = storage.membership(Configuration.of(set(peers)))
            core = host.add_group(
                g, peers, storage, storage.hard_state, storage.terms.copy(), membership
            )
            self.storages[g] = storage
            self._leaders[g] = (None, core.term)
        if self.metadata is not None:
            self.metadata.place({g: self.replicas_of(g) for g in storages}, self.names)
        self._timer = self.loop.call_later(self.settings.heartbeat_interval, self._tick)

    async def caught_up(self, timeout: float) -> list[int]:
        """Wait until every group has a leader and, where this node follows, commits as far
        as the leader said it had committed (so that the high-water mark a new subscription
        starts from is not one a restart left behind), or ``timeout`` passes; returns the
        groups still behind."""
        deadline = self.loop.time() + timeout
        while True:
            behind = [g for g in self.storages if not self._caught_up(g)]
            if not behind or self.loop.time() >= deadline:
                return behind
            await asyncio.sleep(self.settings.heartbeat_interval)

    def _caught_up(self, group: int) -> bool:
        core = self.core(group)
        if core.role is Role.LEADER:
            return True
        return (
            core.leader is not None
            and core.leader_commit is not None
            and (core.commit >= core.leader_commit)
        )

    def replicas_of(self, group: int) -> list[int]:
        """The group's first configuration (placement over the nodes the cluster formed
        with): its replication factor (:attr:`replication`, else ``[cluster]``'s), capped at
        the node count."""
        rf = self.replication.get(group, self.settings.replication_factor)
        return replicas(group, self.founders, rf)

    def core(self, group: int) -> RaftNode:
        assert self.host is not None
        return self.host.core(group)

    def leader(self, group: int) -> int | None:
        """The group's leader as this node knows it (itself included), or None (also
        before the groups are hosted)."""
        if self.host is None or group not in self.storages:
            return None
        core = self.host.core(group)
        return self.id if core.role is Role.LEADER else core.leader

    def is_leader(self, group: int) -> bool:
        return self.leader(group) == self.id

    def takes_proposals(self, group: int) -> bool:
        """This node leads ``group`` and is not handing it over (thesis s3.10)."""
        return self.is_leader(group) and self.core(group).transferee is None

    # -- inputs ------------------------------------------------------------------------------

    def propose(self, group: int, payload: bytes, count: int) -> int:
        """Append a DATA entry on this leader; its last index. Raises the core's NotLeader."""
        assert self.host is not None
        index = self.host.propose(group, payload, count)
        self._schedule()
        return index

    def transfer_leadership(self, group: int, to: int) -> None:
        assert self.host is not None
        self.host.transfer_leadership(group, to)
        self._schedule()

    def hold(self, group: int, seconds: float = OPERATOR_HOLD_SECONDS) -> None:
        """Keep the balancer off ``group`` here for ``seconds`` (an operator chose its leader)."""
        self.held[group] = self.loop.time() + seconds

    def send(self, node: int, kind: int, payload: bytes) -> bool:
        """Send a broker message to ``node``; False if it could not leave (not connected, or
        its buffer full): the caller treats it as lost."""
        name = self.names.get(node)
        return name is not None and self.transport.send(name, kind, payload)

    def _on_message(self, name: str, kind: int, payload: memoryview) -> None:
        if kind == RAFT:
            if self.host is None:
                return  # not hosting yet: Raft resends
            try:
                frame = decode_frame(payload)
            except WireError as e:
                self.stats.bad_frames += 1
                logger.warning("cluster: bad frame from %s dropped: %s", name, e)
                return
            if frame.frm != node_id_of(name) or frame.to != self.id:
                self.stats.bad_frames += 1
                return
            self._step(self.host.receive, frame)
            self._schedule()
            return
        handler = self.handlers.get(kind)
        if handler is not None:
            handler(node_id_of(name), payload)

    def _step(self, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            fn(arg)
        except RuntimeError as e:
            # A core refused what would break safety: a bug, logged, the request dropped.
            self.stats.refused += 1
            logger.error("cluster: %s", e)

    def _tick(self) -> None:
        assert self.host is not None
        self._timer = self.loop.call_later(self.settings.heartbeat_interval, self._tick)
        self.host.tick()
        self._ticks += 1
        if self._ticks % BALANCE_TICKS == 0:
            self.reshape.balance()
        self.reshape.tick(self._ticks)
        if self._ticks % self._retention_ticks == 0:
            self.enforce_retention()
        self._schedule()

    def enforce_retention(self, now_ms: int | None = None) -> int:
        """Retention of every group's log on the loop thread (the cleaner skips replicated
        ones): whole segments up to ``min(commit, durable_index)``, the core told the new
        start in the same step (a follower needing more gets a snapshot). Segments deleted."""
        assert self.host is not None
        deleted = 0
        for g, storage in self.storages.items():
            core = self.host.core(g)
            log = storage.log
            try:
                n = log.enforce_retention(now_ms, below=min(core.commit, core.durable_index))
            except (CommitLogError, OSError):
                logger.exception(
                    "cluster: retention of %s/%d failed", *self.group_keys.get(g, ("group", g))
                )
                continue
            if n:
                deleted += n
                storage.compacted(self.host.compacted(g, log.log_start_offset + 1))
            if log.config.compacted:
                # Below the high-water mark only, and every batch keeps its boundaries (an
                # emptied one stays as a placeholder): the Raft log's entries never move.
                try:
                    log.compact()
                except (CommitLogError, OSError):
                    logger.exception(
                        "cluster: compaction of %s/%d failed", *self.group_keys.get(g, ("group", g))
                    )
        return deleted

    def track(self, g: int, term: int) -> None:  # a group hosted since (reshape)
        self._leaders[g] = (None, term)

    def label(self, g: int) -> str:
        return "{}/{}".format(*self.group_keys.get(g, ("group", g)))

    def untrack(self, g: int) -> None:  # a group no longer hosted (reshape)
        self._leaders.pop(g, None)

    def connected(self, node: int) -> bool:
        return (name := self.names.get(node)) is not None and self.transport.connected(name)

    def preferred(self, group: int) -> int | None:  # the replica that should lead it
        return self.reshape.preferred(group)

    # -- the round ---------------------------------------------------------------------------

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._round)

    wake = _schedule  # (broker.cluster.reshape)

    def _round(self) -> None:
        """Do what the host asks (module docstring), until it asks nothing more."""
        self._scheduled = False
        host = self.host
        if host is None:
            return
        self.stats.rounds += 1
        commits: dict[int, int] = {}
        for _ in range(16):  # each answer may ask for more; a bound keeps the loop fair
            ready = host.ready()
            if not ready:
                break
            if ready.hard_states:
                done_states: list[tuple[int, HardState]] = []
                for g, state in ready.hard_states.items():
                    self.storages[g].persist_hard_state(state)
                    done_states.append((g, state))
                self._step(host.hard_states_persisted, done_states)
            for frame in ready.frames:
                self._send_frame(frame)
            if ready.flushes:
                self._step(host.flushed, self.syncer.flush(ready.flushes))
            for g, index in ready.commits.items():
                self.storages[g].set_commit(index)
                commits[g] = index
        else:
            self._schedule()  # more to do: next iteration, after other callbacks
        for g, index in commits.items():
            self.on_commit(g, index)
        for g, (leader, term) in self._leaders.items():
            core = host.core(g)
            now = (self.leader(g), core.term)
            if now != (leader, term):
                self._leaders[g] = now
                if now[0] != leader:
                    self.stats.leader_changes += 1
                    if now[0] == self.id:
                        self.stats.elections_won += 1
                    logger.info(
                        "cluster: %s/%d: leader %s in term %d",
                        *self.group_keys.get(g, ("group", g)),
                        self.names.get(now[0], "none") if now[0] is not None else "none",
                        core.term,
                    )
                self.on_leader(g)

    def _send_frame(self, frame: Frame) -> None:
        name = self.names.get(frame.to)
        if name is not None:
            self.transport.send(name, RAFT, encode_frame(frame))

    # -- views and shutdown ------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The node's view for ``GET /api/v1/cluster``, ``mqlog cluster status`` and the
        console: nodes (name, address, state) and, per partition this node holds, its role
        here, term, leader, replicas, commit index and, on the leader, each follower's lag."""
        nodes = []
        for i, name in sorted(self.names.items(), key=lambda kv: kv[1]):
            here = i == self.id
            nodes.append(
                {
                    "id": name,
                    "raft_id": i,
                    "address": _addr(
                        self.settings.bind if here else self.transport.members.get(name, ("?", 0))
                    ),
                    "state": "self"
                    if here
                    else "connected"
                    if self.transport.connected(name)
                    else "unreachable",
                }
            )
        partitions = []
        host = self.host
        for g, storage in sorted(
            self.storages.items(), key=lambda kv: self.group_keys.get(kv[0], ("", 0))
        ):
            assert host is not None
            core = host.core(g)
            leader = self.leader(g)
            stream, p = self.group_keys.get(g, ("?", 0))
            last = storage.terms.last_index
            entry: dict[str, Any] = {
                "stream": stream,
                "partition": p,
                "group": g,
                "role": core.role.name.lower(),
                "term": core.term,
                "leader": self.names.get(leader) if leader is not None else None,
                "replicas": sorted(self.names.get(n, str(n)) for n in core.configuration.members),
                "learners": sorted(self.names.get(n, str(n)) for n in core.configuration.learners),
                "preferred_leader": self.names.get(self.preferred(g) or -1),
                "commit_index": storage.commit,
                "last_index": last,
                "quiesced": host.quiesced(g),
                "followers": [
                    {
                        "node": self.names.get(peer, str(peer)),
                        "match": pr.match,
                        "lag": last - pr.match,
                    }
                    for peer, pr in sorted(core.progress.items())
                ]
                if core.role is Role.LEADER
                else [],
            }
            partitions.append(entry)
        return {
            "mode": "cluster",
            "node_id": self.name,
            "nodes": nodes,
            "partitions": partitions,
            "repaired": self.repair.view(),
            "transport": _counters(self.transport.stats),
            "raft": _counters(self.stats),
            "host": _counters(host.stats) if host is not None else {},
            "metadata": self.metadata.status() if self.metadata is not None else None,
            "members": self.membership.view() if self.membership is not None else [],
            "gossip": self.membership.stats() if self.membership is not None else {},
        }

    async def close(self) -> None:
        self.repair.close()
        if self._timer is not None:
            self._timer.cancel()
        self._round()  # what is durable and due goes out before the sockets close
        await self.transport.close()
        if self.membership is not None:
            self.membership.close()
        metadata, self.metadata = self.metadata, None
        if metadata is not None:
            await metadata.close()


def _counters(obj: Any) -> dict[str, int]:
    """A stats dataclass's counters."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _addr(a: tuple[str, int]) -> str:
    host, port = a
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _addrs(addrs: list[tuple[str, int]]) -> str:
    return ", ".join(_addr(a) for a in addrs) or "none"
