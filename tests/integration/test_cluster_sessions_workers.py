"""A client id lives on one node at a time with several workers per node (issue 20 item 3):
two real nodes of two workers each, in network namespaces. The claim of a client id is made
by its home worker (``crc32 % workers``, broker.workers.sessions) through ``$sessions``
(broker.workers.replicated_sessions), so a connection on the other node takes the session
over: the old connection gets DISCONNECT 0x8E [MQTT-3.1.4-3], the new one session present
[MQTT-3.2.2-2] with its subscription, and each message reaches the client once.

Needs root, ``ip`` and ``nft``; skipped with the reason otherwise.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import netlab
from tests.cluster_lab import MQTT_PORT, Member, MqlogCluster
from tests.integration.clients import V5, Client
from tests.netlab import Lab

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)

WORKERS = 2
#: Client ids homed at each of the two workers (crc32 % 2: 1, 1, 1, 0).
CLIENT_IDS = ["roam-a", "roam-b", "roam-c", "roam-d"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[MqlogCluster]:
    with Lab(2) as lab:
        yield MqlogCluster.started(lab, tmp_path, workers=WORKERS)


def _durable(m: Member, client_id: str) -> Client:
    return Client(MQTT_PORT, client_id, V5, host=m.addr, clean=False, session_expiry=300)


def test_a_session_moves_between_nodes_of_two_workers(cluster: MqlogCluster) -> None:
    assert {zlib.crc32(c.encode()) % WORKERS for c in CLIENT_IDS} == {0, 1}
    n1, n2 = cluster.member("n1"), cluster.member("n2")
    pub1 = Client(MQTT_PORT, "pub-1", V5, host=n1.addr)
    pub2 = Client(MQTT_PORT, "pub-2", V5, host=n2.addr)
    assert pub1.connect() == 0 and pub2.connect() == 0
    for cid in CLIENT_IDS:
        topic = f"devices/{cid}/t"
        old = _durable(n1, cid)
        assert old.connect() == 0 and not old.session_present
        assert old.subscribe(topic, qos=1) == [1]
        pub2.publish(topic, b"before", qos=1)
        assert [m.payload for m in old.expect(1)] == [b"before"]

        new = _durable(n2, cid)
        assert new.connect() == 0
        assert new.session_present, cid  # its state came from n1 [MQTT-3.2.2-2]
        assert old.disconnects.get(timeout=10) == 0x8E, cid  # Session taken over
        pub1.publish(topic, b"after", qos=1)
        assert [m.payload for m in new.expect(1)] == [b"after"]  # the subscription moved
        new.expect_none(0.3)  # "before" was acknowledged on n1: not again
        old.expect_none(0.1)

        back = _durable(n1, cid)  # and back to n1
        assert back.connect() == 0 and back.session_present, cid
        assert new.disconnects.get(timeout=10) == 0x8E, cid
        pub2.publish(topic, b"again", qos=1)
        assert [m.payload for m in back.expect(1)] == [b"again"]
        back.disconnect()
    pub1.disconnect()
    pub2.disconnect()
