"""GroupStorage and the state files on real files: entries as record batches (DATA verbatim,
NOOP and CONFIG as control batches), truncation never below commit, the term table from the
checkpoint or the batch headers, torn state files and torn batches, a single-node data
directory, the log start (recorded, moved by retention, reset by a snapshot) and the membership
reopened, and three RaftNode cores wired to three storages by a synchronous in-memory message
pump (a test harness, not the product driver): proposals commit, a crash recovers, a divergent
follower is cut and catches up, a follower behind the leader's log start installs a snapshot."""

from __future__ import annotations

import random
import shutil
from collections import deque
from pathlib import Path

import pytest

from broker.cluster.hardstate import (
    EPOCH_CHECKPOINT_FILE,
    HARD_STATE_FILE,
    LOG_START_FILE,
    StateFileError,
    read_epoch_checkpoint,
    read_hard_state,
    read_log_start,
    write_epoch_checkpoint,
    write_hard_state,
    write_log_start,
)
from broker.cluster.logsync import LogSyncer
from broker.cluster.membership import Configuration
from broker.cluster.messages import (
    AppendLog,
    Commit,
    Effect,
    Entry,
    EntryKind,
    Flush,
    HardState,
    LogStart,
    Message,
    PersistHardState,
    ResetLog,
    Send,
    Truncate,
)
from broker.cluster.raft import RaftConfig, RaftNode, Role
from broker.cluster.storage import GroupStorage, StorageError, encode_entry
from broker.cluster.terms import TermTable
from broker.commitlog import CommitLogError, LogConfig, Record, SegmentedLog
from broker.commitlog.batch import decode_control, encode_batch
from broker.commitlog.disk import fsync_data
from broker.commitlog.errors import LogIOError

CONFIG = LogConfig(segment_bytes=2048, index_interval_bytes=200, fsync="interval")
VOTERS = Configuration.of({0, 1, 2})


def records(n: int, tag: str = "r") -> list[Record]:
    return [
        Record(0, 1000 + i, f"t/{tag}", f"{tag}{i}".encode(), 1, False, "c", b"") for i in range(n)
    ]


def data(storage: GroupStorage, term: int, n: int, tag: str = "r") -> Entry:
    """A DATA entry of ``n`` records to append next (its batch encoded where it lands)."""
    payload, count = encode_entry(records(n, tag), storage.terms.last_index, term)
    return Entry(term, payload, EntryKind.DATA, count)


def noop(term: int) -> Entry:
    return Entry(term, b"", EntryKind.NOOP)


def put(storage: GroupStorage, term: int, n: int = 0, tag: str = "r") -> Entry:
    """Append a NOOP (``n`` = 0) or a DATA entry of ``n`` records; return it."""
    entry = data(storage, term, n, tag) if n else noop(term)
    storage.append(storage.terms.last_index + 1, [entry])
    return entry


# -- state files -----------------------------------------------------------------------------


def test_hard_state_round_trip_and_no_temporary_left(tmp_path: Path) -> None:
    assert read_hard_state(tmp_path) is None
    write_hard_state(tmp_path, HardState(7, 2), commit_hint=41)
    write_hard_state(tmp_path, HardState(8, None), commit_hint=45)
    assert read_hard_state(tmp_path) == (HardState(8, None), 45)
    assert sorted(p.name for p in tmp_path.iterdir()) == [HARD_STATE_FILE]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda b: b[:20], "torn or truncated"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "CRC mismatch"),
        (lambda b: b"\x00" * len(b), "CRC mismatch"),
        (lambda b: b"", "torn or truncated"),
    ],
)
def test_a_damaged_hard_state_is_an_error_naming_the_file(
    tmp_path: Path, damage: object, reason: str
) -> None:
    write_hard_state(tmp_path, HardState(3, 1), commit_hint=0)
    path = tmp_path / HARD_STATE_FILE
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with pytest.raises(StateFileError, match=reason) as raised:
        read_hard_state(tmp_path)
    assert str(path) in str(raised.value)
    with pytest.raises(StateFileError):
        GroupStorage.open(tmp_path, CONFIG)


