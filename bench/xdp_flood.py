"""What the XDP filter saves a node under a flood of strangers' gossip (issue 22).

One run, both filters, in the network lab (tests/netlab.py): namespace n0 runs a one-node
mqlog cluster with a gossip endpoint on the same event loop, guarded by the node's filter
(``--node`` below: the broker as ``mqlog serve`` runs it, plus the gossip socket with the
filter's ``accept``, which is what the membership wiring will do); namespace n1 is a
stranger that sends ``--datagrams`` gossip datagrams (with the magic: only the allowlist
stops them) at ``--rate`` per second; the host is an MQTT client publishing QoS 1 one at a
time (PUBACK after the commit) before and during the flood.

Measured for each filter (``xdp``: ``[xdp] enabled = true``, generic mode on n0's eth0;
``fallback``: ``enabled = false``, the user-space twin on the gossip socket):
- the node process's CPU seconds (utime + stime, /proc/PID/stat) over the flood;
- the machine's CPU seconds over the flood (all processes, softirq included: in generic
  mode the program runs in the receiving softirq, charged to no process of the node);
- the publish latency (PUBACK - PUBLISH) p50 / p99 during the flood, and before it;
- what the filter counted (drop_stranger), and the datagrams the node's socket dropped
  itself for a full receive buffer (UDP RcvbufErrors in n0).

    python -m bench.xdp_flood [--datagrams 100000] [--rate 50000]

Needs root, the lab's tools and bcc (scripts/install-system-deps.sh). Prints a table and a
JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.mqttclient import MqttClient
from broker.cluster.gossip.codec import MAGIC
from tests.netlab import Lab, Node, wait_tcp

ROOT = Path(__file__).resolve().parents[1]
MQTT, HTTP, GOSSIP, RAFT = 1883, 8080, 7946, 7950
SENDER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
dst, n, rate = (sys.argv[1], 7946), int(sys.argv[2]), int(sys.argv[3])
payload = bytes.fromhex(sys.argv[4])
start = time.monotonic()
for i in range(n):
    s.sendto(payload, dst)
    if i % 500 == 499:
        ahead = start + (i + 1) / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
"""


# ------------------------------------------------------------------ the node (in n0)


async def _node(config_path: str) -> None:
    """The broker of ``config_path`` plus its gossip socket, guarded by the broker's filter."""
    import signal

    from broker.cluster.gossip.endpoint import open_endpoint
    from broker.config import load_config
    from broker.server import Server

    cfg = load_config(Path(config_path))
    assert cfg.cluster is not None
    server = Server(cfg)
    await server.start()
    assert server.xdp is not None
    endpoint = await open_endpoint(
        cfg.cluster.node_id,
        (cfg.cluster.bind, cfg.cluster.gossip_port),
        cfg.cluster.secret,
        accept=server.xdp.accept,
    )
    endpoint.join([])
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    endpoint.close()
    await server.stop()


# ------------------------------------------------------------------ the driver (host)


