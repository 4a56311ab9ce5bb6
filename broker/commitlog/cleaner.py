"""Retention and compaction policies, and the background :class:`LogCleaner` thread.

Retention (Kafka's ``retention.ms`` / ``retention.bytes``) deletes whole *closed* segments from
the start of the log only, so the retained offsets stay one contiguous range:

* by age: a closed segment whose newest record (``max_timestamp``) is more than
  ``retention_ms`` older than now is deleted, oldest first, stopping at the first one kept;
* by size: oldest closed segments are deleted while the log's total size exceeds
  ``retention_bytes`` (so after a pass the log is at most ``retention_bytes``, or a single
  active segment).

Compaction (compacted logs only) keeps, per key (the record's topic), only the record with the
highest offset; a key whose latest record is a tombstone (empty payload) loses all its records
once that tombstone is in a closed segment. Offsets are preserved (gaps are allowed) and record
batches keep their boundaries, each rewritten batch holding the surviving records.

The functions here are pure policy or read closed segments only; the log applies their result
under its lock (:meth:`SegmentedLog.enforce_retention`, :meth:`SegmentedLog.compact`).
:class:`LogCleaner` runs both for every open log of a :class:`Streams` on its own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from broker.commitlog.batch import decode_batch, encode_batch, read_header
from broker.commitlog.errors import CommitLogError, LogClosed
from broker.commitlog.segment import Segment

if TYPE_CHECKING:
    from broker.commitlog.streams import Streams

logger = logging.getLogger("broker.commitlog")


def retention_victims(
    segments: Sequence[Segment], now_ms: int, retention_ms: int | None, retention_bytes: int | None
) -> int:
    """How many segments, from the start of ``segments``, retention deletes.

    The last segment (the active one) is never counted.
    """
    closed = len(segments) - 1
    count = 0
    if retention_ms is not None:
        while count < closed and now_ms - segments[count].max_timestamp > retention_ms:
            count += 1
    if retention_bytes is not None:
        total = sum(segment.size for segment in segments[count:])
        while count < closed and total > retention_bytes:
            total -= segments[count].size
            count += 1
    return count


def build_offset_map(scans: Iterable[tuple[Segment, int]]) -> dict[str, int]:
    """Map key (topic) -> latest offset over ``(segment, end_position)`` pairs, in order."""
    latest: dict[str, int] = {}
    for segment, end in scans:
        for record in segment.iter_records(end):
            latest[record.topic] = record.offset
    return latest


def count_removable(segment: Segment, latest: dict[str, int]) -> int:
    """Records of ``segment`` that compaction with ``latest`` would drop."""
    removable = 0
    for record in segment.iter_records():
        if not record.payload or latest.get(record.topic, record.offset) != record.offset:
            removable += 1
    return removable


def cleaned_batches(segment: Segment, latest: dict[str, int]) -> Iterator[bytearray]:
    """Re-encoded batches of ``segment`` holding only the records compaction keeps."""
    for buf, rel, _pos in segment.iter_batches():
        records = decode_batch(buf, rel)
        kept = [r for r in records if r.payload and latest.get(r.topic, r.offset) == r.offset]
        if kept:
            yield encode_batch(
                kept[0].offset,
                kept,
                leader_epoch=read_header(buf, rel).leader_epoch,
                keep_offsets=True,
            )


class LogCleaner:
    """Background thread applying retention and compaction to every open log of ``streams``.

    ``run_once`` does one pass synchronously (tests call it directly with a fake clock);
    ``start`` runs a pass every ``interval_s`` seconds until ``stop``. An error in one log is
    logged and does not stop the others or the thread.
    """

    def __init__(
        self, streams: Streams, interval_s: float = 30.0, *, clock: Callable[[], float] = time.time
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.streams = streams
        self.interval_s = interval_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> tuple[int, int]:
        """One pass; returns (segments deleted by retention, records removed by compaction)."""
        deleted = removed = 0
        now_ms = int(self._clock() * 1000)
        for (stream, partition), log in self.streams.open_logs().items():
            try:
                deleted += log.enforce_retention(now_ms)
                if log.config.compacted:
                    removed += log.compact()
            except LogClosed:
                continue
            except (CommitLogError, OSError):
                logger.exception("cleaner: %s/%d failed", stream, partition)
        return deleted, removed

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:  # the thread must survive a bug in one pass
                logger.exception("cleaner pass failed")

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is not None:
            raise RuntimeError("LogCleaner already started")
        self._thread = threading.Thread(target=self._run, name="commitlog-cleaner", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to stop and wait for the current pass to finish."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> LogCleaner:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
