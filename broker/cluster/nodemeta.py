"""What a node tells the others of itself in its gossip ALIVE updates (``Update.meta``, at most
255 bytes): how to reach its Raft transport and what it serves.

Gossip teaches a node its peers' gossip address (``bind:gossip_port``, the UDP source of their
datagrams); everything else the cluster needs of a peer rides here, so that seeds need only
name gossip addresses (DESIGN, ``[cluster] seeds``) and no port is derived from another:

- ``raft``: the node's ``[cluster] raft_port`` (worker ``i`` listens on ``raft_port + i``, the
  metadata group on ``raft_port - 1``), on the gossip address's host (``[cluster] bind``
  serves both);
- ``workers``: its worker count, which every member must share (worker ``i`` of each node hosts
  the same groups, ``broker.cluster.peerlink`` refuses a link between different counts): a
  member announcing another count is reported at once, before any Raft link is tried;
- ``mqtt`` and ``http``: its client and HTTP API listeners as ``host:port`` (empty when off),
  for ``mqlog cluster status`` and, in a later step, the MQTT 5 server reference of a drain;
- ``cluster``: the id of the member list the node formed with (:func:`cluster_id`, empty
  until it formed; announced again once it has, ``Swim.announce``): a node that starts with
  no member list and hears a member announce another list's id joins that cluster instead of
  forming one (``broker.cluster.formation``);
- ``leaving``: ``mqlog cluster leave`` runs on the node: the leaders move its replicas away
  (``broker.cluster.reshape``).

Encoded as a JSON object (orjson, short keys, about 80 bytes). Decoding is strict about the
keys it knows (types and ranges: a member's bad meta is refused, not half-read) and ignores
keys it does not, so that a later release may add some without breaking a rolling upgrade.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["MAX_META", "MetaError", "NodeMeta", "cluster_id"]

#: The most bytes an ALIVE update carries (the codec's u8 length).
MAX_META = 255


class MetaError(ValueError):
    """A member's meta that is not a valid :class:`NodeMeta` (the member is not dialled)."""


@dataclass(frozen=True, slots=True)
class NodeMeta:
    raft_port: int
    workers: int
    mqtt: str = ""
    http: str = ""
    cluster: str = ""
    leaving: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.raft_port <= 65535:
            raise MetaError(f"raft port {self.raft_port} (1-65535)")
        if not 1 <= self.workers < 65536:
            raise MetaError(f"worker count {self.workers} (1-65535)")

    def encode(self) -> bytes:
        out: dict[str, Any] = {"raft": self.raft_port, "workers": self.workers}
        if self.mqtt:
            out["mqtt"] = self.mqtt
        if self.http:
            out["http"] = self.http
        if self.cluster:
            out["c"] = self.cluster
        if self.leaving:
            out["leaving"] = True
        data = orjson.dumps(out)
        if len(data) > MAX_META:
            raise MetaError(f"meta of {len(data)} bytes (at most {MAX_META}): {data!r}")
        return data

    @classmethod
    def decode(cls, data: bytes) -> NodeMeta:
        """The meta in ``data``; :class:`MetaError` saying what is wrong."""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise MetaError(f"not JSON: {data[:40]!r}") from None
        if not isinstance(obj, dict):
            raise MetaError(f"not a JSON object: {data[:40]!r}")
        raft, workers = obj.get("raft"), obj.get("workers")
        mqtt, http = obj.get("mqtt", ""), obj.get("http", "")
        cluster, leaving = obj.get("c", ""), obj.get("leaving", False)
        if type(raft) is not int or type(workers) is not int:
            raise MetaError(f"raft and workers must be integers: {data[:80]!r}")
        if not isinstance(mqtt, str) or not isinstance(http, str):
            raise MetaError(f"mqtt and http must be strings: {data[:80]!r}")
        if not isinstance(cluster, str) or type(leaving) is not bool:
            raise MetaError(f"c must be a string, leaving a boolean: {data[:80]!r}")
        return cls(raft, workers, mqtt, http, cluster, leaving)


def cluster_id(names: Iterable[str]) -> str:
    """A short id of a member list (the same on every member that formed with it)."""
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()[:12]
