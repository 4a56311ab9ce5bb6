"""The fetch API's routes (broker.http.fetch_api) in process: aiohttp's test server over real
partition logs in a temporary directory, without a broker.

tests/integration/test_fetch_api.py covers the same routes end to end against records a
real client published; here: the limits (default, caps, bytes), the Accept header, every
400 / 404 / 416 / 503 answer and its message, empty reads, and a partition read through a
:class:`LogReader` (another worker's) that stops at the announced high-water mark.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from broker.commitlog import CommitLogError, LogConfig, Record, SegmentedLog, Streams, StreamSpec
from broker.commitlog.batch import encode_control
from broker.commitlog.reader import LogReader
from broker.http.arrow import ARROW_STREAM_TYPE, SCHEMA
from broker.http.fetch_api import (
    DEFAULT_MAX_RECORDS,
    MAX_RECORDS_LIMIT,
    FetchApi,
)

T0 = 1_700_000_000_000
RECORDS = "/api/v1/streams/{}/partitions/{}/records"
OFFSET = "/api/v1/streams/{}/partitions/{}/offset"
TELEMETRY = StreamSpec("telemetry", ("devices/#",), 2, LogConfig(fsync="never"))


class FakeServer:
    """What FetchApi uses of its server: the stream specs and a partition's log for reading.

    ``logs`` overrides :meth:`partition_log` per partition (a LogReader, or an error)."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.logs: dict[tuple[str, int], SegmentedLog | LogReader | Exception] = {}

    def partition_log(self, key: tuple[str, int]) -> SegmentedLog | LogReader:
        found = self.logs.get(key)
        if isinstance(found, Exception):
            raise found
        return found if found is not None else self.streams.log(*key)


class Fetcher:
    """An aiohttp test server with the fetch routes, on a loop of its own."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.add_routes(FetchApi(server).routes())  # type: ignore[arg-type]
        self.client: TestClient[Any, Any] = self.loop.run_until_complete(self._start(app))

    @staticmethod
    async def _start(app: web.Application) -> TestClient[Any, Any]:
        client: TestClient[Any, Any] = TestClient(TestServer(app))
        await client.start_server()
        return client

    def get(self, path: str, accept: str | None = None) -> tuple[int, dict[str, str], bytes]:
        async def go() -> tuple[int, dict[str, str], bytes]:
            headers = {"Accept": accept} if accept is not None else {}
            async with self.client.get(path, headers=headers) as resp:
                return resp.status, dict(resp.headers), await resp.read()

        return self.loop.run_until_complete(go())

    def json(self, path: str, status: int = 200) -> Any:
        got, headers, body = self.get(path, accept="application/json")
        assert got == status, body
        assert headers["Content-Type"].startswith("application/json")
        return orjson.loads(body)

    def rows(self, path: str) -> tuple[dict[str, str], list[dict[str, Any]]]:
        status, headers, body = self.get(path)
        assert status == 200, body
        assert headers["Content-Type"] == ARROW_STREAM_TYPE
        table = pa.ipc.open_stream(body).read_all()
        assert table.schema == SCHEMA
        return headers, table.to_pylist()

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


@pytest.fixture
def streams(tmp_path: Path) -> Iterator[Streams]:
    with Streams(tmp_path / "data", [TELEMETRY]) as s:
        yield s


@pytest.fixture
def server(streams: Streams) -> FakeServer:
    """The one place FetchApi's server is built: adapt here when its interface changes."""
    return FakeServer(streams)


@pytest.fixture
def fetch(server: FakeServer) -> Iterator[Fetcher]:
    f = Fetcher(server)
    yield f
    f.close()


def records(n: int, first: int = 0, size: int = 10) -> list[Record]:
    return [
        Record(
            0, T0 + 10 * i, f"devices/d{i % 3}", b"%d:" % i + b"p" * size, i % 3, i % 2 == 0, "c"
        )
        for i in range(first, first + n)
    ]


def fill(streams: Streams, n: int, partition: int = 0, size: int = 10) -> list[Record]:
    written = records(n, size=size)
    streams.log("telemetry", partition).append(written)
    return [r._replace(offset=i) for i, r in enumerate(written)]


# ========================================================================= records


