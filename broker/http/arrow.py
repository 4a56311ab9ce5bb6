"""Log records as Arrow record batches and JSON: the wire format of the HTTP fetch API.

The Arrow schema is the contract shared with the Spark data source (``spark_sink.source``
declares the same columns as its Spark schema):
``stream string, partition int32, offset int64, timestamp timestamp[us, UTC], topic string,
payload binary, qos int32, retain bool, client_id string, properties map<string, string>``.
Types are exact (``string``, never ``large_string``) and fields nullable (as Spark's schema
declares them, though no value is ever null) so Spark takes the batches as they are.

``properties`` flattens the record's MQTT 5 properties into strings: each user property
(``0x26``) under its own name (the first value wins when a name repeats, as a map keeps one
value per key), and each other property under ``mqtt.<name>`` in lower case
(``mqtt.content_type``, ``mqtt.message_expiry_interval``, ...); binary values
(correlation data) are hex. A record without properties has an empty map.

Two encoders give the same bytes: :func:`to_record_batch` over :class:`~broker.commitlog.Record`
tuples, and :func:`columns_to_record_batch` over a read's stored columns
(:meth:`SegmentedLog.read_columns <broker.commitlog.SegmentedLog.read_columns>`), which joins
each column's slices into one buffer and lets Arrow's kernels do the per-record work (no
Python object per record: issue 7).

Pure functions over immutable inputs: safe to call from any thread (the HTTP API encodes in a
worker thread, off the broker's loop).
"""

from __future__ import annotations

import base64
from array import array
from collections.abc import Iterable, Sequence
from operator import itemgetter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from broker.commitlog import Record
from broker.commitlog.batch import RECORD_FIXED_SIZE
from broker.commitlog.columns import FIXED_COLUMNS, ColumnRead
from broker.mqtt.properties import PropertyId, decode_properties

PROPERTIES_TYPE = pa.map_(pa.string(), pa.string())

