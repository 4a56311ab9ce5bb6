"""The sessions of a node killed -9 behave as if each client's connection had dropped
(broker.workers.orphans), on three real nodes in network namespaces: once gossip declares the
node dead, the leader of ``$sessions`` holds its sessions offline, publishes each will once
after its delay (MQTT 5 s3.1.3.2.2; 3.1.1: at once [MQTT-3.1.2-8]) unless the client came
back first [MQTT-3.1.3-9], ends a session whose expiry ran (s3.1.2.11.2: session present 0
after it [MQTT-3.2.2-3]) and keeps one within its expiry with what was published meanwhile;
the killed node, restarted, publishes none of those wills again.

Needs root, ``ip`` and ``nft``; skipped with the reason otherwise.
"""

from __future__ import annotations

import queue
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import netlab
from tests.cluster_lab import MQTT_PORT, Member, MqlogCluster
from tests.integration.clients import V5, Client
from tests.integration.rawclient import RawClient
from tests.netlab import Lab

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)

#: The will delay of the client whose will must wait (seconds).
DELAY = 3
#: The session expiry of the session that must be gone after the death (seconds).
SHORT = 4


@pytest.fixture(params=[1, 2], ids=["1-worker", "2-workers"])
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MqlogCluster]:
    """Three nodes of one worker, or of two (the client ids below are homed at both)."""
    with Lab(3) as lab:
        yield MqlogCluster.started(lab, tmp_path, workers=request.param)


def _raw(m: Member, client_id: str, version: int, **kw: object) -> RawClient:
    c = RawClient(MQTT_PORT, version, host=m.addr)
    assert c.connect(client_id, **kw) == (False, 0)
    return c


def _wills(
    sub: Client, until: float, first: dict[str, float] | None = None
) -> Counter[tuple[str, bytes]]:
    """Every message ``sub`` gets until ``until`` (monotonic), counted; ``first`` gets the
    time each topic first arrived."""
    got: Counter[tuple[str, bytes]] = Counter()
    while (left := until - time.monotonic()) > 0:
        try:
            m = sub.messages.get(timeout=left)
        except queue.Empty:
            break
        got[(m.topic, m.payload)] += 1
        if first is not None:
            first.setdefault(m.topic, time.monotonic())
    return got


def test_a_dead_nodes_wills_and_expiry_run_on_a_survivor(cluster: MqlogCluster) -> None:
    n1, n2, n3 = (cluster.member(n) for n in ("n1", "n2", "n3"))
    watcher = Client(MQTT_PORT, "watcher", V5, host=n2.addr)
    assert watcher.connect() == 0
    assert watcher.subscribe("wills/#", qos=1) == [1]
    # On n1: a 5.0 will with a delay, a 3.1.1 clean session's will (no delay), a 5.0 will
    # whose client comes back (on n2) before its delay, a session that expires and one that
    # outlives the death with messages queued for it (with two workers: "clean-311" and
    # "short" are homed at worker 0, the others at worker 1). Each connection stays open until n1
    # dies (a client closing its socket would have n1 itself publish its will).
    delayed = _raw(
        n1,
        "delayed",
        5,
        clean=False,
        session_expiry=300,
        will=("wills/delayed", b"d", 1, False),
        will_delay=DELAY,
    )
    clean311 = _raw(n1, "clean-311", 4, will=("wills/clean311", b"c", 1, False))
    returns = _raw(
        n1,
        "returns",
        5,
        clean=False,
        session_expiry=300,
        will=("wills/returns", b"r", 1, False),
        will_delay=60,
    )
    short = _raw(n1, "short", 5, clean=False, session_expiry=SHORT)
    assert short.subscribe("queued/short", 1) == [1]
    durable = _raw(n1, "durable", 5, clean=False, session_expiry=300)
    assert durable.subscribe("queued/durable", 1) == [1]
    time.sleep(2.0)  # each session's state committed (the timer persists it within 1 s)

    killed = time.monotonic()
    declared = cluster.kill_and_time_death(n1)  # seconds until each survivor saw it dead
    dead_at = killed + max(declared.values())
    # The client of "returns" is back, on n2, well within its will delay: no will for it.
    back = RawClient(MQTT_PORT, 5, host=n2.addr)
    assert back.connect("returns", clean=False, session_expiry=300) == (True, 0)
    publisher = Client(MQTT_PORT, "publisher", V5, host=n3.addr)
    assert publisher.connect() == 0
    for topic in ("queued/short", "queued/durable"):
        publisher.publish(topic, b"meanwhile", qos=1)

    arrived: dict[str, float] = {}
    got = _wills(watcher, dead_at + DELAY + 6, arrived)
    assert got == {("wills/clean311", b"c"): 1, ("wills/delayed", b"d"): 1}, got
    # The delayed one waited its delay from the death (the poll above saw it late by < 1 s).
    assert arrived["wills/delayed"] >= dead_at - 1.0 + DELAY
    print(
        f"declared dead after {max(declared.values()):.2f} s; wills after "
        + ", ".join(f"{t}: {at - killed:.2f} s" for t, at in sorted(arrived.items()))
    )

    time.sleep(max(0.0, dead_at + SHORT + 2 - time.monotonic()))
    gone = RawClient(MQTT_PORT, 5, host=n3.addr)  # past its expiry: no session
    assert gone.connect("short", clean=False, session_expiry=SHORT) == (False, 0)
    kept = RawClient(MQTT_PORT, 5, host=n3.addr)  # within its expiry: its session, its queue
    assert kept.connect("durable", clean=False, session_expiry=300) == (True, 0)
    (msg,) = kept.deliveries(1)
    assert (msg.topic, msg.payload) == ("queued/durable", b"meanwhile")

    # n1 comes back: its claims were superseded, it publishes none of those wills again.
    cluster.restart(n1)
    cluster.wait_all_alive()
    again = _wills(watcher, time.monotonic() + DELAY + 3)
    assert not again, again
    for c in (back, gone, kept):
        c.disconnect()
    for c in (delayed, clean311, returns, short, durable):
        c.sock.close()  # their node died under them
    publisher.disconnect()
    watcher.disconnect()
