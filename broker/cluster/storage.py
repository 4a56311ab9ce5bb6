"""One Raft group's storage over one partition's segmented log (Redpanda's model: the Raft log
IS the partition log).

Raft index = log offset + 1 (``broker.cluster.messages``): an entry is one record batch, index
``i`` is the record at offset ``i - 1``, the core's ``terms.last_index`` is the log's end offset
and the commit index is the log's high-water mark, which this storage pins
(``SegmentedLog.set_high_watermark``), so that readers never see an uncommitted record.

* A DATA entry's payload is a record batch encoded ONCE, by the leader, with base offset
  ``index - 1`` and leader epoch = the entry's term (:func:`encode_entry`); every replica
  writes those bytes verbatim (``SegmentedLog.append_raw``, which checks the CRC and the
  structure), so replication never rewrites the term, nor does compaction.
* NOOP (and CONFIG) entries are control batches (``broker.commitlog.batch``): one offset each,
  control type = the entry kind, body = the payload, timestamp ``CONTROL_TIMESTAMP`` (0: each
  replica encodes its own, and with no clock in them they are the same bytes everywhere, and
  never move a segment's max timestamp); readers of records skip them.
* Compaction (a compacted stream, whose log must ``keep_empty_batches``: :meth:`over` refuses
  it otherwise) keeps every batch's base offset, offsets and epoch: a batch it rewrote is the
  same entry with fewer records, and one it emptied a control batch of type
  ``CONTROL_COMPACTED`` covering the same offsets, which is a DATA entry too (its bytes, its
  count of offsets), so a compacted entry replicates verbatim and a follower's log matches.
  Compaction counts only records below the high-water mark (the commit index), so a
  truncation never cuts what removed a committed record.
* Truncation cuts the log between batches, never below the commit index (``floor``); the
  commit hint of the hard state also floors it after a restart, never the other way round.
* The term table (``TermTable``: term -> first index) is rebuilt at :meth:`open` from the
  batches' leader epochs (``SegmentedLog.epoch_runs``, a few headers per segment), or read from
  the ``leader-epoch-checkpoint`` (:mod:`broker.cluster.hardstate`). The checkpoint holds every
  run of the log and may hold runs past its end, never fewer: it is rewritten before the first
  batch of a new term is appended and after a truncation that drops a run. At open, runs at or
  past the log end (a batch the crash lost) are dropped and the rest checked against the log's
  last batch; a missing, damaged or inconsistent checkpoint is rebuilt by the scan. Measured
  (``python -m bench.epoch_scan``, 1 GiB in 16 segments of 1 KiB batches, 6 terms): the scan
  takes 0.27 s where reading every batch header takes 3.1 s; ``open`` takes 0.39 s with the
  scan, 0.20 s with the checkpoint (the log's own open).
* A torn last batch (a crash in the middle of a ``write()``) fails its CRC and the log's
  recovery cuts it: the log ends at the last whole entry.
* A damaged batch (the disk, not a crash) is never handed out: :meth:`entries` stops before
  it, and returns none when the read starts in it: a committed one, the core sends nothing
  to that follower but heartbeats until ``broker.cluster.repair`` rewrote it from another
  replica; an uncommitted one, which nobody repairs, its leader steps down
  (``broker.cluster.election``) and the next leader's log keeps or overwrites it. A
  truncation may start at a damaged batch (``SegmentedLog.truncate``).
* ``append`` writes to the page cache only, whatever the stream's fsync policy
  (``append_raw(defer_fsync=True)``); ``flush`` fsyncs the log, once for every entry appended
  since the last one, and :attr:`flushed_index` (what the core may be told in ``flushed()``)
  moves only there. So the driver sends a round's messages before its one fsync (a leader
  writes its own disk in parallel with its followers, Raft thesis s10.2.1; a follower
  fsyncs a frame of many entries once), and the core counts an entry towards commit only
  once reported flushed.
* The hard state (term, voted_for, commit hint) is written temp file + fsync + rename +
  directory fsync before the core is told ``hard_state_persisted``.
* The log start and the configurations (``raft-log-start``, :mod:`broker.cluster.hardstate`):
  the core's term table starts after the start index (``TermTable.start``, of the recorded
  term), so it never answers for an index retention removed, and the core is built with
  :meth:`membership` (the configuration in force at the start and the CONFIG entries after it,
  which are control batches of control type 2). The file is rewritten before a CONFIG batch is
  appended (like the checkpoint it may hold one past the log end, dropped at open, never lack
  one), after a truncation that drops one, when the driver records the ``LogStart`` the core
  returned from ``compacted`` (:meth:`compacted`; the segments may go before or after), and
  BEFORE an installed snapshot resets the log (:meth:`reset_log`): a crash in the middle leaves
  a log ending before the recorded start, which :meth:`open` resets again. A log whose start
  retention moved past the recorded one takes its start term from the checkpoint's runs (or 0
  for a log of epoch 0 only); otherwise :meth:`open` refuses it (the term there is unknown).

A data directory written by the single-node broker opens as it is: every batch has epoch 0, so
the term table is one run of term 0 (or none for an empty log), and there is no hard state yet.

Called from one thread (the group's driver); not thread-safe.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from broker.cluster.hardstate import (
    StateFileError,
    read_epoch_checkpoint,
    read_hard_state,
    read_log_start,
    write_epoch_checkpoint,
    write_hard_state,
    write_log_start,
)
from broker.cluster.membership import Configuration, Membership
from broker.cluster.messages import Entry, EntryKind, HardState, LogStart, ResetLog
from broker.cluster.terms import TermTable
from broker.commitlog import (
    CorruptRecordBatch,
    LogConfig,
    Record,
    SegmentedLog,
    UnsupportedFormat,
    small_batch,
)
from broker.commitlog.batch import (
    CONTROL_COMPACTED,
    CONTROL_FLAG,
    decode_control,
    encode_control,
    read_header,
    validate_batch,
)

logger = logging.getLogger("broker.cluster")


#: The timestamp of a control batch (module doc).
CONTROL_TIMESTAMP = 0


class StorageError(Exception):
    """An entry or a request the storage cannot honour (a bug of its caller)."""


def encode_entry(records: Sequence[Record], last_index: int, term: int) -> tuple[bytes, int]:
    """The leader's DATA entry for ``records``: the batch at base offset ``last_index`` (the
    core's ``terms.last_index`` before ``propose``) with leader epoch ``term``, and its count;
    ``core.propose(*encode_entry(...))``."""
    return bytes(small_batch.encode(last_index, records, leader_epoch=term)), len(records)


class GroupStorage:
    """See the module doc. Implements ``broker.cluster.raft.LogReader``. Create with
    :meth:`open`."""

    def __init__(
        self,
        log: SegmentedLog,
        terms: TermTable,
        hard_state: HardState,
        commit: int,
        start_config: Configuration | None = None,
        configs: list[tuple[int, Configuration]] | None = None,
    ) -> None:
        self.log = log
        #: The configuration in force at the log start (None: the group's initial one, which
        #: the driver knows), and the CONFIG entries after it: (index, configuration).
        self.start_config = start_config
        self.configs = configs or []
        self.directory = log.directory
        #: The log's term table, kept in step with every append and truncation. The core
        #: keeps its own (``terms.copy()`` at start), ahead of the log inside one step.
        self.terms = terms
        self.hard_state = hard_state
        #: The commit index as far as this storage knows (the high-water mark); after a
        #: restart, the hint of the hard state capped by the log end.
        self.commit = commit
        #: Entries up to this index are durable.
        self.flushed_index = terms.last_index

    @classmethod
    def open(
        cls, directory: Path, config: LogConfig, *, clock: Callable[[], float] = time.time
    ) -> GroupStorage:
        """Open (recovering) the partition log in ``directory`` and the group's state files;
        ``clock`` is the log's (segment_ms rolls).
        Raises the log's errors and :class:`StateFileError` for a damaged hard state."""
        return cls.over(SegmentedLog.open(directory, config, clock=clock))

    @classmethod
    def over(cls, log: SegmentedLog) -> GroupStorage:
        """:meth:`open` over ``log``, already open (the broker's ``Streams`` opened it and
        closes it); on an error the log is closed."""
        try:
            if log.config.compacted and not log.config.keep_empty_batches:
                raise StorageError(
                    f"{log.directory}: a compacted log is a Raft log only if its compaction "
                    "keeps the batches it empties (LogConfig.keep_empty_batches)"
                )
            found = read_hard_state(log.directory)
            hard, hint = found if found is not None else (HardState(0, None), 0)
            stored = read_log_start(log.directory)
            start, start_term, encoded = stored if stored is not None else (0, 0, [])
            configs = [(i, Configuration.decode(conf)) for i, conf in encoded]
            if log.end_offset < start:
                logger.warning("%s: finishing a reset to offset %d", log.directory, start)
                log.reset(start)
            runs = _load_runs(log)
            if log.log_start_offset > start:
                start = log.log_start_offset
                start_term = _moved_start_term(log, runs, hard)
            terms = _term_table(log, runs, start, start_term)
        except BaseException:
            log.close()
            raise
        at_start = [conf for i, conf in configs if i <= start]
        after = [(i, conf) for i, conf in configs if start < i <= terms.last_index]
        # Entries up to the hint that survived the crash are committed ones (the log is never
        # cut below commit, and a crash keeps a prefix): readers may see them at once. What
        # precedes the start is committed by definition.
        commit = max(start, min(hint, log.end_offset))
        log.set_high_watermark(commit)
        return cls(log, terms, hard, commit, at_start[-1] if at_start else None, after)

    def membership(self, initial: Configuration) -> Membership:
        """What the core starts with: the configuration at the log start (``initial``, the
        group's first configuration, when none was recorded) and the CONFIG entries after it."""
        return Membership(self.start_config or initial, self.terms.start, self.configs)

    # -- the core's LogReader -----------------------------------------------------------------

    def entries(self, first: int, last: int, max_entries: int, max_bytes: int) -> list[Entry]:
        if first <= self.terms.start:
            raise StorageError(f"{self.directory}: index {first} is before the log start")
        try:
            batches = self.log.read_batches(first - 1, last, max_entries, max_bytes)
        except CorruptRecordBatch:
            # Damaged here (reported; broker.cluster.repair rewrites it from a replica): none
            # leaves until then, never the damaged bytes.
            return []
        if not batches or read_header(batches[0]).base_offset != first - 1:
            raise StorageError(f"{self.directory}: no entry starts at index {first}")
        return [_entry(batch) for batch in batches]

    def entry_start(self, index: int) -> int:
        if index <= self.terms.start:
            raise StorageError(f"{self.directory}: index {index} is before the log start")
        try:
            return read_header(self.log.read_batches(index - 1, index, 1, 0)[0]).base_offset + 1
        except CorruptRecordBatch:
            # A damaged batch hides where its entry starts: the first index of the term's run
            # is an entry's first index at or before it (the core probes from there).
            return self.terms.first_index_of_run(index)

    # -- effects ----------------------------------------------------------------------------

    def append(self, first_index: int, entries: Sequence[Entry]) -> None:
        """``AppendLog``: write ``entries`` from ``first_index``, the log's end offset + 1, to
        the page cache (durable at the next :meth:`flush`)."""
        if first_index != self.terms.last_index + 1:
            raise StorageError(
                f"{self.directory}: append at index {first_index}, the log ends at "
                f"{self.terms.last_index}"
            )
        for e in entries:
            base = self.terms.last_index
            if e.kind is EntryKind.DATA:
                batch = e.payload
                h = read_header(batch)
                if h.attributes & CONTROL_FLAG and _control_type(batch) != CONTROL_COMPACTED:
                    raise StorageError(f"{self.directory}: a DATA entry holds a control batch")
                if (h.base_offset, h.leader_epoch, h.next_offset - base) != (base, e.term, e.count):
                    raise StorageError(
                        f"{self.directory}: entry of term {e.term} covering {e.count} at index "
                        f"{base + 1} holds a batch at offset {h.base_offset}, epoch "
                        f"{h.leader_epoch}, {h.next_offset - h.base_offset} offsets"
                    )
            else:
                if e.count != 1:
                    raise StorageError(f"a {e.kind.name} entry covers one index, not {e.count}")
                batch = encode_control(base, e.term, int(e.kind), e.payload, CONTROL_TIMESTAMP)
                if e.kind is EntryKind.CONFIG:
                    # Before the batch: the file never lacks a configuration the log holds.
                    self.configs.append((base + 1, Configuration.decode(e.payload)))
                    self._write_log_start()
            if e.term != self.terms.last_term or not self.terms.runs():
                # Before the batch: the checkpoint never lacks a run the log holds.
                runs = [*_offset_runs(self.terms), (base, e.term)]
                write_epoch_checkpoint(self.directory, runs)
            self.log.append_raw(batch, defer_fsync=True)
            self.terms.append(e.term, e.count)

    def truncate(self, from_index: int) -> None:
        """``Truncate``: drop every entry from ``from_index`` on (an entry's first index),
        never at or below the commit index."""
        before = len(self.terms.runs())
        self.log.truncate(from_index - 1, floor=self.commit)
        self.terms.truncate_from(from_index)
        self.flushed_index = min(self.flushed_index, self.terms.last_index)
        if len(self.terms.runs()) < before:
            write_epoch_checkpoint(self.directory, _offset_runs(self.terms))
        if self.configs and self.configs[-1][0] >= from_index:
            self.configs = [(i, conf) for i, conf in self.configs if i < from_index]
            self._write_log_start()

    def compacted(self, start: LogStart) -> None:
        """Record the ``LogStart`` the core returned from ``compacted(first_index)`` after
        retention or compaction removed (or is about to remove) the batches up to
        ``start.index``."""
        if start.index <= self.terms.start:
            return
        self.terms.compact(start.index + 1)
        self.start_config = start.configuration
        self.configs = [(i, conf) for i, conf in self.configs if i > start.index]
        self._write_log_start()

    def reset_log(self, reset: ResetLog) -> None:
        """``ResetLog``: the log becomes empty after ``last_index`` (an installed snapshot; for
        a partition under plain retention the records before it are gone everywhere). The
        new start is recorded first, then the log reset (module doc); durable on return."""
        index = reset.last_index
        self.start_config, self.configs = reset.configuration, []
        self.terms.reset(index, reset.last_term)
        self._write_log_start()
        self.log.reset(index)
        write_epoch_checkpoint(self.directory, [])
        self.flushed_index = index
        self.set_commit(index)

    def _write_log_start(self) -> None:
        confs = [(i, conf.encode()) for i, conf in self.configs]
        if self.start_config is not None:
            confs.insert(0, (self.terms.start, self.start_config.encode()))
        write_log_start(self.directory, self.terms.start, self.terms.start_term, confs)

    def flush(self) -> int:
        """``Flush``: fsync the log; return the index now durable (for ``core.flushed``)."""
        self.log.flush()
        self.flushed_index = self.terms.last_index
        return self.flushed_index

    def persist_hard_state(self, state: HardState) -> None:
        """``PersistHardState``: durable when this returns (module doc)."""
        write_hard_state(self.directory, state, self.commit)
        self.hard_state = state

    def set_commit(self, index: int) -> None:
        """``Commit``: readers may see the records up to ``index`` (the high-water mark)."""
        if index > self.commit:
            self.commit = index
            self.log.set_high_watermark(index)

    def close(self) -> None:
        self.log.close()


