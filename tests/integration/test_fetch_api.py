"""The HTTP fetch API against a real broker process: records as Arrow and JSON, paging by
offset, offset lookup by time, and the errors for bad offsets, streams and parameters."""

from __future__ import annotations

import base64
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from broker.commitlog import LogConfig, Record, Streams, StreamSpec
from broker.http.arrow import SCHEMA
from tests.integration.clients import V5, Client
from tests.integration.conftest import BrokerFactory, BrokerProcess

STREAMS = """
[[streams]]
name = "telemetry"
topic_filter = ["devices/#"]
partitions = 2
"""
RECORDS = "/api/v1/streams/{}/partitions/{}/records"


def fetch(
    broker: BrokerProcess, path: str, json: bool = False
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(broker.http_url + path)
    if json:
        req.add_header("Accept", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def arrow(body: bytes) -> pa.Table:
    return pa.ipc.open_stream(body).read_all()


def partition_of(topic: str, partitions: int = 2) -> int:
    return zlib.crc32(topic.encode()) % partitions


@pytest.fixture
def published(broker_factory: BrokerFactory) -> tuple[BrokerProcess, list[tuple[str, bytes]]]:
    """A broker with 30 QoS 1 publishes (acked, so committed) on one topic of partition 0
    (with MQTT 5 properties on every third) and one on the other partition."""
    broker = broker_factory(config=STREAMS)
    topic = next(t for t in (f"devices/d{i}/telemetry" for i in range(50)) if partition_of(t) == 0)
    other = next(t for t in (f"devices/d{i}/telemetry" for i in range(50)) if partition_of(t) == 1)
    client = Client(broker.port, "sensor-1", V5)
    assert client.connect() == 0
    sent = []
    for i in range(30):
        props = None
        if i % 3 == 0:
            props = Properties(PacketTypes.PUBLISH)
            props.UserProperty = [("unit", "celsius"), ("seq", str(i))]
            props.ContentType = "application/json"
        payload = orjson.dumps({"seq": i, "temp": 20 + i / 10}) + bytes([0, 255])
        client.publish(topic, payload, qos=1, properties=props)
        sent.append((topic, payload))
    client.publish(other, b"elsewhere", qos=1)
    client.disconnect()
    return broker, sent


def test_arrow_records_equal_what_was_published(published: Any) -> None:
    broker, sent = published
    status, headers, body = fetch(broker, RECORDS.format("telemetry", 0) + "?offset=0")
    assert status == 200
    assert headers["Content-Type"] == "application/vnd.apache.arrow.stream"
    table = arrow(body)
    assert table.schema == SCHEMA  # exact types: string, int32, timestamp[us, UTC], map
    rows = table.to_pylist()
    assert [r["offset"] for r in rows] == list(range(30))
    assert [(r["topic"], r["payload"]) for r in rows] == sent
    assert {r["stream"] for r in rows} == {"telemetry"}
    assert {r["partition"] for r in rows} == {0}
    assert {(r["qos"], r["retain"], r["client_id"]) for r in rows} == {(1, False, "sensor-1")}
    now = time.time()
    assert all(now - 60 < r["timestamp"].timestamp() <= now + 1 for r in rows)
    for i, r in enumerate(rows):
        props = dict(r["properties"])
        if i % 3 == 0:
            assert props == {
                "unit": "celsius",
                "seq": str(i),
                "mqtt.content_type": "application/json",
            }
        else:
            assert props == {}
    assert headers["X-Mqlog-Next-Offset"] == "30"
    assert headers["X-Mqlog-High-Water-Mark"] == "30"
    assert headers["X-Mqlog-Earliest-Offset"] == "0"
    _, _, other = fetch(broker, RECORDS.format("telemetry", 1) + "?offset=0")
    assert [(r["partition"], r["payload"]) for r in arrow(other).to_pylist()] == [(1, b"elsewhere")]


def test_json_records_carry_the_same_data(published: Any) -> None:
    broker, sent = published
    status, headers, body = fetch(
        broker, RECORDS.format("telemetry", 0) + "?offset=3&max_records=4", json=True
    )
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    data = orjson.loads(body)
    assert data["next_offset"] == 7 and data["high_water_mark"] == 30
    recs = data["records"]
    assert [r["offset"] for r in recs] == [3, 4, 5, 6]
    assert [base64.b64decode(r["payload"]) for r in recs] == [p for _, p in sent[3:7]]
    assert recs[0]["properties"]["seq"] == "3" and recs[1]["properties"] == {}
    assert isinstance(recs[0]["timestamp"], int)


def test_paging_by_next_offset_reads_every_record_once(published: Any) -> None:
    broker, _ = published
    offset, pages, seen = 5, 0, []
    while True:
        status, headers, body = fetch(
            broker, RECORDS.format("telemetry", 0) + f"?offset={offset}&max_records=7"
        )
        assert status == 200
        rows = arrow(body).to_pylist()
        assert len(rows) <= 7
        if not rows:
            assert headers["X-Mqlog-Next-Offset"] == str(offset)
            break
        pages += 1
        seen += [r["offset"] for r in rows]
        offset = int(headers["X-Mqlog-Next-Offset"])
    assert seen == list(range(5, 30)) and pages == 4


def test_offset_past_high_water_mark_is_416_naming_the_range(published: Any) -> None:
    broker, _ = published
    status, _, body = fetch(broker, RECORDS.format("telemetry", 0) + "?offset=31")
    assert status == 416
    err = orjson.loads(body)
    assert "[0, 30]" in err["error"] and "telemetry" in err["error"]
    assert (err["earliest_offset"], err["high_water_mark"]) == (0, 30)


def test_unknown_stream_partition_and_bad_parameters(published: Any) -> None:
    broker, _ = published
    status, _, body = fetch(broker, RECORDS.format("nope", 0) + "?offset=0")
    assert status == 404 and "nope" in orjson.loads(body)["error"]
    status, _, body = fetch(broker, RECORDS.format("telemetry", 2) + "?offset=0")
    assert status == 404 and "partitions 0..1" in orjson.loads(body)["error"]
    for query, word in (
        ("", "'offset' is required"),
        ("?offset=x", "integer"),
        ("?offset=-1", ">= 0"),
        ("?offset=0&max_records=0", "max_records"),
    ):
        status, _, body = fetch(broker, RECORDS.format("telemetry", 0) + query)
        assert status == 400, query
        assert word in orjson.loads(body)["error"], query


def test_offset_for_timestamp(published: Any) -> None:
    broker, _ = published
    rows = arrow(fetch(broker, RECORDS.format("telemetry", 0) + "?offset=0")[2]).to_pylist()
    path = "/api/v1/streams/telemetry/partitions/0/offset?timestamp="

    def lookup(ms: int) -> int:
        status, _, body = fetch(broker, path + str(ms))
        assert status == 200
        return int(orjson.loads(body)["offset"])

    ms = [int(r["timestamp"].timestamp() * 1000) for r in rows]
    assert lookup(0) == 0
    assert lookup(ms[-1] + 1) == 30  # after every record: the high-water mark
    # Reference: the first record whose timestamp is >= the target.
    for target in {ms[0], ms[12], ms[29]}:
        assert lookup(target) == next(i for i, t in enumerate(ms) if t >= target)
    status, _, body = fetch(broker, path + "yesterday")
    assert status == 400 and "epoch milliseconds" in orjson.loads(body)["error"]


def test_reading_below_the_earliest_retained_offset_is_416(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    """Retention dropped the oldest segments: a read below the log start offset names the
    valid range instead of returning other data."""
    broker = broker_factory(
        config=STREAMS.replace("partitions = 2", "partitions = 1")
        + 'segment_bytes = "1KiB"\nretention = "forever"\n',
        start=False,
    )
    small = LogConfig(segment_bytes=1024, retention_bytes=4096)
    with Streams(broker.data_dir, [StreamSpec("telemetry", ("devices/#",), 1, small)]) as s:
        plog = s.log("telemetry", 0)
        for i in range(200):
            plog.append([Record(0, 1_700_000_000_000 + i, "devices/a", b"x" * 40)])
        assert plog.enforce_retention() > 0
        earliest = plog.log_start_offset
    assert earliest > 0
    broker.start()
    status, _, body = fetch(broker, RECORDS.format("telemetry", 0) + "?offset=0")
    assert status == 416
    err = orjson.loads(body)
    assert f"[{earliest}, 200]" in err["error"]
    assert err["earliest_offset"] == earliest
    status, _, body = fetch(broker, RECORDS.format("telemetry", 0) + f"?offset={earliest}")
    assert status == 200
    assert arrow(body).column("offset").to_pylist()[0] == earliest


def test_columns_that_vary_per_record(broker_factory: BrokerFactory) -> None:
    """QoS and retain are encoded per record when they vary (constant columns take a
    shortcut), and every column keeps the record's own value."""
    broker = broker_factory(config=STREAMS.replace("partitions = 2", "partitions = 1"), start=False)
    written = [
        Record(
            0, 1_700_000_000_000 + i, f"devices/d{i % 3}", b"%d" % i, i % 3, i % 4 == 0, f"c{i % 2}"
        )
        for i in range(12)
    ]
    with Streams(broker.data_dir, [StreamSpec("telemetry", ("devices/#",), 1)]) as s:
        s.log("telemetry", 0).append(written)
    broker.start()
    status, _, body = fetch(broker, RECORDS.format("telemetry", 0) + "?offset=0")
    assert status == 200
    rows = arrow(body).to_pylist()
    assert [
        (
            r["offset"],
            int(r["timestamp"].timestamp() * 1000),
            r["topic"],
            r["payload"],
            r["qos"],
            r["retain"],
            r["client_id"],
        )
        for r in rows
    ] == [(i, *r[1:7]) for i, r in enumerate(written)]
