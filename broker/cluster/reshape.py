"""A node's side of a cluster that changes shape (issue 21): each group's replicas follow
placement over the members, one single-server membership change at a time per group; leaders
follow the replicas.

Every :data:`PLAN_SECONDS` (:meth:`Reshaper.tick`, from ``ClusterNode``'s clock), for every
group this node leads, the replicas placement wants are computed over the *eligible* members
(``broker.cluster.placement.replicas``, the rendezvous order of the first placement, so a
member's arrival or departure moves only the groups whose top set it enters or leaves):

- a node that joined after formation (``broker.cluster.formation``, ``ClusterNode.admit``)
  is eligible as soon as gossip announced it, and receives the groups placement gives it;
- a member that announces it is leaving (``mqlog cluster leave``, ``NodeMeta.leaving``) is
  not, as long as the others still make up the group's replication factor (a three-node
  cluster's leaver keeps its replicas: there is nowhere to move them);
- a member dead or left for longer than ``[cluster] replace_after`` as this node's gossip
  sees it is *gone*; its replicas are re-created on the live nodes.

:func:`~broker.cluster.reconfigure.next_step` then names the next change (remove a dead voter,
add a learner on a new node, promote it once caught up, remove a live voter placement no
longer wants, handing leadership away first if that is this node) and the host proposes it.
Catch-up is throttled: a leader starts a new learner only while fewer than
:data:`MAX_CHANGING` of its groups are changing shape, so that the catch-up streams never
starve its clients' publishes (a learner's catch-up is one stream of the group's log).
Gossip decides who is eligible; Raft alone decides what a group's configuration is: every
change goes through the group's log, and a stale view of the members can only delay a change
or propose one the core refuses, never lose data.

**Joining a group.** A node that a leader replicates a group to that it does not host (it was
added as a learner) hosts it on the first such message (:meth:`Reshaper.join`,
``MultiRaft.on_unknown_group``): the worker gives the group's storage and serves the
partition from it from then on (:attr:`Reshaper.on_join`, ``RemoteFetches.promote``); until
its log brings the group's configuration the core knows the leader as the only voter and
itself as a learner, so it never campaigns on a guess. At a restart the node hosts the groups
whose log names it (``RemoteFetches.place``).

**Giving a replica up.** A removed replica does not learn of its removal from its own log
(the leader no longer sends to it, thesis s4.2.2), so once the removal has committed the
leader tells it (:data:`REMOVED`, again every tick until it answers); the node then
stops hosting the group, serves the partition remotely again, and moves its copy aside
(:attr:`Reshaper.on_removed`, ``RemoteFetches.demote``): the committed configuration without
it has a majority holding every committed entry, so this copy is never the only one, and it
is kept on disk (renamed), not deleted. The group is noted in ``DATA/cluster/removed``
(``removed.worker<i>`` for worker ``i`` > 0: each worker's groups are its own) so that a
restart does not host it again by placement's guess. A removed node that was down when the
notice was sent (or whose leader changed before sending it) hears no leader afterwards (its
core stays quiet meanwhile: PreVote and stickiness keep it from disrupting the group), so it
asks the voters it knows every planner pass (:data:`ASKED`), and the group's leader answers
with the notice if its committed configuration lacks the asker.

**Leaders** (:meth:`Reshaper.balance`): each node hands a group it leads to the group's
preferred replica (the first voter in placement order over the eligible members) once it is
connected and holds the whole log, so leaders spread evenly after joins and leaves (Kafka's
preferred leader election).

**Several workers per node.** Each worker's ``ClusterNode`` leads and follows the groups of
the partitions it owns, so each runs a reshaper of its own over them; gossip runs in worker 0
alone (``broker.cluster.membership_service``). Worker 0 tells the other workers what its
gossip sees on every planner pass (:attr:`Reshaper.tell`, ``broker.cluster.worker_view``:
the members' Raft addresses and the :class:`Survey`), and a worker ``i`` > 0 plans over what
it was told last (:attr:`Reshaper.told`), dialling a newcomer at its ``raft_port + i``. Told
views older than :data:`STALE_SECONDS` (worker 0 down) plan nothing: a view that old could
be missing a death or a return, and waiting costs only a delay. Called from the node's event
loop.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import orjson

from broker.cluster.gossip.messages import State
from broker.cluster.hardstate import write_atomically
from broker.cluster.membership import ChangeKind, ChangeRefused, Configuration
from broker.cluster.membership_service import MembershipService
from broker.cluster.multiraft import MultiRaft
from broker.cluster.nodesettings import NodeSettings
from broker.cluster.placement import node_id_of, replicas
from broker.cluster.raft import NotLeader, RaftNode, Role
from broker.cluster.reconfigure import Step, next_step, take
from broker.cluster.storage import GroupStorage

logger = logging.getLogger("broker.cluster")

LIVE = (State.ALIVE, State.SUSPECT)
#: Seconds between two planner passes (each takes at most one step per group).
PLAN_SECONDS = 1.0
#: Groups one leader moves at once (a learner catching up, or a change not yet committed).
MAX_CHANGING = 2
#: Transport kind (the node's own, below ``node.FIRST_APP_KIND``): a leader tells a removed
#: replica its removal committed (group, :data:`TOLD`), which answers (group,
#: :data:`HEARD`); a replica that hears no leader asks a voter (group, :data:`ASKED`).
REMOVED = 4
_REMOVED = struct.Struct("<IB")
TOLD, HEARD, ASKED = 0, 1, 2
#: Seconds a view worker 0 told is planned over (it tells one every :data:`PLAN_SECONDS`).
STALE_SECONDS = 5 * PLAN_SECONDS


class Survey(NamedTuple):
    """What gossip says as placement needs it (:meth:`Reshaper.eligible`): the members
    placement counts (in no order), those live now (this node included), those leaving."""

    eligible: list[int]
    live: set[int]
    leaving: set[int]


class ReshapeHost(Protocol):
    """What the reshaper needs of its node (``broker.cluster.node.ClusterNode``)."""

    id: int
    loop: Any  # its event loop: ``time()`` is the gossip membership's clock
    settings: NodeSettings
    host: MultiRaft | None
    membership: MembershipService | None
    names: dict[int, str]
    storages: dict[int, GroupStorage]
    replication: dict[int, int]
    everywhere: set[int]
    held: dict[int, float]
    state_dir: Path
    handlers: dict[int, Callable[[int, memoryview], None]]

    def track(self, g: int, term: int) -> None: ...
    def untrack(self, g: int) -> None: ...
    def label(self, g: int) -> str: ...
    def wake(self) -> None: ...
    def send(self, node: int, kind: int, payload: bytes) -> bool: ...
    def connected(self, node: int) -> bool: ...


class Reshaper:
    """See the module docstring."""

    def __init__(self, node: ReshapeHost) -> None:
        self.node = node
        #: Set by the worker: the storage of a group it may host (its partition is read
        #: remotely now and will be served from this storage), or None.
        self.on_join: Callable[[int], GroupStorage | None] = lambda g: None
        #: Set by the worker: group ``g`` is no longer hosted here, as its leader said (the
        #: second argument): serve it remotely and move its copy aside.
        self.on_removed: Callable[[int, int], None] = lambda g, leader: None
        self.changes = 0
        self.joined = 0
        self.given_up = 0
        #: Group -> the nodes this leader removed from it that were not yet told so.
        self.untold: dict[int, set[int]] = {}
        index = node.settings.worker[0]
        self._removed_file = node.state_dir / (
            "removed" if index == 0 else f"removed.worker{index}"
        )
        #: Groups removed from this node (never hosted again by placement's guess).
        self.removed: set[int] = _load(self._removed_file)
        node.handlers[REMOVED] = self._on_removed
        #: Worker 0 of several: tells the other workers what its gossip sees (set by the
        #: worker, ``broker.cluster.worker_view``; the module docstring).
        self.tell: Callable[[], None] | None = None
        #: A worker ``i`` > 0: the survey worker 0 told last, and the loop time it came.
        self.told: tuple[Survey, float] | None = None

    # -- who is where ------------------------------------------------------------------------

    def eligible(self) -> Survey:
        """What this node's gossip says (the module docstring): worker 0's own view, or on
        another worker what worker 0 told last."""
        node, membership = self.node, self.node.membership
        if membership is None and self.told is not None:
            return self.told[0]
        if membership is None or node.settings.gossip is None:
            return Survey(list(node.names), set(node.names), set())
        now_ms = node.loop.time() * 1000
        limit_ms = node.settings.gossip.replace_after * 1000
        members = membership.core_members()
        gone = {
            node_id_of(m.node)
            for m in members
            if m.state not in LIVE and now_ms - m.since >= limit_ms
        }
        live = {node_id_of(m.node) for m in members if m.state in LIVE} | {node.id}
        leaving = {node_id_of(n) for n in membership.leaving()}
        if membership.meta.leaving:
            leaving.add(node.id)
        return Survey([n for n in node.names if n not in gone], live, leaving)

    def surveyed(self) -> bool:
        """Whether this node knows what gossip says: its members (worker 0), or a view
        worker 0 told less than :data:`STALE_SECONDS` ago (another worker)."""
        membership = self.node.membership
        if membership is not None:
            return bool(membership.core_members())
        told = self.told
        return told is not None and self.node.loop.time() - told[1] < STALE_SECONDS

    def wanted(self, g: int, eligible: list[int], leaving: set[int]) -> list[int]:
        """The replicas placement wants for group ``g`` (its voters, in placement order):
        ``replication_factor`` of them (every eligible member for a group on every node),
        leaving members left out while the others are at least the replication factor."""
        rf = self.node.settings.replication_factor
        if g not in self.node.everywhere:
            rf = self.node.replication.get(g, rf)
        staying = [n for n in eligible if n not in leaving]
        chosen = staying if len(staying) >= rf else eligible
        if g in self.node.everywhere:
            return replicas(g, chosen, len(chosen))
        return replicas(g, chosen, rf)

    def preferred(self, g: int) -> int | None:
        """The voter that should lead ``g``: the first in placement order over the eligible
        members (the leaving last)."""
        assert self.node.host is not None
        voters = self.node.host.core(g).configuration.voters
        eligible, _, leaving = self.eligible()
        order = replicas(g, [n for n in eligible if n not in leaving], len(eligible))
        order += replicas(g, leaving & set(eligible), len(eligible))
        return next((n for n in order if n in voters), None)

    # -- a group joined ----------------------------------------------------------------------

    def join(self, g: int, leader: int) -> None:
        """``leader`` replicates group ``g`` to this node, which does not host it."""
        node, host = self.node, self.node.host
        if host is None or g in node.storages or leader not in node.names:
            return
        storage = self.on_join(g)
        if storage is None:
            return
        membership = storage.membership(Configuration.of({leader}, {node.id}))
        core = host.add_group(
            g, [leader, node.id], storage, storage.hard_state, storage.terms.copy(), membership
        )
        node.storages[g] = storage
        node.track(g, core.term)
        self.joined += 1
        if g in self.removed:
            self.removed.discard(g)
            write_atomically(self._removed_file, orjson.dumps(sorted(self.removed)))
        logger.info(
            "cluster: %s: joined as a replica (its leader %s added this node)",
            node.label(g),
            node.names.get(leader, leader),
        )

    # -- the passes --------------------------------------------------------------------------

    def tick(self, ticks: int) -> None:
        """Every tick (``ticks`` since start): tell the replicas removed since that their
        removal committed; every :data:`PLAN_SECONDS`, a planner pass (module docstring)."""
        node, host = self.node, self.node.host
        if host is None:
            return
        for g in [g for g, untold in self.untold.items() if untold]:
            if g in node.storages and host.core(g).role is Role.LEADER:
                self._tell_removed(g, host.core(g))
            else:
                del self.untold[g]  # no longer this node's to tell
        if ticks % max(1, round(PLAN_SECONDS / node.settings.heartbeat_interval)):
            return
        if not self.surveyed():
            return
        if self.tell is not None:
            self.tell()  # what this pass plans over, to the other workers
        eligible, live, leaving = self.eligible()
        for g in node.storages:
            if host.core(g).leader is None and host.core(g).role is not Role.LEADER:
                self._ask_if_removed(g, host.core(g))
        led = [g for g in node.storages if host.core(g).role is Role.LEADER]
        changing = sum(1 for g in led if _changing(host.core(g)))
        for g in led:
            core = host.core(g)
            step = next_step(core, self.wanted(g, eligible, leaving), live)
            if step is None:
                continue
            if step.kind is ChangeKind.ADD_LEARNER:
                if changing >= MAX_CHANGING:
                    continue  # throttled: catch-up streams of this leader (module doc)
                changing += 1
            self._take(g, step)
        node.wake()

    def _take(self, g: int, step: Step) -> None:
        node = self.node
        assert node.host is not None
        try:
            take(node.host, g, step)
        except (ChangeRefused, NotLeader, ValueError) as e:
            logger.info("cluster: %s: %s not taken now: %s", node.label(g), step, e)
            return
        self.changes += 1
        if step.kind is ChangeKind.REMOVE:
            self.untold.setdefault(g, set()).add(step.node)
        what = "leadership to" if step.kind is None else _VERB[step.kind]
        logger.info("cluster: %s: %s %s", node.label(g), what, node.names.get(step.node, step.node))

    def balance(self) -> None:
        """Hand each group led here to its preferred replica (:meth:`preferred`) once it is
        connected and holds the whole log; TimeoutNow (thesis s3.10), one per group; a failed
        one leaves it here. Groups an operator moved are left alone (``ClusterNode.hold``)."""
        node = self.node
        assert node.host is not None
        for g in node.storages:
            core = node.host.core(g)
            if core.role is not Role.LEADER or core.transferee is not None:
                continue
            if node.held.get(g, 0.0) > node.loop.time():
                continue
            preferred = self.preferred(g)
            if preferred is None or preferred == node.id:
                continue
            progress = core.progress.get(preferred)
            if (
                progress is not None
                and progress.match == core.terms.last_index
                and node.connected(preferred)
            ):
                try:
                    node.host.transfer_leadership(g, preferred)
                except (RuntimeError, ValueError) as e:
                    logger.warning("cluster: transfer of %s refused: %s", node.label(g), e)

    # -- removed replicas --------------------------------------------------------------------

    def _tell_removed(self, g: int, core: RaftNode) -> None:
        """Tell the nodes this leader removed from ``g`` once the removal committed."""
        untold = self.untold.get(g)
        if not untold or core.membership.last_index > core.commit:
            return
        for n in sorted(untold):
            if n in core.configuration.members:
                untold.discard(n)  # added back since
            else:
                self.node.send(n, REMOVED, _REMOVED.pack(g, TOLD))

    def _ask_if_removed(self, g: int, core: RaftNode) -> None:
        """A replica that knows no leader may have been removed without being told (it was
        down then, or the leader changed before telling it): ask the voters it knows; the
        one that leads ``g`` answers :data:`TOLD` if its committed configuration lacks it."""
        for n in sorted(core.configuration.voters - {self.node.id}):
            self.node.send(n, REMOVED, _REMOVED.pack(g, ASKED))

    def _on_removed(self, frm: int, body: memoryview) -> None:
        g, what = _REMOVED.unpack_from(body)
        node = self.node
        if what == HEARD:
            self.untold.get(g, set()).discard(frm)
            return
        if what == ASKED:
            core = node.host.core(g) if node.host is not None and g in node.storages else None
            if (
                core is not None
                and core.role is Role.LEADER
                and core.membership.last_index <= core.commit  # committed, none in flight
                and frm not in core.configuration.members
            ):
                node.send(frm, REMOVED, _REMOVED.pack(g, TOLD))
            return
        node.send(frm, REMOVED, _REMOVED.pack(g, HEARD))
        if node.host is None or g not in node.storages:
            return
        if node.host.core(g).role is Role.LEADER:
            return  # a leader is not removed by another node: a stale notice
        node.host.remove_group(g)
        del node.storages[g]
        node.untrack(g)
        self.removed.add(g)
        write_atomically(self._removed_file, orjson.dumps(sorted(self.removed)))
        self.on_removed(g, frm)
        self.given_up += 1
        logger.info(
            "cluster: %s: removed from the group (told by %s): served remotely from now on, "
            "this node's copy moved aside",
            node.label(g),
            node.names.get(frm, frm),
        )


def _changing(core: RaftNode) -> bool:
    """A group changing shape: a learner catching up, or a change not yet committed."""
    return bool(core.configuration.learners) or core.membership.last_index > core.commit


def _load(path: Path) -> set[int]:
    try:
        return {int(g) for g in orjson.loads(path.read_bytes())}
    except FileNotFoundError:
        return set()


_VERB = {
    ChangeKind.ADD_LEARNER: "adding a learner on",
    ChangeKind.PROMOTE: "promoting",
    ChangeKind.REMOVE: "removing",
}
