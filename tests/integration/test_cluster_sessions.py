"""Persistent sessions across a three-node cluster (``$sessions`` replicated, a client id
owned by one node at a time: broker.workers.replicated_sessions), with real ``mqlog serve``
processes (the Cluster of test_cluster.py) and real clients (paho, and hand-built bytes
where the QoS 2 steps must be withheld or resent).

What is asserted: a persistent session (5.0 and 3.1.1) made on node 1 resumes on node 2 with
session present and gets what was published while it was offline; QoS 2 flows in flight
when a client moves to another node complete exactly once, on the receiving and on the
sending side; a second connection with the same client id on another node closes the first
(5.0: DISCONNECT 0x8E) [MQTT-3.1.4-3], and two racing connects on two nodes leave exactly one
connected; after the kill -9 of the node holding a session, the client reconnects elsewhere
and keeps its subscription; after a clean stop it resumes elsewhere where it left off.
"""

from __future__ import annotations

import contextlib
import queue
import select
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from broker.commitlog import Record, SegmentedLog
from broker.commitlog.streams import INTERNAL_LOG, SESSIONS_STREAM
from broker.workers.replicated_sessions import CLAIM_PREFIX
from tests.integration.clients import V5, V311, Client
from tests.integration.conftest import BrokerProcess
from tests.integration.rawclient import RawClient
from tests.integration.test_cluster import Cluster, _publish_all, _replay
from tests.mqttbytes import DISCONNECT, PUBCOMP, PUBLISH, PUBREC, PUBREL


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for the module; each test uses its own client ids and topics."""
    c = Cluster(tmp_path_factory.mktemp("cluster-sessions"), partitions=2)
    try:
        c.start()
        c.wait_balanced()
        yield c
    finally:
        c.stop()


def _durable(port: int, client_id: str, version: int) -> Client:
    """A client whose session outlives its connection (3.1.1: clean session 0; 5.0: clean
    start 0 and an expiry)."""
    if version == V5:
        return Client(port, client_id, V5, clean=False, session_expiry=300)
    return Client(port, client_id, V311, clean=False)


@pytest.mark.parametrize("version", [V5, V311], ids=["v5", "v311"])
def test_a_persistent_session_resumes_on_another_node(cluster: Cluster, version: int) -> None:
    n1, n2, n3 = cluster.nodes
    topic = f"devices/resume{version}/t"
    sub = _durable(n1.port, f"roamer-{version}", version)
    assert sub.connect() == 0 and not sub.session_present
    assert sub.subscribe(topic, qos=1) == [1]
    sub.disconnect()
    missed = [f"m{i}".encode() for i in range(5)]
    assert _publish_all(n3, topic, missed, f"pub-{version}") == missed

    again = _durable(n2.port, f"roamer-{version}", version)
    assert again.connect() == 0
    assert again.session_present  # [MQTT-3.2.2-2]
    assert [m.payload for m in again.expect(5)] == missed
    # It keeps following what any node accepts, from node 2 now.
    assert _publish_all(n1, topic, [b"live"], f"pub2-{version}") == [b"live"]
    assert [m.payload for m in again.expect(1)] == [b"live"]
    again.expect_none(0.3)  # nothing twice
    again.disconnect()


def test_qos2_in_flight_across_nodes_is_delivered_once(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    topic = "devices/q2/x"
    # The receiving side: one delivery PUBREC'd (PUBREL sent) and one not, on node 1.
    sub = RawClient(n1.port, 5)
    assert sub.connect("q2-sub", clean=False, session_expiry=300) == (False, 0)
    assert sub.subscribe(topic, 2) == [2]
    pub = RawClient(n3.port, 5)
    pub.connect("q2-pub")
    for pid, payload in ((1, b"first"), (2, b"second")):
        pub.publish(topic, payload, 2, pid)
        assert pub.expect(PUBREC).packet_id == pid
        pub.ack(PUBREL, pid)
        assert pub.expect(PUBCOMP).packet_id == pid
    pub.disconnect()
    first, second = sub.deliveries(2)
    assert (first.payload, first.qos, second.payload) == (b"first", 2, b"second")
    sub.ack(PUBREC, first.packet_id)
    assert sub.expect(PUBREL).packet_id == first.packet_id
    sub.close()  # neither PUBCOMP nor PUBREC for the second

    moved = RawClient(n2.port, 5)
    assert moved.connect("q2-sub", clean=False, session_expiry=300) == (True, 0)
    # [MQTT-4.4.0-1]: the PUBREL again for the released one, the PUBLISH (DUP) for the other.
    assert moved.expect(PUBREL).packet_id == first.packet_id
    (again,) = moved.deliveries(1)
    assert (again.payload, again.dup, again.packet_id) == (b"second", True, second.packet_id)
    moved.ack(PUBCOMP, first.packet_id)
    moved.ack(PUBREC, again.packet_id)
    assert moved.expect(PUBREL).packet_id == again.packet_id
    moved.ack(PUBCOMP, again.packet_id)
    moved.expect_nothing(PUBLISH, 0.5)  # "first" is not delivered a second time
    moved.disconnect()

    # The sending side: PUBREC received on node 1, the PUBLISH resent (DUP) on node 2 is
    # the same message (its packet id is in the replicated session), stored once.
    sender = RawClient(n1.port, 5)
    assert sender.connect("q2-sender", clean=False, session_expiry=300) == (False, 0)
    sender.publish("devices/q2/y", b"once", 2, 9)
    assert sender.expect(PUBREC).packet_id == 9
    sender.close()
    sender = RawClient(n2.port, 5)
    assert sender.connect("q2-sender", clean=False, session_expiry=300) == (True, 0)
    sender.publish("devices/q2/y", b"once", 2, 9, dup=True)
    assert sender.expect(PUBREC).packet_id == 9
    sender.ack(PUBREL, 9)
    assert sender.expect(PUBCOMP).packet_id == 9
    sender.disconnect()
    assert _replay(n3, "devices/q2/y", 1) == [b"once"]


def test_the_same_client_id_on_another_node_takes_the_connection_over(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    old = Client(n1.port, "twin", V5, clean=False, session_expiry=300)
    assert old.connect() == 0
    assert old.subscribe("devices/twin/t", qos=1) == [1]
    new = Client(n2.port, "twin", V5, clean=False, session_expiry=300)
    assert new.connect() == 0 and new.session_present
    assert old.disconnects.get(timeout=10) == 0x8E  # Session taken over [MQTT-3.1.4-3]
    # The session continues on node 2 with its subscription.
    assert _publish_all(n3, "devices/twin/t", [b"after"], "twin-pub") == [b"after"]
    assert [m.payload for m in new.expect(1)] == [b"after"]
    old.expect_none(0.2)
    # 3.1.1 has no DISCONNECT from the server: the old connection is closed.
    raw = RawClient(n2.port, 4)
    assert raw.connect("twin311", clean=False) == (False, 0)
    other = RawClient(n3.port, 4)
    assert other.connect("twin311", clean=False) == (True, 0)
    assert raw.closed_by_broker() is None
    other.disconnect()
    new.disconnect()


def _connect_together(clients: list[RawClient], cid: str) -> list[tuple[bool, int] | Exception]:
    """CONNECT every client at once (one thread each); each one's CONNACK or error."""
    answers: list[tuple[bool, int] | Exception] = [ValueError("no answer")] * len(clients)

    def connect(i: int) -> None:
        try:
            answers[i] = clients[i].connect(cid, clean=False, session_expiry=300)
        except Exception as e:  # refused and closed before a CONNACK arrived
            answers[i] = e

    threads = [threading.Thread(target=connect, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def test_racing_connects_on_two_nodes_leave_exactly_one_connected(cluster: Cluster) -> None:
    _n1, n2, n3 = cluster.nodes
    for round_ in range(3):
        cid = f"racer-{round_}"
        clients = [RawClient(b.port, 5) for b in (n2, n3)]
        answers = _connect_together(clients, cid)
        accepted = [i for i, a in enumerate(answers) if isinstance(a, tuple) and a[1] == 0]
        assert accepted, answers
        # Of two accepted connections the earlier is taken over (closed, 5.0: 0x8E).
        if len(accepted) == 2:
            ready, _, _ = select.select([clients[i].sock for i in accepted], [], [], 5.0)
            assert ready, f"both connections of {cid} stayed open"
            closed = next(i for i in accepted if clients[i].sock is ready[0])
            p = clients[closed].read_packet(2.0)
            assert p.type == DISCONNECT and p.body[0] == 0x8E, p
            accepted.remove(closed)
        (survivor,) = (clients[i] for i in accepted)
        survivor.expect_nothing(DISCONNECT, 0.3)
        assert survivor.subscribe(f"devices/{cid}/t", 1) == [1]  # still served
        survivor.disconnect()


def test_a_session_of_a_stopped_node_resumes_elsewhere_where_it_left_off(
    cluster: Cluster,
) -> None:
    n1, n2, n3 = cluster.nodes
    topic = "devices/leaver/t"
    sub = Client(n2.port, "leaver", V5, clean=False, session_expiry=300)
    assert sub.connect() == 0
    assert sub.subscribe(topic, qos=1) == [1]
    seen = [f"seen{i}".encode() for i in range(5)]
    assert _publish_all(n1, topic, seen, "leaver-pub") == seen
    assert [m.payload for m in sub.expect(5)] == seen
    # A SUBACK follows the PUBACKs paho sent before it (one connection, in order).
    assert sub.subscribe("devices/leaver/other", qos=1) == [1]
    n2.stop()  # its positions were committed (by the timer, or by the drain at shutdown)
    sub.paho.loop_stop()
    cluster.wait_leaders([n1, n3])
    later = [b"later1", b"later2"]
    assert _publish_all(n1, topic, later, "leaver-pub2") == later
    back = Client(n3.port, "leaver", V5, clean=False, session_expiry=300)
    assert back.connect() == 0 and back.session_present
    assert [m.payload for m in back.expect(2)] == later  # nothing it had acknowledged
    back.expect_none(0.3)
    back.disconnect()
    cluster.start([n2])
    cluster.wait_leaders(cluster.nodes)


def test_kill_9_of_the_session_holder_keeps_the_subscription(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    topic = "devices/orphan/t"
    sub = Client(n1.port, "orphan", V5, clean=False, session_expiry=300)
    assert sub.connect() == 0
    assert sub.subscribe(topic, qos=1) == [1]
    assert _publish_all(n2, topic, [b"before"], "orphan-pub") == [b"before"]
    assert [m.payload for m in sub.expect(1)] == [b"before"]
    n1.kill()
    with contextlib.suppress(queue.Empty):  # paho may be slow to notice: the node is gone
        sub.disconnects.get(timeout=10)
    sub.paho.loop_stop()
    cluster.wait_leaders([n2, n3])
    missed = [b"while-away-1", b"while-away-2"]
    assert _publish_all(n2, topic, missed, "orphan-pub2") == missed
    started = time.monotonic()
    back = Client(n3.port, "orphan", V5, clean=False, session_expiry=300)
    assert back.connect() == 0 and back.session_present
    assert time.monotonic() - started < 5.0  # a dead holder is not waited for long
    # The last state node 1 committed may predate the PUBACK of "before": QoS 1 may deliver
    # it again after a crash [MQTT-4.3.2-1]; nothing published meanwhile is missing.
    got = [m.payload for m in back.expect(2)]
    if got[0] == b"before":
        got = got[1:] + [m.payload for m in back.expect(1)]
    assert got == missed
    back.expect_none(0.3)
    back.disconnect()
    cluster.start([n1])
    cluster.wait_leaders(cluster.nodes)
    # The restarted node no longer holds the session: its client connects through it.
    last = Client(n1.port, "orphan", V5, clean=False, session_expiry=300)
    assert last.connect() == 0 and last.session_present
    assert last.subscribe(topic, qos=1) == [1]
    last.disconnect()


def _compacted_sessions(b: BrokerProcess, into: Path) -> list[Record]:
    """A copy of node ``b``'s ``$sessions``, compacted as its nodes compact it (every record
    in a closed segment, the active one rolled first), read whole."""
    shutil.copytree(b.data_dir / SESSIONS_STREAM / "0", into)
    log = SegmentedLog.open(into, replace(INTERNAL_LOG, keep_empty_batches=True))
    try:
        log.roll()
        log.compact()
        out: list[Record] = []
        offset = log.log_start_offset
        while batch := log.read(offset):
            out += batch
            offset = batch[-1].offset + 1
        return out
    finally:
        log.close()


def test_sessions_that_ended_leave_no_claim_once_compacted(
    cluster: Cluster, tmp_path: Path
) -> None:
    keeper = _durable(cluster.nodes[0].port, "keeper", V5)
    assert keeper.connect() == 0
    keeper.disconnect()  # a persistent session: its claim stays
    for i in range(60):
        b, cid = cluster.nodes[i % 3], f"brief-{i}"
        if i % 3 == 2:  # a persistent session ended by a clean start [MQTT-3.1.2-4]
            durable = _durable(b.port, cid, V5)
            assert durable.connect() == 0
            durable.disconnect()
        c = Client(b.port, cid, V311 if i % 3 == 0 else V5)  # clean: it ends as it goes
        assert c.connect() == 0
        c.disconnect()
    time.sleep(3.0)  # the ends committed everywhere
    keys = {r.topic for r in _compacted_sessions(cluster.nodes[1], tmp_path / "copy")}
    assert not sorted(k for k in keys if "brief-" in k)
    assert {"keeper", CLAIM_PREFIX + "keeper"} <= keys