def test_log_start_round_trip_and_damage(tmp_path: Path) -> None:
    assert read_log_start(tmp_path) is None
    confs = [(5, VOTERS.encode()), (9, Configuration.of({0, 1}, {2}).encode())]
    write_log_start(tmp_path, 5, 2, confs)
    assert read_log_start(tmp_path) == (5, 2, confs)
    path = tmp_path / LOG_START_FILE
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(StateFileError, match=LOG_START_FILE):
        read_log_start(tmp_path)


def test_epoch_checkpoint_round_trip_and_damage(tmp_path: Path) -> None:
    assert read_epoch_checkpoint(tmp_path) is None
    write_epoch_checkpoint(tmp_path, [(0, 0), (5, 2), (9, 4)])
    assert read_epoch_checkpoint(tmp_path) == [(0, 0), (5, 2), (9, 4)]
    path = tmp_path / EPOCH_CHECKPOINT_FILE
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(StateFileError, match=EPOCH_CHECKPOINT_FILE):
        read_epoch_checkpoint(tmp_path)


# -- entries on the log ----------------------------------------------------------------------


def test_entries_are_batches_and_noops_are_control_batches(tmp_path: Path) -> None:
    storage = GroupStorage.open(tmp_path, CONFIG)
    written = [put(storage, 1), put(storage, 1, 3), put(storage, 1, 2, "s"), put(storage, 2)]
    assert storage.terms == TermTable([(1, 1), (7, 2)], 7)
    assert storage.entries(1, 7, 10, 1 << 20) == written
    assert storage.entries(2, 4, 10, 1 << 20) == written[1:2]
    assert [storage.entry_start(i) for i in range(1, 8)] == [1, 2, 2, 2, 5, 5, 7]
    # Readers see committed records only, never the no-ops.
    assert storage.log.read(0) == []
    storage.set_commit(6)
    assert [r.payload for r in storage.log.read(0)] == [b"r0", b"r1", b"r2", b"s0", b"s1"]
    assert storage.flush() == 7
    storage.close()


