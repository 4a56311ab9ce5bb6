"""The host of every Raft group one node holds (MultiRaft, as CockroachDB and TiKV call it).

Sans-IO like the core it hosts: no event loop, no socket, no file; the clock is ``tick()``.
Inputs: ``tick()``, ``receive(frame)`` (one frame from one peer node, messages of many
groups), ``propose(group, payload)``, ``transfer_leadership(group, peer)``, and the storage
completions, batched so that one fsync round answers for many groups: ``flushed(...)`` and
``hard_states_persisted(...)``. Output accumulates until ``ready()`` drains it: at most ONE
frame per peer node holding every group's messages to it (``broker.cluster.frames``), and per
group the index to flush, the hard state to persist and the new commit index. The caller
makes the hard states and flushes durable, then reports them; frames may leave at once (a core
holds back any message its pending hard state governs).

Each group's ``GroupLog`` is written synchronously while the host steps its core (an append
or a truncation goes to the page cache, not yet durable): a frame can step one core several
times, and the core reads back what it appended before.

Idle groups cost nothing: quiescence, CockroachDB's design. A leader whose group is idle
(``RaftNode.idle``: every follower holds and has flushed the whole log, all of it committed, no
hard state pending, no transfer) marks its next heartbeats ``quiesce`` and stops ticking the
group; a follower that gets such a beat and follows that leader at that term and commit stops
ticking the group too. A quiesced group wakes (is ticked again) on a proposal, a transfer, any
message for it other than a quiescing beat or an acknowledgement that changes nothing, and on
node liveness: frames are node heartbeats (an empty one goes to each peer every heartbeat
interval), the host keeps per peer node the tick it last heard from it, and when a node has
been silent for an election timeout every group quiesced under it as leader wakes, so that its
followers elect as usual.

Safety is untouched: quiescence only withholds ``tick()`` calls, as a slow clock or a paused
process would, and Raft's safety never depends on timing (Raft s5.6); terms, votes and logs
change only through the cores' own inputs, and beats and acks are rebuilt exactly as the cores
sent them. Liveness: a group stays quiesced only while its leader's node is heard from; a
dead or cut-off leader node wakes its groups within an election timeout of silence, and a
stale quiesced leader wakes on its first message from a newer term or on a proposal (it then
ticks, so CheckQuorum steps it down).

A dead follower does not keep a group awake: as CockroachDB quiesces over the live replicas
only, a leader quiesces once every follower it has heard from within an election timeout is
caught up (``RaftNode.idle_without`` the silent nodes), as long as those and itself are a
majority of the voters; when a silent node is heard again, the groups quiesced here without it
wake, so it catches up at once. Without this, one node down kept every group it replicated
ticking and beating on the others (3,080 us of CPU per group per second, measured in bench/
raft_core.py: 1,000 such groups are three cores) for as long as it stayed down.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from broker.cluster.frames import (
    Ack,
    Beat,
    Frame,
    Notice,
    ack_message,
    beat_message,
    notice_message,
)
from broker.cluster.membership import ChangeKind, Configuration, Membership
from broker.cluster.messages import (
    AppendEntries,
    AppendLog,
    Commit,
    Effect,
    Entry,
    Flush,
    HardState,
    InstallSnapshot,
    LogStart,
    Message,
    PersistHardState,
    ResetLog,
    Send,
    TimeoutNow,
    Truncate,
)
from broker.cluster.raft import LogReader, RaftConfig, RaftNode, Role
from broker.cluster.terms import TermTable


class GroupLog(LogReader, Protocol):
    """One group's log on this node, as the host writes it while stepping the core."""

    def append(self, first_index: int, entries: tuple[Entry, ...]) -> None:
        """Write ``entries`` at ``first_index``..., right after the last entry (not durable)."""

    def truncate(self, from_index: int) -> None:
        """Drop every entry at ``from_index`` and above."""

    def reset_log(self, reset: ResetLog) -> None:
        """Replace the whole log by an installed snapshot (empty after ``reset.last_index``),
        durably, before returning."""


