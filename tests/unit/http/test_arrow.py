"""The Arrow fetch body built from a read's columns is byte for byte the one built from its
Record tuples (the reference encoder), whatever the records and the read's limits."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pytest

from broker.commitlog import LogConfig, Record, SegmentedLog
from broker.commitlog.reader import LogReader
from broker.http import arrow as fetch
from broker.http.arrow import SCHEMA, columns_to_record_batch, to_ipc_stream, to_record_batch
from broker.mqtt.properties import PropertyId, encode_properties

CONFIG = LogConfig(
    segment_bytes=64 << 10, index_interval_bytes=1024, fsync="never", retention_ms=None
)
PROPERTIES = [
    b"",
    encode_properties({PropertyId.USER_PROPERTY: [("site", "a"), ("line", "7"), ("site", "b")]}),
    encode_properties(
        {
            PropertyId.CONTENT_TYPE: "application/json",
            PropertyId.CORRELATION_DATA: b"\x00\xff",
            PropertyId.MESSAGE_EXPIRY_INTERVAL: 60,
        }
    ),
]


def records(
    rng: random.Random, n: int, start: int, *, topics: int, props: bool, mixed: bool
) -> list[Record]:
    return [
        Record(
            -1,
            1_700_000_000_000 + start + i - rng.randrange(5),
            f"devices/{rng.randrange(topics)}/telemetry/é",
            rng.randbytes(rng.choice([0, 1, 64, 300])),
            rng.randrange(3) if mixed else 1,
            mixed and rng.random() < 0.5,
            f"client-{rng.randrange(topics)}",
            rng.choice(PROPERTIES) if props else b"",
        )
        for i in range(n)
    ]


def same_body(log: SegmentedLog | LogReader, offset: int, limit: int, max_bytes: int) -> None:
    expected = to_ipc_stream(to_record_batch("telemetry", 3, log.read(offset, limit, max_bytes)))
    batch = columns_to_record_batch("telemetry", 3, log.read_columns(offset, limit, max_bytes))
    assert batch.schema == SCHEMA
    assert to_ipc_stream(batch) == expected


@pytest.mark.parametrize("gather_below", [0, 1 << 30])  # fixed columns joined / gathered
@pytest.mark.parametrize(
    ("topics", "props", "mixed"),
    [
        (25, False, False),  # fleet telemetry: the common case
        (25, True, True),  # MQTT 5 properties, per-record QoS and retain
        (2000, False, True),  # many topics: string tables differ from batch to batch
        (1, True, False),
    ],
)
def test_columns_body_equals_tuples_body(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    topics: int,
    props: bool,
    mixed: bool,
    gather_below: int,
) -> None:
    monkeypatch.setattr(fetch, "_GATHER_BELOW", gather_below)
    rng = random.Random(topics)
    with SegmentedLog.open(tmp_path, CONFIG) as log:
        for b in range(40):
            log.append(
                records(
                    rng, rng.choice([1, 10, 250]), b * 250, topics=topics, props=props, mixed=mixed
                )
            )
        assert len(log.segments) > 1
        reader = LogReader(tmp_path, CONFIG, log.end_offset)
        end = log.end_offset
        for offset, limit, max_bytes in [
            (0, 10_000, 8 << 20),
            (end - 1, 10, 1 << 20),
            (end, 10, 1 << 20),
        ] + [
            (rng.randrange(end), rng.choice([1, 17, 1000]), rng.choice([1, 5000, 1 << 20]))
            for _ in range(40)
        ]:
            same_body(log, offset, limit, max_bytes)
            same_body(reader, offset, limit, max_bytes)
        reader.close()


@pytest.mark.parametrize("props", [False, True])
def test_columns_body_over_many_small_batches(tmp_path: Path, props: bool) -> None:
    """A fleet's log: thousands of 1-3-record batches, each one device's topic and client id
    (the same string table again and again), read 4,000 records at a time."""
    rng = random.Random(7)
    with SegmentedLog.open(tmp_path, CONFIG) as log:
        for b in range(3000):
            device = rng.randrange(10)
            log.append(
                [
                    r._replace(topic=f"devices/{device}/telemetry", client_id=f"dev-{device}")
                    for r in records(
                        rng, rng.choice([1, 1, 2, 3]), b * 3, topics=1, props=props, mixed=True
                    )
                ]
            )
        end = log.end_offset
        for offset in [0, *(rng.randrange(end) for _ in range(10))]:
            same_body(log, offset, 4000, 1 << 20)


def test_columns_body_values(tmp_path: Path) -> None:
    """A direct check of the decoded values, beyond equality with the reference encoder."""
    written = [
        Record(
            0,
            1_700_000_000_000 + i,
            f"d/{i % 3}",
            b"%d" % i,
            i % 3,
            i % 4 == 0,
            f"c{i % 2}",
            PROPERTIES[i % 3],
        )
        for i in range(12)
    ]
    with SegmentedLog.open(tmp_path, CONFIG) as log:
        log.append(written[:5])
        log.append(written[5:])
        rows = pa.Table.from_batches(
            [columns_to_record_batch("s", 0, log.read_columns(2))]
        ).to_pylist()
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
    ] == [(i, *r[1:7]) for i, r in enumerate(written)][2:]
    assert dict(rows[0]["properties"]) == {
        "mqtt.content_type": "application/json",
        "mqtt.correlation_data": "00ff",
        "mqtt.message_expiry_interval": "60",
    }
    assert dict(rows[2]["properties"]) == {"site": "a", "line": "7"}
