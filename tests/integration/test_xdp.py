"""The XDP filter attached for real (generic mode) to a lab namespace's eth0, and its
user-space twin, with the same assertions (issue 22).

Layout: the lab's namespace n0 runs ``tests/xdp_agent.py`` (the filter, a real gossip
endpoint with the filter's ``accept``, TCP listeners on the Raft and MQTT ports); the host
(the test process) is a member; namespace n1 is a stranger. Each test reads the filter's
counters and the endpoint's (``received``: datagrams that reached the gossip code) before and
after. In kernel mode the endpoint's ``filtered`` stays 0: the socket never saw the dropped
datagrams. In user mode the endpoint refuses them itself (``filtered``), and the stranger's
Raft connection passes (Raft authenticates its links; the user-space twin guards gossip).

The broker tests run ``mqlog serve`` with ``[xdp]`` in a one-node cluster: attached, counted
in /metrics and ``GET /api/v1/cluster``, detached by kill -9, attached again on restart,
detached by SIGTERM; and with BPF off, ``mqlog_xdp_enabled 0`` and the reason.

Needs root, ip and nft (the lab), and for the kernel mode bcc and kernel headers
(scripts/install-system-deps.sh installs and links them); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.cluster.gossip.codec import MAGIC
from tests import netlab
from tests.cluster_lab import HTTP_PORT, MqlogCluster
from tests.netlab import Lab, Node

GOSSIP, RAFT, MQTT = 7946, 7950, 1883
ROOT = Path(__file__).resolve().parents[2]


def _bpf_unavailable() -> str | None:
    from broker.xdp.system_bcc import BccMissing, import_bcc

    try:
        import_bcc()
    except BccMissing as e:
        return f"{e} (scripts/install-system-deps.sh installs it)"
    headers = Path("/lib/modules") / os.uname().release / "build"
    if not headers.exists():
        return f"no kernel headers at {headers} (scripts/install-system-deps.sh links them)"
    return None


LAB_REASON = netlab.unavailable_reason()
BPF_REASON = LAB_REASON or _bpf_unavailable()
pytestmark = pytest.mark.skipif(LAB_REASON is not None, reason=f"network lab: {LAB_REASON}")
needs_bpf = pytest.mark.skipif(BPF_REASON is not None, reason=f"XDP unavailable: {BPF_REASON}")

SENDER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(int(sys.argv[3])):
    s.sendto(bytes.fromhex(sys.argv[4]), (sys.argv[1], int(sys.argv[2])))
"""
CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0) as s:
        print(s.recv(2).decode())
except OSError as e:
    print(type(e).__name__)
"""


def env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT}:{path}" if path else str(ROOT)}


class Agent:
    """tests/xdp_agent.py in a namespace, driven over its stdin and stdout."""

    def __init__(self, node: Node, mode: str, log: Path) -> None:
        self.node, self.mode = node, mode
        argv = [sys.executable, "-m", "tests.xdp_agent", mode, "eth0", str(GOSSIP), str(RAFT)]
        self.popen = subprocess.Popen(
            ["ip", "netns", "exec", node.ns, *argv, str(MQTT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("ab"),
            env=env(),
            cwd=ROOT,
            start_new_session=True,
        )
        self.log = log
        first = self._read()
        assert first.get("ready"), first

    def _read(self) -> dict[str, Any]:
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        assert line, f"the agent exited: {self.log.read_text(errors='replace')[-3000:]}"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
        self.popen.stdin.flush()
        return self._read()

    def kill(self) -> None:
        os.killpg(self.popen.pid, 9)
        self.popen.wait(10)


def gossip(status: dict[str, Any], verdict: str) -> int:
    return int(status["packets"].get("gossip", {}).get(verdict, 0))


def received(status: dict[str, Any]) -> int:
    return int(status["endpoint"].get("received", 0))


def filtered(status: dict[str, Any]) -> int:
    return int(status["endpoint"].get("filtered", 0))


def wait_status(agent: Agent, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The agent's status once ``done`` holds (the counters move as packets arrive)."""
    deadline = time.monotonic() + 10
    while True:
        status = agent.call("status")
        if done(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.02)