def _entry(batch: bytes) -> Entry:
    """The entry a stored batch is: a NOOP or CONFIG control batch that entry, any other batch
    (a compacted one's placeholder included) a DATA entry of its bytes and offsets."""
    h = read_header(batch)
    if h.attributes & CONTROL_FLAG:
        kind, body = decode_control(batch)
        if kind != CONTROL_COMPACTED:
            return Entry(h.leader_epoch, body, EntryKind(kind), 1)
    return Entry(h.leader_epoch, batch, EntryKind.DATA, h.next_offset - h.base_offset)


def _control_type(batch: bytes) -> int:
    """The control type of a control batch received in a DATA entry, -1 for bad bytes."""
    try:
        validate_batch(batch, 0, 0)
        return decode_control(batch)[0]
    except (CorruptRecordBatch, UnsupportedFormat, ValueError, struct.error):
        return -1


def _offset_runs(terms: TermTable) -> list[tuple[int, int]]:
    """The (first offset, epoch) runs of a term table (index = offset + 1)."""
    return [(first - 1, term) for first, term in terms.runs()]


def _load_runs(log: SegmentedLog) -> list[tuple[int, int]]:
    """The log's (first offset, epoch) runs: from the checkpoint when it agrees with the log,
    else from the batch headers (and the checkpoint rewritten). See the module doc."""
    end = log.end_offset
    try:
        runs = read_epoch_checkpoint(log.directory)
    except StateFileError as exc:
        logger.warning("%s; rebuilding it from the log", exc)
        runs = None
    if runs is not None:
        runs = [(offset, epoch) for offset, epoch in runs if offset < end]
        if not _agrees(log, runs):
            logger.warning("%s: leader-epoch checkpoint disagrees with the log", log.directory)
            runs = None
    if runs is None:
        runs = log.epoch_runs()
        write_epoch_checkpoint(log.directory, runs)
    return runs