def test_arrow_by_default_with_paging_headers(streams: Streams, fetch: Fetcher) -> None:
    written = fill(streams, 12)
    headers, rows = fetch.rows(RECORDS.format("telemetry", 0) + "?offset=4&max_records=5")
    assert [(r["offset"], r["payload"], r["qos"], r["retain"]) for r in rows] == [
        (r.offset, r.payload, r.qos, r.retain) for r in written[4:9]
    ]
    assert {(r["stream"], r["partition"]) for r in rows} == {("telemetry", 0)}
    assert headers["X-Mqlog-Next-Offset"] == "9"
    assert headers["X-Mqlog-High-Water-Mark"] == "12"
    assert headers["X-Mqlog-Earliest-Offset"] == "0"


@pytest.mark.parametrize(
    ("accept", "as_json"),
    [
        (None, False),
        ("*/*", False),
        ("application/vnd.apache.arrow.stream", False),
        ("text/html", False),
        ("application/json", True),
        ("text/html, application/json;q=0.9", True),
    ],
)
def test_accept_header_chooses_json_or_arrow(
    streams: Streams, fetch: Fetcher, accept: str | None, as_json: bool
) -> None:
    fill(streams, 3)
    status, headers, body = fetch.get(RECORDS.format("telemetry", 0) + "?offset=0", accept)
    assert status == 200
    if as_json:
        assert headers["Content-Type"].startswith("application/json")
        assert [r["offset"] for r in orjson.loads(body)["records"]] == [0, 1, 2]
    else:
        assert headers["Content-Type"] == ARROW_STREAM_TYPE
        assert pa.ipc.open_stream(body).read_all().num_rows == 3


def test_json_records(streams: Streams, fetch: Fetcher) -> None:
    written = fill(streams, 5)
    data = fetch.json(RECORDS.format("telemetry", 0) + "?offset=1&max_records=3")
    assert (data["stream"], data["partition"]) == ("telemetry", 0)
    assert (data["next_offset"], data["high_water_mark"]) == (4, 5)
    assert data["records"] == [
        {
            "stream": "telemetry",
            "partition": 0,
            "offset": r.offset,
            "timestamp": r.timestamp,
            "topic": r.topic,
            "payload": base64.b64encode(r.payload).decode(),
            "qos": r.qos,
            "retain": r.retain,
            "client_id": "c",
            "properties": {},
        }
        for r in written[1:4]
    ]


def test_reading_at_the_high_water_mark_returns_nothing(streams: Streams, fetch: Fetcher) -> None:
    fill(streams, 4)
    headers, rows = fetch.rows(RECORDS.format("telemetry", 0) + "?offset=4")
    assert rows == [] and headers["X-Mqlog-Next-Offset"] == "4"
    data = fetch.json(RECORDS.format("telemetry", 0) + "?offset=4")
    assert (data["records"], data["next_offset"], data["high_water_mark"]) == ([], 4, 4)
    headers, rows = fetch.rows(RECORDS.format("telemetry", 1) + "?offset=0")  # an empty log
    assert rows == [] and headers["X-Mqlog-High-Water-Mark"] == "0"


def test_max_records_default_and_cap(streams: Streams, fetch: Fetcher) -> None:
    fill(streams, MAX_RECORDS_LIMIT + 5, size=1)
    _, rows = fetch.rows(RECORDS.format("telemetry", 0) + "?offset=0")
    assert len(rows) == DEFAULT_MAX_RECORDS
    headers, rows = fetch.rows(RECORDS.format("telemetry", 0) + "?offset=0&max_records=99999999")
    assert len(rows) == MAX_RECORDS_LIMIT
    assert headers["X-Mqlog-Next-Offset"] == str(MAX_RECORDS_LIMIT)
    data = fetch.json(RECORDS.format("telemetry", 0) + "?offset=3&max_records=99999999")
    assert len(data["records"]) == MAX_RECORDS_LIMIT
    assert data["next_offset"] == MAX_RECORDS_LIMIT + 3


