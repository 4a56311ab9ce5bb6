"""Free local ports for the brokers the benchmarks and the tests start (no numpy here: the
tests import it too)."""

from __future__ import annotations

import random
import socket

#: Ports free_port gave (never twice: the system may pick a port it just freed again, and a
#: broker given one port for MQTT and HTTP does not start).
_given_ports: set[int] = set()


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on now, and not given before by this process."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _given_ports:
            _given_ports.add(port)
            return port


#: Where :func:`cluster_port` looks: below Linux's ephemeral range (32768-60999 by default),
#: so that no outgoing connection is ever given a port next to a node's Raft port (bind(0)
#: answers with odd ports, connect() takes even ones: raft_port - 1 and + 1 are even) and
#: above the xdist blocks' neighbours nothing else here listens on.
CLUSTER_PORT_RANGE = (10_000, 19_999)


def cluster_port(workers: int = 1) -> int:
    """A Raft port for a cluster node on 127.0.0.1 with ``workers`` workers: the port, the
    metadata group's below it and the workers' above it (``p - 1`` to ``p + workers - 1``)
    are free now and were never given by this process."""
    lo, hi = CLUSTER_PORT_RANGE
    rng = random.Random()
    for _ in range(10_000):
        port = rng.randrange(lo + 1, hi - workers)
        span = range(port - 1, port + workers)
        if any(p in _given_ports for p in span):
            continue
        socks: list[socket.socket] = []
        try:
            for p in span:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _given_ports.update(span)
        return port
    raise RuntimeError(f"no {workers + 1} free ports in a row in {lo}-{hi}")


def gossip_port() -> int:
    """A UDP port on 127.0.0.1 for a cluster node's gossip (``[cluster] gossip_port``), in
    :data:`CLUSTER_PORT_RANGE`, free now and never given by this process (as a TCP port
    either: the config refuses one number for two listeners)."""
    lo, hi = CLUSTER_PORT_RANGE
    rng = random.Random()
    for _ in range(10_000):
        port = rng.randrange(lo, hi)
        if port in _given_ports:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        _given_ports.add(port)
        return port
    raise RuntimeError(f"no free UDP port in {lo}-{hi}")