@dataclass(slots=True)
class Ready:
    """What the host asks of its driver since the last ``ready()``.

    ``frames``: at most one per peer node. ``flushes``: group -> make its log durable up to
    this index, then report ``flushed``. ``hard_states``: group -> the latest hard state to
    persist (temp file, fsync, rename, directory fsync; in order per group), then report
    ``hard_states_persisted``. ``commits``: group -> its new commit index."""

    frames: list[Frame] = field(default_factory=list)
    flushes: dict[int, int] = field(default_factory=dict)
    hard_states: dict[int, HardState] = field(default_factory=dict)
    commits: dict[int, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.frames or self.flushes or self.hard_states or self.commits)


@dataclass(slots=True)
class HostStats:
    """Counters since the host started."""

    #: ``RaftNode.tick`` calls (a quiesced group gets none).
    group_ticks: int = 0
    frames_sent: int = 0
    beats_sent: int = 0
    #: Commit notices that left (``broker.cluster.commits``; at most one per group a frame).
    notices_sent: int = 0
    #: Groups woken because their leader's node fell silent.
    woken_by_silence: int = 0
    #: Groups led here woken because a follower's node was heard again after silence.
    woken_by_return: int = 0
    #: Group messages dropped because this node holds no such group.
    unknown_group: int = 0
    #: Frames dropped because they came from a node outside ``nodes``.
    unknown_node: int = 0
    #: Groups joined as a new replica (:meth:`MultiRaft.join_group`).
    joined: int = 0
    #: Leaderships another leader tried to hand over here while this node was leaving
    #: (:attr:`MultiRaft.declines_leadership`).
    declined: int = 0


