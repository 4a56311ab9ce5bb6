"""Free local ports for the brokers the benchmarks and the tests start (no numpy here: the
tests import it too)."""

from __future__ import annotations

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
