"""Bytes of Python heap per idle MQTT connection, counted by tracemalloc in the broker's own
process (issue 23): deterministic, unlike the RSS growth the ``storm`` scenario of
:mod:`bench.mqtt_bench` measures (which also counts the allocator's arenas and the kernel's
socket buffers are not in it either way).

One worker (``mqlog serve`` with ``--workers 1``, the config/broker.toml defaults otherwise)
runs in this process under tracemalloc; a client process opens ``--conns`` connections as the
storm's generator does (MQTT 3.1.1, clean session, keepalive 0, a user name, no
subscription), each CONNECTed and CONNACKed, then holds them idle (parked, where the checkout
parks idle connections: broker.net.parking, after ``[router] park_after``). The figure: traced bytes
after minus before, over the connections; and the allocation sites that grew most, per
connection.

``--src DIR ...`` measures other checkouts in the same run (each in its own process), for a
before/after: ``python -m bench.conn_memory --src /tmp/before .``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: The client side, run as a separate process so that none of its objects are traced: opens
#: the connections, waits for every CONNACK, prints "ready", holds them until stdin closes.
CLIENTS = r"""
import socket, struct, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
def s(x):
    b = x.encode()
    return struct.pack(">H", len(b)) + b
socks = []
for i in range(n):
    body = s("MQTT") + bytes([4, 0x82]) + struct.pack(">H", 0) + s(f"idle-{i}") + s("bench")
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(b"\x10" + bytes([len(body)]) + body)
    socks.append(c)
for c in socks:
    got = b""
    while len(got) < 4:
        got += c.recv(4 - len(got))
    assert got[0] == 0x20 and got[3] == 0, got
print("ready", flush=True)
sys.stdin.read()
"""


async def measure(conns: int, top: int) -> dict[str, object]:
    from broker.config import load_config
    from broker.server import Server

    data = tempfile.mkdtemp(prefix="conn-memory-")
    cfg = load_config(
        REPO / "config" / "broker.toml",
        {
            "server.port": 0,
            "http.port": 0,
            "commitlog.data_dir": data,
            "router.workers": 1,
            "server.connection_messages": False,
            "server.sys_interval": 0,
        },
    )
    server = Server(cfg)
    await server.start()
    port = server._listeners[0].sockets[0].getsockname()[1]
    # one connection first: every lazily built table, cache and free list of the first
    # connection is the server's, not the per-connection cost
    await asyncio.to_thread(_hold, port, 1, None)
    gc.collect()
    tracemalloc.start(FRAMES)
    before = tracemalloc.take_snapshot()
    held = await asyncio.to_thread(_open, port, conns)
    await asyncio.sleep(0.5)  # the last CONNACKs' callbacks; then the connections are idle
    parked = await _parked(server, conns)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    assert len(server.links) == conns + 0, len(server.links)
    stats = after.compare_to(before, "traceback")
    grown = sum(s.size_diff for s in stats)
    by_site: dict[str, list[int]] = {}
    for s in stats:
        site = by_site.setdefault(_site(s.traceback), [0, 0])
        site[0] += s.size_diff
        site[1] += s.count_diff
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]
    sites = [(where, size / conns, count) for where, (size, count) in ranked]
    held.stdin.close()
    held.wait(10)
    await server.stop()
    shutil.rmtree(data, ignore_errors=True)
    return {"bytes_per_conn": grown / conns, "sites": sites, "parked": parked}


async def _parked(server: object, conns: int) -> int:
    """Wait for the idle connections to park (broker.net.parking, after ``[router]
    park_after``; a checkout without parking: none); how many did."""
    lot = getattr(server, "parking", None)
    if lot is None or not lot.after:
        return 0
    deadline = time.monotonic() + 2 * lot.after + 5  # looks are spread over half of it
    while len(lot) < conns and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
    await asyncio.sleep(0.5)  # the closes of the last ones' transports (uv_close callbacks)
    return len(lot)


#: Frames kept per allocation: enough to reach our code from uvloop's callbacks.
FRAMES = 12


def _site(tb: tracemalloc.Traceback) -> str:
    """Where an allocation was made, as the innermost frame of our code (an allocation made
    by the interpreter or uvloop for us is charged to the line that caused it), with the
    innermost frame itself when that is elsewhere."""
    frames = list(tb)[::-1]  # most recent call first (a Traceback runs oldest first)
    ours = next((f for f in frames if f.filename.startswith(str(REPO / "broker"))), None)
    inner = f"{Path(frames[0].filename).name}:{frames[0].lineno}"
    if ours is None:
        return inner
    where = f"{Path(ours.filename).relative_to(REPO)}:{ours.lineno}"
    return where if ours is frames[0] else f"{where} (in {inner})"


def _open(port: int, n: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENTS, str(port), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError(f"clients failed: {line!r}")
    return proc


def _hold(port: int, n: int, _: object) -> None:
    proc = _open(port, n)
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(10)
    time.sleep(0.3)


def child(conns: int, top: int) -> None:
    import uvloop

    print(json.dumps(uvloop.run(measure(conns, top))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conns", type=int, default=2000)
    ap.add_argument("--top", type=int, default=15, help="allocation sites listed")
    ap.add_argument("--src", nargs="*", default=[str(REPO)], help="checkouts to measure")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.conns, args.top)
        return 0
    for src in args.src:
        root = Path(src).resolve()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.conn_memory",
                "--child",
                "--conns",
                str(args.conns),
                "--top",
                str(args.top),
            ],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            print(f"{root}: failed\n{out.stderr[-3000:]}")
            continue
        doc = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{root}: {doc['bytes_per_conn']:,.0f} bytes per idle connection "
            f"({args.conns} connections, tracemalloc; {doc.get('parked', 0)} parked)"
        )
        for where, size, count in doc["sites"]:
            print(f"  {size:8.1f} B/conn  {count:+7d} blocks  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