def test_max_bytes_bounds_a_read_but_returns_at_least_one_record(
    streams: Streams, fetch: Fetcher
) -> None:
    log = streams.log("telemetry", 0)
    for r in records(20, size=1000):
        log.append([r])  # a batch each: the byte budget is counted in whole batches
    _, one = fetch.rows(RECORDS.format("telemetry", 0) + "?offset=0&max_bytes=1")
    assert [r["offset"] for r in one] == [0]
    _, some = fetch.rows(RECORDS.format("telemetry", 0) + "?offset=5&max_bytes=3500")
    assert 1 <= len(some) < 15
    assert [r["offset"] for r in some] == list(range(5, 5 + len(some)))
    data = fetch.json(RECORDS.format("telemetry", 0) + "?offset=5&max_bytes=3500")
    assert [r["offset"] for r in data["records"]] == [r["offset"] for r in some]


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("", "query parameter 'offset' is required"),
        ("?offset=", "'offset' must be an integer, got ''"),
        ("?offset=x", "'offset' must be an integer, got 'x'"),
        ("?offset=1.5", "'offset' must be an integer"),
        ("?offset=-1", "'offset' must be >= 0, got -1"),
        ("?offset=0&max_records=0", "'max_records' must be >= 1, got 0"),
        ("?offset=0&max_records=many", "'max_records' must be an integer"),
        ("?offset=0&max_bytes=0", "'max_bytes' must be >= 1, got 0"),
        ("?offset=0&max_bytes=1MiB", "'max_bytes' must be an integer"),
    ],
)
def test_bad_parameters_are_400_naming_them(fetch: Fetcher, query: str, words: str) -> None:
    for accept in (None, "application/json"):
        status, headers, body = fetch.get(RECORDS.format("telemetry", 0) + query, accept)
        assert status == 400
        assert headers["Content-Type"].startswith("application/json")
        assert words in orjson.loads(body)["error"]


@pytest.mark.parametrize(
    ("stream", "partition", "words"),
    [
        ("nope", "0", "no stream named 'nope'"),
        ("telemetry", "2", "stream 'telemetry' has partitions 0..1, not '2'"),
        ("telemetry", "-1", "not '-1'"),
        ("telemetry", "one", "not 'one'"),
    ],
)
def test_unknown_stream_or_partition_is_404(
    fetch: Fetcher, stream: str, partition: str, words: str
) -> None:
    for path in (RECORDS, OFFSET):
        status, _, body = fetch.get(path.format(stream, partition) + "?offset=0&timestamp=0")
        assert status == 404
        assert words in orjson.loads(body)["error"]


def test_offset_past_the_high_water_mark_is_416(streams: Streams, fetch: Fetcher) -> None:
    fill(streams, 3)
    for accept in (None, "application/json"):
        status, _, body = fetch.get(RECORDS.format("telemetry", 0) + "?offset=4", accept)
        assert status == 416
        err = orjson.loads(body)
        assert (err["offset"], err["earliest_offset"], err["high_water_mark"]) == (4, 0, 3)
        assert "stream 'telemetry' partition 0" in err["error"] and "[0, 3]" in err["error"]


def test_offset_below_the_log_start_is_416(tmp_path: Path) -> None:
    small = LogConfig(fsync="never", segment_bytes=300, retention_bytes=600, retention_ms=None)
    with Streams(tmp_path / "d", [StreamSpec("telemetry", ("devices/#",), 1, small)]) as s:
        log = s.log("telemetry", 0)
        for r in records(30, size=40):
            log.append([r])
        assert log.enforce_retention() > 0
        first = log.log_start_offset
        fetch = Fetcher(FakeServer(s))
        try:
            status, _, body = fetch.get(RECORDS.format("telemetry", 0) + f"?offset={first - 1}")
            assert status == 416
            err = orjson.loads(body)
            assert (err["earliest_offset"], err["high_water_mark"]) == (first, 30)
            headers, rows = fetch.rows(RECORDS.format("telemetry", 0) + f"?offset={first}")
            assert rows[0]["offset"] == first
            assert headers["X-Mqlog-Earliest-Offset"] == str(first)
        finally:
            fetch.close()


