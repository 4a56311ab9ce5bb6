"""An operator's leadership transfer (``mqlog cluster transfer-leader``) across the nodes.

The node asked need not lead the group: it passes the request to the leader's node
(:data:`TRANSFER`). The leader first tells the new leader to keep the group
(:data:`HOLD`: its balancer, which hands every group to its preferred replica, leaves this
one alone for :data:`~broker.cluster.node.OPERATOR_HOLD_SECONDS`), then starts Raft's
leadership transfer (TimeoutNow, thesis s3.10). Both messages ride the link to that node in
order; a lost one leaves the leader where it was, and the command, which waits for the new
leader to show, says so.
"""

from __future__ import annotations

import asyncio
import logging
import struct

from broker.cluster.node import FIRST_APP_KIND, ClusterNode

log = logging.getLogger("broker.cluster")

#: A request to hand a group's leadership to a node: group, node id (u32 each). Kinds
#: FIRST_APP_KIND and + 1 are the broker's forwards (broker.workers.replicated).
TRANSFER = FIRST_APP_KIND + 2
#: Sent by a leader to the node an operator hands a group to, before the hand-over: group.
HOLD = FIRST_APP_KIND + 3

_TRANSFER = struct.Struct("<II")
_HOLD = struct.Struct("<I")


class Leadership:
    """Operator transfers of ``node``'s groups; registers its two message kinds."""

    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        node.handlers[TRANSFER] = self._on_transfer
        node.handlers[HOLD] = self._on_hold

    def transfer(self, g: int, label: str, name: str, leader_hint: int | None = None) -> str:
        """Start moving group ``g``'s (called ``label``) leadership to node ``name``: here if
        this node leads it, else through its leader. On a node outside the group
        (``leader_hint``: the leader its reads last named) the leader checks that ``name`` is
        a voter. Raises ``ValueError`` with the reason."""
        node = self.node
        to = next((i for i, n in node.names.items() if n == name), None)
        if g not in node.storages:
            if to is None:
                raise ValueError(f"{name!r} is not a node of this cluster")
            if leader_hint is None:
                raise ValueError(f"{label} has no known leader here now: try again")
            if not node.send(leader_hint, TRANSFER, _TRANSFER.pack(g, to)):
                raise ValueError(f"{label}: its leader {node.names[leader_hint]} is unreachable")
            return f"{label}: asked its leader {node.names[leader_hint]} to hand it to {name}"
        if to is None or to not in node.core(g).configuration.voters:
            raise ValueError(f"{name!r} is not a voter of {label}")
        leader = node.leader(g)
        if leader is None:
            raise ValueError(f"{label} has no leader now: try again")
        if leader == to:
            return f"{label}: {name} leads it already"
        if leader == node.id:
            self._hand_over(g, to)
            return f"{label}: handing leadership to {name}"
        if not node.send(leader, TRANSFER, _TRANSFER.pack(g, to)):
            raise ValueError(f"{label}: its leader {node.names[leader]} is unreachable")
        return f"{label}: asked its leader {node.names[leader]} to hand it to {name}"

    async def drain(
        self, timeout: float, asked: dict[int, int] | None = None, every: float = 1.0
    ) -> dict[int, int]:
        """Hand every group this node leads to its most caught-up other voter (``mqlog
        cluster leave``), each held there against the balancers (:data:`HOLD`); transfers
        that fail are asked for again every ``every`` s, until none is led here or
        ``timeout`` passes. From then on this node declines the leaderships the others'
        balancers would hand back to it (``MultiRaft.declines_leadership``: they do not
        know yet that it leaves). Returns group -> the node last asked to lead it
        (``asked``, updated)."""
        if self.node.host is not None:
            self.node.host.declines_leadership = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        asked = {} if asked is None else asked
        while self.hand_away(asked) and loop.time() < deadline:
            await asyncio.sleep(every)
        return asked

    def hand_away(self, asked: dict[int, int]) -> bool:
        """One pass of :meth:`drain`: start a transfer of each group led here (``asked``
        records where to); whether any group was led here."""
        node = self.node
        led = [g for g in node.storages if node.is_leader(g)]
        for g in led:
            core = node.core(g)
            others = [v for v in core.configuration.voters if v != node.id]
            if not others or core.transferee is not None:
                continue
            progress = core.progress
            to = max(others, key=lambda v: (progress[v].match, v == asked.get(g)))
            try:
                self._hand_over(g, to)
            except ValueError as e:
                log.warning("cluster: leave: transfer of group %d refused: %s", g, e)
                continue
            asked[g] = to
        return bool(led)

    async def vacate(
        self, timeout: float, asked: dict[int, int], every: float = 1.0
    ) -> tuple[list[int], list[int]]:
        """Wait until the leaders moved this node's replicas elsewhere (``mqlog cluster
        leave``: the node announced it is leaving, ``broker.cluster.reshape``) and it leads
        nothing, handing away any leadership it holds meanwhile (``asked`` records where),
        or ``timeout`` passes. Returns (the groups placement keeps here: too few other
        members to move them to, known at once; those it could move that are still here)."""
        node = self.node
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            eligible, _, leaving = node.reshape.eligible()
            wanted = {g: node.reshape.wanted(g, eligible, leaving) for g in node.storages}
            kept = [g for g in node.storages if node.id in wanted[g]]
            movable = [g for g in node.storages if g not in kept]
            led = self.hand_away(asked)
            if (not movable and not led) or loop.time() >= deadline:
                return kept, movable
            await asyncio.sleep(every)

    def _on_transfer(self, frm: int, body: memoryview) -> None:
        g, to = _TRANSFER.unpack_from(body)
        if g in self.node.storages and self.node.is_leader(g) and to != self.node.id:
            if to not in self.node.core(g).configuration.voters:
                log.warning("cluster: transfer of group %d to %d refused: not a voter", g, to)
                return
            try:
                self._hand_over(g, to)
            except ValueError as e:
                log.warning("cluster: transfer of group %d asked by node %d refused: %s", g, frm, e)

    def _hand_over(self, g: int, to: int) -> None:
        self.node.send(to, HOLD, _HOLD.pack(g))
        self.node.transfer_leadership(g, to)

    def _on_hold(self, frm: int, body: memoryview) -> None:
        (g,) = _HOLD.unpack_from(body)
        if g in self.node.storages:
            self.node.hold(g)