SCHEMA = pa.schema(
    [
        pa.field("stream", pa.string()),
        pa.field("partition", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("topic", pa.string()),
        pa.field("payload", pa.binary()),
        pa.field("qos", pa.int32()),
        pa.field("retain", pa.bool_()),
        pa.field("client_id", pa.string()),
        pa.field("properties", PROPERTIES_TYPE),
    ]
)

#: Arrow IPC stream media type (https://www.iana.org/assignments/media-types/).
ARROW_STREAM_TYPE = "application/vnd.apache.arrow.stream"

_NAMES: dict[int, str] = {int(pid): f"mqtt.{pid.name.lower()}" for pid in PropertyId}


def property_pairs(blob: bytes) -> list[tuple[str, str]]:
    """The properties of one record as ``(key, value)`` string pairs with unique keys."""
    if not blob:
        return []
    out: dict[str, str] = {}
    for pid, value in decode_properties(blob).items():
        if pid == PropertyId.USER_PROPERTY:
            for name, text in value:
                out.setdefault(name, text)
        elif isinstance(value, bytes | bytearray):
            out.setdefault(_NAMES[pid], bytes(value).hex())
        elif isinstance(value, list):  # subscription identifiers
            out.setdefault(_NAMES[pid], ",".join(str(v) for v in value))
        else:
            out.setdefault(_NAMES[pid], str(value))
    return list(out.items())


def to_record_batch(stream: str, partition: int, records: Sequence[Record]) -> pa.RecordBatch:
    """One Arrow record batch (schema :data:`SCHEMA`) holding ``records`` in order."""
    n = len(records)
    if n == 0:
        return pa.record_batch([pa.array([], f.type) for f in SCHEMA], schema=SCHEMA)
    offsets, timestamps, topics, payloads, qos, retain, client_ids, props = zip(
        *records, strict=True
    )
    millis = pa.array(timestamps, pa.int64())
    columns = [
        pa.repeat(pa.scalar(stream, pa.string()), n),
        pa.repeat(pa.scalar(partition, pa.int32()), n),
        pa.array(offsets, pa.int64()),
        pc.multiply(millis, 1000).cast(pa.timestamp("us", tz="UTC")),
        pa.array(topics, pa.string()),
        pa.array(payloads, pa.binary()),
        _column(qos, pa.int32()),
        _column(retain, pa.bool_()),
        pa.array(client_ids, pa.string()),
        _properties_column(props),
    ]
    return pa.record_batch(columns, schema=SCHEMA)


def columns_to_record_batch(stream: str, partition: int, read: ColumnRead) -> pa.RecordBatch:
    """The record batch :func:`to_record_batch` makes of the same records, from their columns.

    Offsets and string indexes are per stored batch (a base offset and a string table each):
    a run-end-encoded column spreads each slice's base (and string-table start) over its
    records, so one Arrow add makes them absolute for the whole read.
    """
    n = read.count
    if n == 0:
        return to_record_batch(stream, partition, [])
    run_ends = pa.array(read.run_ends, pa.int32())
    bases = pc.run_end_decode(
        pa.RunEndEncodedArray.from_arrays(run_ends, pa.array(read.bases, pa.int64()))
    )
    table_starts = pc.run_end_decode(
        pa.RunEndEncodedArray.from_arrays(run_ends, pa.array(read.table_starts, pa.uint32()))
    )
    strings = pa.array(read.strings, pa.string())
    millis, deltas, topics, client_ids, payload_lengths, qos, flags = _stored_fixed(read)
    columns = [
        pa.repeat(pa.scalar(stream, pa.string()), n),
        pa.repeat(pa.scalar(partition, pa.int32()), n),
        pc.add(deltas.cast(pa.int64()), bases),
        pc.multiply(millis, 1000).cast(pa.timestamp("us", tz="UTC")),
        strings.take(pc.add(topics, table_starts)),
        _binary(n, payload_lengths.buffers()[1], read.joined("payloads")),
        qos.cast(pa.int32()),
        pc.not_equal(pc.bit_wise_and(flags, pa.scalar(1, pa.uint8())), 0),
        strings.take(pc.add(client_ids, table_starts)),
        _stored_properties(n, read),
    ]
    return pa.record_batch(columns, schema=SCHEMA)


#: The fixed-size columns :func:`columns_to_record_batch` uses, and their Arrow types.
_FIXED = [
    ("timestamps", pa.int64()),
    ("deltas", pa.uint32()),
    ("topic_indexes", pa.uint32()),
    ("client_id_indexes", pa.uint32()),
    ("payload_lengths", pa.uint32()),
    ("qos", pa.uint8()),
    ("flags", pa.uint8()),
]
#: Above this many records per slice on average, joining each column's slices is cheaper.
_GATHER_BELOW = 32


def _stored_fixed(read: ColumnRead) -> list[pa.Array]:
    """Timestamps, offset deltas, topic and client id indexes, payload lengths, QoS and flags
    of the read's records (little-endian, as Arrow on every host this runs on).

    Read from large batches, each column's slices are joined. From small ones (a fleet's log:
    1-3 records per batch, where slicing seven columns of every batch was half the fetch), the
    batches' whole column blocks (``RECORD_FIXED_SIZE * n`` bytes) are joined with one bytes
    slice each, and Arrow gathers every column's bytes from them with one take: within a
    block a slice's column is one run of bytes, so the byte indexes are a run-end decode of
    one start per slice plus the output position.
    """
    n = read.count
    spans = read.spans
    if n >= _GATHER_BELOW * len(spans):
        return [
            pa.Array.from_buffers(type_, n, [None, pa.py_buffer(read.joined(name))])
            for name, type_ in _FIXED
        ]
    data = b"".join(
        [b[p : p + RECORD_FIXED_SIZE * k] for b, _v, p, k, _f, _s, _x, _y, _a, _c in spans]
    )
    blocks = pa.Array.from_buffers(pa.uint8(), len(data), [None, pa.py_buffer(data)])
    counts = _int64s(map(itemgetter(3), spans))
    firsts = _int64s(map(itemgetter(4), spans))
    ends = pa.array(read.run_ends, pa.int64())
    run_starts = pc.subtract(ends, pc.subtract(_int64s(map(itemgetter(5), spans)), firsts))
    block_starts = pc.multiply(pc.subtract(pc.cumulative_sum(counts), counts), RECORD_FIXED_SIZE)
    firsts_less_starts = pc.subtract(firsts, run_starts)
    out = []
    for name, type_ in _FIXED:
        width, at = FIXED_COLUMNS[name]
        # Byte q of the output, in slice j, is byte q + starts[j] of the blocks: slice j's
        # output begins at width * run_starts[j], its bytes at block_starts[j] + at * n_j
        # + width * firsts[j].
        starts = pc.add(
            pc.add(block_starts, pc.multiply(counts, at)), pc.multiply(firsts_less_starts, width)
        )
        index = pc.add(
            _arange(width * n),
            pc.run_end_decode(pa.RunEndEncodedArray.from_arrays(pc.multiply(ends, width), starts)),
        )
        out.append(pa.Array.from_buffers(type_, n, [None, blocks.take(index).buffers()[1]]))
    return out


def _int64s(values: Iterable[int]) -> pa.Array:
    """``values`` as an int64 array (through ``array``: no per-value pyarrow conversion)."""
    return pa.Array.from_buffers(
        pa.int64(), len(buf := array("q", values)), [None, pa.py_buffer(buf)]
    )


_ARANGE = [pa.array(range(1 << 16), pa.int64())]


def _arange(n: int) -> pa.Array:
    """0 .. n - 1 (int64), a slice of one array kept for every read (replaced by a longer
    one when a read needs more)."""
    values = _ARANGE[0]
    if len(values) < n:
        values = _ARANGE[0] = pa.array(range(max(n, 2 * len(values))), pa.int64())
    return values.slice(0, n)


def _binary(n: int, lengths: bytes, data: bytes) -> pa.Array:
    """A binary array: the stored lengths summed into Arrow's n + 1 int32 offsets (a zero
    first), the stored bytes as its data."""
    ends = pa.Array.from_buffers(pa.int32(), n + 1, [None, pa.py_buffer(b"\0\0\0\0" + lengths)])
    return pa.Array.from_buffers(
        pa.binary(), n, [None, pc.cumulative_sum(ends).buffers()[1], pa.py_buffer(data)]
    )


def _stored_properties(n: int, read: ColumnRead) -> pa.Array:
    data = read.joined("properties")
    if not data:
        return _empty_maps(n)
    return _properties_column(_binary(n, read.joined("property_lengths"), data).to_pylist())


def _column(values: Sequence[Any], type_: pa.DataType) -> pa.Array:
    """``values`` as an array; a constant column (telemetry's QoS and retain flag) is built
    as a repeated scalar, ~10x cheaper than converting every Python value."""
    first = values[0]
    if values.count(first) == len(values):
        return pa.repeat(pa.scalar(first, type_), len(values))
    return pa.array(values, type_)


def _properties_column(blobs: Sequence[bytes]) -> pa.Array:
    if not any(blobs):
        return _empty_maps(len(blobs))
    return pa.array([property_pairs(p) if p else () for p in blobs], PROPERTIES_TYPE)


def _empty_maps(n: int) -> pa.Array:
    """The common case (MQTT 3.1.1 telemetry): n empty maps, built from offsets alone."""
    return pa.MapArray.from_arrays(
        pa.repeat(pa.scalar(0, pa.int32()), n + 1), _NO_STRINGS, _NO_STRINGS
    )


_NO_STRINGS = pa.array([], pa.string())


def to_ipc_stream(batch: pa.RecordBatch) -> bytes:
    """``batch`` as an Arrow IPC stream (schema, the batch, end-of-stream marker)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, SCHEMA) as writer:
        if batch.num_rows:
            writer.write_batch(batch)
    return bytes(sink.getvalue())


def to_json_record(stream: str, partition: int, record: Record) -> dict[str, Any]:
    """One record as a JSON object: timestamp in epoch milliseconds, payload in base64."""
    return {
        "stream": stream,
        "partition": partition,
        "offset": record.offset,
        "timestamp": record.timestamp,
        "topic": record.topic,
        "payload": base64.b64encode(record.payload).decode("ascii"),
        "qos": record.qos,
        "retain": record.retain,
        "client_id": record.client_id,
        "properties": dict(property_pairs(record.properties)),
    }
