"""The HTTP fetch API: read a partition's records by offset, find an offset by time.

Routes (mounted by :class:`broker.http.api.HttpApi`):

- ``GET /api/v1/streams/<stream>/partitions/<p>/records?offset=N[&max_records=M][&max_bytes=B]``:
  records with offset >= N in order, at most ``M`` (default :data:`DEFAULT_MAX_RECORDS`, capped
  at :data:`MAX_RECORDS_LIMIT`) and about ``B`` bytes of stored records (capped at
  :data:`MAX_BYTES_LIMIT`; at least one record when one exists). The body is an Arrow IPC
  stream with schema :data:`broker.http.arrow.SCHEMA`, or JSON with ``Accept: application/json``
  (``{"records": [...], "next_offset", ...}``, payload in base64, timestamp in epoch ms).
  Headers ``X-Mqlog-Next-Offset`` (where to continue: past the last record returned, or N when
  there was none), ``X-Mqlog-High-Water-Mark`` and ``X-Mqlog-Earliest-Offset``.
  ``offset == high-water mark`` returns no records (the caller is caught up).
  With an ACL file, only the records whose topic the caller may read (its ``read`` rules, as
  a subscriber's; anonymous rules without credentials) are returned; the next offset still
  moves past the ones withheld, so a reader never stalls on them.
- ``GET /api/v1/streams/<stream>/partitions/<p>/offset?timestamp=<epoch ms>``: the first offset
  whose record timestamp is >= the timestamp, or the high-water mark when there is none.

Errors are JSON ``{"error": ...}``: 400 for a malformed parameter, 404 for an unknown stream or
partition, 416 for an offset outside ``[earliest, high-water mark]``; the 416 body also carries
``earliest_offset`` and ``high_water_mark`` so a client can skip forward deliberately.
503 at a damaged range the stream holds (``on_corruption = "stop"``): the body names it
(``damaged_from``, ``damaged_to``, -1 for "to the segment's end"); under ``skip`` (the default)
a read passes over damage, so the records returned may skip offsets, as after compaction.

Threads: the log read runs on the broker's loop (the log's rule: reads from the owner's loop
thread), bounded by the limits above; encoding the immutable records as Arrow or JSON runs in
the loop's default executor, so a fetch holds the loop only for the read itself.

The partitions are found through :class:`PartitionSource` (:class:`broker.server.Server` is
one): this room never imports the server.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import orjson
from aiohttp import web

from broker.commitlog import (
    CommitLogError,
    CorruptRecordBatch,
    OffsetOutOfRange,
    Record,
    SegmentedLog,
    Streams,
)
from broker.commitlog.columns import ColumnRead
from broker.commitlog.reader import LogReader
from broker.http.access import HttpUser, request_user

# broker.http.arrow (and pyarrow with it) is imported by the first fetch, not with this
# module: pyarrow adds about 50 MB to the RSS of every process that imports it (the
# supervisor and each worker of every broker), for an API many brokers never serve.

DEFAULT_MAX_RECORDS = 1000
#: Upper bound of one fetch: a read of this many records holds the loop for a few ms.
MAX_RECORDS_LIMIT = 10_000
DEFAULT_MAX_BYTES = 1 << 20
MAX_BYTES_LIMIT = 8 << 20

PARTITION_PATH = "/api/v1/streams/{stream}/partitions/{partition}"


class BadRequest(Exception):
    """A request parameter is missing or malformed; the message names it."""


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


def _int_param(
    request: web.Request, name: str, default: int | None = None, minimum: int = 0
) -> int:
    raw = request.query.get(name)
    if raw is None:
        if default is None:
            raise BadRequest(f"query parameter {name!r} is required")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"query parameter {name!r} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise BadRequest(f"query parameter {name!r} must be >= {minimum}, got {value}")
    return value


class PartitionSource(Protocol):
    """Where the fetch API finds a stream's partitions and their logs."""

    @property
    def streams(self) -> Streams: ...

    def partition_log(self, key: tuple[str, int]) -> SegmentedLog | LogReader:
        """The log of partition ``key`` for reading (this worker's own, or a reader of the
        one another worker owns)."""
        ...