def test_a_log_that_cannot_be_opened_is_503(server: FakeServer, fetch: Fetcher) -> None:
    server.logs[("telemetry", 1)] = CommitLogError("/data/telemetry/1: permission denied")
    for path in (RECORDS, OFFSET):
        status, _, body = fetch.get(path.format("telemetry", 1) + "?offset=0&timestamp=0")
        assert status == 503
        assert orjson.loads(body) == {"error": "/data/telemetry/1: permission denied"}


def test_another_workers_partition_is_read_up_to_its_announced_mark(
    streams: Streams, server: FakeServer, fetch: Fetcher
) -> None:
    """The fetch reads a partition another worker owns through a LogReader: nothing past
    the high-water mark that worker announced, though its file holds more."""
    log = streams.log("telemetry", 1)
    log.append(records(4))
    log.append(records(3, first=4))
    reader = LogReader(log.directory, log.config, end_offset=4)
    server.logs[("telemetry", 1)] = reader
    headers, rows = fetch.rows(RECORDS.format("telemetry", 1) + "?offset=0")
    assert [r["offset"] for r in rows] == [0, 1, 2, 3]
    assert headers["X-Mqlog-High-Water-Mark"] == "4"
    assert headers["X-Mqlog-Next-Offset"] == "4"
    assert fetch.json(RECORDS.format("telemetry", 1) + "?offset=0")["next_offset"] == 4
    status, _, _ = fetch.get(RECORDS.format("telemetry", 1) + "?offset=5")
    assert status == 416
    reader.advance(7)
    _, rows = fetch.rows(RECORDS.format("telemetry", 1) + "?offset=4")
    assert [r["offset"] for r in rows] == [4, 5, 6]
    reader.close()


# ========================================================================= offset by time


def test_offset_for_time(streams: Streams, fetch: Fetcher) -> None:
    fill(streams, 10)  # timestamps T0, T0 + 10, ..., T0 + 90

    def lookup(ms: int) -> int:
        data = fetch.json(OFFSET.format("telemetry", 0) + f"?timestamp={ms}")
        assert (data["stream"], data["partition"], data["timestamp"]) == ("telemetry", 0, ms)
        assert (data["earliest_offset"], data["high_water_mark"]) == (0, 10)
        return int(data["offset"])

    assert lookup(0) == 0
    assert lookup(T0) == 0
    assert lookup(T0 + 1) == 1
    assert lookup(T0 + 50) == 5
    assert lookup(T0 + 90) == 9
    assert lookup(T0 + 91) == 10  # after every record: the high-water mark
    assert fetch.json(OFFSET.format("telemetry", 1) + "?timestamp=0")["offset"] == 0  # empty


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("", "'timestamp' is required"),
        ("?timestamp=yesterday", "'timestamp' must be an integer"),
        ("?timestamp=-5", "'timestamp' must be >= 0"),
        ("?timestamp=2026-11-21T10:00:00Z", "'timestamp' must be an integer"),
    ],
)
def test_offset_for_time_bad_timestamp_is_400(fetch: Fetcher, query: str, words: str) -> None:
    data = fetch.json(OFFSET.format("telemetry", 0) + query, status=400)
    assert words in data["error"] and "(epoch milliseconds)" in data["error"]


def test_control_batches_are_skipped_and_paged_past(streams: Streams, fetch: Fetcher) -> None:
    """A replicated log's control batches (Raft no-ops) take offsets no fetch returns; an
    Arrow fetch that met only control batches still names the offset to go on from."""
    log = streams.log("telemetry", 0)
    fill(streams, 2)
    log.append_raw(encode_control(2, 1, 1, b"", 0))
    log.append(records(1, first=3))
    log.append_raw(encode_control(4, 2, 1, b"", 0))
    headers, rows = fetch.rows(RECORDS.format("telemetry", 0) + "?offset=0")
    assert [r["offset"] for r in rows] == [0, 1, 3]
    assert headers["X-Mqlog-Next-Offset"] == "5" == headers["X-Mqlog-High-Water-Mark"]
    headers, rows = fetch.rows(RECORDS.format("telemetry", 0) + "?offset=4")
    assert rows == [] and headers["X-Mqlog-Next-Offset"] == "5"
    got = fetch.json(RECORDS.format("telemetry", 0) + "?offset=0")
    assert [r["offset"] for r in got["records"]] == [0, 1, 3]
