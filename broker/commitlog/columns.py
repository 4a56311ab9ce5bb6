"""A read's records as columns: the stored batches' column bytes, without a tuple per record.

:meth:`SegmentedLog.read_columns` returns the same records as :meth:`SegmentedLog.read` (same
offsets, limits and errors) as a :class:`ColumnRead`: for every batch the read crossed, the
slice of each stored column (:mod:`broker.commitlog.batch`) that holds the returned records.
The batch layout is already columnar, so a consumer that wants columns (the Arrow fetch API,
:func:`broker.http.arrow.columns_to_record_batch`) joins the slices into one buffer per column
instead of building a :class:`~broker.commitlog.Record` per record and pulling the tuples apart
again. The decoding work per batch is a header, the string table (memoised on its bytes) and
one span tuple, whatever the record count: issue 7 measured ~1.2 us per record for
:meth:`read` on 1,000-record batches, the time a 1M-record Spark drain spent on the broker's
loop thread; a fleet's log has 1-3 records per batch, so the per-batch work is what counts
there (measured: ~3x less CPU per record than slicing every column of every batch).

The slices are ``memoryview`` s (or, joined, ``bytes``) of the immutable ``bytes`` the log
read (no copy until they are joined). Plain data, no pyarrow here (the log does not depend on
the wire format); safe to hand to another thread once the read returned.
"""

from __future__ import annotations

from typing import cast

from broker.commitlog.batch import (
    _COUNT,
    BATCH_HEADER,
    BATCH_HEADER_SIZE,
    CONTROL_FLAG,
    RECORD_FIXED_SIZE,
    _array,
    _limit,
    _read_table,
    columns,
)

#: Byte width and position (in widths of one record: the column starts at ``p + at * n``) of
#: each fixed-size column in a batch of ``n`` records whose columns start at ``p``.
FIXED_COLUMNS = {
    "timestamps": (8, 0),
    "deltas": (4, 8),
    "topic_indexes": (4, 12),
    "client_id_indexes": (4, 16),
    "property_lengths": (4, 20),
    "payload_lengths": (4, 24),
    "qos": (1, 28),
    "flags": (1, 29),
}

#: One slice of a stored batch: ``(buffer, view of it, p, n, first, stop, properties from,
#: properties to, payloads from, payloads to)``: records ``first .. stop - 1`` of the batch of
#: ``n`` records whose columns start at ``p`` in ``buffer``, and where their properties and
#: payloads lie.
Span = tuple[bytes, memoryview, int, int, int, int, int, int, int, int]