def _config(node: Node, work: Path, xdp: bool) -> Path:
    key = work / "cluster.key"
    if not key.exists():
        fd = os.open(key, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, os.urandom(16).hex().encode())
        os.close(fd)
    data = work / f"data-{'xdp' if xdp else 'fallback'}"
    path = work / f"n0-{'xdp' if xdp else 'fallback'}.toml"
    path.write_text(
        f'[server]\nhost = "{node.addr}"\nport = {MQTT}\nsys_interval = 0\n'
        f'[commitlog]\ndata_dir = "{data}"\nfsync = "always"\n'
        f'[http]\nhost = "{node.addr}"\nport = {HTTP}\n'
        f'[cluster]\nnode_id = "n1"\nbind = "{node.addr}"\ngossip_port = {GOSSIP}\n'
        f'raft_port = {RAFT}\nsecret_file = "{key}"\n'
        f'[xdp]\nenabled = {"true" if xdp else "false"}\ninterface = "eth0"\n'
    )
    return path


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_cpu() -> float:
    """Busy CPU seconds of the whole machine (user, nice, system, irq, softirq, steal)."""
    cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in cpu[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _rcvbuf_errors(lab: Lab, node: Node) -> int:
    lines = [ln.split() for ln in lab.exec(node, "cat", "/proc/net/snmp").splitlines()]
    udp = [ln for ln in lines if ln and ln[0] == "Udp:"]
    return int(udp[1][udp[0].index("RcvbufErrors")])


async def _publish_until(client: MqttClient, until: asyncio.Future[None]) -> list[float]:
    """QoS 1 publishes, one at a time, until ``until`` is done; their latencies in ms."""
    latencies = []
    while not until.done():
        sent = time.monotonic()
        acked = await client.publish("bench/xdp", b"x" * 64)
        latencies.append((acked - sent) * 1000)
    return latencies


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else float("nan")


async def _measure(lab: Lab, node: Node, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    stranger = lab.nodes[1]
    client = await MqttClient.connect(node.addr, MQTT, "bench-xdp")
    loop = asyncio.get_running_loop()
    quiet = loop.create_future()
    loop.call_later(3.0, quiet.set_result, None)  # after a warm-up
    before = await _publish_until(client, quiet)
    rcvbuf0, cpu0, machine0 = _rcvbuf_errors(lab, node), _proc_cpu(pid), _machine_cpu()
    argv = ["ip", "netns", "exec", stranger.ns, sys.executable, "-c", SENDER, node.addr]
    argv += [str(args.datagrams), str(args.rate), (MAGIC + bytes(60)).hex()]
    started = time.monotonic()
    sender = await asyncio.create_subprocess_exec(*argv)
    flood = loop.create_task(sender.wait())
    during = await _publish_until(client, flood)  # type: ignore[arg-type]
    seconds = time.monotonic() - started
    await asyncio.sleep(0.5)  # what the socket still held
    cpu, machine = _proc_cpu(pid) - cpu0, _machine_cpu() - machine0
    client.close()
    url = f"http://{node.addr}:{HTTP}/api/v1/cluster"
    with urllib.request.urlopen(url, timeout=5) as response:
        xdp = json.load(response)["xdp"]
    return {
        "filter": xdp["filter"],
        "flood_s": round(seconds, 2),
        "node_cpu_s": round(cpu, 2),
        "machine_cpu_s": round(machine, 2),
        "dropped_by_filter": xdp["packets"].get("gossip", {}).get("drop_stranger", 0),
        "socket_rcvbuf_drops": _rcvbuf_errors(lab, node) - rcvbuf0,
        "p50_ms_before": round(_pct(before, 50), 2),
        "p99_ms_before": round(_pct(before, 99), 2),
        "publishes_during": len(during),
        "p50_ms_during": round(_pct(during, 50), 2),
        "p99_ms_during": round(_pct(during, 99), 2),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Lab(2) as lab:
        node = lab.nodes[0]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        for xdp in (True, False):
            config = _config(node, Path(tmp), xdp)
            log = Path(tmp) / f"{config.stem}.log"
            argv = [sys.executable, "-m", "bench.xdp_flood", "--node", str(config)]
            proc = lab.spawn(node, argv, log_path=log, env=env, cwd=ROOT)
            try:
                wait_tcp(node.addr, MQTT, timeout=60)
                rows.append({"mode": "xdp" if xdp else "fallback"})
                rows[-1].update(asyncio.run(_measure(lab, node, proc.pid, args)))
            except Exception:
                print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
                raise
            finally:
                proc.terminate()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datagrams", type=int, default=100_000)
    parser.add_argument("--rate", type=int, default=50_000, help="datagrams per second")
    parser.add_argument("--node", help=argparse.SUPPRESS)  # the node process, in n0
    args = parser.parse_args(argv)
    if args.node:
        asyncio.run(_node(args.node))
        return 0
    rows = run(args)
    print(f"{'':<22}" + "".join(f"{row['mode']:>14}" for row in rows))
    for key in list(rows[0])[1:]:
        print(f"{key:<22}" + "".join(f"{row[key]!s:>14}" for row in rows))
    print(json.dumps({"bench": "xdp_flood", "datagrams": args.datagrams, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
