"""The network lab (tests/netlab.py) does what the cluster tests will rely on: namespaces that
reach each other over the bridge, partitions that really cut TCP and heal, one-way cuts that
are one-way, random drops that drop some packets but not all, kill -9 and SIGSTOP of a whole
process group, and nothing left behind. Then a short chaos run on one mqlog node: kill -9 and
restart under QoS 1 load with fsync = "always", and the queue checker finds nothing lost.

Needs root, ``ip`` and ``nft``; skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import netlab
from tests.netlab import Lab, Node, Proc

pytestmark = pytest.mark.skipif(
    netlab.unavailable_reason() is not None,
    reason=f"network lab unavailable: {netlab.unavailable_reason()}",
)

PY = sys.executable
TCP_SERVER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9000))
s.listen()
while True:
    c, _ = s.accept()
    c.sendall(b"hi")
    c.close()
"""
TCP_CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 9000), timeout=1.0) as s:
        print(s.recv(2).decode())
except OSError as e:
    print(type(e).__name__)
"""
UDP_RECEIVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 9001))
print("ready", flush=True)
s.settimeout(float(sys.argv[1]))
n = 0
try:
    while True:
        s.recv(64)
        n += 1
except OSError:
    pass
print("count", n, flush=True)
"""
UDP_SENDER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[2])):
    s.sendto(b"x", (sys.argv[1], 9001))
    time.sleep(0.001)