def _moved_start_term(log: SegmentedLog, runs: list[tuple[int, int]], hard: HardState) -> int:
    """The term of index ``log_start_offset`` (offset - 1), which retention removed past the
    recorded start: from a run that covers it, or 0 for a log of epoch 0 (epochs never
    decrease); else the log cannot be opened (module doc)."""
    start = log.log_start_offset
    covering = [epoch for offset, epoch in runs if offset < start]
    if covering:
        return covering[-1]
    if (runs and runs[0][1] == 0) or (not runs and hard.term == 0):
        return 0
    raise StorageError(
        f"{log.directory}: the log starts at offset {start}, past the recorded Raft log start, "
        "and the term there is unknown"
    )


def _term_table(
    log: SegmentedLog, runs: list[tuple[int, int]], start: int, start_term: int
) -> TermTable:
    """The term table of the log after index ``start`` (of ``start_term``)."""
    end = log.end_offset
    firsts = [(offset + 1, epoch) for offset, epoch in runs]
    kept = [(first, epoch) for first, epoch in firsts if first > start]
    if end > start and (not kept or kept[0][0] > start + 1):
        before = [epoch for first, epoch in firsts if first <= start]
        if not before:
            raise StorageError(f"{log.directory}: no term known for index {start + 1}")
        kept.insert(0, (start + 1, before[-1]))
    return TermTable(kept, end, start, start_term)


def _agrees(log: SegmentedLog, runs: list[tuple[int, int]]) -> bool:
    """Spot checks: the last run starts with a batch of its epoch, the last batch has it."""
    start, end = log.log_start_offset, log.end_offset
    if end == start:
        return not runs or runs[-1][0] < start
    if not runs:
        return False
    offset, epoch = runs[-1]
    try:
        last = read_header(log.read_batches(end - 1, end, 1, 0)[0])
        if offset < start:
            return last.leader_epoch == epoch
        first = read_header(log.read_batches(offset, offset + 1, 1, 0)[0])
    except CorruptRecordBatch:
        return False  # a damaged batch there: the checkpoint is rebuilt from the headers
    return (first.base_offset, first.leader_epoch, last.leader_epoch) == (offset, epoch, epoch)
