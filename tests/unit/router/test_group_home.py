"""What a shared group needs to move between a cluster's nodes (broker.workers.cluster_groups),
on a router over a real log: the ``done`` positions it persists (below them every record was
acknowledged), a new home continuing from them (at least once [MQTT-4.8.2]), and a member's
node waiting for a record its home saw committed before this replica did."""

from __future__ import annotations

from typing import Any

import orjson

from broker.commitlog.keys import PartitionKey
from broker.mqtt.packets import Subscribe, Subscription
from broker.router.hooks import SingleWorker
from broker.router.state import SESSIONS
from tests.unit.router.conftest import Harness

GROUP = "$share/g/t/+"


def _persisted(h: Harness) -> dict[str, Any]:
    """The group's latest state record in ``$sessions``."""
    log = h.streams.log(*SESSIONS)
    records = [r for r in log.read(log.log_start_offset, 10_000) if r.topic == GROUP]
    state: dict[str, Any] = orjson.loads(records[-1].payload)
    return state


def test_done_positions_stop_at_the_first_unacknowledged_record(h: Harness) -> None:
    fast, a = h.connect("fast", 4)
    slow, b = h.connect("slow", 4)
    for s in (a, b):
        h.subscribe(s, GROUP, 1)
    _, pub = h.connect("pub", 4)
    for i in range(6):
        h.publish(pub, "t/x", b"%d" % i, 1, i + 1)
    h.run()
    got = {"fast": fast.take(), "slow": slow.take()}
    assert sorted(p.payload for sent in got.values() for p in sent) == [b"%d" % i for i in range(6)]
    for p in got["fast"]:
        h.router.puback(a, p.packet_id)  # the slow member acknowledges nothing
    h.tick(1)
    state = _persisted(h)
    first_unacked = min(int(p.payload) for p in got["slow"])
    assert state["cursors"] == [["default", 0, 6]]  # handed out: one node continues here
    assert state["done"] == [["default", 0, first_unacked]]  # a new home continues here

    # A new home (here: the same router, its groups dropped and held again from the record)
    # gives every record not done to the members again: at least once.
    h.router.rehome_groups({GROUP: state})
    h.run()
    again = sorted(int(p.payload) for p in fast.take() + slow.take())
    assert again == list(range(first_unacked, 6))


class _Elsewhere(SingleWorker):
    """A member's side: every group is held by another node (1)."""

    def __init__(self) -> None:
        self.group_peers = _Peers()


class _Peers:
    def __init__(self) -> None:
        self.done: list[int] = []

    def home(self, group: str) -> int | None:
        return 1

    def join(self, *args: object) -> None:
        pass

    def leave(self, *args: object) -> None:
        pass

    def deliver(self, *args: object) -> None:
        pass

    def done(self, home: int, group: str, client_id: str, key: PartitionKey, offset: int) -> None:
        self.done.append(offset)


def test_a_record_not_yet_committed_here_waits_for_the_commit(h: Harness) -> None:
    """The home read it committed; this replica learns the commit a round later: the record
    is not counted done (lost) but sent once it is readable here."""
    h.hooks = _Elsewhere()
    h.restart()
    link, s = h.connect("member", 4)
    h.router.subscribe(s, Subscribe(1, [Subscription(GROUP, 1)]))
    h.run()
    _, pub = h.connect("pub", 4)
    h.publish(pub, "t/x", b"0", 1, 1)
    h.run()
    h.router.remote_deliver(GROUP, "member", ("default", 0), 1, 1)  # not here yet
    assert link.take() == []
    assert h.hooks.group_peers.done == []  # type: ignore[attr-defined]
    h.publish(pub, "t/x", b"1", 1, 2)
    h.run()
    assert [p.payload for p in link.take()] == [b"1"]
