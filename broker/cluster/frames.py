"""What one node sends another in one step: a frame carrying every group's traffic between them.

A ``Frame`` holds three lists. ``beats`` are the groups' heartbeats, coalesced (etcd's and
CockroachDB's coalesced heartbeats): a core's heartbeat is an AppendEntries without entries, and
only its group, term, commit and anchor travel, with a flag asking the follower to quiesce.
``acks`` are the successful AppendResps (every heartbeat's answer among them), likewise reduced
to their group, term, match and flushed indexes. ``messages`` is every other message, whole,
beside its group. The sender and receiver of each beat and ack are the frame's ``frm`` and
``to`` (a group's replica ids are node ids).

The reduction is lossless: ``beat_message`` and ``ack_message`` rebuild exactly the message the
core sent (a test holds them to it), so a receiving core sees what it would have seen without
coalescing.

Why a beat carries its anchor (``prev_index``, ``prev_term``) and not only (group, term,
commit): the core anchors a heartbeat at the follower's ``match``, so that a follower that lost
an unflushed tail in a crash refuses it and the leader sends the entries again; etcd's heartbeat
carries none because etcd persists before acknowledging, which this core does not (it
acknowledges appended entries and counts only flushed ones towards commit).

An empty frame is still sent once per heartbeat interval to each peer: frames are node
liveness (``broker.cluster.multiraft``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from broker.cluster.messages import AppendEntries, AppendResp, Message


class Beat(NamedTuple):
    """A heartbeat of one group: the AppendEntries ``(term, prev_index, prev_term, (),
    commit)`` from the frame's sender, its leader; ``quiesce``: the leader stops ticking the
    group, and asks the follower to do the same."""

    group: int
    term: int
    commit: int
    prev_index: int
    prev_term: int
    quiesce: bool


class Ack(NamedTuple):
    """A successful AppendResp of one group: ``(term, True, match, flushed, 0, None)``."""

    group: int
    term: int
    match: int
    flushed: int


@dataclass(slots=True)
class Frame:
    frm: int
    to: int
    beats: list[Beat] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    messages: list[tuple[int, Message]] = field(default_factory=list)

    def put(self, group: int, m: Message, quiesce: bool = False) -> None:
        """Add ``m`` (of ``group``, from ``frm`` to ``to``): as a beat, an ack, or whole."""
        if isinstance(m, AppendEntries) and not m.entries:
            self.beats.append(Beat(group, m.term, m.commit, m.prev_index, m.prev_term, quiesce))
        elif isinstance(m, AppendResp) and m.success:
            self.acks.append(Ack(group, m.term, m.match_index, m.flushed_index))
        else:
            self.messages.append((group, m))

    def __len__(self) -> int:
        """How many group messages the frame carries (0: a node heartbeat only)."""
        return len(self.beats) + len(self.acks) + len(self.messages)


def beat_message(frm: int, to: int, b: Beat) -> AppendEntries:
    return AppendEntries(frm, to, b.term, b.prev_index, b.prev_term, (), b.commit)


def ack_message(frm: int, to: int, a: Ack) -> AppendResp:
    return AppendResp(frm, to, a.term, True, a.match, a.flushed, 0, None)