def test_appends_wait_for_one_flush_even_under_fsync_always(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many entries appended at once (a follower catching up) are fsynced once, by ``flush``,
    not one by one: an fsync per entry held a follower's event loop for seconds under a
    loaded disk, and the leader's CheckQuorum deposed it. Until the flush, nothing new is
    reported durable."""
    calls: list[int] = []

    def counting(fd: int) -> None:
        calls.append(fd)
        fsync_data(fd)

    monkeypatch.setattr("broker.commitlog.segment._fsync_data", counting)
    always = LogConfig(segment_bytes=1 << 20, index_interval_bytes=200, fsync="always")
    storage = GroupStorage.open(tmp_path, always)
    put(storage, 1)
    storage.flush()
    durable = storage.flushed_index
    calls.clear()
    entries = []
    for i in range(50):
        entries.append(data(storage, 1, 3, f"e{i}"))
        storage.append(storage.terms.last_index + 1, entries[-1:])
    assert calls == [] and storage.flushed_index == durable
    assert storage.flush() == storage.terms.last_index == durable + 150
    assert len(calls) == 1
    storage.close()
    reopened = SegmentedLog.open(tmp_path, always)
    assert len(reopened.read(0, 1000)) == 150
    reopened.close()


def test_an_entry_whose_batch_does_not_fit_its_place_is_refused(tmp_path: Path) -> None:
    storage = GroupStorage.open(tmp_path, CONFIG)
    put(storage, 1)
    wrong_epoch = Entry(1, bytes(encode_batch(1, records(2), leader_epoch=2)), count=2)
    wrong_base = Entry(1, bytes(encode_batch(0, records(2), leader_epoch=1)), count=2)
    wrong_count = Entry(1, bytes(encode_batch(1, records(2), leader_epoch=1)), count=3)
    for entry in (wrong_epoch, wrong_base, wrong_count):
        with pytest.raises(StorageError, match="holds a batch"):
            storage.append(2, [entry])
    with pytest.raises(StorageError, match="append at index 5"):
        storage.append(5, [noop(1)])
    assert storage.log.end_offset == 1
    storage.close()


def test_truncation_never_reaches_the_commit_index(tmp_path: Path) -> None:
    storage = GroupStorage.open(tmp_path, CONFIG)
    for term, n in ((1, 0), (1, 2), (2, 0), (2, 3)):
        put(storage, term, n)
    storage.set_commit(3)
    with pytest.raises(CommitLogError, match="below the committed"):
        storage.truncate(2)
    storage.truncate(4)
    assert storage.terms == TermTable([(1, 1)], 3)
    assert read_epoch_checkpoint(tmp_path) == [(0, 1)]  # the dropped run left it
    storage.close()


def test_appends_wait_for_a_flush(tmp_path: Path) -> None:
    """Under fsync "always" too, an append is durable only at the next flush."""
    storage = GroupStorage.open(tmp_path, LogConfig(segment_bytes=1 << 20, fsync="always"))
    put(storage, 1, 2)
    assert (storage.flushed_index, storage.terms.last_index) == (0, 2)
    assert storage.log.segments and storage.log._segments[-1].dirty
    assert storage.flush() == 2
    assert not storage.log._segments[-1].dirty
    storage.set_commit(2)
    put(storage, 1, 3)
    storage.truncate(3)  # the unflushed entry is gone: nothing past the log end counts
    assert (storage.flushed_index, storage.terms.last_index) == (2, 2)
    storage.close()


def test_a_group_whose_fsync_failed_never_reports_its_log_durable_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After an fsync error the kernel may have dropped the dirty pages: a later fsync that
    succeeds vouches for nothing, so the failed group's entries count on the other replicas
    only (broker.cluster.logsync). The other groups flush as before."""
    config = LogConfig(segment_bytes=1 << 20, fsync="always")
    storages = {g: GroupStorage.open(tmp_path / str(g), config) for g in (1, 2)}
    syncer = LogSyncer(storages, str)
    for storage in storages.values():
        put(storage, 1, 2)
    failing = storages[1].log

    def fail() -> None:
        raise LogIOError(failing.directory, "fsync segment", OSError(5, "Input/output error"))

    monkeypatch.setattr(failing, "flush", fail)
    with caplog.at_level("CRITICAL", logger="broker.cluster"):
        assert syncer.flush({1: 2, 2: 2}) == [(2, 2)]
    assert "1: fsync failed" in caplog.text and syncer.failed == {1}
    monkeypatch.undo()  # the disk answers again: the group stays out
    put(storages[1], 1, 1)
    put(storages[2], 1, 1)
    assert syncer.flush({1: 3, 2: 3}) == [(2, 3)]
    assert storages[1].flushed_index == 0
    for storage in storages.values():
        storage.close()


# -- recovery --------------------------------------------------------------------------------


def test_the_term_table_comes_from_the_checkpoint_or_the_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = GroupStorage.open(tmp_path, CONFIG)
    for term in (1, 2, 4):
        put(storage, term)
        for _ in range(8):
            put(storage, term, 4)
    want = storage.terms.copy()
    assert len(storage.log.segments) > 2
    storage.close()
    scans: list[int] = []
    scan = SegmentedLog.epoch_runs

    def counted(log: SegmentedLog) -> list[tuple[int, int]]:
        scans.append(1)
        return scan(log)

    monkeypatch.setattr(SegmentedLog, "epoch_runs", counted)
    reopened = GroupStorage.open(tmp_path, CONFIG)
    assert (reopened.terms, scans) == (want, [])  # the checkpoint agreed with the log
    reopened.close()
    # A stale checkpoint (a run that is not in the log) and a damaged one: rebuilt by a scan.
    write_epoch_checkpoint(tmp_path, [(0, 1), (3, 2)])
    reopened = GroupStorage.open(tmp_path, CONFIG)
    assert (reopened.terms, len(scans)) == (want, 1)
    reopened.close()
    (tmp_path / EPOCH_CHECKPOINT_FILE).write_bytes(b"garbage")
    reopened = GroupStorage.open(tmp_path, CONFIG)
    assert (reopened.terms, len(scans)) == (want, 2)
    assert read_epoch_checkpoint(tmp_path) == [(0, 1), (33, 2), (66, 4)]
    reopened.close()


def test_a_torn_last_batch_is_cut_at_recovery(tmp_path: Path) -> None:
    storage = GroupStorage.open(tmp_path / "live", CONFIG)
    for term, n in ((1, 0), (1, 3), (2, 0), (2, 2)):
        put(storage, term, n)
    storage.persist_hard_state(HardState(2, 1))
    storage.flush()
    want = storage.terms.copy()
    # The crash: an image of the directory while the log is open (no clean shutdown), then
    # half of the next batch, as a crash in the middle of its write() leaves it.
    crashed = tmp_path / "crashed"
    shutil.copytree(tmp_path / "live", crashed)
    storage.close()
    torn = bytes(encode_batch(7, records(4), leader_epoch=2))
    active = max(crashed.glob("*.log"))
    with active.open("ab") as f:
        f.write(torn[: len(torn) // 2])
    recovered = GroupStorage.open(crashed, CONFIG)
    assert recovered.log.end_offset == 7 and recovered.terms == want
    assert recovered.hard_state == HardState(2, 1)
    put(recovered, 2, 4, "after")
    assert recovered.terms.last_index == 11
    recovered.close()


def test_a_single_node_data_directory_opens_as_term_zero(tmp_path: Path) -> None:
    # Written by today's single-node path: SegmentedLog.append, leader epoch 0, no state files.
    with SegmentedLog.open(tmp_path, CONFIG) as log:
        for i in range(40):
            log.append(records(1 + i % 3, f"n{i}"))
        end = log.end_offset
        single = log.read(0, max_records=10_000)
    storage = GroupStorage.open(tmp_path, CONFIG)
    assert storage.terms == TermTable([(1, 0)], end)
    assert storage.hard_state == HardState(0, None) and storage.commit == 0
    assert storage.entries(1, 1, 1, 0)[0].term == 0
    # A cluster's first term goes on from there; committed, the old records read as before.
    put(storage, 1)
    storage.set_commit(end + 1)
    assert storage.log.read(0, max_records=10_000) == single
    storage.close()
    with SegmentedLog.open(tmp_path, CONFIG) as log:  # and the single node still opens it
        assert log.read(0, max_records=10_000) == single and log.end_offset == end + 1


# -- three cores on three storages -----------------------------------------------------------

RAFT = RaftConfig(election_ticks=10, heartbeat_ticks=1, max_batch=4)


class Cluster:
    """Three RaftNode cores over three GroupStorages, messages pumped in order, a node's
    effects applied at once (a flush is an fsync, a hard state its file)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.storages: dict[int, GroupStorage] = {}
        self.cores: dict[int, RaftNode] = {}
        self.wire: deque[Message] = deque()
        self.down: set[int] = set()
        #: (node, from index) of every truncation applied.
        self.truncations: list[tuple[int, int]] = []
        #: (node, last index) of every installed snapshot.
        self.resets: list[tuple[int, int]] = []
        for node in range(3):
            self.start(node, root / f"n{node}")

    def start(self, node: int, directory: Path) -> None:
        storage = GroupStorage.open(directory, CONFIG)
        self.storages[node] = storage
        self.cores[node] = RaftNode(
            node,
            [0, 1, 2],
            storage,
            random.Random(node),
            RAFT,
            storage.hard_state,
            storage.terms.copy(),
            storage.membership(VOTERS),
        )

    def apply(self, node: int, effects: list[Effect]) -> None:
        storage, core = self.storages[node], self.cores[node]
        done: list[Effect] = []
        for e in effects:
            if isinstance(e, Send):
                self.wire.append(e.message)
            elif isinstance(e, AppendLog):
                storage.append(e.first_index, e.entries)
            elif isinstance(e, Truncate):
                storage.truncate(e.from_index)
                self.truncations.append((node, e.from_index))
            elif isinstance(e, Flush):
                done += core.flushed(storage.flush())
            elif isinstance(e, PersistHardState):
                storage.persist_hard_state(e.state)
                done += core.hard_state_persisted(e.state)
            elif isinstance(e, Commit):
                storage.set_commit(e.index)
            elif isinstance(e, ResetLog):
                storage.reset_log(e)
                self.resets.append((node, e.last_index))
        assert not core.refused
        if done:
            self.apply(node, done)

    def pump(self) -> None:
        while self.wire:
            m = self.wire.popleft()
            if m.frm not in self.down and m.to not in self.down:
                self.apply(m.to, self.cores[m.to].receive(m))

    def tick(self, times: int = 1) -> None:
        for _ in range(times):
            for node, core in self.cores.items():
                if node not in self.down:
                    self.apply(node, core.tick())
            self.pump()

    def leader(self) -> RaftNode:
        for _ in range(200):
            up = [c for n, c in self.cores.items() if n not in self.down]
            leads = [c for c in up if c.role is Role.LEADER]
            if len(leads) == 1 and all(c.leader == leads[0].id for c in up):
                return leads[0]
            self.tick()
        raise AssertionError("no leader")

    def propose(self, lead: RaftNode, n: int, tag: str) -> None:
        self.apply(
            lead.id, lead.propose(*encode_entry(records(n, tag), lead.terms.last_index, lead.term))
        )
        self.pump()

    def batches(self, node: int) -> list[bytes]:
        log = self.storages[node].log
        start, end = log.log_start_offset, log.end_offset
        return log.read_batches(start, end, 1 << 30, 1 << 40) if end > start else []

    def close(self) -> None:
        for storage in self.storages.values():
            storage.close()


def test_three_cores_on_real_storage_commit_recover_and_repair(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    lead = cluster.leader()
    for i in range(6):
        cluster.propose(lead, 1 + i % 4, f"a{i}")
    cluster.tick(3)
    end = lead.terms.last_index
    assert end == 1 + sum(1 + i % 4 for i in range(6))  # the noop and 15 records
    for node in range(3):
        assert cluster.storages[node].commit == end == cluster.cores[node].commit
        assert cluster.batches(node) == cluster.batches(lead.id)  # the leader's bytes
        assert len(cluster.storages[node].log.read(0)) == end - 1  # records, no noop

    # A follower crashes: an image of its directory while open, with a torn batch by hand.
    follower = next(n for n in range(3) if n != lead.id)
    crashed = tmp_path / "crashed"
    shutil.copytree(tmp_path / f"n{follower}", crashed)
    cluster.storages[follower].close()
    cluster.down.add(follower)
    torn = bytes(encode_batch(end, records(3), leader_epoch=lead.term))
    with max(crashed.glob("*.log")).open("ab") as f:
        f.write(torn[:60])
    for i in range(4):  # the two others commit on
        cluster.propose(lead, 2, f"b{i}")
    cluster.tick(2)
    assert lead.commit == lead.terms.last_index == end + 8
    cluster.start(follower, crashed)
    assert cluster.storages[follower].log.end_offset == end  # the torn batch cut
    cluster.down.discard(follower)
    cluster.tick(5)
    assert cluster.batches(follower) == cluster.batches(lead.id)
    assert cluster.storages[follower].terms == cluster.storages[lead.id].terms

    # The leader is cut off with entries nobody else has; the others elect and commit on.
    old = lead
    cluster.down.add(old.id)
    cluster.propose(old, 3, "lost")
    cluster.propose(old, 1, "lost2")
    assert old.terms.last_index == end + 8 + 4 and old.commit == end + 8
    cluster.tick(RAFT.election_ticks)
    lead = cluster.leader()
    assert lead.id != old.id and lead.term > old.term
    cluster.propose(lead, 2, "new")
    cluster.tick(2)
    cluster.down.discard(old.id)
    cluster.tick(5)
    assert old.role is Role.FOLLOWER and old.leader == lead.id
    assert cluster.truncations == [(old.id, end + 9)]  # its own two entries, nothing else
    assert cluster.batches(old.id) == cluster.batches(lead.id)
    payloads = [r.payload for r in cluster.storages[old.id].log.read(0, max_records=100)]
    assert b"lost0" not in payloads and b"new1" in payloads
    tables = [cluster.storages[n].terms for n in range(3)]
    assert tables[0] == tables[1] == tables[2] == lead.terms
    cluster.close()

    # Every node's table, recovered from its files, is the leader's (and so from the headers).
    for node in range(3):
        directory = crashed if node == follower else tmp_path / f"n{node}"
        for drop_checkpoint in (False, True):
            if drop_checkpoint:
                (directory / EPOCH_CHECKPOINT_FILE).unlink()
            reopened = GroupStorage.open(directory, CONFIG)
            assert reopened.terms == lead.terms
            assert reopened.hard_state.term == lead.term
            reopened.close()


# -- log start, configurations, snapshots ------------------------------------------------------


def config_entry(term: int, conf: Configuration) -> Entry:
    return Entry(term, conf.encode(), EntryKind.CONFIG)


def test_config_entries_are_control_batches_and_reopen_as_the_membership(tmp_path: Path) -> None:
    storage = GroupStorage.open(tmp_path, CONFIG)
    grown = Configuration.of({0, 1, 2}, {3})
    put(storage, 1, 2)
    storage.append(3, [config_entry(1, grown)])
    put(storage, 1, 3)
    (batch,) = storage.log.read_batches(2, 3, 1, 1 << 20)
    assert decode_control(batch) == (int(EntryKind.CONFIG), grown.encode())
    assert storage.entries(3, 3, 1, 1 << 20) == [config_entry(1, grown)]
    storage.set_commit(6)
    assert [r.payload for r in storage.log.read(0)] == [b"r0", b"r1", b"r0", b"r1", b"r2"]
    storage.close()
    reopened = GroupStorage.open(tmp_path, CONFIG)
    membership = reopened.membership(VOTERS)
    assert (membership.at(2), membership.at(3), membership.current) == (VOTERS, grown, grown)
    reopened.truncate(3)  # above the commit hint of no hard state: allowed
    assert reopened.membership(VOTERS).current == VOTERS
    reopened.close()
    assert GroupStorage.open(tmp_path, CONFIG).membership(VOTERS).last_index == 0


def test_the_log_start_bounds_the_term_table_and_survives_a_restart(tmp_path: Path) -> None:
    storage = GroupStorage.open(tmp_path, CONFIG)
    put(storage, 1)
    put(storage, 1, 3)  # [2..4]
    put(storage, 2, 2)  # [5..6]
    put(storage, 2)  # 7
    storage.set_commit(7)
    storage.compacted(LogStart(4, 1, VOTERS))  # what core.compacted(5) returned
    assert (storage.terms.start, storage.terms.term_at(4), storage.terms.term_at(3)) == (4, 1, None)
    with pytest.raises(StorageError, match="before the log start"):
        storage.entries(2, 4, 10, 1 << 20)
    assert storage.entries(5, 7, 10, 1 << 20)[0].count == 2
    storage.close()
    reopened = GroupStorage.open(tmp_path, CONFIG)  # the batches below it are still there
    assert reopened.terms == TermTable([(5, 2)], 7, 4, 1)
    assert reopened.commit == 4 and reopened.membership(VOTERS).base_index == 4
    reopened.close()


def test_retention_past_the_recorded_start_takes_the_term_from_the_checkpoint(
    tmp_path: Path,
) -> None:
    storage = GroupStorage.open(tmp_path, CONFIG)
    for term in (1, 1, 2, 2, 3, 3):
        put(storage, term, 30)  # about a segment each
    storage.set_commit(storage.terms.last_index)
    storage.flush()
    segments = storage.log.segments
    assert len(segments) > 3
    storage.close()
    for base in segments[:3]:  # retention, the driver not told (a crash before it was)
        for path in tmp_path.glob(f"{base:020d}.*"):
            path.unlink()
    reopened = GroupStorage.open(tmp_path, CONFIG)
    start = segments[3]
    assert reopened.terms.start == start and reopened.terms.start_term == 2
    assert reopened.terms.first_index_of_run(start + 1) == start + 1
    reopened.close()
    (tmp_path / EPOCH_CHECKPOINT_FILE).unlink()  # rebuilt from the headers: the term is unknown
    with pytest.raises(StorageError, match="the term there is unknown"):
        GroupStorage.open(tmp_path, CONFIG)


def test_reset_log_restarts_the_log_at_the_snapshot_and_an_interrupted_one_finishes(
    tmp_path: Path,
) -> None:
    storage = GroupStorage.open(tmp_path, CONFIG)
    put(storage, 1, 3)
    put(storage, 2, 2)  # a divergent tail past the snapshot
    grown = Configuration.of({0, 1, 2}, {3})
    storage.reset_log(ResetLog(9, 3, grown))
    log = storage.log
    assert (log.log_start_offset, log.end_offset, storage.commit) == (9, 9, 9)
    assert storage.terms == TermTable([], 9, 9, 3)
    put(storage, 3, 2)
    assert storage.entries(10, 11, 10, 1 << 20)[0].count == 2
    storage.close()
    reopened = GroupStorage.open(tmp_path, CONFIG)
    assert reopened.terms == TermTable([(10, 3)], 11, 9, 3)
    assert reopened.membership(VOTERS).at(9) == grown
    reopened.close()
    # A crash after the start was recorded, before the log was reset: open finishes it.
    write_log_start(tmp_path, 20, 4, [(20, grown.encode())])
    reopened = GroupStorage.open(tmp_path, CONFIG)
    assert (reopened.log.log_start_offset, reopened.log.end_offset) == (20, 20)
    assert reopened.terms == TermTable([], 20, 20, 4)
    reopened.close()


def test_a_follower_behind_the_leaders_log_start_installs_a_snapshot(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    lead = cluster.leader()
    behind = next(n for n in range(3) if n != lead.id)
    cluster.down.add(behind)
    for i in range(5):
        cluster.propose(lead, 1 + i % 3, f"a{i}")
    cluster.tick(2)
    # Retention on the leader: whole entries up to an entry's last index go.
    # The noop at 1, then entries of 1, 2, 3, 1, 2 records: [2], [3..4], [5..7], [8], [9..10].
    first = lead.terms.last_index - 2  # [8] and [9..10] are kept
    assert cluster.storages[lead.id].entry_start(first) == first
    cluster.storages[lead.id].compacted(lead.compacted(first))
    assert lead.log_start.index == first - 1
    cluster.down.discard(behind)
    cluster.tick(5)
    assert cluster.resets == [(behind, first - 1)]
    storage = cluster.storages[behind]
    assert storage.log.log_start_offset == first - 1
    assert storage.commit == lead.commit == lead.terms.last_index
    assert cluster.batches(behind) == cluster.batches(lead.id)[-2:]  # the entries after it
    assert storage.terms.start == first - 1 and cluster.cores[behind].terms == lead.terms
    cluster.close()
