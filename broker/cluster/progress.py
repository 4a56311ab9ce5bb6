"""The leader's view of one follower or learner (etcd-io/raft's Progress and Inflights).

A progress is in one of three states:

- PROBE: the leader does not know where the follower's log meets its own. At most one
  AppendEntries is outstanding; the answer (or a heartbeat interval without one) decides the
  next. A new leader starts every peer here, and a rejection sends a peer back here.
- REPLICATE: the follower accepted an AppendEntries, so the leader streams: it sends batch
  after batch without waiting for each answer, up to ``max_inflight`` unacknowledged messages.
  A follower far behind is caught up at a window per round trip, not a batch per round trip,
  and each peer's window is its own, so a long catch-up never holds back another peer's
  heartbeat. An acknowledgement frees every in-flight message it covers.
- SNAPSHOT: the follower needs entries that the leader's log no longer has (retention or
  compaction removed them); the leader sent InstallSnapshot and sends no entries until the
  follower answers at or past the snapshot's index. Sent again after an election timeout
  without an answer.

``next`` is optimistic (the next index to send), ``match`` is what the follower said equals the
leader's log, ``flushed`` what it said is durable among those: the only figure commit counts.

Catch-up of a learner (thesis s4.2.1, in rounds): a round ends when the learner's ``match``
reaches the leader's last index as it was when the round began; the learner is caught up when
its latest round ended within an election timeout of the round's start, and stops being so
when the current round has lasted longer than that. Only a caught-up learner is promoted.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class ProgressState(enum.Enum):
    PROBE = "probe"
    REPLICATE = "replicate"
    SNAPSHOT = "snapshot"


@dataclass(slots=True)
class Progress:
    """``active``: heard from in this CheckQuorum period; ``acked``: a success came since the
    last heartbeat. ``inflight``: the last index of each unacknowledged AppendEntries sent in
    REPLICATE, ascending. ``probing``: a probe is outstanding (PROBE). ``snapshot_index``: the
    index of the InstallSnapshot sent (SNAPSHOT), and ``snapshot_ticks`` since it was sent."""

    next: int
    match: int = 0
    flushed: int = 0
    active: bool = False
    acked: bool = False
    state: ProgressState = ProgressState.PROBE
    inflight: deque[int] = field(default_factory=deque)
    probing: bool = False
    snapshot_index: int = 0
    snapshot_ticks: int = 0
    #: Catch-up rounds: the index that ends the current round, its age in ticks, and whether
    #: the last round ended in time.
    round_end: int = 0
    round_ticks: int = 0
    caught_up: bool = False
    #: The highest commit index sent to the follower (in an AppendEntries, a heartbeat or a
    #: notice): it needs a ``CommitNotice`` only to learn more (``broker.cluster.commits``).
    commit_sent: int = 0

    def can_send(self, max_inflight: int) -> bool:
        if self.state is ProgressState.REPLICATE:
            return len(self.inflight) < max_inflight
        return self.state is ProgressState.PROBE and not self.probing

    def sent(self, last: int) -> None:
        """An AppendEntries carrying entries up to ``last`` left."""
        self.next = last + 1
        if self.state is ProgressState.REPLICATE:
            self.inflight.append(last)
        else:
            self.probing = True

    def acknowledged(self, match: int, flushed: int) -> None:
        """A success: the follower's log equals ours up to ``match``. It counts as an
        acknowledgement (``acked``) only if it moved ``match`` or nothing is in flight: a
        follower that answers heartbeats at the same ``match`` while entries are in flight has
        lost them, and the next heartbeat must probe it again (otherwise a full window of lost
        messages is never resent: simulator seed 8486)."""
        if match > self.match or not self.waiting():
            self.acked = True
        self.match = max(self.match, match)
        self.flushed = max(self.flushed, flushed)
        if self.state is not ProgressState.REPLICATE:
            if self.state is ProgressState.SNAPSHOT and self.match < self.snapshot_index:
                return
            self.state = ProgressState.REPLICATE
            self.probing = False
            self.next = self.match + 1
        self.next = max(self.next, self.match + 1)
        inflight = self.inflight
        while inflight and inflight[0] <= self.match:
            inflight.popleft()

    def probe(self, next_index: int) -> None:
        """Back to PROBE from ``next_index`` (a rejection, or nothing heard for an interval)."""
        self.state = ProgressState.PROBE
        self.inflight.clear()
        self.probing = False
        self.next = next_index

    def snapshot(self, index: int) -> None:
        self.state = ProgressState.SNAPSHOT
        self.inflight.clear()
        self.probing = False
        self.snapshot_index = index
        self.snapshot_ticks = 0
        self.next = index + 1

    def waiting(self) -> bool:
        """Something was sent that nothing has answered yet."""
        return bool(self.inflight) or self.probing

    def tick_round(self, election_ticks: int) -> None:
        self.round_ticks += 1
        if self.round_ticks > election_ticks:
            self.caught_up = False

    def end_round_if_reached(self, last_index: int, election_ticks: int) -> None:
        if self.match >= self.round_end:
            self.caught_up = self.round_ticks <= election_ticks
            self.round_end = last_index
            self.round_ticks = 0
