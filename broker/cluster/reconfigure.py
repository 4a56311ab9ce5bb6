"""The next membership step of a group toward the replicas placement wants (sans-IO).

When the cluster changes shape (a node joins, one is dead past ``replace_after``, one leaves:
issue 21), each group's desired replicas change (``broker.cluster.placement`` over the new
member list), and its leader moves the group there one single-server change at a time (Raft
thesis s4.1-s4.2: a learner is added, catches up, is promoted; a voter is removed), as etcd
and CockroachDB do. :func:`next_step` decides the next step from the leader's own state; the
driver takes it (``MultiRaft.propose_change`` / ``transfer_leadership``) and asks again
after the change commits. The core refuses anything unsafe on its own (a change while another
is uncommitted or before the term's first entry committed, a promotion of a learner that is
not caught up); the planner only avoids asking for it, and chooses an order that keeps the
group as available as it can be at every step:

1. a learner nobody wants is removed (a join that was called off);
2. a voter nobody wants that is not live (dead, or cut off) is removed before its
   replacement is added: with one of three voters dead the group already needs both others;
   removing it changes nothing there, and the replacement's promotion then restores the
   margin. A live voter is kept until its replacement votes (add before remove), so a leave
   or a rebalance never narrows the margin;
3. a wanted learner that is caught up is promoted;
4. a wanted node that is missing and live is added as a learner, one learner at a time per
   group: catch-up traffic is throttled to one stream per group;
5. once every wanted node votes, a live voter nobody wants is removed; if that is the leader
   itself, leadership is handed first to the most caught-up wanted voter (thesis s3.10: the
   core brings it up to date, then sends TimeoutNow), and the new leader removes it.

Where a wanted node is not live, the group waits at the step before (it does not shrink while
it cannot grow). Placement's order is the order of additions and of transfers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol

from broker.cluster.membership import ChangeKind
from broker.cluster.raft import RaftNode, Role


class Step(NamedTuple):
    """A membership change (``kind``) of ``node``, or, with ``kind`` None, a leadership
    transfer to ``node``."""

    kind: ChangeKind | None
    node: int


def next_step(core: RaftNode, desired: Sequence[int], live: Collection[int]) -> Step | None:
    """The next step toward ``desired`` (the group's voters, in placement order) for the group
    ``core`` leads, given the nodes that are ``live``; None when there is none to take now
    (not the leader, a transfer or a change in flight, nothing to do, or waiting for a node)."""
    if core.role is not Role.LEADER or core.transferee is not None:
        return None
    if core.membership.last_index > core.commit:
        return None  # a change in flight: one at a time (thesis s4.1)
    if core.terms.term_at(core.commit) != core.term:
        return None  # the term's first entry has not committed (the single-server errata)
    conf = core.configuration
    wanted = dict.fromkeys(desired)
    for n in sorted(conf.learners - wanted.keys()):
        return Step(ChangeKind.REMOVE, n)
    for n in sorted(conf.voters - wanted.keys()):
        if n != core.id and n not in live and len(conf.voters) > 1:
            return Step(ChangeKind.REMOVE, n)
    progress = core.progress
    for n in wanted:
        if n in conf.learners and progress[n].caught_up:
            return Step(ChangeKind.PROMOTE, n)
    if not conf.learners & wanted.keys():
        for n in wanted:
            if n not in conf.members and n in live:
                return Step(ChangeKind.ADD_LEARNER, n)
    if wanted.keys() <= conf.voters:
        for n in sorted(conf.voters - wanted.keys()):
            if n != core.id:
                return Step(ChangeKind.REMOVE, n)
            # The most caught-up wanted voter (placement order breaks ties): the core sends it
            # what it lacks and then TimeoutNow; a transfer that fails is asked for again.
            best = max(wanted, key=lambda m: progress[m].match)
            return Step(None, best)
    return None


class StepTaker(Protocol):
    """What takes a step: ``broker.cluster.multiraft.MultiRaft``."""

    def transfer_leadership(self, group: int, peer: int) -> None: ...
    def propose_change(self, group: int, kind: ChangeKind, node: int) -> None: ...


def take(host: StepTaker, group: int, step: Step) -> None:
    """Propose ``step`` for ``group`` on its leader's ``host``; raises what the core refuses
    with (``ChangeRefused``, ``NotLeader``, ``ValueError``)."""
    if step.kind is None:
        host.transfer_leadership(group, step.node)
    else:
        host.propose_change(group, step.kind, step.node)
