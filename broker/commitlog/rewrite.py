"""A damaged range of a segment rewritten in place from intact copies of its batches, and the
raw-batch reads of a replicated log past damage.

A replicated log holds the same bytes on every replica: each replica writes the leader's batch
verbatim (``ReplicaOps.append_raw``) and encodes its control batches identically. So a range of
a segment that holds no intact batch (a :class:`~broker.commitlog.integrity.DamagedRange`, from
its first bad byte to the next intact batch or to the segment's end) can be restored from
another replica's batches for the same offsets. :func:`rewrite_range` writes them over the
damaged bytes, in place, only when

* each verifies (CRC and structure, :func:`~broker.commitlog.batch.validate_batch`);
* they tile the range's offsets exactly: the first starts at the range's ``first_offset`` (one
  past the intact batch before it), each where the previous ends, and the last ends where the
  intact batch after the range starts (``last_offset`` + 1), or, for a range running to the
  end of a sealed segment, where the next segment starts (:func:`range_offsets`);
* their bytes fill the damaged bytes exactly (``end - position``): the batches around the range
  keep their positions, so the indexes and every position a reader holds stay right;
* the range is still damaged, and the batch after it still starts at ``last_offset`` + 1.

Otherwise nothing is written: :class:`~broker.commitlog.errors.RewriteRefused` says why. When
only the length differs (a compacted log, ``$retained`` or ``$sessions``, whose replicas
compacted at different times: each keeps every batch's offsets and epoch, not its bytes), the
range cannot be rewritten in place, and the sealed segment is rewritten whole instead, as the
cleaner rewrites one (:func:`resized_batches`, then ``ReplicaOps.rewrite`` swaps the copy in):
every batch as it is, the range's offsets from the replacement. Only a segment whose one
damaged range this is: with other damage in it the copy would lose bytes, so it is refused
(reads pass over it or hold at it per the stream's ``on_corruption``). The epochs of the
batches are the caller's to check: the log knows no term but the one each batch stores.

The write uses its own descriptor without ``O_APPEND`` (on Linux a ``pwrite`` to an
``O_APPEND`` descriptor appends, whatever its offset), is fdatasynced and read back; then the
segment's cached read state and damage scan are dropped, its ``damaged`` list loses the range,
and the range's reports are forgotten (:func:`~broker.commitlog.integrity.forget`). A crash
during the write leaves at worst the range damaged, never the bytes around it.

The offset index and time index are left as they are: the range's batches lie between two of
their entries, or after the last (an index built past damage lacks entries for it; reads walk
from the entry before). The next full recovery rebuilds them as if nothing had happened.

Called by :class:`~broker.commitlog.replica.ReplicaOps` with the log's locks held.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from broker.commitlog import integrity
from broker.commitlog.batch import BATCH_HEADER_SIZE, read_header, validate_batch
from broker.commitlog.disk import fsync_data
from broker.commitlog.errors import (
    CorruptRecordBatch,
    LogIOError,
    RewriteRefused,
    UnsupportedFormat,
)
from broker.commitlog.integrity import DamagedRange
from broker.commitlog.segment import Segment

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def range_offsets(
    segments: Sequence[Segment], damage: DamagedRange
) -> tuple[Segment, int, int] | None:
    """The segment of ``segments`` holding ``damage`` and the offsets ``first, last`` the range
    covers; None when that segment is gone (retention, a truncation) or the range holds no byte
    or no offset (a file cut short, a compaction's report without offsets)."""
    names = [segment.log_path.name for segment in segments]
    if damage.path.name not in names:
        return None
    i = names.index(damage.path.name)
    segment = segments[i]
    first = damage.first_offset
    if damage.last_offset >= 0:
        last = damage.last_offset
    elif i + 1 < len(segments):
        last = segments[i + 1].base_offset - 1
    else:
        last = segment.next_offset - 1
    if first < 0 or last < first or damage.end <= damage.position:
        return None
    return segment, first, last


def _where(damage: DamagedRange) -> str:
    return f"{damage.path}: bytes {damage.position}..{damage.end} (offsets {damage.offsets()})"


def check_batches(
    damage: DamagedRange,
    first: int,
    last: int,
    batches: Sequence[bytes],
    exact_size: bool = True,
) -> int:
    """Check that ``batches`` tile offsets ``first..last`` and (``exact_size``) fill the range's
    bytes (module doc); returns their largest timestamp. Raises :class:`RewriteRefused`."""
    expect = first
    total = 0
    max_ts = -1
    for i, batch in enumerate(batches):
        try:
            h = validate_batch(batch, 0, 0)
        except (CorruptRecordBatch, UnsupportedFormat) as exc:
            raise RewriteRefused(f"{_where(damage)}: replacement batch {i}: {exc}") from None
        if h.batch_length != len(batch):
            raise RewriteRefused(
                f"{_where(damage)}: replacement batch {i} has {len(batch) - h.batch_length} "
                "bytes after its end"
            )
        if h.base_offset != expect:
            raise RewriteRefused(
                f"{_where(damage)}: replacement batch {i} starts at offset {h.base_offset}, "
                f"not {expect}"
            )
        expect = h.next_offset
        total += len(batch)
        max_ts = max(max_ts, h.max_timestamp)
    if expect != last + 1:
        raise RewriteRefused(
            f"{_where(damage)}: the replacement batches end at offset {expect - 1}, the range "
            f"at {last}"
        )
    if exact_size and total != damage.end - damage.position:
        raise RewriteRefused(
            f"{_where(damage)}: {total} bytes of replacement batches for "
            f"{damage.end - damage.position} damaged bytes: not rewritten in place"
        )
    return max_ts


def rewrite_range(
    segment: Segment, damage: DamagedRange, first: int, last: int, batches: Sequence[bytes]
) -> int:
    """Write ``batches`` over ``damage`` in ``segment`` (module doc); returns how many were
    written, 0 when the range held exactly these bytes already (repaired meanwhile). Raises
    :class:`RewriteRefused` (nothing written) or :class:`LogIOError`."""
    max_ts = check_batches(damage, first, last, batches)
    if damage.end > segment.size:
        raise RewriteRefused(f"{_where(damage)}: the segment holds {segment.size} bytes")
    data = b"".join(batches)
    path = segment.log_path
    try:
        fd = os.open(path, os.O_RDWR | _CLOEXEC)
    except OSError as exc:
        raise LogIOError(path, "open segment to rewrite a damaged range", exc) from exc
    try:
        if damage.end < segment.size:
            head = os.pread(fd, BATCH_HEADER_SIZE, damage.end)
            after = read_header(head).base_offset if len(head) == BATCH_HEADER_SIZE else -1
            if after != last + 1:
                raise RewriteRefused(
                    f"{_where(damage)}: the batch after the range starts at offset {after}, "
                    f"not {last + 1}"
                )
        if os.pread(fd, len(data), damage.position) == data:
            written = 0
        else:
            walk = integrity.walk(fd, path, damage.position, damage.end, first)
            if not any(isinstance(item, DamagedRange) for item in walk):
                raise RewriteRefused(f"{_where(damage)}: the range holds intact batches now")
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], damage.position + done)
            fsync_data(fd)
            if os.pread(fd, len(data), damage.position) != data:
                raise LogIOError(path, "rewrite a damaged range", OSError(5, "read back differs"))
            written = len(batches)
    except OSError as exc:
        raise LogIOError(path, "rewrite a damaged range", exc) from exc
    finally:
        os.close(fd)
    segment._drop_read_state()
    segment._damage_scan = None
    segment.damaged = [d for d in segment.damaged if d.position != damage.position]
    if damage.last_offset < 0:
        segment.next_offset = max(segment.next_offset, last + 1)
    segment.max_timestamp = max(segment.max_timestamp, max_ts)
    integrity.forget(path, damage.position, damage.end)
    if damage.path != path:
        integrity.forget(damage.path, damage.position, damage.end)
    return written


