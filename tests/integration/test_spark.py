"""The ``mqlog`` Spark data source and ``mqlog spark-drain`` against a real broker process,
with a real local SparkSession (local[2]) shared by the module.

One broker serves the module; each test uses its own stream (selected by topic prefix), so
tests do not see each other's records. Offsets are checked against what was published: every
record exactly once, in order, nothing else.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from broker.commitlog import LogConfig, Record, Streams, StreamSpec
from spark_sink.drain import error_message, spark_session, start_drain
from spark_sink.worker_python import worker_python
from tests.integration.clients import V5, Client
from tests.integration.conftest import ROOT, BrokerProcess, free_port

pytestmark = pytest.mark.spark

STREAMS = (
    "".join(
        f'[[streams]]\nname = "{name}"\ntopic_filter = ["{name}/#"]\npartitions = {parts}\n{extra}'
        for name, parts, extra in (
            ("batch", 2, ""),
            ("flow", 2, ""),
            ("crash", 2, ""),
            ("limit", 2, ""),
            ("old", 1, 'segment_bytes = "1KiB"\nretention = "forever"\n'),
        )
    )
    + '[[streams]]\nname = "telemetry"\ntopic_filter = ["devices/#"]\npartitions = 2\n'
)
OLD_RECORDS = 200

#: A test about the Spark side (the drain's checkpoint, its errors, the example script), each
#: starting a JVM of its own, runs against the two-worker broker only: the broker side (the
#: fetch API over one worker and across two) is covered for both counts by the batch,
#: streaming, limit and retention tests.
SPARK_SIDE = pytest.mark.only_workers(2, reason="Spark-side test; the broker side is covered")

Published = dict[str, list[tuple[bytes, dict[str, str]]]]  # topic -> [(payload, properties)]


@pytest.fixture(scope="module")
def broker(
    tmp_path_factory: pytest.TempPathFactory, module_workers: int
) -> Iterator[BrokerProcess]:
    b = BrokerProcess(tmp_path_factory.mktemp("broker"), STREAMS, workers=module_workers)
    # Stream "old" lost its first segments to retention before the broker started.
    small = LogConfig(segment_bytes=1024, retention_bytes=4096)
    with Streams(b.data_dir, [StreamSpec("old", ("old/#",), 1, small)]) as streams:
        plog = streams.log("old", 0)
        for i in range(OLD_RECORDS):
            plog.append([Record(0, 1_700_000_000_000 + i, "old/a", b"%d" % i)])
        plog.enforce_retention()
    b.start()
    yield b
    b.stop()


#: Short-lived test JVMs (this one and the drain subprocesses) start and warm up about twice
#: as fast with the C1 compiler only and the serial collector.
FAST_JVM = {
    "SPARK_LOCAL_IP": "127.0.0.1",
    "JDK_JAVA_OPTIONS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
}


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    saved = {k: os.environ.get(k) for k in FAST_JVM}
    os.environ.update(FAST_JVM)
    session = spark_session(
        extra={"spark.driver.memory": "768m", "spark.sql.streaming.minBatchesToRetain": "5"}
    )
    yield session
    session.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def publish(
    broker: BrokerProcess,
    stream: str,
    n: int,
    start: int = 0,
    topics: int = 4,
    with_properties: bool = False,
) -> Published:
    """``n`` QoS 1 publishes over ``topics`` topics of ``stream``, all acknowledged
    (committed) on return; returns what was sent per topic, in order."""
    client = Client(broker.port, f"pub-{stream}", V5)
    assert client.connect() == 0
    sent: Published = defaultdict(list)
    infos = []
    for i in range(start, start + n):
        topic = f"{stream}/dev{i % topics}/telemetry"
        payload = b'{"seq": %d}' % i + bytes([i % 256])
        props = None
        expected: dict[str, str] = {}
        if with_properties and i % 2 == 0:
            props = Properties(PacketTypes.PUBLISH)
            props.UserProperty = [("seq", str(i))]
            props.ContentType = "application/json"
            expected = {"seq": str(i), "mqtt.content_type": "application/json"}
        infos.append(client.paho.publish(topic, payload, 1, properties=props))
        sent[topic].append((payload, expected))
    for info in infos:
        info.wait_for_publish(timeout=10)
        assert info.is_published()
    client.disconnect()
    return sent


def read(spark: Any, broker: BrokerProcess, stream: str, **options: str) -> list[Any]:
    reader = spark.read.format("mqlog").option("broker", broker.http_url).option("stream", stream)
    for key, value in options.items():
        reader = reader.option(key, value)
    return sorted(reader.load().collect(), key=lambda r: (r["partition"], r["offset"]))


def offsets_by_partition(rows: list[Any]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for r in rows:
        out[r["partition"]].append(r["offset"])
    return {p: sorted(o) for p, o in out.items()}


def assert_exactly_once(rows: list[Any], sent: Published) -> None:
    """Every published record once, per topic in publish order, offsets without gaps."""
    by_topic: dict[str, list[tuple[int, int, bytes]]] = defaultdict(list)
    for r in rows:
        by_topic[r["topic"]].append((r["partition"], r["offset"], bytes(r["payload"])))
    assert set(by_topic) == set(sent)
    for topic, got in by_topic.items():
        got.sort()
        assert [p for _, _, p in got] == [p for p, _ in sent[topic]], topic
    for p, offs in offsets_by_partition(rows).items():
        assert offs == list(range(len(offs))), f"partition {p}: gaps or duplicates"


# ------------------------------------------------------------------------------ workers
def test_worker_launcher_drops_only_sparks_zips(tmp_path: Path) -> None:
    """The launcher runs the interpreter with Spark's PYTHONPATH minus exactly the two
    ``python/lib`` zips, other entries (spaces, ``*``, empty) kept in order."""
    launcher = worker_python(sys.executable, "local[2]")
    assert launcher is not None
    assert worker_python(sys.executable, "spark://host:7077") is None
    assert worker_python("/usr/bin/env", "local[2]") is None
    home = tmp_path / "spark home"
    kept = [str(tmp_path / "a b"), "/x/*/python/lib", "", "/y/pyspark.zip.d"]
    path = [f"{home}/python/lib/pyspark.zip", f"{home}/python/lib/py4j-0.10.9.9-src.zip", *kept]
    out = subprocess.run(
        [launcher, "-c", "import os; print(os.environ['PYTHONPATH'])"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.rstrip("\n").split(os.pathsep) == kept


def test_spark_workers_import_the_installed_pyspark(spark: Any) -> None:
    """Workers (forked from Spark's daemon, started like the streaming source runner through
    the launcher) import PySpark from site-packages, with cached bytecode, not from the zip
    Spark prepends to their PYTHONPATH."""
    import pyspark

    where = (
        spark.sparkContext.parallelize([0], 1)
        .map(lambda _: __import__("pyspark").__file__)
        .collect()
    )
    assert where == [pyspark.__file__]


# ------------------------------------------------------------------------------ batch
def test_batch_read_equals_what_was_published(spark: Any, broker: BrokerProcess) -> None:
    sent = publish(broker, "batch", 120, with_properties=True)
    rows = read(spark, broker, "batch")
    assert len(rows) == 120
    assert_exactly_once(rows, sent)
    for r in rows:
        assert r["stream"] == "batch" and r["qos"] == 1 and r["retain"] is False
        assert r["client_id"] == "pub-batch"
        index = [p for p, _ in sent[r["topic"]]].index(bytes(r["payload"]))
        assert dict(r["properties"]) == sent[r["topic"]][index][1]
    schema = (
        spark.read.format("mqlog")
        .option("broker", broker.http_url)
        .option("stream", "batch")
        .load()
        .schema.simpleString()
    )
    assert schema == (
        "struct<stream:string,partition:int,offset:bigint,timestamp:timestamp,"
        "topic:string,payload:binary,qos:int,retain:boolean,client_id:string,"
        "properties:map<string,string>>"
    )

    # An offset range: [5, 20) of partition 0, [3, high-water mark) of partition 1.
    hwm = {p: len(o) for p, o in offsets_by_partition(rows).items()}
    ranged = read(
        spark,
        broker,
        "batch",
        startingOffsets='{"0": 5, "1": 3}',
        endingOffsets='{"batch": {"0": 20, "1": -1}}',
    )
    assert offsets_by_partition(ranged) == {0: list(range(5, 20)), 1: list(range(3, hwm[1]))}
    expected = {(r["partition"], r["offset"]): bytes(r["payload"]) for r in rows}
    assert all(expected[(r["partition"], r["offset"])] == bytes(r["payload"]) for r in ranged)

    filtered = read(
        spark, broker, "batch", topicFilter="batch/+/telemetry", startingOffsets="latest"
    )
    assert filtered == []
    one = read(spark, broker, "batch", topicFilter="batch/dev1/#")
    assert [bytes(r["payload"]) for r in sorted(one, key=lambda r: r["offset"])] == [
        p for p, _ in sent["batch/dev1/telemetry"]
    ]

    # startingTimestamp: each partition from its first record at or after the time.
    cut = sorted(rows, key=lambda r: r["timestamp"])[60]["timestamp"]
    ms = round(cut.timestamp() * 1000)  # naive local time, as PySpark returns timestamps
    later = read(spark, broker, "batch", startingTimestamp=str(ms))
    assert {(r["partition"], r["offset"]) for r in later} == {
        (r["partition"], r["offset"]) for r in rows if r["timestamp"] >= cut
    }


def test_bad_input_gives_clear_errors(spark: Any, broker: BrokerProcess) -> None:
    def error(**options: str) -> str:
        stream = options.pop("stream", "batch")
        url = options.pop("broker", broker.http_url)
        with pytest.raises(Exception) as info:
            reader = spark.read.format("mqlog").option("broker", url).option("stream", stream)
            for key, value in options.items():
                reader = reader.option(key, value)
            reader.load().collect()
        return error_message(info.value)

    assert "no stream named 'nope'" in error(stream="nope")
    assert "streams: " in error(stream="nope")
    down = f"http://127.0.0.1:{free_port()}"
    assert "cannot reach the mqlog broker's HTTP API at " + down in error(broker=down)
    assert "is out of range: valid offsets are [0, " in error(startingOffsets='{"0": 100000}')
    assert "names partition(s) [7]" in error(startingOffsets='{"7": 0}')
    assert "option 'startingOffsets'" in error(startingOffsets="yesterday")
    assert "option 'maxRecordsPerTrigger' must be > 0" in error(maxRecordsPerTrigger="0")
    assert "not a valid MQTT topic filter" in error(topicFilter="a/#/b")
    assert "option 'broker' must be the broker's HTTP API" in error(broker="localhost:1")


def test_data_deleted_by_retention(spark: Any, broker: BrokerProcess) -> None:
    """Offsets below the earliest retained one: an error naming the range, or with
    failOnDataLoss=false the read skips forward to the earliest offset."""
    part = next(iter(read(spark, broker, "old", startingOffsets="earliest")), None)
    assert part is not None
    earliest = part["offset"]
    assert earliest > 0
    message = ""
    with pytest.raises(Exception) as info:
        read(spark, broker, "old", startingOffsets='{"0": 0}')
    message = error_message(info.value)
    assert f"valid offsets are [{earliest}, {OLD_RECORDS}]" in message
    assert "failOnDataLoss=false" in message
    rows = read(spark, broker, "old", startingOffsets='{"0": 0}', failOnDataLoss="false")
    assert [r["offset"] for r in rows] == list(range(earliest, OLD_RECORDS))
    assert [bytes(r["payload"]) for r in rows] == [b"%d" % i for i in range(earliest, OLD_RECORDS)]


# ------------------------------------------------------------------------------ streaming
def drain_in_process(
    spark: Any, broker: BrokerProcess, stream: str, out: Path, checkpoint: Path, **options: str
) -> Any:
    """One Trigger.AvailableNow run of the stream into Parquet; returns the finished query."""
    reader = (
        spark.readStream.format("mqlog")
        .option("broker", broker.http_url)
        .option("stream", stream)
        .option("startingOffsets", "earliest")
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    query = (
        reader.load()
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120), "AvailableNow query did not finish"
    assert query.exception() is None
    return query


def test_streaming_restarts_append_without_duplicates_or_gaps(
    spark: Any, broker: BrokerProcess, tmp_path: Path
) -> None:
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    sent: Published = defaultdict(list)
    total = 0
    for run, n in enumerate((90, 0, 40)):
        for topic, items in publish(broker, "flow", n, start=total).items():
            sent[topic] += items
        total += n
        query = drain_in_process(spark, broker, "flow", out, checkpoint)
        new_rows = sum(p["numInputRows"] for p in query.recentProgress)
        assert new_rows == n, f"run {run} read {new_rows} records, {n} were new"
        rows = spark.read.parquet(str(out)).collect()
        assert len(rows) == total
        assert_exactly_once(rows, sent)

    # A continuous query (processing-time trigger) picks up records published while it runs.
    reader = (
        spark.readStream.format("mqlog").option("broker", broker.http_url).option("stream", "flow")
    )
    query = (
        reader.load()
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        for topic, items in publish(broker, "flow", 30, start=total).items():
            sent[topic] += items
        total += 30
        deadline = time.monotonic() + 60
        while spark.read.parquet(str(out)).count() < total:
            assert time.monotonic() < deadline, "continuous query did not catch up"
            query.awaitTermination(1)
    finally:
        query.stop()
    assert_exactly_once(spark.read.parquet(str(out)).collect(), sent)


def test_max_records_per_trigger_bounds_each_micro_batch(
    spark: Any, broker: BrokerProcess, tmp_path: Path
) -> None:
    sent = publish(broker, "limit", 250)
    query = drain_in_process(
        spark, broker, "limit", tmp_path / "out", tmp_path / "cp", maxRecordsPerTrigger="60"
    )
    sizes = [p["numInputRows"] for p in query.recentProgress]
    assert sizes == [60, 60, 60, 60, 10]
    assert_exactly_once(spark.read.parquet(str(tmp_path / "out")).collect(), sent)


# ------------------------------------------------------------------------------ drain job
def drain_command(broker: BrokerProcess, out: Path, checkpoint: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "broker.cli",
        "spark-drain",
        "--broker",
        broker.http_url,
        "--output",
        str(out),
        "--checkpoint",
        str(checkpoint),
        *extra,
    ]


@SPARK_SIDE
def test_drain_survives_sigkill_mid_batch_exactly_once(
    spark: Any, broker: BrokerProcess, tmp_path: Path
) -> None:
    """SIGKILL the drain's driver (Python and its JVM) while a micro-batch is in flight
    (its offsets logged, its commit not), restart it: every record exactly once."""
    sent = publish(broker, "crash", 4000)
    out, checkpoint = tmp_path / "out", tmp_path / "cp"
    cmd = drain_command(
        broker, out, checkpoint, "--stream", "crash", "--once", "--max-records-per-trigger", "1000"
    )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        # Batch 1 in flight: offsets/1 written, commits/1 not yet.
        deadline = time.monotonic() + 120
        while not (
            (checkpoint / "offsets" / "1").exists() and not (checkpoint / "commits" / "1").exists()
        ):
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "the drain never started batch 1"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (checkpoint / "commits" / "3").exists()  # killed before the drain finished
    assert spark.read.parquet(str(out)).count() < 4000

    # The restart: the same drain query (start_drain, as the CLI runs it) on the same
    # checkpoint, in this process to spare a second JVM start.
    query = start_drain(
        spark,
        broker.http_url,
        str(out),
        str(checkpoint),
        streams=["crash"],
        once=True,
        max_records_per_trigger=1000,
    )
    assert query.awaitTermination(120) and query.exception() is None
    assert sum(p["numInputRows"] for p in query.recentProgress) >= 1000  # batch 1 re-ran
    rows = spark.read.parquet(str(out)).collect()
    assert len(rows) == 4000
    assert_exactly_once(rows, sent)
    dates = {p.name for p in out.iterdir() if p.name.startswith("date=")}
    assert dates == {f"date={r['date']}" for r in rows}
    assert {"stream", "partition", "offset", "payload", "date"} <= set(rows[0].asDict())


@SPARK_SIDE
def test_drain_unknown_stream_is_a_clear_error(broker: BrokerProcess, tmp_path: Path) -> None:
    done = subprocess.run(
        drain_command(broker, tmp_path / "o", tmp_path / "c", "--stream", "nope", "--once"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "unknown stream(s) 'nope'" in done.stderr and "batch" in done.stderr


@SPARK_SIDE
def test_example_fleet_drain_and_per_device_aggregates(
    broker: BrokerProcess, tmp_path: Path
) -> None:
    """examples/iot/spark_aggregates.py: the fleet publishes, the drain writes Parquet, Spark
    SQL reports each device's readings (all of them: none missing)."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "iot" / "spark_aggregates.py"),
            "--broker",
            broker.http_url,
            "--port",
            str(broker.port),
            "--devices",
            "3",
            "--rate",
            "20",
            "--fleet-duration",
            "1.5",
            "--output",
            str(tmp_path / "telemetry"),
        ],
        cwd=ROOT,
        env={**os.environ, **FAST_JVM},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    sent = re.search(
        r"fleet: done: 3 devices sent (\d+) messages .* acknowledged (\d+)", done.stdout
    )
    assert sent and sent.group(1) == sent.group(2), done.stdout
    assert f"drained {sent.group(1)} new record(s)" in done.stdout
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("device "))
    devices = [line.split() for line in lines[header + 1 : header + 4]]
    assert [d[0] for d in devices] == ["dev-000", "dev-001", "dev-002"]
    assert sum(int(d[1]) for d in devices) == int(sent.group(1))
    assert all(d[7] == "0" for d in devices)  # no reading missing from any device's seq
    assert "spark_aggregates: 3 device(s)" in done.stdout