def send_from_host(addr: str, payload: bytes, count: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(count):
            s.sendto(payload, (addr, GOSSIP))


def connect(lab: Lab, src: Node | None, addr: str, port: int) -> str:
    argv = [sys.executable, "-c", CONNECT, addr, str(port)]
    out = subprocess.run(argv, capture_output=True, text=True) if src is None else None
    return (out.stdout if out is not None else lab.exec(src, *argv)).strip()


def xdp_attached(lab: Lab, node: Node) -> bool:
    return "prog/xdp" in lab.exec(node, "ip", "link", "show", "eth0")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(2) as lab:
        yield lab


@pytest.fixture(
    scope="module", params=[pytest.param("kernel", marks=needs_bpf), pytest.param("user")]
)
def agent(request: pytest.FixtureRequest, lab: Lab, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    log = tmp_path_factory.mktemp("xdp") / f"agent-{request.param}.log"
    agent = Agent(lab.nodes[0], request.param, log)
    agent.call("allow", addr=lab.host_addr)
    yield agent
    agent.kill()  # kill -9 of the process that attached: nothing stays attached
    assert not xdp_attached(lab, lab.nodes[0])


def test_member_gossip_passes_stranger_and_bad_magic_are_dropped(agent: Agent, lab: Lab) -> None:
    n0, stranger = lab.nodes
    before = agent.call("status")
    lab.exec(stranger, sys.executable, "-c", SENDER, n0.addr, str(GOSSIP), "20", MAGIC.hex())
    send_from_host(n0.addr, b"XXXX" + bytes(40), 5)  # a member's, without the magic
    send_from_host(n0.addr, MAGIC + bytes(40), 10)

    def done(s: dict[str, Any]) -> bool:
        return (
            received(s) - received(before) >= 10
            and gossip(s, "drop_stranger") - gossip(before, "drop_stranger") >= 20
        )

    after = wait_status(agent, done)
    assert received(after) - received(before) == 10
    assert gossip(after, "pass") - gossip(before, "pass") == 10
    assert gossip(after, "drop_stranger") - gossip(before, "drop_stranger") == 20
    assert gossip(after, "drop_bad_magic") - gossip(before, "drop_bad_magic") == 5
    # Kernel: the socket never saw the 25; user space: the endpoint refused them itself.
    assert filtered(after) - filtered(before) == (0 if agent.mode == "kernel" else 25)
    assert after["enabled"] is (agent.mode == "kernel")
    assert lab.host_addr in after["members"] and stranger.addr not in after["members"]


def test_mqtt_and_raft_pass(agent: Agent, lab: Lab) -> None:
    n0, stranger = lab.nodes
    before = agent.call("status")
    for port in (RAFT - 1, RAFT, MQTT):  # the member reaches the metadata, Raft, MQTT ports
        assert connect(lab, None, n0.addr, port) == "ok", port
    assert connect(lab, stranger, n0.addr, MQTT) == "ok"  # clients are anyone
    # A stranger's Raft SYN dies in the kernel; the user-space twin leaves Raft to its
    # authenticated handshake (broker.cluster.peerlink).
    expected = "TimeoutError" if agent.mode == "kernel" else "ok"
    assert connect(lab, stranger, n0.addr, RAFT) == expected
    after = agent.call("status")
    if agent.mode == "kernel":
        raft, mqtt = after["packets"]["raft"], after["packets"]["mqtt"]
        assert raft["pass"] > before["packets"].get("raft", {}).get("pass", 0)
        assert raft["drop_stranger"] > before["packets"].get("raft", {}).get("drop_stranger", 0)
        assert mqtt["pass"] > before["packets"].get("mqtt", {}).get("pass", 0)
        assert after["bytes"]["mqtt"]["pass"] > 0


def test_removed_member_is_dropped_from_then_on(agent: Agent, lab: Lab) -> None:
    n0 = lab.nodes[0]
    before = agent.call("status")
    send_from_host(n0.addr, MAGIC + bytes(8), 3)
    allowed = wait_status(agent, lambda s: received(s) - received(before) >= 3)
    assert received(allowed) - received(before) == 3
    denied = agent.call("deny", addr=lab.host_addr)
    assert lab.host_addr not in denied["members"]
    try:
        send_from_host(n0.addr, MAGIC + bytes(8), 4)
        after = wait_status(
            agent, lambda s: gossip(s, "drop_stranger") - gossip(denied, "drop_stranger") >= 4
        )
        assert gossip(after, "drop_stranger") - gossip(denied, "drop_stranger") == 4
        assert received(after) == received(allowed)
    finally:
        agent.call("allow", addr=lab.host_addr)


def test_a_join_from_network_passes_its_gossip_not_its_raft(agent: Agent, lab: Lab) -> None:
    """``[cluster] join_from``: a stranger of that network may send gossip (a node joining
    later; the codec authenticates it), nothing else changes for it."""
    n0, stranger = lab.nodes
    agent.call("join_from", nets=[f"{stranger.addr}/24"])
    try:
        before = agent.call("status")
        lab.exec(stranger, sys.executable, "-c", SENDER, n0.addr, str(GOSSIP), "6", MAGIC.hex())
        after = wait_status(agent, lambda s: received(s) - received(before) >= 6)
        assert received(after) - received(before) == 6
        assert gossip(after, "pass") - gossip(before, "pass") == 6
        assert gossip(after, "drop_stranger") == gossip(before, "drop_stranger")
        if agent.mode == "kernel":
            assert connect(lab, stranger, n0.addr, RAFT) == "TimeoutError"
    finally:
        agent.call("join_from", nets=[])
    before = agent.call("status")
    lab.exec(stranger, sys.executable, "-c", SENDER, n0.addr, str(GOSSIP), "3", MAGIC.hex())
    after = wait_status(
        agent, lambda s: gossip(s, "drop_stranger") - gossip(before, "drop_stranger") >= 3
    )
    assert gossip(after, "drop_stranger") - gossip(before, "drop_stranger") == 3


NO_PRIVILEGE = """
import json, sys
from pathlib import Path
from broker.config import load_config
from broker.xdp import open_filter
f = open_filter(load_config(Path(sys.argv[1])))
print(json.dumps(f.status()))
"""


def test_without_privilege_the_broker_filters_in_user_space(tmp_path: Path) -> None:
    """root without its capabilities (setpriv drops them all): the filter is not even
    compiled (bcc would only say "failed to compile"), and the reason names what lacks."""
    key = tmp_path / "cluster.key"
    key.write_text("k" * 32)
    key.chmod(0o600)
    config = tmp_path / "broker.toml"
    config.write_text(
        f'[cluster]\nnode_id = "n1"\nbind = "127.0.0.1"\nsecret_file = "{key}"\n'
        '[xdp]\nenabled = true\ninterface = "lo"\n'
    )
    drop = ["setpriv", "--bounding-set", "-all", "--inh-caps", "-all", "--ambient-caps", "-all"]
    argv = [*drop, sys.executable, "-c", NO_PRIVILEGE, str(config)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env(), cwd=ROOT, check=True)
    status = json.loads(out.stdout)
    assert status["enabled"] is False and status["filter"] == "user space"
    assert "not permitted" in status["reason"], status["reason"]


# ------------------------------------------------------------------ the broker


def scrape(addr: str) -> str:
    with urllib.request.urlopen(f"http://{addr}:{HTTP_PORT}/metrics", timeout=5) as response:
        text: str = response.read().decode()
    return text


XDP_ON = '[xdp]\nenabled = true\ninterface = "eth0"\nmode = "generic"\n'


@needs_bpf
def test_broker_attaches_counts_and_detaches(tmp_path: Path) -> None:
    with Lab(1) as lab:
        cluster = MqlogCluster(lab, tmp_path, extra=XDP_ON)
        m = cluster.members[0]
        cluster.start()
        assert xdp_attached(lab, m.node)
        send_from_host(m.addr, MAGIC + bytes(8), 7)  # the host is no member
        status = cluster.status(m)["xdp"]
        assert status["enabled"] and status["interface"] == "eth0"
        assert status["members"] == [m.addr]
        metrics = scrape(m.addr)
        assert "mqlog_xdp_enabled 1.0" in metrics
        assert 'mqlog_xdp_packets_total{class="gossip",verdict="drop_stranger"} 7.0' in metrics
        assert 'mqlog_xdp_packets_total{class="mqtt",verdict="pass"}' in metrics
        cluster.kill(m)
        assert not xdp_attached(lab, m.node)
        cluster.start(m)
        assert xdp_attached(lab, m.node)
        assert cluster.stop(m) == {m.node_id: 0}
        assert not xdp_attached(lab, m.node)
        assert "xdp: filter attached to eth0 (generic mode)" in m.log()


def test_broker_without_bpf_filters_in_user_space_and_says_why(tmp_path: Path) -> None:
    with Lab(1) as lab:
        off = XDP_ON.replace("enabled = true", "enabled = false")
        cluster = MqlogCluster(lab, tmp_path, extra=off)
        m = cluster.members[0]
        cluster.start()  # waits for the MQTT port; the HTTP API may open a moment later
        assert not xdp_attached(lab, m.node)
        deadline = time.monotonic() + 10
        while True:
            try:
                status = cluster.status(m)["xdp"]
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, "the HTTP API never answered"
                time.sleep(0.1)
        assert status["enabled"] is False and status["filter"] == "user space"
        assert status["reason"] == "[xdp] enabled = false"
        assert "mqlog_xdp_enabled 0.0" in scrape(m.addr)
        cluster.stop(m)
        assert m.log().count("gossip is filtered in user space: [xdp] enabled = false") == 1
