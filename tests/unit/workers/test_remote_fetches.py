"""Both ends of the fetch protocol (broker.workers.remote_fetches) over a real log, with the
node transport replaced by a list of the messages sent: a replica answers committed batches
only, holds a live poll until the next commit, refuses and counts a malformed or oversized
request without raising; the asking side drops and counts an answer that fails verification,
and its partition serves what it fetched (broker.workers.remote_partition)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from broker.cluster.fetch import (
    NOT_REPLICA,
    OK,
    OUT_OF_RANGE,
    REFUSED,
    REQUEST,
    FetchRequest,
    decode_answer,
    encode_answer,
    encode_request,
    verified_records,
)
from broker.commitlog import LogConfig, Record, SegmentedLog
from broker.commitlog.batch import encode_batch
from broker.workers.remote_fetches import FETCH, FETCHED, MAX_PARKED, RemoteFetches
from broker.workers.remote_partition import Chunk, Chunks, RemotePartition

GROUP = 42
LEADER = 7
TERM = 3


class Node:
    """The parts of ClusterNode the fetch service uses; ``sent`` is the network."""

    def __init__(self, storages: dict[int, Any]) -> None:
        self.handlers: dict[int, Any] = {}
        self.storages = storages
        self.names = {LEADER: "n7", 8: "n8"}
        self.sent: list[tuple[int, int, bytes]] = []
        self.down: set[str] = set()
        self.transport = SimpleNamespace(connected=lambda name: name not in self.down)
        self.reshape = SimpleNamespace(on_join=None)  # broker.cluster.reshape's hook

    def send(self, to: int, kind: int, body: bytes) -> bool:
        self.sent.append((to, kind, body))
        return True

    def leader(self, group: int) -> int | None:
        return LEADER

    def core(self, group: int) -> Any:
        return SimpleNamespace(term=TERM)


class Service:
    hold_seconds = 5.0

    def __init__(self, node: Node) -> None:
        self.node = node
        self.moved: list[RemotePartition] = []
        self.remote = RemoteFetches(self)  # type: ignore[arg-type]
        self.router = None

    def remote_moved(self, part: RemotePartition) -> None:
        self.moved.append(part)

    def remote_leader(self, part: RemotePartition) -> None:
        pass


def rec(offset: int) -> Record:
    return Record(offset, 1000 + offset, "t", f"p{offset}".encode(), 1, False, "c", b"")


@pytest.fixture
def replica(tmp_path: Path) -> Any:
    """A service hosting GROUP over a log of 10 records, 6 of them committed."""
    log = SegmentedLog.open(tmp_path, LogConfig(segment_bytes=1 << 20))
    for base in (0, 3, 6):
        log.append([rec(base + i) for i in range(3 if base < 6 else 4)])
    log.set_high_watermark(6)
    yield Service(Node({GROUP: SimpleNamespace(log=log)}))
    log.close()


def ask(service: Any, offset: int, max_bytes: int = 1 << 20, wait_ms: int = 0) -> None:
    body = encode_request(FetchRequest(1, GROUP, offset, max_bytes, wait_ms))
    service.node.handlers[FETCH](9, memoryview(body))


def answers(service: Any) -> list[Any]:
    out = [decode_answer(body) for to, kind, body in service.node.sent if kind == FETCHED]
    service.node.sent.clear()
    return out


def test_a_replica_answers_committed_batches_only(replica: Any) -> None:
    ask(replica, 1)
    [a] = answers(replica)
    assert (a.error, a.leader, a.term, a.log_start, a.high_watermark) == (OK, LEADER, TERM, 0, 6)
    records, end = verified_records(a, 1)
    assert [r.offset for r in records] == [1, 2, 3, 4, 5] and end == 6  # not 6..9
    ask(replica, 7)  # past the mark: not readable, whatever the log holds
    [a] = answers(replica)
    assert a.error == OUT_OF_RANGE and not a.batches
    ask(replica, 1, max_bytes=0)  # the marks only
    [a] = answers(replica)
    assert a.error == OK and a.high_watermark == 6 and not a.batches


def test_a_live_poll_is_held_until_the_next_commit(replica: Any) -> None:
    ask(replica, 6, wait_ms=1000)
    # Past this replica's mark (a new leader before its first commit): held too, not refused.
    ask(replica, 8, wait_ms=1000)
    assert answers(replica) == [] and replica.remote.parked_count == 2
    replica.node.storages[GROUP].log.set_high_watermark(10)
    replica.remote.committed(GROUP)
    first, second = answers(replica)
    assert [r.offset for r in verified_records(first, 6)[0]] == [6, 7, 8, 9]
    assert [r.offset for r in verified_records(second, 8)[0]] == [8, 9]
    assert replica.remote.parked_count == 0


def test_held_polls_are_bounded(replica: Any) -> None:
    for _ in range(MAX_PARKED + 3):
        ask(replica, 6, wait_ms=1000)
    assert replica.remote.parked_count == MAX_PARKED
    assert len(answers(replica)) == 3  # the ones over the bound answered at once


@pytest.mark.parametrize(
    "body",
    [
        b"\x01",  # too short to name the request
        REQUEST.pack(5, GROUP, 0, 1 << 30, 0),  # oversized
        REQUEST.pack(5, GROUP, -4, 10, 0),  # negative offset
        REQUEST.pack(5, GROUP, 0, 10, 0) + b"tail",
    ],
)
def test_malformed_requests_are_refused_and_counted(replica: Any, body: bytes) -> None:
    replica.node.handlers[FETCH](9, memoryview(body))  # must not raise
    assert replica.remote.refused == 1
    sent = answers(replica)
    if len(body) >= 12:
        [a] = sent
        assert (a.request, a.error) == (5, REFUSED)
    else:
        assert sent == []


def test_a_node_without_the_group_says_so(replica: Any) -> None:
    body = encode_request(FetchRequest(3, GROUP + 1, 0, 10, 0))
    replica.node.handlers[FETCH](9, memoryview(body))
    [a] = answers(replica)
    assert a.error == NOT_REPLICA


def outsider() -> tuple[Service, RemotePartition]:
    service = Service(Node({}))
    part = RemotePartition(("s", 0), LogConfig(), GROUP, service, [LEADER, 8])  # type: ignore[arg-type]
    return service, part


def test_an_outsider_polls_the_leader_and_serves_what_it_fetched() -> None:
    service, part = outsider()
    part.watchers.add(object())  # type: ignore[arg-type]
    service.remote.add(part)
    [(to, kind, body)] = service.node.sent
    assert (to, kind) == (LEADER, FETCH)  # no leader known yet: the first replica
    request = int.from_bytes(body[:8], "little")
    batches = [bytes(encode_batch(0, [rec(0), rec(1)])), bytes(encode_batch(2, [rec(2)]))]
    service.node.sent.clear()
    service.remote.on_fetched(
        LEADER, memoryview(encode_answer(request, GROUP, OK, 8, 0, 3, batches, term=2))
    )
    assert part.end_offset == 3 and part.leader() == 8 and service.moved == [part]
    assert part.leader_term == 2
    assert [r.offset for r in part.read(1)] == [1, 2]
    # The next live poll went out at once, to the new leader, from the new mark, held there.
    [(to, kind, body)] = service.node.sent
    sent = REQUEST.unpack(body)
    assert (to, sent[2], sent[4]) == (8, 3, 1000)


def test_an_outsider_believes_no_leader_of_an_earlier_term() -> None:
    """Each answer names the leader and its term (a node without a ``$sessions`` replica
    follows the shared groups' home by both, broker.workers.cluster_groups); a replica
    behind, still naming the leader of an earlier term, does not move it back."""
    _, part = outsider()
    part.marks(8, 0, 0, term=4)
    assert (part.leader(), part.leader_term) == (8, 4)
    part.marks(LEADER, 0, 0, term=3)  # a follower that has not heard of term 4 yet
    assert (part.leader(), part.leader_term) == (8, 4)
    part.marks(LEADER, 0, 0, term=5)
    assert (part.leader(), part.leader_term) == (LEADER, 5)
    part.skip(LEADER)  # a failed fetch: no leader known, the term seen stays
    assert (part.leader(), part.leader_term) == (None, 5)
    part.marks(8, 0, 0, term=4)
    assert part.leader() is None


def test_an_outsider_drops_and_counts_a_corrupt_answer() -> None:
    service, part = outsider()
    service.remote.add(part)
    request = int.from_bytes(service.node.sent[0][2][:8], "little")
    bad = bytearray(encode_batch(0, [rec(0)]))
    bad[-1] ^= 1
    service.remote.on_fetched(
        LEADER, memoryview(encode_answer(request, GROUP, OK, None, 0, 1, [bytes(bad)]))
    )
    assert service.remote.bad_answers == 1
    assert part.end_offset == 0 and part.chunks.count == 0
    service.remote.on_fetched(LEADER, memoryview(b"short"))  # must not raise
    assert service.remote.bad_answers == 2


def test_a_read_past_what_was_fetched_starts_a_fetch_and_returns_nothing_yet() -> None:
    service, part = outsider()
    part.log.end_offset = 100
    service.node.sent.clear()
    assert part.read(50) == []
    [(_to, kind, body)] = service.node.sent
    assert kind == FETCH and REQUEST.unpack(body)[2] == 50
    assert part.read(50) == [] and len(service.node.sent) == 1  # one fetch per offset


def test_chunks_stay_disjoint_and_bounded() -> None:
    chunks = Chunks()
    chunks.add(Chunk(0, 3, [rec(0), rec(1), rec(2)], 6))
    chunks.add(Chunk(2, 5, [rec(2), rec(3), rec(4)], 6))  # overlaps: the older one goes
    assert chunks.starts == [2] and chunks.read(3, 10)[0] == [rec(3), rec(4)]
    assert chunks.read(0, 10) == ([], 0)
    chunks.add(Chunk(5, 7, [rec(6)], 2))  # offset 5 holds no record (a no-op)
    assert chunks.read(5, 10)[0] == [rec(6)]


def test_a_poll_to_a_node_whose_link_went_down_goes_to_the_next_replica_at_the_tick() -> None:
    service, part = outsider()
    service.remote.add(part)
    [(to, _, _)] = service.node.sent
    service.node.sent.clear()
    service.remote.tick(time.monotonic())
    assert service.node.sent == []  # answered within its wait: nothing to do
    service.node.down.add(service.node.names[to])  # its link broke (kill -9)
    service.remote.tick(time.monotonic())
    [(again, kind, _)] = service.node.sent
    assert kind == FETCH and again != to


def test_a_failed_history_read_wakes_the_readers_at_the_next_tick() -> None:
    service, part = outsider()
    part.log.end_offset = 100
    assert part.read(50) == []
    [(_to, _, body)] = service.node.sent
    request = int.from_bytes(body[:8], "little")
    service.remote.on_fetched(
        LEADER, memoryview(encode_answer(request, GROUP, REFUSED, None, 0, 0))
    )
    assert service.moved == []  # not at once: a failing replica is not asked in a loop
    service.remote.tick(time.monotonic())
    assert service.moved == [part]  # woken: the reader reads, and so fetches, again