class MultiRaft:
    """Every group of node ``node_id``. Not thread-safe: one caller at a time.

    ``nodes``: every node of the cluster (this one included); a group's peers are among them.
    ``quiesce``: False keeps every group ticking and heartbeating (the cost quiescence saves).
    """

    def __init__(
        self,
        node_id: int,
        nodes: Iterable[int],
        rng: random.Random,
        config: RaftConfig | None = None,
        quiesce: bool = True,
    ) -> None:
        self.id = node_id
        self.peers = [n for n in nodes if n != node_id]
        self.config = config or RaftConfig()
        self.quiesce = quiesce
        self.now = 0
        self.stats = HostStats()
        self._rng = rng
        self._cores: dict[int, RaftNode] = {}
        self._logs: dict[int, GroupLog] = {}
        #: Groups ticked each tick (a dict for its insertion order: runs replay exactly).
        self._ticking: dict[int, None] = {}
        #: Deletions from ``_ticking`` since it was last rebuilt: a dict never shrinks, and
        #: iterating one that once held 10,000 groups walks 10,000 slots even when empty.
        self._stopped = 0
        #: Quiesced group -> the node it is quiesced under as leader (this one for leaders).
        self._quiesced: dict[int, int] = {}
        #: Leader node -> the groups quiesced here as its followers.
        self._under: dict[int, dict[int, None]] = {n: {} for n in self.peers}
        self._heard = dict.fromkeys(self.peers, 0)
        self._silent: set[int] = set()
        self._sent_at = dict.fromkeys(self.peers, -self.config.heartbeat_ticks)
        self._out: dict[int, Frame] = {}
        self._ready = Ready()
        #: Called when a leader replicates a group this node does not host (group, leader):
        #: the driver hosts it (:meth:`join_group`, or :meth:`add_group` over a log that
        #: holds the group already) or leaves the message dropped.
        self.on_unknown_group: Callable[[int, int], None] | None = None
        #: Group -> asked before its leadership is handed over here (the balancer, an
        #: operator, a reconfiguration; thesis s3.10) with the node it goes to: True, go on;
        #: False, its application first persists what the next leader needs and asks for the
        #: hand-over again itself (broker.workers.cluster_groups).
        self.before_transfer: dict[int, Callable[[int], bool]] = {}
        #: Set while this node leaves the cluster (``mqlog cluster leave``): a leadership
        #: handed over here (TimeoutNow: the other nodes' balancers, which do not know yet
        #: that it leaves) is declined. Safe: TimeoutNow only hastens an election, and its
        #: sender abandons the transfer after an election timeout (thesis s3.10).
        self.declines_leadership = False

    # -- groups ------------------------------------------------------------------------------

    def add_group(
        self,
        group: int,
        peers: list[int],
        log: GroupLog,
        hard_state: HardState | None = None,
        terms: TermTable | None = None,
        membership: Membership | None = None,
    ) -> RaftNode:
        """Host ``group`` (replicas on ``peers``, this node among them) over ``log``, with
        what was durable at start (``membership``: the configurations the log holds, which
        win over ``peers``). The group starts ticking."""
        if group in self._cores:
            raise ValueError(f"group {group} is already hosted on node {self.id}")
        unknown = set(peers) - set(self.peers) - {self.id}
        if unknown or self.id not in peers:
            raise ValueError(f"group {group}: peers {peers} not within nodes of node {self.id}")
        core = RaftNode(self.id, peers, log, self._rng, self.config, hard_state, terms, membership)
        self._cores[group] = core
        self._logs[group] = log
        self._ticking[group] = None
        return core

    def add_node(self, node: int) -> None:
        """A node joined the cluster: frames to and from it are taken from now on."""
        if node == self.id or node in self._heard:
            return
        self.peers.append(node)
        self._under[node] = {}
        self._heard[node] = self.now
        self._sent_at[node] = self.now - self.config.heartbeat_ticks

    def join_group(self, group: int, leader: int, log: GroupLog) -> RaftNode:
        """Host ``group`` as a new, empty replica because ``leader`` replicates it here (it
        added this node as a learner, thesis s4.2.1): until the log brings the group's
        configuration (every CONFIG entry holds all of it), this node is a learner of a group
        whose only known voter is ``leader``, so it never campaigns on a guess."""
        if group in self._cores:
            raise ValueError(f"group {group} is already hosted on node {self.id}")
        placeholder = Membership(Configuration.of({leader}, {self.id}))
        core = RaftNode(self.id, (), log, self._rng, self.config, membership=placeholder)
        self._cores[group] = core
        self._logs[group] = log
        self._ticking[group] = None
        self.stats.joined += 1
        return core

    def remove_group(self, group: int) -> None:
        """Stop hosting ``group`` (this node is no longer among its members); its log is the
        caller's to delete."""
        self._cores.pop(group)
        self._logs.pop(group)
        self._ticking.pop(group, None)
        leader = self._quiesced.pop(group, None)
        if leader is not None and leader != self.id:
            self._under[leader].pop(group, None)

    def core(self, group: int) -> RaftNode:
        """The core of ``group``, to read its state (role, leader, term, commit)."""
        return self._cores[group]

    @property
    def groups(self) -> list[int]:
        return list(self._cores)

    def quiesced(self, group: int) -> bool:
        return group in self._quiesced

    def silent(self, node: int) -> bool:
        """Whether nothing came from ``node`` for an election timeout (every node sends each
        peer a frame every heartbeat interval, quiesced or not), or it is no peer."""
        return node not in self._heard or node in self._silent

    @property
    def ticking(self) -> int:
        """How many groups a tick steps."""
        return len(self._ticking)

    # -- inputs ------------------------------------------------------------------------------

    def tick(self) -> None:
        self.now += 1
        quiesce = self.quiesce
        cores = self._cores
        if self._stopped > len(self._ticking):
            self._ticking = dict(self._ticking)
            self._stopped = 0
        for g in list(self._ticking):
            core = cores[g]
            effects = core.tick()
            if not effects:
                continue
            # An idle leader's tick emits only its heartbeats: they carry the notice.
            if quiesce and core.role is Role.LEADER and _quiet(core, self._silent):
                self._route(g, effects, quiesce=True)
                self._stop_ticking(g)
                self._quiesced[g] = self.id
            else:
                self._route(g, effects)
        self.stats.group_ticks += len(self._ticking)
        for peer in self.peers:
            if (
                peer not in self._silent
                and self.now - self._heard[peer] >= self.config.election_ticks
            ):
                self._silent.add(peer)
                self._wake_under(peer)
                self._wake_led_with(peer, lost=True)
            if self.now - self._sent_at[peer] >= self.config.heartbeat_ticks:
                self._frame(peer)  # node liveness, even with nothing else to say

    def receive(self, frame: Frame) -> None:
        """Step every group ``frame`` carries (it came from node ``frame.frm``)."""
        frm = frame.frm
        if frm not in self._heard:
            self.stats.unknown_node += 1
            return
        self._heard[frm] = self.now
        if frm in self._silent:
            self._silent.discard(frm)
            self._wake_led_with(frm, lost=False)
        for b in frame.beats:
            self._on_beat(frm, b)
        for a in frame.acks:
            self._on_ack(frm, a)
        for g, m in frame.messages:
            core = self._cores.get(g) or self._joined(g, m)
            if core is None:
                self.stats.unknown_group += 1
                continue
            if self.declines_leadership and isinstance(m, TimeoutNow):
                self.stats.declined += 1
                continue
            self._wake(g)
            self._route(g, self._step(core, m))
        for n in frame.notices:  # after the messages: a notice follows its group's appends
            self._on_notice(frm, n)

    def propose(self, group: int, payload: bytes, count: int = 1) -> int:
        """Append ``payload`` (a batch of ``count`` records, ``RaftNode.propose``) to ``group``
        on its leader here; its last index. Raises ``NotLeader`` (the core's) off the leader,
        and then leaves a quiesced group quiesced."""
        core = self._cores[group]
        effects = core.propose(payload, count)
        self._wake(group)
        self._route(group, effects)
        return core.terms.last_index

    def compacted(self, group: int, first_index: int) -> LogStart:
        """Retention removed ``group``'s entries before ``first_index`` (committed and
        durable): the core's ``compacted``, whose ``LogStart`` the driver stores with the log.
        A follower that needs what went gets a snapshot (``InstallSnapshot``)."""
        return self._cores[group].compacted(first_index)

    def propose_change(self, group: int, kind: ChangeKind, node: int) -> None:
        """One single-server membership change of ``group`` on its leader here
        (``RaftNode.propose_change``, whose refusals it raises)."""
        effects = self._cores[group].propose_change(kind, node)
        self._wake(group)
        self._route(group, effects)

    def transfer_leadership(self, group: int, peer: int) -> None:
        ready = self.before_transfer.get(group)
        if ready is not None and not ready(peer):
            return
        effects = self._cores[group].transfer_leadership(peer)
        self._wake(group)
        self._route(group, effects)

    def flushed(self, done: Iterable[tuple[int, int]]) -> None:
        """One fsync round made each ``(group, index)``'s log durable up to ``index``."""
        for g, index in done:
            core = self._cores.get(g)
            if core is not None:
                self._route(g, core.flushed(index))

    def hard_states_persisted(self, done: Iterable[tuple[int, HardState]]) -> None:
        for g, state in done:
            core = self._cores.get(g)
            if core is not None:
                self._route(g, core.hard_state_persisted(state))

    def ready(self) -> Ready:
        """Drain what accumulated since the last call: at most one frame per peer node."""
        ready, self._ready = self._ready, Ready()
        ready.frames = list(self._out.values())
        self._out = {}
        for f in ready.frames:
            self._sent_at[f.to] = self.now
            self.stats.beats_sent += len(f.beats)
            self.stats.notices_sent += len(f.notices)
        self.stats.frames_sent += len(ready.frames)
        return ready

    def _joined(self, g: int, m: Message) -> RaftNode | None:
        """A group this node does not host: if ``m`` is a leader's replication to it, the
        driver may host it now (:attr:`on_unknown_group`, with :meth:`join_group` or
        :meth:`add_group`); its core, or None."""
        if self.on_unknown_group is None or not isinstance(m, AppendEntries | InstallSnapshot):
            return None
        self.on_unknown_group(g, m.frm)
        return self._cores.get(g)

    # -- quiescence --------------------------------------------------------------------------

    def _on_beat(self, frm: int, b: Beat) -> None:
        g = b.group
        core = self._cores.get(g) or self._joined(g, beat_message(frm, self.id, b))
        if core is None:
            self.stats.unknown_group += 1
            return
        effects = self._step(core, beat_message(frm, self.id, b))
        if effects:
            self._route(g, effects)
        if (
            b.quiesce
            and self.quiesce
            and core.role is Role.FOLLOWER
            and core.leader == frm
            and core.term == b.term
            and core.commit == b.commit
        ):
            if self._quiesced.get(g) != frm:
                self._wake(g)  # quiesced under an older leader, if at all
                self._stop_ticking(g)
                self._quiesced[g] = frm
                self._under[frm][g] = None
        elif g in self._quiesced:
            self._wake(g)  # the leader beats without quiescing: it is busy again

    def _on_ack(self, frm: int, a: Ack) -> None:
        g = a.group
        core = self._cores.get(g)
        if core is None:
            self.stats.unknown_group += 1
            return
        effects = self._step(core, ack_message(frm, self.id, a))
        # The answers to a quiescing beat reach a quiesced leader: they change nothing.
        if g in self._quiesced and (
            effects or (core.role is Role.LEADER and not _quiet(core, self._silent))
        ):
            self._wake(g)
        if effects:
            self._route(g, effects)

    def _on_notice(self, frm: int, n: Notice) -> None:
        """A commit notice: the group's leader is busy (it just committed), so a quiesced
        group wakes, as on any message but a quiescing beat."""
        core = self._cores.get(n.group)
        if core is None:
            self.stats.unknown_group += 1
            return
        self._wake(n.group)
        self._route(n.group, self._step(core, notice_message(frm, self.id, n)))

    def _stop_ticking(self, group: int) -> None:
        del self._ticking[group]
        self._stopped += 1

    def _wake(self, group: int) -> None:
        leader = self._quiesced.pop(group, None)
        if leader is None:
            return
        if leader != self.id:
            del self._under[leader][group]
        self._ticking[group] = None

    def _wake_under(self, peer: int) -> None:
        """``peer`` has been silent for an election timeout: its followers here tick again."""
        woken = self._under[peer]
        self.stats.woken_by_silence += len(woken)
        for g in woken:
            del self._quiesced[g]
            self._ticking[g] = None
        self._under[peer] = {}

    def _wake_led_with(self, peer: int, lost: bool) -> None:
        """Groups this node leads, quiesced, with ``peer`` among their replicas. ``peer`` is
        heard again after an election timeout of silence (``lost`` False): they tick again,
        so that it hears their leader within a heartbeat and catches up (its own groups would
        otherwise wait out an election timeout and pre-vote). ``peer`` fell silent (``lost``):
        those left without a live majority tick again, so CheckQuorum steps their leader down
        (Raft thesis s6.2) instead of it claiming the lead it cannot use until a proposal."""
        for g, leader in list(self._quiesced.items()):
            core = self._cores[g]
            if leader != self.id or peer not in core.progress:
                continue
            if not lost:
                self._wake(g)
                self.stats.woken_by_return += 1
            elif not _quiet(core, self._silent):
                self._wake(g)

    # -- effects -----------------------------------------------------------------------------

    def _step(self, core: RaftNode, m: Message) -> list[Effect]:
        effects = core.receive(m)
        if core.refused:
            raise RuntimeError(f"node {self.id}: core refused: {core.refused[-1]}")
        return effects

    def _frame(self, peer: int) -> Frame:
        frame = self._out.get(peer)
        if frame is None:
            frame = self._out[peer] = Frame(self.id, peer)
        return frame

    def _route(self, g: int, effects: list[Effect], quiesce: bool = False) -> None:
        for e in effects:
            if isinstance(e, Send):
                m = e.message
                (self._out.get(m.to) or self._frame(m.to)).put(g, m, quiesce)
            elif isinstance(e, AppendLog):
                self._logs[g].append(e.first_index, e.entries)
            elif isinstance(e, Truncate):
                self._logs[g].truncate(e.from_index)
            elif isinstance(e, ResetLog):
                self._logs[g].reset_log(e)
            elif isinstance(e, Flush):
                flushes = self._ready.flushes
                flushes[g] = max(flushes.get(g, 0), e.index)
            elif isinstance(e, PersistHardState):
                self._ready.hard_states[g] = e.state
            elif isinstance(e, Commit):
                self._ready.commits[g] = e.index


def _quiet(core: RaftNode, silent: set[int]) -> bool:
    """A leader's group may quiesce: idle over the live replicas, and no learner in its
    configuration (a learner is promoted once a round of its catch-up ends within an election
    timeout, thesis s4.2.1: rounds are counted in ticks and end on acknowledgements, so a
    quiesced group would keep a caught-up learner from ever being promoted)."""
    return not core.configuration.learners and core.idle_without(silent)