def resized_batches(
    segment: Segment, damage: DamagedRange, replacement: Sequence[bytes]
) -> Iterator[bytes]:
    """Every batch of sealed ``segment``, verified, with the range ``damage`` replaced by
    ``replacement`` (module doc); :class:`RewriteRefused` if the segment holds other damage,
    or no longer this range (repaired meanwhile)."""
    path = segment.log_path
    try:
        fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    except OSError as exc:
        raise LogIOError(path, "open segment", exc) from exc
    replaced = False
    try:
        for item in integrity.walk(fd, path, 0, segment.size, segment.base_offset):
            if item is None:
                break
            if isinstance(item, DamagedRange):
                if (item.position, item.end) != (damage.position, damage.end):
                    raise RewriteRefused(
                        f"{_where(damage)}: the segment is damaged at bytes "
                        f"{item.position}..{item.end} too: not rewritten whole"
                    )
                yield from replacement
                replaced = True
                continue
            buf, rel, _pos, _next = item
            length = read_header(bytes(buf[rel : rel + BATCH_HEADER_SIZE])).batch_length
            yield bytes(buf[rel : rel + length])
    finally:
        os.close(fd)
    if not replaced:
        raise RewriteRefused(f"{_where(damage)}: the range holds intact batches now")


def verified_batches(segment: Segment, offset: int) -> Iterator[tuple[bytes, int, int]]:
    """``(buffer, position in it, file position)`` of each intact batch of ``segment`` holding
    offsets at or past ``offset``, found by a verified walk from the segment's start
    (:func:`~broker.commitlog.integrity.walk`): what ``ReplicaOps.read_batches`` reads once
    the batches it reads plainly fail. Each damaged range met is reported; one wholly before
    ``offset`` is passed over, one at or past it raises :class:`CorruptRecordBatch` with its
    ``first_offset`` and ``last_offset``."""
    path = segment.log_path
    try:
        fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    except OSError as exc:
        raise LogIOError(path, "open segment", exc) from exc
    try:
        for item in integrity.walk(fd, path, 0, segment.size, segment.base_offset):
            if item is None:
                return
            if isinstance(item, DamagedRange):
                integrity.report(item)
                if 0 <= item.last_offset < offset:
                    continue
                error = CorruptRecordBatch(
                    f"{item.reason}; offsets {item.offsets()}", item.position, path
                )
                error.first_offset, error.last_offset = item.first_offset, item.last_offset
                raise error
            buf, rel, pos, next_offset = item
            if next_offset > offset:
                yield buf, rel, pos
    finally:
        os.close(fd)
