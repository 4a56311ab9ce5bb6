"""Corrupt batches repaired from a healthy replica, on three real ``mqlog serve`` nodes on
127.0.0.1 (issue 25 item 4): damage a follower's and then the leader's segment; nothing is lost,
everything is repaired.

One stream ``tele`` (``devices/#``), one partition replicated on the three nodes, 16 KiB
segments, ``on_corruption = "stop"`` (a reader is held at a damaged range until it is
repaired, instead of skipping it), messages published with ``mosquitto_pub``:

* a follower stopped cleanly has one byte of a payload changed in a sealed segment, and is
  started again; a ``mosquitto_sub`` on ``$replay/earliest/...`` through it meets the damage,
  is held, and receives every message with its ORIGINAL bytes, in order, once the node
  rewrote the batch with the leader's copy;
* the leader's copy is damaged while it runs (the file written in place, as a disk would) and
  a follower that was away comes back: the leader's reads to catch it up meet the damage; it
  sends nothing of it, repairs its copy from the other follower, and the follower catches up;

each time ``mqlog_repaired_batches_total{stream="tele",partition="0"}`` counts 1 on the node
repaired, its log has the ERROR line of the damage and the repair's line naming partition,
segment, byte range and offsets, no bug is logged, and the segment file is byte for byte the
same on the three nodes.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.ports import cluster_port, gossip_port
from tests.integration.clients import SubProcess
from tests.integration.conftest import READY, BrokerProcess

SECRET = b"0123456789abcdef-test-cluster-secret"
TOPIC = "devices/a/t"
STREAM = (
    '[[streams]]\nname = "tele"\ntopic_filter = ["devices/#"]\npartitions = 1\n'
    'segment_bytes = "16KiB"\nindex_interval_bytes = 256\non_corruption = "stop"\n'
)


def payload(tag: str, i: int) -> str:
    return f"{tag}{i:04d}-" + "x" * 40


class Cluster:
    def __init__(self, tmp: Path) -> None:
        secret = tmp / "cluster.key"
        secret.write_bytes(SECRET)
        secret.chmod(0o600)
        ports = [cluster_port() for _ in range(3)]
        gossip = [gossip_port() for _ in range(3)]
        self.nodes: list[BrokerProcess] = []
        for i in range(3):
            seeds = ", ".join(f'"127.0.0.1:{p}"' for j, p in enumerate(gossip) if j != i)
            extra = STREAM + (
                f'[cluster]\nnode_id = "n{i + 1}"\nbind = "127.0.0.1"\nraft_port = {ports[i]}\n'
                f"gossip_port = {gossip[i]}\n"
                f'seeds = [{seeds}]\nsecret_file = "{secret}"\nelection_timeout = "500ms"\n'
                'heartbeat_interval = "50ms"\n'
            )
            self.nodes.append(BrokerProcess(tmp / f"n{i + 1}", extra, fsync="always"))

    def start(self, nodes: list[BrokerProcess] | None = None) -> None:
        errors: list[BaseException] = []

        def run(b: BrokerProcess) -> None:
            try:
                b.start(timeout=30)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(b,)) for b in nodes or self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def name(self, b: BrokerProcess) -> str:
        return f"n{self.nodes.index(b) + 1}"

    def partition(self, b: BrokerProcess) -> dict:
        with urllib.request.urlopen(f"{b.http_url}/api/v1/cluster", timeout=5) as r:
            view = json.loads(r.read())
        return next(p for p in view["partitions"] if p["stream"] == "tele")

    def settled_leader(self, among: list[BrokerProcess], timeout: float = 20.0) -> BrokerProcess:
        """The leader of tele/0 once every node of ``among`` names it, it is the preferred
        replica (the balancer moves it no more) when that one is among them, and every node
        has committed as far as it."""
        deadline = time.monotonic() + timeout
        names = {self.name(b) for b in among}
        while True:
            views = [self.partition(b) for b in among]
            leader = views[0]["leader"]
            settled = all(v["leader"] == leader for v in views) and leader in names
            if views[0]["preferred_leader"] in names:
                settled = settled and leader == views[0]["preferred_leader"]
            commits = {v["commit_index"] for v in views}
            if settled and len(commits) == 1:
                return self.nodes[int(leader[1:]) - 1]
            if time.monotonic() > deadline:
                raise AssertionError(f"tele/0 not settled after {timeout}s: {views}")
            time.sleep(0.05)

    def stop(self) -> None:
        for b in self.nodes:
            try:
                b.stop()
            except RuntimeError:
                b.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("repair"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def publish(b: BrokerProcess, lines: list[str]) -> None:
    subprocess.run(
        ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(b.port), "-t", TOPIC, "-q", "1", "-l"],
        input="".join(line + "\n" for line in lines),
        text=True,
        check=True,
        timeout=60,
        capture_output=True,
    )


def replay(b: BrokerProcess, last: str, qos: int = 1, timeout: float = 30.0) -> list[str]:
    """What ``$replay/earliest/<TOPIC>`` delivers through ``b`` until ``last`` (or
    ``timeout``), and then nothing more for 0.3 s."""
    sub = SubProcess(b.port, f"$replay/earliest/{TOPIC}", "-q", str(qos))
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = sub.wait_for(0)
            if lines and lines[-1].endswith(" " + last):
                break
            time.sleep(0.05)
        time.sleep(0.3)
        return [line.split(" ", 1)[1] for line in sub.wait_for(0)]
    finally:
        sub.stop()


def segments(b: BrokerProcess) -> list[Path]:
    return sorted((b.data_dir / "tele" / "0").glob("*.log"))


def damage(b: BrokerProcess, texts: list[str]) -> tuple[Path, str]:
    """Change the first byte of the first of ``texts`` (payloads) that lies in a sealed segment
    of ``b``, before that segment's last two batches, in place (the same inode, as a disk
    would); returns the segment and the payload. Not in the last two: a clean start checks the
    batches from the last index entry on (one at least every 256 bytes, so every other batch
    here), which would find it before any read."""
    for path in segments(b)[:-1]:
        data = bytearray(path.read_bytes())
        starts = [0]
        while starts[-1] < len(data):
            starts.append(starts[-1] + struct.unpack_from("<I", data, starts[-1] + 8)[0])
        for text in texts:
            at = data.find(text.encode())
            if 0 <= at < starts[-3]:
                data[at] ^= 0x20
                with open(path, "r+b") as f:
                    f.write(data)
                return path, text
    raise AssertionError(f"none of {texts[:3]}... is in a sealed segment of {b.data_dir}")


def repaired_metric(b: BrokerProcess) -> float:
    with urllib.request.urlopen(b.http_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(
        r'^mqlog_repaired_batches_total\{partition="0",stream="tele"\} (\S+)$', text, re.M
    )
    return float(found[0]) if found else -1.0


def wait_for_repair(b: BrokerProcess, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while repaired_metric(b) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)


def check_logs(b: BrokerProcess, target: Path, peers: set[str]) -> None:
    """The ERROR line of the damage and the repair's line, each naming partition, segment,
    byte range and offsets (the same ones); no bug."""
    log = b.log()
    error = re.search(
        r"ERROR .*corrupt record batch: stream tele partition 0, segment (\S+), "
        r"bytes (\d+\.\.\d+), offsets (\d+\.\.\d*)",
        log,
    )
    assert error is not None, log[-3000:]
    assert error.group(1).rstrip(",") == str(target)
    fixed = re.search(
        r"repaired corrupt record batches from node (n\d): stream tele partition 0, segment "
        r"(\S+), bytes (\d+\.\.\d+), offsets (\d+)\.\.(\d+)",
        log,
    )
    assert fixed is not None, log[-3000:]
    assert fixed.group(1) in peers
    assert fixed.group(2).rstrip(",") == str(target) and fixed.group(3) == error.group(2)
    assert error.group(3).split("..")[0] == fixed.group(4)
    assert "bug while serving" not in log and "Traceback" not in log


def same_bytes_everywhere(cluster: Cluster, target: Path) -> None:
    copies = {(b.data_dir / "tele" / "0" / target.name).read_bytes() for b in cluster.nodes}
    assert len(copies) == 1


def test_a_damaged_follower_is_repaired_and_its_held_reader_gets_the_original_bytes(
    cluster: Cluster,
) -> None:
    leader = cluster.settled_leader(cluster.nodes)
    sent = [payload("f", i) for i in range(1000)]
    publish(leader, sent)
    cluster.settled_leader(cluster.nodes)
    victim = next(b for b in cluster.nodes if b is not leader)
    victim.stop()
    target, _ = damage(victim, sent[300:])
    cluster.start([victim])
    assert repaired_metric(victim) == 0
    assert replay(victim, sent[-1], qos=0) == sent  # held at the damage, then the repaired batch
    wait_for_repair(victim)
    assert repaired_metric(victim) == 1
    check_logs(victim, target, {cluster.name(b) for b in cluster.nodes if b is not victim})
    # Found by the replay's read (after the restart was ready), which a QoS 0 subscription
    # (no PUBACK to pump it again) only resumed because the repair woke it.
    log = victim.log()
    assert log.rindex(READY) < log.rindex("corrupt record batch: stream tele")
    same_bytes_everywhere(cluster, target)


def test_a_damaged_leader_sends_no_bad_byte_and_is_repaired_from_a_follower(
    cluster: Cluster,
) -> None:
    leader = cluster.settled_leader(cluster.nodes)
    before = repaired_metric(leader)
    away = next(b for b in cluster.nodes if b is not leader and repaired_metric(b) < 1)
    away.stop()
    live = [b for b in cluster.nodes if b is not away]
    sent = [payload("g", i) for i in range(1000)]
    publish(leader, sent)
    assert cluster.settled_leader(live) is leader
    target, _ = damage(leader, sent[200:])
    # The follower comes back: the leader's reads to catch it up meet the damage.
    cluster.start([away])
    cluster.settled_leader(cluster.nodes)
    wait_for_repair(leader)
    assert before == 0 and repaired_metric(leader) == 1
    got = replay(away, sent[-1])
    assert got[-len(sent) :] == sent
    assert got == replay(leader, sent[-1])  # the same history, every byte as published
    check_logs(leader, target, {cluster.name(b) for b in live if b is not leader})
    same_bytes_everywhere(cluster, target)
