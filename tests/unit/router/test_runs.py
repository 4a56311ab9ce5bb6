"""Runs: a consumer's read delivered in one piece (Delivery.send_run) when no per-message
rule applies, and message by message when one does; the deliveries are the same either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.commitlog.keys import PartitionKey
from broker.config import RouterConfig
from broker.mqtt.packets import Subscribe, Subscription
from broker.mqtt.properties import PropertyId
from broker.router.hooks import SingleWorker
from tests.unit.router.conftest import Harness


def _load(h: Harness, n: int, qos: int = 1, **kw: object) -> None:
    _, pub = h.connect("pub", 4)
    for i in range(n):
        h.publish(pub, f"t/{i % 3}", b"%d" % i, qos, i % 60000 + 1 if qos else None, **kw)
    h.run()


def test_replay_is_sent_as_runs_within_the_receive_maximum(tmp_path: Path) -> None:
    h = Harness(tmp_path / "data", RouterConfig(max_inflight=100))
    _load(h, 150)
    link, s = h.connect("sub", 5, receive_maximum=10)
    h.subscribe(s, "$replay/earliest/t/+", 1)
    assert link.runs == 0  # 5.0 replay deliveries carry mqlog-offset: one by one
    link, s = h.connect("sub4", 4)
    h.router.subscribe(s, Subscribe(1, [Subscription("$replay/earliest/t/+", 1)]))
    h.run()
    got = link.take()
    assert link.runs >= 1
    assert len(got) == 100  # 3.1.1: max_inflight (100) bounds the window
    assert [p.packet_id for p in got] == list(range(1, 101))  # consecutive, in order
    assert [p.payload for p in got] == [b"%d" % i for i in range(100)]
    assert all(p.qos == 1 and not p.retain and not p.dup for p in got)
    assert sorted(s.inflight) == list(range(1, 101))
    assert [s.inflight_entry(i) for i in range(1, 101)] == [
        (("default", 0), i, 1, False, False, None, "$replay/earliest/t/+") for i in range(100)
    ]
    h.streams.close()


def test_quota_and_packet_ids_in_use(tmp_path: Path) -> None:
    h = Harness(tmp_path / "data", RouterConfig(max_inflight=8))
    _load(h, 50)
    link, s = h.connect("sub", 4)
    s.next_packet_id = 65533  # a run does not wrap: ids 65533..65535, then 1..
    h.subscribe(s, "$replay/earliest/t/+", 1)
    got = link.take()
    assert link.runs == 2
    assert len(got) == 8  # the send quota (max_inflight; 5.0: also receive maximum)
    assert [p.packet_id for p in got] == [65533, 65534, 65535, 1, 2, 3, 4, 5]
    for pid in (65534, 2):
        h.router.puback(s, pid)
    got = link.take()
    assert [p.packet_id for p in got] == [6, 7]
    assert [p.payload for p in got] == [b"8", b"9"]
    s.next_packet_id = 5  # 5..7 are in use: one by one, skipping them [MQTT-2.2.1-3]
    h.router.puback(s, 3)
    h.router.puback(s, 4)
    got = link.take()
    assert [p.packet_id for p in got] == [8, 9]
    h.streams.close()


def test_qos_is_the_minimum_and_mixed_runs_go_one_by_one(h: Harness) -> None:
    _, pub = h.connect("pub", 4)
    link, s = h.connect("sub", 4)
    h.subscribe(s, "t/#", 1)
    for i in range(20):
        h.publish(pub, "t/a", b"%d" % i, i % 2, i + 1 if i % 2 else None)
    h.run()
    got = link.take()
    assert [p.qos for p in got] == [i % 2 for i in range(20)]  # [MQTT-3.8.4-8]
    assert [p.packet_id for p in got if p.qos] == list(range(1, 11))


def test_properties_no_local_and_retain_as_published(h: Harness) -> None:
    link, s = h.connect("c", 5)
    h.router.subscribe(
        s, Subscribe(1, [Subscription("t/+", 0, no_local=True, retain_as_published=True)])
    )
    h.run()
    _, other = h.connect("o", 5)
    for i in range(10):
        h.publish(s, "t/a", b"own%d" % i)  # not delivered back [MQTT-3.8.3-3]
        h.publish(other, "t/a", b"%d" % i, retain=i == 3)
    h.publish(other, "t/a", b"expiring", properties={PropertyId.MESSAGE_EXPIRY_INTERVAL: 60})
    h.run()
    got = link.take()
    assert [p.payload for p in got] == [b"%d" % i for i in range(10)] + [b"expiring"]
    assert [p.retain for p in got][:10] == [i == 3 for i in range(10)]
    assert got[-1].properties == {PropertyId.MESSAGE_EXPIRY_INTERVAL: 60}
    for i in range(10):
        h.publish(other, "t/b", b"%d" % i, retain=i == 5)
    h.run()
    got = link.take()
    assert link.runs == 1 and [p.retain for p in got] == [i == 5 for i in range(10)]


def test_records_of_other_topics_are_passed_over(h: Harness) -> None:
    _, pub = h.connect("pub", 4)
    for i in range(30):
        h.publish(pub, "other/x", b"%d" % i)
    for i in range(10):
        h.publish(pub, "t/a", b"%d" % i)
    h.run()
    link, s = h.connect("sub", 4)
    h.subscribe(s, "$replay/earliest/t/+", 0)
    assert [p.payload for p in link.take()] == [b"%d" % i for i in range(10)]
    assert s.consumers["$replay/earliest/t/+"].cursors[("default", 0)] == 40


@pytest.mark.parametrize(
    "acks",
    [
        "all",
        "unknown",
        "duplicate",
        "qos2",
        "group",
    ],
)
def test_puback_run_is_puback_for_each(tmp_path: Path, acks: str) -> None:
    """Router.puback_run (a read of PUBACKs) leaves the state puback(..., pump=False) one by
    one leaves: unknown ids and PUBACKs for QoS 2 deliveries ignored, shared-group
    deliveries done, a repeated id acknowledged once; then the same deliveries follow."""
    outcomes = []
    for one_by_one in (True, False):
        h = Harness(tmp_path / ("a" if one_by_one else "b"), RouterConfig(max_inflight=20))
        _, pub = h.connect("pub", 4)
        link, s = h.connect("sub", 4)
        h.subscribe(s, "t/+" if acks != "group" else "$share/g/t/+", 2 if acks == "qos2" else 1)
        for i in range(30):
            h.publish(pub, f"t/{i % 2}", b"%d" % i, 1 + (acks == "qos2" and i % 3 == 0), i + 1)
        h.run()
        sent = [p.packet_id for p in link.take()]
        ids = sent[:12]
        if acks == "unknown":
            ids = [*ids[:5], 999, *ids[5:]]
        elif acks == "duplicate":
            ids = [*ids[:5], ids[3], *ids[5:]]
        if one_by_one:
            for pid in ids:
                h.router.puback(s, pid, pump=False)
        else:
            h.router.puback_run(s, ids)
        state = {pid: (e[1], e[2]) for pid, e in s.inflight_entries()}
        h.router.pump_session(s)
        h.run()
        outcomes.append(
            (
                sent,
                state,
                [(p.packet_id, p.payload) for p in link.take()],
                [(g.name, len(g.members)) for g in h.router.groups.values()],
            )
        )
        h.streams.close()
    assert outcomes[0] == outcomes[1]
    sent, state, after, _ = outcomes[0]
    if acks != "qos2":
        assert len(state) == 20 - 12 and len(after) == 30 - 20  # the freed quota is used


@pytest.mark.parametrize("restart", [False, True], ids=["reconnect", "restart"])
def test_run_deliveries_are_resent_under_their_own_ids(tmp_path: Path, restart: bool) -> None:
    """A run's in-flight entries hold each delivery's own record: after some PUBACKs (one
    read of them, out of order) and a reconnect, or a restart from the persisted session,
    the rest go out again with DUP under the same packet ids and with their own payloads
    [MQTT-4.4.0-1]; new deliveries take ids none of them holds [MQTT-2.2.1-3]; in the end
    every record was delivered once besides the DUP resends, in order."""
    h = Harness(tmp_path / "data", RouterConfig(max_inflight=10))
    _load(h, 40)
    link, s = h.connect("sub", 4, clean=False)
    s.next_packet_id = 65531  # runs do not wrap: 65531..65535, then from 1
    h.subscribe(s, "$replay/earliest/t/+", 1)
    got = link.take()
    assert link.runs >= 2
    assert [(p.packet_id, p.payload) for p in got] == list(
        zip(
            [65531, 65532, 65533, 65534, 65535, 1, 2, 3, 4, 5],
            [b"%d" % i for i in range(10)],
            strict=True,
        )
    )
    acked = [65535, 2, 65532, 3]
    h.router.puback_run(s, acked)
    kept = [(p.packet_id, p.payload) for p in got if p.packet_id not in acked]
    h.drop(s, link)
    if restart:
        h.restart()
    link, s = h.connect("sub", 4, clean=False)
    again = link.take()
    assert [(p.packet_id, p.payload, p.dup) for p in again[:6]] == [
        (pid, payload, True) for pid, payload in kept
    ]
    fresh = again[6:]
    assert [p.payload for p in fresh] == [b"10", b"11", b"12", b"13"]  # the 4 freed slots
    assert not any(p.dup for p in fresh)
    assert sorted(s.inflight) == sorted([pid for pid, _ in kept] + [p.packet_id for p in fresh])
    first_time = [p.payload for p in got + fresh]
    while s.inflight:
        h.router.puback_run(s, list(s.inflight))
        h.router.pump_session(s)
        h.run()
        sent = link.take()
        assert len({p.packet_id for p in sent}) == len(sent) <= 10
        first_time += [p.payload for p in sent if not p.dup]
    assert first_time == [b"%d" % i for i in range(40)]
    h.streams.close()


class _GroupsElsewhere(SingleWorker):
    """One worker of several, whose shared groups are all held by another."""

    def __init__(self, peers: _Peers) -> None:
        self.group_peers = peers


class _Peers:
    """GroupPeers of a broker whose shared groups are all held by worker 1: records what
    this worker tells it."""

    def __init__(self) -> None:
        self.done_offsets: list[int] = []

    def home(self, group: str) -> int | None:
        return 1

    def join(self, *args: object) -> None:
        pass

    def leave(self, *args: object) -> None:
        pass

    def deliver(self, *args: object) -> None:
        pass

    def joined(self, *args: object) -> None:
        pass

    def done(self, home: int, group: str, client_id: str, key: PartitionKey, offset: int) -> None:
        self.done_offsets.append(offset)


def test_puback_run_of_group_deliveries_tells_the_groups_home(h: Harness) -> None:
    """Deliveries of a shared group held by another worker, acknowledged by one read of
    PUBACKs, are each reported done to the group's home (else it keeps them outstanding and
    gives them to another member if this worker goes away), the plain ones are not."""
    peers = _Peers()
    h.hooks = _GroupsElsewhere(peers)
    h.restart()
    _load(h, 6)
    link, s = h.connect("sub", 4)
    h.subscribe(s, "t/+", 1)
    h.router.subscribe(s, Subscribe(2, [Subscription("$share/g/t/+", 1)]))
    h.run()
    h.router.pump_session(s)
    link.take()
    for offset in (1, 3, 4):
        h.router.remote_deliver("$share/g/t/+", "sub", 1, ("default", 0), offset, 1)
    grouped = [p.packet_id for p in link.take()]
    assert len(grouped) == 3
    h.router.puback_run(s, [*grouped, *[pid for pid in s.inflight if pid not in grouped]])
    assert sorted(peers.done_offsets) == [1, 3, 4]
    assert not s.inflight
