"""Partition keys cross the worker mesh and come back equal to the router's own.

A :data:`~broker.commitlog.keys.PartitionKey` is a plain ``(stream, partition)`` tuple: the
partition frames pack it (broker.workers.partitions), the shared groups' frames carry it in
JSON (broker.workers.groups), and ``marshal`` (the forwarded rows) refuses ``NamedTuple``
instances. Each test fails if a key stops making the trip, or comes back as something the
router's dictionaries (``partitions``, cursors) do not find.
"""

from __future__ import annotations

import marshal
from pathlib import Path
from typing import Any

import pytest

from broker.commitlog import Streams
from broker.commitlog.config import StreamSpec
from broker.commitlog.keys import PartitionKey
from broker.mqtt.topics import topic_matches
from broker.workers.groups import MeshGroupPeers
from broker.workers.partitions import pack_key, unpack_key


@pytest.fixture
def keys(tmp_path: Path) -> list[PartitionKey]:
    """Distinct keys as the log makes them, for a few streams (one with a non-ASCII name)."""
    streams = Streams(
        tmp_path,
        [StreamSpec("devices", ("d/#",), 8), StreamSpec("capteurs-é", ("c/#",), 3)],
        matches=topic_matches,
    )
    try:
        made = [streams.partition_for(t) for t in ("d/1", "d/2/x", "c/7", "other", "$SYS/x")]
    finally:
        streams.close()
    return list(dict.fromkeys([*made, ("$retained", 0), ("$sessions", 0), ("default", 65535)]))


def test_the_log_makes_plain_tuples(keys: list[PartitionKey]) -> None:
    assert all(type(key) is tuple for key in keys)


def test_a_key_crosses_in_a_partition_frame(keys: list[PartitionKey]) -> None:
    for key in keys:
        frame = b"\x07" + pack_key(key) + b"rows"
        got, end = unpack_key(memoryview(frame), 1)
        assert got == key and hash(got) == hash(key)
        assert frame[end:] == b"rows"


def test_a_key_crosses_in_marshal(keys: list[PartitionKey]) -> None:
    assert marshal.loads(marshal.dumps(keys)) == keys


class _Mesh:
    def __init__(self) -> None:
        self.sent: list[tuple[int, int, bytes]] = []

    def send(self, worker: int, kind: int, body: bytes) -> None:
        self.sent.append((worker, kind, body))


class _Router:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def remote_leave(self, *args: Any) -> None:
        self.calls.append(("leave", args))

    def remote_done(self, *args: Any) -> None:
        self.calls.append(("done", args))

    def remote_deliver(self, *args: Any) -> None:
        self.calls.append(("deliver", args))


def test_a_key_crosses_in_the_shared_groups_frames(keys: list[PartitionKey]) -> None:
    """Member to home (LEAVE with orphans, DONE) and home to member (DELIVER): the key the
    receiving router gets finds the same entry of a dictionary keyed by the sender's."""
    mesh, router = _Mesh(), _Router()
    sender = MeshGroupPeers(0, lambda group: 1, 100)
    receiver = MeshGroupPeers(1, lambda group: 1, 100)
    sender.mesh = mesh  # type: ignore[assignment]
    receiver.router = router  # type: ignore[assignment]
    group = "$share/g/d/#"
    for key in keys:
        sender.leave(1, group, "c", 9, [(key, 5)])
        sender.done(1, group, "c", key, 6)
        sender.deliver(1, group, "c", 9, key, 7, 1)
    for _, kind, body in mesh.sent:
        receiver.handlers()[kind](0, 0, memoryview(body))
    cursors = {key: i for i, key in enumerate(keys)}
    got: dict[str, list[Any]] = {"leave": [], "done": [], "deliver": []}
    for name, args in router.calls:
        key = args[4][0][0] if name == "leave" else args[2] if name == "done" else args[3]
        got[name].append(cursors[key])
    assert got == {name: list(range(len(keys))) for name in got}
