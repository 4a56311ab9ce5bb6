"""NATS 2.9 (Debian ``nats-server``) with MQTT on JetStream's file store: the one config
writer for every benchmark that runs it, the single node of bench/mqtt_bench.py and the three
replicated nodes of bench/targets.py (the chaos runs and bench/cluster_bench.py).

MQTT in NATS needs JetStream: QoS 1 messages and sessions are JetStream streams, kept by
its file store under ``store_dir``; it is the peer that persists, as mqlog does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

NATS_SERVER = "/usr/sbin/nats-server"


def nats_server() -> str | None:
    """The ``nats-server`` binary, or None when it is not installed."""
    return shutil.which("nats-server") or (NATS_SERVER if Path(NATS_SERVER).exists() else None)


def nats_config(
    *,
    name: str,
    listen: str,
    store_dir: Path,
    mqtt_listen: str,
    mqtt: str = "",
    http: str | None = None,
    cluster: str | None = None,
) -> str:
    """A server's config: its client port ``listen``, JetStream on ``store_dir``, MQTT on
    ``mqtt_listen`` (``mqtt`` adds options to the block, e.g. ``stream_replicas: 3``);
    optionally the monitoring port ``http`` and a ``cluster`` block's body."""
    lines = [
        f"server_name: {name}",
        f'listen: "{listen}"',
        f'jetstream {{ store_dir: "{store_dir}" }}',
        f'mqtt {{ listen: "{mqtt_listen}"{", " + mqtt if mqtt else ""} }}',
    ]
    if http is not None:
        lines.insert(2, f'http: "{http}"')
    if cluster is not None:
        lines.append(f"cluster {{ {cluster} }}")
    return "\n".join(lines) + "\n"