class _Column:
    """A column of :class:`ColumnRead` as one view per batch slice, made on first use
    (``ColumnRead._slices``); the attribute's name is the column's."""

    __slots__ = ("name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, read: ColumnRead, owner: type | None = None) -> list[memoryview]:
        return read._slices(self.name)


class ColumnRead:
    """The records of one read, column by column (every list has one item per batch slice).

    Per-record columns, little-endian, one ``memoryview`` per slice, to be joined in order:
    ``timestamps`` (int64 ms), ``deltas`` (uint32, record offset minus the slice's entry in
    ``bases``), ``topic_indexes`` and ``client_id_indexes`` (uint32, into that slice's string
    table: ``strings[table_starts[i] + index]``), ``property_lengths`` and ``payload_lengths``
    (uint32 bytes), ``qos`` (uint8), ``flags`` (uint8, bit 0 retain, other bits to ignore);
    ``properties`` and ``payloads`` hold the records' bytes, concatenated in record order.
    ``run_ends[i]`` is the number of records in slices ``0..i`` (Arrow's run-end encoding).
    :meth:`joined` gives one of these columns as one ``bytes``.

    The read records only a :data:`Span` per slice (``spans``); the per-column view lists are
    made on first use. A fleet's log holds batches of 1-3 records (one router loop turn each),
    where a dozen ``memoryview`` slices per batch were most of a read's CPU (measured),
    and the Arrow fetch (:meth:`joined`) needs none of them.

    ``count`` records in all; ``next_offset`` is one past the last one, or past the control
    batches the read skipped after it (0 when the read met neither), so a reader that went
    through control batches only still moves on. ``len()`` is ``count``, so the log's read
    loops count records the same way for a ``ColumnRead`` as for a ``list[Record]``.
    """

    __slots__ = (
        "_buf",
        "_view",
        "_views",
        "bases",
        "count",
        "next_offset",
        "run_ends",
        "spans",
        "strings",
        "table_starts",
    )

    def __init__(self) -> None:
        # The buffer the last batch came from and a view of it: a read's batches mostly share
        # one buffer (the segment's read-ahead chunk), so one view serves all their slices.
        self._buf = b""
        self._view = memoryview(self._buf)
        # Column name -> (len(spans) it was made for, its views).
        self._views: dict[str, tuple[int, list[memoryview]]] = {}
        self.count = 0
        self.next_offset = 0
        self.bases: list[int] = []
        self.run_ends: list[int] = []
        self.strings: list[str] = []
        self.table_starts: list[int] = []
        self.spans: list[Span] = []

    def __len__(self) -> int:
        return self.count

    def joined(self, column: str) -> bytes:
        """Column ``column`` (a name above) of every slice, as one ``bytes``: slices of the
        read's buffers, joined once (no view per slice)."""
        spans = self.spans
        if column == "properties":
            return b"".join([b[x:y] for b, _v, _p, _n, _f, _s, x, y, _x, _y in spans])
        if column == "payloads":
            return b"".join([b[x:y] for b, _v, _p, _n, _f, _s, _x, _y, x, y in spans])
        w, at = FIXED_COLUMNS[column]
        return b"".join(
            [
                b[p + at * n + w * f : p + at * n + w * s]
                for b, _v, p, n, f, s, _x, _y, _a, _b in spans
            ]
        )

    def _slices(self, column: str) -> list[memoryview]:
        made = self._views.get(column)
        spans = self.spans
        if made is not None and made[0] == len(spans):
            return made[1]
        views: list[memoryview]
        if column == "properties":
            views = [v[x:y] for _b, v, _p, _n, _f, _s, x, y, _x, _y in spans]
        elif column == "payloads":
            views = [v[x:y] for _b, v, _p, _n, _f, _s, _x, _y, x, y in spans]
        else:
            w, at = FIXED_COLUMNS[column]
            views = [
                v[p + at * n + w * f : p + at * n + w * s]
                for _b, v, p, n, f, s, _x, _y, _a, _c in spans
            ]
        self._views[column] = (len(spans), views)
        return views

    timestamps = _Column()
    deltas = _Column()
    topic_indexes = _Column()
    client_id_indexes = _Column()
    property_lengths = _Column()
    payload_lengths = _Column()
    qos = _Column()
    flags = _Column()
    properties = _Column()
    payloads = _Column()


def decode_columns_into(
    buf: bytes,
    pos: int,
    out: ColumnRead,
    min_offset: int,
    max_records: int,
    max_bytes: int,
) -> tuple[int, int]:
    """:func:`~broker.commitlog.batch.decode_into` for columns: add to ``out`` the slice of
    the batch at ``pos`` that ``decode_into`` would return as records; same limits, same
    return value ``(bytes_left, stop_offset)``.

    A batch taken whole (every batch of a read but its first and last, usually) costs no work
    per record: only a batch cut by ``min_offset`` or a limit unpacks its fixed columns to
    find where to cut.
    """
    (base, length, _magic, attrs, _res, _epoch, last_delta, n, _first_ts, _max_ts, _crc) = (
        BATCH_HEADER.unpack_from(buf, pos)
    )
    if attrs & CONTROL_FLAG:  # a control batch holds no record (batch module doc)
        out.next_offset = base + last_delta + 1
        return max_bytes, -1
    end = pos + length
    strings, p = _table(buf, pos + BATCH_HEADER_SIZE, end)
    data = p + n * RECORD_FIXED_SIZE  # the properties, then the payloads
    size = end - p  # of all records: columns, properties and payloads
    if min_offset <= base and size <= max_bytes and n <= max_records - out.count:
        first, stop, bytes_left, stop_offset = 0, n, max_bytes - size, -1
        last = base + last_delta
        if buf.count(0, p + 20 * n, p + 24 * n) == 4 * n:  # no properties (the common case)
            props_from = props_to = payloads_from = data
        else:
            props_from = data
            props_to = payloads_from = data + sum(_array("I", n).unpack_from(buf, p + 20 * n))
        payloads_to = end
    else:
        cols = columns(n).unpack_from(buf, p)
        first, stop, bytes_left, stop_offset = _limit(
            cols, n, base, last_delta == n - 1, out.count, min_offset, max_records, max_bytes
        )
        if first == stop:
            return bytes_left, stop_offset
        ints = cast("tuple[int, ...]", cols[: 6 * n])  # the six integer columns
        last = base + ints[n + stop - 1]
        prop_lengths = ints[4 * n : 5 * n]
        payload_lengths = ints[5 * n :]
        props_from = data + sum(prop_lengths[:first])
        props_to = props_from + sum(prop_lengths[first:stop])
        payloads_from = data + sum(prop_lengths) + sum(payload_lengths[:first])
        payloads_to = payloads_from + sum(payload_lengths[first:stop])
    if out._buf is not buf:
        out._buf = buf
        out._view = memoryview(buf)
    out.count += stop - first
    out.next_offset = last + 1
    out.bases.append(base)
    out.run_ends.append(out.count)
    out.table_starts.append(len(out.strings))
    out.strings += strings
    out.spans.append(
        (buf, out._view, p, n, first, stop, props_from, props_to, payloads_from, payloads_to)
    )
    return bytes_left, stop_offset


#: Tables up to this many bytes are memoised (:func:`_table`), which bounds the memo's memory.
_MEMO_TABLE_BYTES = 512
#: Entries per memo before it is emptied (a partition's devices x their topics, roughly).
_MEMO_ENTRIES = 4096
#: Table size by the table's count and lengths, then the decoded strings by the whole table.
_TABLE_SIZES: dict[bytes, int] = {}
_TABLES: dict[bytes, tuple[str, ...]] = {}


def _table(buf: bytes, t: int, end: int) -> tuple[tuple[str, ...] | list[str], int]:
    """:func:`~broker.commitlog.batch._read_table`, memoised on the table's bytes.

    A fleet's log is written one router loop turn at a time, so its batches hold 1-3 records
    and each batch's table is one device's topic and client id, repeated batch after batch:
    decoding it was 40% of a read's CPU (measured on 2-record batches). Two dict lookups on
    the stored bytes replace the decode; equal bytes decode to equal strings, so the result
    is the same.
    Module-level dicts: lookups and stores are atomic under the GIL, so reads on several
    threads share them safely.
    """
    (m,) = _COUNT.unpack_from(buf, t)
    head = buf[t : t + 4 + 2 * m]
    size = _TABLE_SIZES.get(head)
    if size is not None:
        strings = _TABLES.get(buf[t : t + size])
        if strings is not None and t + size <= end:
            return strings, t + size
    decoded, q = _read_table(buf, t, end)
    size = q - t
    if size <= _MEMO_TABLE_BYTES:
        if len(_TABLES) >= _MEMO_ENTRIES:
            _TABLES.clear()
            _TABLE_SIZES.clear()
        _TABLE_SIZES[head] = size
        _TABLES[buf[t:q]] = tuple(decoded)
    return decoded, q
