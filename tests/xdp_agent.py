"""The filtered end of tests/integration/test_xdp.py, run inside a lab namespace.

``python -m tests.xdp_agent MODE IFACE GOSSIP_PORT RAFT_PORT MQTT_PORT`` opens the filter
(MODE ``kernel``: the XDP program attached to IFACE in generic mode; ``user``: the user-space
filter), a real ``GossipEndpoint`` on the gossip port with the filter's ``accept``, and TCP
listeners on the metadata, Raft and MQTT ports that answer ``ok`` to each connection. It then
reads one JSON command per line on stdin and answers one JSON line on stdout:
``{"op": "allow" | "deny", "addr": A}``, ``{"op": "join_from", "nets": [CIDR, ...]}``,
``{"op": "status"}``. Every answer holds the
filter's counters and the endpoint's (``received``: datagrams past the filter).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from broker.cluster.gossip.endpoint import open_endpoint
from broker.xdp.kernel import KernelFilter, Ports
from broker.xdp.members import MemberFilter
from broker.xdp.userspace import UserSpaceFilter


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"ok")
    await writer.drain()
    writer.close()


async def main(mode: str, iface: str, gossip: int, raft: int, mqtt: int) -> None:
    ports = Ports(gossip, raft - 1, raft, (mqtt,))
    filt: MemberFilter = (
        KernelFilter.load(ports, iface, "generic")
        if mode == "kernel"
        else UserSpaceFilter("the test runs the user-space filter")
    )
    endpoint = await open_endpoint("agent", ("0.0.0.0", gossip), b"s" * 16, prefilter=filt.accept)
    servers = [await asyncio.start_server(_answer, "0.0.0.0", p) for p in (raft - 1, raft, mqtt)]
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)

    def reply(**extra: Any) -> None:
        answer = {
            **filt.status(),
            "endpoint": dict(endpoint.counters),
            **extra,
        }
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()

    reply(ready=True)
    while line := await stdin.readline():
        cmd = json.loads(line)
        if cmd["op"] == "allow":
            filt.allow(cmd["addr"])
        elif cmd["op"] == "deny":
            filt.deny(cmd["addr"])
        elif cmd["op"] == "join_from":
            filt.set_join_from(cmd["nets"])
        reply()
    endpoint.close()
    for server in servers:
        server.close()
    filt.close()


if __name__ == "__main__":
    mode, iface, *ports = sys.argv[1:]
    asyncio.run(main(mode, iface, *(int(p) for p in ports)))