def test_drain_as_a_user_quiet_and_local(tmp_path: Path) -> None:
    """`mqlog spark-drain --user` against a broker with allow_anonymous = false: the
    records are those the user's ACL reads; the driver stays on 127.0.0.1 without being
    told (no SPARK_LOCAL_IP in the environment); the JVM's log goes to the checkpoint's
    spark-driver.log, and mqlog's output carries mqlog's lines only."""
    from tests.integration.test_auth import make_password_file

    pw = make_password_file(tmp_path / "passwd", {"alice": "a-pw", "bob": "b-pw"})
    acl = tmp_path / "acl"
    acl.write_text("user alice\ntopic readwrite alice/#\nuser bob\ntopic readwrite bob/#\n")
    closed = BrokerProcess(
        tmp_path / "broker",
        f'[auth]\nallow_anonymous = false\npassword_file = "{pw}"\nacl_file = "{acl}"\n',
    )
    closed.start()
    try:
        for name in ("alice", "bob"):
            c = Client(closed.port, f"{name}-pub", V5)
            c.paho.username_pw_set(name, f"{name[0]}-pw")
            assert c.connect() == 0
            for i in range(3):
                c.publish(f"{name}/x", b"%s-%d" % (name.encode(), i), qos=1)
            c.disconnect()
        out, checkpoint = tmp_path / "out", tmp_path / "cp"
        cmd = drain_command(closed, out, checkpoint, "--stream", "default", "--once")
        env = {k: v for k, v in os.environ.items() if k not in ("SPARK_LOCAL_IP",)}
        refused = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        assert refused.returncode == 1
        assert "refused no credentials" in refused.stderr and "'user'" in refused.stderr
        done = subprocess.run(
            [*cmd, "--user", "alice"],
            cwd=ROOT,
            env={**env, "MQLOG_PASSWORD": "a-pw"},
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        closed.stop()
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.strip()]
    assert all(line.startswith("mqlog spark-drain: ") for line in said), said
    assert "stopped after" in said[-1] and "3 record(s)" in said[-1]
    log = checkpoint / "spark-driver.log"
    assert log.is_file() and f"Spark's own log (WARN and above) is in {log}" in done.stderr
    assert "resolves to a loopback address" not in log.read_text()
    import pyarrow.parquet as pq

    table = pq.read_table(out)
    assert sorted(table.column("topic").to_pylist()) == ["alice/x"] * 3