class FetchApi:
    """The fetch routes of one broker; handlers run on the loop that owns the logs."""

    def __init__(self, server: PartitionSource) -> None:
        self.server = server

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get(f"{PARTITION_PATH}/records", self.records),
            web.get(f"{PARTITION_PATH}/offset", self.offset_for_time),
        ]

    def _log(
        self, request: web.Request
    ) -> tuple[str, int, SegmentedLog | LogReader] | web.Response:
        """The partition named by the path, or a 404 response."""
        name = request.match_info["stream"]
        spec = self.server.streams.specs.get(name)
        if spec is None:
            return _json({"error": f"no stream named {name!r}"}, 404)
        raw = request.match_info["partition"]
        if not raw.isdigit() or int(raw) >= spec.partitions:
            return _json(
                {"error": f"stream {name!r} has partitions 0..{spec.partitions - 1}, not {raw!r}"},
                404,
            )
        partition = int(raw)
        try:
            return name, partition, self.server.partition_log((name, partition))
        except CommitLogError as e:
            return _json({"error": str(e)}, 503)

    async def records(self, request: web.Request) -> web.Response:
        found = self._log(request)
        if isinstance(found, web.Response):
            return found
        stream, partition, plog = found
        try:
            offset = _int_param(request, "offset")
            max_records = min(
                _int_param(request, "max_records", DEFAULT_MAX_RECORDS, 1), MAX_RECORDS_LIMIT
            )
            max_bytes = min(_int_param(request, "max_bytes", DEFAULT_MAX_BYTES, 1), MAX_BYTES_LIMIT)
        except BadRequest as e:
            return _json({"error": str(e)}, 400)
        as_json = "application/json" in request.headers.get("Accept", "")
        try:
            if as_json:
                records = plog.read(offset, max_records, max_bytes)
            else:
                read = plog.read_columns(offset, max_records, max_bytes)
        except OffsetOutOfRange as e:
            return _json(
                {
                    "error": f"stream {stream!r} partition {partition}: {e}",
                    "offset": e.offset,
                    "earliest_offset": e.log_start_offset,
                    "high_water_mark": e.end_offset,
                },
                416,
            )
        except CorruptRecordBatch as e:
            # A damaged range the stream holds (on_corruption = "stop"): the client learns
            # which offsets; other partitions and requests are unaffected.
            return _json(
                {
                    "error": f"stream {stream!r} partition {partition}: {e}",
                    "offset": offset,
                    "damaged_from": e.first_offset,
                    "damaged_to": e.last_offset,
                },
                503,
            )
        except CommitLogError as e:  # not held here (a cluster node outside its group)
            return _json({"error": str(e)}, 503)
        if as_json:
            next_offset = records[-1].offset + 1 if records else offset
        else:
            # Past the control batches the read skipped too (a replicated log's no-ops).
            next_offset = max(offset, read.next_offset)
        headers = {
            "X-Mqlog-Next-Offset": str(next_offset),
            "X-Mqlog-High-Water-Mark": str(plog.end_offset),
            "X-Mqlog-Earliest-Offset": str(plog.log_start_offset),
        }
        loop = asyncio.get_running_loop()
        user = request_user(request)
        reader = user if user is not None and user.authorizer is not None else None
        if as_json:
            if reader is not None:
                records = [r for r in records if reader.can_read(r.topic)]
            body = await loop.run_in_executor(
                None, _json_body, stream, partition, records, next_offset, plog.end_offset
            )
            return web.Response(body=body, content_type="application/json", headers=headers)
        body = await loop.run_in_executor(None, _arrow_body, stream, partition, read, reader)
        from broker.http.arrow import ARROW_STREAM_TYPE  # imported by _arrow_body

        return web.Response(body=body, content_type=ARROW_STREAM_TYPE, headers=headers)

    async def offset_for_time(self, request: web.Request) -> web.Response:
        found = self._log(request)
        if isinstance(found, web.Response):
            return found
        stream, partition, plog = found
        try:
            timestamp = _int_param(request, "timestamp")
        except BadRequest as e:
            return _json({"error": f"{e} (epoch milliseconds)"}, 400)
        return _json(
            {
                "stream": stream,
                "partition": partition,
                "timestamp": timestamp,
                "offset": plog.offset_for_time(timestamp),
                "earliest_offset": plog.log_start_offset,
                "high_water_mark": plog.end_offset,
            }
        )


def _arrow_body(stream: str, partition: int, read: ColumnRead, reader: HttpUser | None) -> bytes:
    import pyarrow as pa  # on first use (see the imports)

    from broker.http.arrow import columns_to_record_batch, to_ipc_stream

    batch = columns_to_record_batch(stream, partition, read)
    if reader is not None and batch.num_rows:
        topics = batch.column("topic").to_pylist()
        allowed = {t: reader.can_read(t) for t in set(topics)}  # once per distinct topic
        batch = batch.filter(pa.array([allowed[t] for t in topics], pa.bool_()))
    return to_ipc_stream(batch)


def _json_body(
    stream: str, partition: int, records: list[Record], next_offset: int, high_water_mark: int
) -> bytes:
    from broker.http.arrow import to_json_record  # on first use (see the imports)

    return orjson.dumps(
        {
            "stream": stream,
            "partition": partition,
            "next_offset": next_offset,
            "high_water_mark": high_water_mark,
            "records": [to_json_record(stream, partition, r) for r in records],
        }
    )
