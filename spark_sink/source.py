"""The ``mqlog`` PySpark data source: batch and Structured Streaming reads of a broker's streams.

Spark plans on the driver and reads in Python workers:

- offsets are the log's own: a Spark offset is ``{stream: {"<partition>": next offset}}``
  (string keys, as Spark stores offsets as JSON), so a checkpoint names exactly which records
  a micro-batch held, and a restarted query re-reads the same records (exactly-once output
  with an idempotent or transactional sink such as the file sink);
- an :class:`OffsetRangePartition` carries everything a worker needs (broker URL, stream,
  partition, ``[start, end)``, topic filter, data-loss policy), plain picklable values; no
  reader holds a connection or other unpicklable state;
- :func:`read_range` fetches the range through the HTTP fetch API as Arrow record batches
  (schema :data:`broker.http.arrow.SCHEMA`) and yields them as they are, filtered by topic;
- ``maxRecordsPerTrigger`` is admission control through ``ReadMaxRows``: a micro-batch takes
  at most that many log records, shared among partitions in proportion to their backlog;
  ``Trigger.AvailableNow`` fixes the high-water marks at query start and drains up to them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from spark_sink.client import (
    BrokerClient,
    Fetched,
    MqlogSourceError,
    OffsetOutOfRange,
    PartitionOffsets,
)
from spark_sink.options import EARLIEST, LATEST, Positions, SourceOptions, parse_options

# pyarrow.compute and broker.mqtt are imported where they are used: Spark unpickles the data
# source, and so imports this module, in a fresh process at every query start (the streaming
# source runner), which then only plans offsets; the two cost it ~0.09 s before the first
# micro-batch.

logger = logging.getLogger("spark_sink")

#: The Spark schema of every row; :data:`broker.http.arrow.SCHEMA` is the same in Arrow.
SCHEMA_DDL = (
    "stream string, partition int, offset long, timestamp timestamp, topic string, "
    "payload binary, qos int, retain boolean, client_id string, "
    "properties map<string, string>"
)

#: A partition's offset range is split into Spark partitions of at most this many records,
#: so one busy log partition still spreads over the executor cores.
SPLIT_RECORDS = 250_000

SparkOffsets = dict[str, dict[str, int]]


class DataLoss(MqlogSourceError):
    """Records a query needed were deleted (retention) or are gone (a truncated log)."""


class OffsetRangePartition(InputPartition):
    """Records ``[start, end)`` of one stream partition; picklable, self-contained."""

    def __init__(
        self,
        broker: str,
        stream: str,
        partition: int,
        start: int,
        end: int,
        topic_filter: str | None,
        fail_on_data_loss: bool,
        fetch_records: int,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        super().__init__((stream, partition, start, end))
        self.broker = broker
        self.user = user
        self.password = password
        self.stream = stream
        self.partition = partition
        self.start = start
        self.end = end
        self.topic_filter = topic_filter
        self.fail_on_data_loss = fail_on_data_loss
        self.fetch_records = fetch_records

    def __repr__(self) -> str:
        return f"OffsetRangePartition({self.stream}/{self.partition} [{self.start}, {self.end}))"


# ------------------------------------------------------------------------------ reading
def filter_topics(batch: pa.RecordBatch, topic_filter: str) -> pa.RecordBatch:
    """The rows of ``batch`` whose topic matches the MQTT ``topic_filter``.

    Matching is decided once per distinct topic with the broker's own
    :func:`~broker.mqtt.topics.topic_matches`.
    """
    import pyarrow.compute as pc

    from broker.mqtt.topics import topic_matches

    topics = batch.column("topic")
    distinct = pc.unique(topics).to_pylist()
    keep = [t for t in distinct if topic_matches(topic_filter, t)]
    if len(keep) == len(distinct):
        return batch
    return batch.filter(pc.is_in(topics, value_set=pa.array(keep, pa.string())))


def _lost(part: OffsetRangePartition, message: str) -> None:
    """Raise :class:`DataLoss`, or warn when the query runs with ``failOnDataLoss=false``."""
    where = f"stream {part.stream!r} partition {part.partition}"
    if part.fail_on_data_loss:
        raise DataLoss(
            f"{where}: {message}. Set option failOnDataLoss=false to skip the "
            "missing records with a warning instead of failing"
        )
    logger.warning("%s: %s; skipping them (failOnDataLoss=false)", where, message)


def read_range(part: OffsetRangePartition) -> Iterator[pa.RecordBatch]:
    """Fetch ``[part.start, part.end)`` as Arrow batches in offset order.

    The next fetch is in flight while Spark consumes the current batch (one request ahead,
    on a helper thread that holds the connection only while it waits for the broker), so the
    broker's read and encode overlap Spark's conversion and Parquet write instead of
    alternating with them.
    """
    if part.start >= part.end:
        return
    with (
        BrokerClient(part.broker, user=part.user, password=part.password) as client,
        ThreadPoolExecutor(1) as ahead,
    ):

        def fetch(offset: int) -> Future[Fetched]:
            return ahead.submit(
                client.fetch,
                part.stream,
                part.partition,
                offset,
                min(part.fetch_records, part.end - offset),
            )

        offset = part.start
        pending = fetch(offset)
        while True:
            try:
                fetched = pending.result()
            except OffsetOutOfRange as e:
                if offset < e.earliest_offset:
                    _lost(
                        part,
                        f"offsets {offset}..{min(e.earliest_offset, part.end) - 1} "
                        f"were deleted by retention (earliest retained offset is "
                        f"{e.earliest_offset})",
                    )
                    offset = e.earliest_offset
                    if offset >= part.end:
                        return
                    pending = fetch(offset)
                    continue
                _lost(
                    part,
                    f"offset {offset} is past the high-water mark "
                    f"{e.high_water_mark}: the broker no longer holds records "
                    f"{e.high_water_mark}..{part.end - 1} it reported before",
                )
                return
            batch = fetched.batch
            if batch is None:  # caught up below the planned end: the log lost its tail
                _lost(
                    part,
                    f"the high-water mark {fetched.high_water_mark} is below the "
                    f"planned end offset {part.end}",
                )
                return
            offset = fetched.next_offset
            if offset < part.end:
                pending = fetch(offset)
            if batch.column("offset")[-1].as_py() >= part.end:  # a gap (compaction)
                import pyarrow.compute as pc

                batch = batch.filter(pc.less(batch.column("offset"), part.end))
            if part.topic_filter is not None:
                batch = filter_topics(batch, part.topic_filter)
            if batch.num_rows:
                yield batch
            if offset >= part.end:
                return


def _read(partition: InputPartition) -> Iterator[pa.RecordBatch]:
    # With no ranges to read, Spark still runs one task with a placeholder partition.
    if not isinstance(partition, OffsetRangePartition):
        return iter(())
    return read_range(partition)


# ------------------------------------------------------------------------------ planning
def _resolve(
    client: BrokerClient,
    opts: SourceOptions,
    stream: str,
    parts: list[PartitionOffsets],
    spec: str | Positions,
    *,
    starting: bool,
) -> dict[int, int]:
    """Concrete offsets per partition for ``spec`` (``earliest``/``latest``/positions)."""
    if starting and opts.starting_timestamp is not None:
        return {
            p.partition: client.offset_for_time(stream, p.partition, opts.starting_timestamp)
            for p in parts
        }
    known = {p.partition for p in parts}
    given: dict[int, int] = {}
    if isinstance(spec, dict):
        given = spec.get(stream, {})
        unknown = sorted(set(given) - known)
        if unknown:
            key = "startingOffsets" if starting else "endingOffsets"
            raise OffsetOutOfRange(
                f"option {key!r} names partition(s) {unknown} of stream {stream!r}, which has "
                f"partitions 0..{len(parts) - 1}",
                unknown[0],
                0,
                0,
            )
    out = {}
    for p in parts:
        default = EARLIEST if starting else LATEST
        if isinstance(spec, str):
            default = EARLIEST if spec == "earliest" else LATEST
        offset = given.get(p.partition, default)
        out[p.partition] = (
            p.earliest_offset
            if offset == EARLIEST
            else p.high_water_mark
            if offset == LATEST
            else offset
        )
    return out


def _check_start(opts: SourceOptions, stream: str, p: PartitionOffsets, offset: int) -> int:
    """``offset`` when the partition holds it; below the earliest offset: the earliest with a
    warning (``failOnDataLoss=false``) or an error; past the high-water mark: an error."""
    where = f"stream {stream!r} partition {p.partition}"
    if offset > p.high_water_mark:
        raise OffsetOutOfRange(
            f"{where}: starting offset {offset} is out of range: valid offsets are "
            f"[{p.earliest_offset}, {p.high_water_mark}]",
            offset,
            p.earliest_offset,
            p.high_water_mark,
        )
    if offset < p.earliest_offset:
        message = (
            f"{where}: starting offset {offset} is out of range: valid offsets are "
            f"[{p.earliest_offset}, {p.high_water_mark}] (offsets below "
            f"{p.earliest_offset} were deleted by retention)"
        )
        if opts.fail_on_data_loss:
            raise OffsetOutOfRange(
                message + "; set failOnDataLoss=false to start at the earliest retained offset",
                offset,
                p.earliest_offset,
                p.high_water_mark,
            )
        logger.warning("%s; starting at %d (failOnDataLoss=false)", message, p.earliest_offset)
        return p.earliest_offset
    return offset


def split_ranges(
    opts: SourceOptions, ranges: Sequence[tuple[str, int, int, int]]
) -> list[OffsetRangePartition]:
    """Input partitions for ``(stream, partition, start, end)`` ranges (empty ones dropped),
    each at most :data:`SPLIT_RECORDS` records."""
    out = []
    for stream, partition, start, end in ranges:
        for lo in range(start, end, SPLIT_RECORDS):
            out.append(
                OffsetRangePartition(
                    opts.broker,
                    stream,
                    partition,
                    lo,
                    min(end, lo + SPLIT_RECORDS),
                    opts.topic_filter,
                    opts.fail_on_data_loss,
                    opts.max_records_per_fetch,
                    opts.user,
                    opts.password,
                )
            )
    return out


def to_spark(offsets: dict[str, dict[int, int]]) -> SparkOffsets:
    return {s: {str(p): o for p, o in sorted(parts.items())} for s, parts in offsets.items()}


def from_spark(offsets: dict[str, Any]) -> dict[str, dict[int, int]]:
    return {s: {int(p): int(o) for p, o in parts.items()} for s, parts in offsets.items()}


def allocate(budget: int, backlog: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
    """Split ``budget`` records among partitions in proportion to their backlog.

    Never more than a partition's backlog or than ``budget`` in total; when the budget is
    smaller than the total backlog it is used completely, so every batch makes progress.
    """
    total = sum(backlog.values())
    if total <= budget:
        return dict(backlog)
    share = {k: budget * n // total for k, n in backlog.items()}
    left = budget - sum(share.values())
    for k in sorted(backlog, key=lambda k: backlog[k] - share[k], reverse=True):
        if left == 0:
            break
        if share[k] < backlog[k]:
            share[k] += 1
            left -= 1
    return share


class MqlogBatchReader(DataSourceReader):
    """A batch read of ``[startingOffsets, endingOffsets)`` of each partition."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        opts = self.opts
        ranges = []
        with opts.client() as client:
            for stream in opts.streams:
                parts = client.partitions(stream)
                starts = _resolve(
                    client, opts, stream, parts, opts.starting or "earliest", starting=True
                )
                ends = _resolve(client, opts, stream, parts, opts.ending, starting=False)
                for p in parts:
                    start = _check_start(opts, stream, p, starts[p.partition])
                    end = ends[p.partition]
                    if end > p.high_water_mark:
                        raise OffsetOutOfRange(
                            f"stream {stream!r} partition {p.partition}: ending offset {end} "
                            f"is past the high-water mark {p.high_water_mark}",
                            end,
                            p.earliest_offset,
                            p.high_water_mark,
                        )
                    if end < start:
                        raise OffsetOutOfRange(
                            f"stream {stream!r} partition {p.partition}: ending offset {end} "
                            f"is below the starting offset {start}",
                            end,
                            p.earliest_offset,
                            p.high_water_mark,
                        )
                    ranges.append((stream, p.partition, start, end))
        return split_ranges(opts, ranges)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(partition)


class MqlogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of new records; offsets as in the module docstring.

    Runs in one long-lived Python process on the driver: the broker client is created on
    first use and closed in :meth:`stop`.
    """

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._client: BrokerClient | None = None
        #: Trigger.AvailableNow: the high-water marks at query start, never read past them.
        self._target: dict[str, dict[int, int]] | None = None

    @property
    def client(self) -> BrokerClient:
        if self._client is None:
            self._client = self.opts.client()
        return self._client

    def _partitions(self) -> dict[str, list[PartitionOffsets]]:
        return {s: self.client.partitions(s) for s in self.opts.streams}

    def initialOffset(self) -> dict[str, Any]:
        opts = self.opts
        out: dict[str, dict[int, int]] = {}
        for stream, parts in self._partitions().items():
            starts = _resolve(
                self.client, opts, stream, parts, opts.starting or "latest", starting=True
            )
            out[stream] = {
                p.partition: _check_start(opts, stream, p, starts[p.partition]) for p in parts
            }
        return to_spark(out)

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_records_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {
            s: {p.partition: p.high_water_mark for p in parts}
            for s, parts in self._partitions().items()
        }

    def reportLatestOffset(self) -> dict[str, Any]:
        return to_spark(
            {
                s: {p.partition: p.high_water_mark for p in parts}
                for s, parts in self._partitions().items()
            }
        )

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        begin = from_spark(start)
        backlog: dict[tuple[str, int], int] = {}
        base: dict[tuple[str, int], int] = {}
        for stream, parts in self._partitions().items():
            for p in parts:
                key = (stream, p.partition)
                # A partition new since the last batch starts at its earliest offset.
                first = begin.get(stream, {}).get(p.partition, p.earliest_offset)
                if not self.opts.fail_on_data_loss:
                    first = max(first, p.earliest_offset)
                end = p.high_water_mark
                if self._target is not None:
                    end = min(end, self._target.get(stream, {}).get(p.partition, 0))
                base[key] = first
                backlog[key] = max(0, end - first)
        take = backlog
        if isinstance(limit, ReadMaxRows):
            take = allocate(limit.max_rows, backlog)
        out: dict[str, dict[int, int]] = {}
        for (stream, pid), first in base.items():
            out.setdefault(stream, {})[pid] = first + take[(stream, pid)]
        return to_spark(out)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin, stop = from_spark(start), from_spark(end)
        if any(p not in begin.get(s, {}) for s, parts in stop.items() for p in parts):
            # A partition new since the previous batch starts where latestOffset started it.
            for stream, current in self._partitions().items():
                for p in current:
                    begin.setdefault(stream, {}).setdefault(p.partition, p.earliest_offset)
        ranges = [
            (stream, p, begin.get(stream, {}).get(p, 0), o)
            for stream, parts in stop.items()
            for p, o in sorted(parts.items())
        ]
        return split_ranges(self.opts, ranges)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to release: the broker keeps records until retention, not until read."""

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class MqlogDataSource(DataSource):
    """``spark.read.format("mqlog")`` / ``spark.readStream.format("mqlog")``; options in
    :mod:`spark_sink.options`. Options are validated when the source is created."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.parsed = parse_options(options)

    @classmethod
    def name(cls) -> str:
        return "mqlog"

    def schema(self) -> StructType | str:
        return SCHEMA_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return MqlogBatchReader(self.parsed)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return MqlogStreamReader(self.parsed)
