"""Retention and compaction policies (Kafka's ``cleanup.policy``: delete and compact).

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
under its lock (:meth:`SegmentedLog.enforce_retention`, :meth:`SegmentedLog.compact`), and
:class:`broker.commitlog.cleaner.LogCleaner` runs both for every open log on its own thread.
This module imports neither: the log depends on the policy, the cleaner on the log.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from broker.commitlog.batch import CONTROL_FLAG, decode_batch, encode_batch, read_header
from broker.commitlog.segment import Segment


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
    """Re-encoded batches of ``segment`` holding only the records compaction keeps; a control
    batch (a Raft no-op or configuration) is kept as it is."""
    for buf, rel, _pos in segment.iter_batches():
        header = read_header(buf, rel)
        if header.attributes & CONTROL_FLAG:
            yield bytearray(buf[rel : rel + header.batch_length])
            continue
        records = decode_batch(buf, rel)
        kept = [r for r in records if r.payload and latest.get(r.topic, r.offset) == r.offset]
        if kept:
            yield encode_batch(
                kept[0].offset,
                kept,
                leader_epoch=header.leader_epoch,
                keep_offsets=True,
            )