"""


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab(2) as lab:
        yield lab


def tcp(lab: Lab, src: Node, dst: Node) -> str:
    """'hi' if src opened a TCP connection to dst's server, else the error's name."""
    return lab.exec(src, PY, "-c", TCP_CLIENT, dst.addr).strip()


def wait_line(proc: Proc, prefix: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proc.log().splitlines():
            if line.startswith(prefix):
                return line
        if not proc.alive() and prefix not in proc.log():
            break
        time.sleep(0.02)
    raise AssertionError(f"no {prefix!r} from {proc.argv[:2]}: {proc.log()!r}")


def udp_delivered(lab: Lab, src: Node, dst: Node, n: int, tmp: Path) -> int:
    """Datagrams of ``n`` sent from src that dst received."""
    log = tmp / f"udp-{src.name}-{dst.name}-{time.monotonic_ns()}.log"
    rx = lab.spawn(dst, [PY, "-c", UDP_RECEIVER, "1.0"], log_path=log)
    wait_line(rx, "ready")
    lab.exec(src, PY, "-c", UDP_SENDER, dst.addr, str(n))
    rx.popen.wait(20)
    return int(wait_line(rx, "count").split()[1])


def test_namespaces_reach_each_other_over_the_bridge(lab: Lab, tmp_path: Path) -> None:
    a, b = lab.nodes
    assert a.addr != b.addr
    assert set(netlab.list_namespaces()) >= {a.ns, b.ns}
    assert "lo" in lab.exec(a, "ip", "-o", "link", "show", "up")
    lab.spawn(b, [PY, "-c", TCP_SERVER])
    netlab.wait_tcp(b.addr, 9000)  # from the host, over the bridge
    assert tcp(lab, a, b) == "hi"


def test_partition_blocks_tcp_and_heals(lab: Lab) -> None:
    a, b = lab.nodes
    lab.spawn(b, [PY, "-c", TCP_SERVER])
    netlab.wait_tcp(b.addr, 9000)
    lab.isolate(b)
    assert tcp(lab, a, b) in ("TimeoutError", "timeout")
    assert lab.faults == ["isolate n1"]
    lab.heal()
    assert lab.faults == []
    assert tcp(lab, a, b) == "hi"


def test_one_way_cut_is_one_way(lab: Lab, tmp_path: Path) -> None:
    a, b = lab.nodes
    lab.cut(a, b)
    assert udp_delivered(lab, a, b, 20, tmp_path) == 0
    assert udp_delivered(lab, b, a, 20, tmp_path) == 20
    lab.heal()
    assert udp_delivered(lab, a, b, 20, tmp_path) == 20


def test_random_drop_drops_some_but_not_all(lab: Lab, tmp_path: Path) -> None:
    a, b = lab.nodes
    lab.drop(a, 30)
    got = udp_delivered(lab, a, b, 300, tmp_path)
    # Binomial(300, 0.7): mean 210, sd 8; these bounds are 7 sd away
    assert 150 <= got <= 270, lab.rules(b)
    lab.heal()
    assert udp_delivered(lab, a, b, 50, tmp_path) == 50


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _children(proc: Proc) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-g", str(proc.pid)], capture_output=True, text=True, check=False
    ).stdout
    return [int(p) for p in out.split() if int(p) != proc.pid]


def test_pause_resume_and_kill_reach_the_whole_group(lab: Lab) -> None:
    a = lab.nodes[0]
    proc = lab.spawn(a, ["sh", "-c", "sleep 1000 & sleep 1000 & wait"])
    deadline = time.monotonic() + 10
    while len(_children(proc)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    kids = _children(proc)
    assert len(kids) == 2
    proc.pause()
    for pid in [proc.pid, *kids]:
        while _state(pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(pid) == "T"
    proc.resume()
    for pid in [proc.pid, *kids]:
        while _state(pid) == "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(pid) != "T"
    proc.kill()
    while proc.group_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not proc.group_alive()  # the children died with the leader


def _ours(prefix_pid: int) -> tuple[list[str], list[str]]:
    ns = [n for n in netlab.list_namespaces() if n.startswith(f"netlab-{prefix_pid}-")]
    links = [n for n in netlab.list_links() if n.startswith(f"nl{prefix_pid}-")]
    return ns, links


def _nft_tables() -> str:
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout


def test_cleanup_leaves_nothing_even_after_a_failure() -> None:
    tables_before = _nft_tables()
    procs: list[Proc] = []
    with pytest.raises(RuntimeError, match="boom"), Lab(3) as lab:
        procs.append(lab.spawn(lab.nodes[0], ["sleep", "1000"]))
        lab.isolate(lab.nodes[1])
        lab.drop(lab.nodes[2], 10)
        assert len(_ours(os.getpid())[0]) == 3
        raise RuntimeError("boom")
    assert _ours(os.getpid()) == ([], [])
    assert _nft_tables() == tables_before
    assert not procs[0].group_alive()


def test_sweep_removes_what_a_dead_lab_left() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    ns, link = f"netlab-{dead.pid}-0-n0", f"nl{dead.pid}-0b"
    netlab.run(["ip", "netns", "add", ns])
    netlab.run(["ip", "link", "add", link, "type", "bridge"])
    try:
        removed = netlab.sweep_leftovers()
        assert ns in removed and link in removed
        assert _ours(dead.pid) == ([], [])
    finally:
        netlab.run(["ip", "netns", "del", ns], check=False)
        netlab.run(["ip", "link", "del", link], check=False)


@pytest.mark.slow
def test_mqlog_single_node_kill9_under_qos1_load_loses_nothing(tmp_path: Path) -> None:
    """Two kill -9 + restarts and one pause of one mqlog node with two workers (the
    signals reach the supervisor and both workers: one process group), fsync = "always",
    under QoS 1 publishers: every acknowledged id comes back from $replay/earliest."""
    from bench.chaos import Step, run_chaos
    from bench.targets import MqlogTarget

    steps = [
        Step("kill", "leader", 0.0, 0.5, 0, 0),
        Step("pause", "leader", 1.0, 0.5, 0, 1),
        Step("kill", "leader", 0.0, 0.5, 0, 2),
    ]
    with Lab(1) as lab:
        target = MqlogTarget(lab, tmp_path, workers=2)
        res = asyncio.run(
            run_chaos(lab, target, steps, publishers=4, topics=2, rate=50, log=lambda s: None)
        )
    r = res.report
    assert r.faults == 3
    assert r.acked > 100
    assert r.lost == 0, r.table()
    assert r.unexpected == 0 and r.order_violations == 0, r.table()
    assert r.never_available == 0, r.table()
