"""The drain job: stream a broker's records into Parquet, exactly once, partitioned by date.

``mqlog spark-drain --broker URL [--stream S] --output DIR --checkpoint DIR [--once]
[--user U] [--spark-log FILE]``.

A Structured Streaming query from the ``mqlog`` source (every user stream unless ``--stream``
names some) to the Parquet file sink, partitioned by ``date`` (the record's UTC date); every
source column is kept, so ``stream``, ``partition`` and ``offset`` identify each row.
Exactly-once across restarts and crashes comes from the two logs in the checkpoint and the
sink: the offsets of micro-batch N are written before it runs and its files are listed in
``OUTPUT/_spark_metadata`` only when it commits, so a killed run re-runs batch N with the same
offsets and readers of the sink (Spark) never see files of an uncommitted attempt. Read the
output with ``spark.read.parquet(OUTPUT)`` (which honours ``_spark_metadata``), not by listing
files. ``--once`` uses ``Trigger.AvailableNow``: it drains what the broker holds at start and
exits.

The driver stays quiet and local: when the broker is on this machine (a loopback URL) and
Spark's master is local, the driver binds to 127.0.0.1 (``SPARK_LOCAL_IP``,
``spark.driver.host``, ``spark.driver.bindAddress``) instead of whatever address the host name
resolves to, and the JVM's own log (WARN and above) goes to a file (``--spark-log``, default
``CHECKPOINT/spark-driver.log``), never to mqlog's output.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import shutil
import signal
import sys
import threading
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from spark_sink.client import BrokerClient, MqlogSourceError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

#: Quiet, small-machine defaults for a local session (overridable with ``extra``).
LOCAL_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.memory": "1g",
    "spark.sql.sources.partitionOverwriteMode": "dynamic",
    "spark.python.worker.reuse": "true",
    "spark.sql.streaming.noDataMicroBatches.enabled": "false",
    # The file sink writes up to this many date partitions at once per task instead of
    # sorting every micro-batch by date first (a batch spans one or two dates): the sort
    # buffered a task's whole input before writing its first row (a JFR profile of the 1M
    # drain showed UnsafeExternalRowSorter and a write phase after each task's reads).
    "spark.sql.maxConcurrentOutputFileWriters": "4",
    # Parquet's TIMESTAMP(MICROS) instead of Spark's legacy INT96 (a 12-byte binary per
    # value, hashed into a dictionary that 1 ms telemetry timestamps outgrow): with the
    # timestamp dictionary off too (start_drain), the JVM spent 5.8-6.8 s of CPU per 1M-record
    # drain instead of 6.9-9.9 s (runs before and after, same load).
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
}


def java_home() -> str | None:
    """``JAVA_HOME`` as set, or derived from the ``java`` on ``PATH``; None without Java."""
    if os.environ.get("JAVA_HOME"):
        return os.environ["JAVA_HOME"]
    java = shutil.which("java")
    if java is None:
        return None
    return str(Path(os.path.realpath(java)).parent.parent)


#: Spark's driver log as log4j2 properties: WARN and above, to one file (FILE is replaced).
LOG4J2_TO_FILE = """\
rootLogger.level = warn
rootLogger.appenderRef.file.ref = file
appender.file.type = File
appender.file.name = file
appender.file.fileName = FILE
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{yyyy-MM-dd HH:mm:ss} %p %c{1}: %m%n%ex
"""

LOOPBACK = "127.0.0.1"


def is_local(broker: str) -> bool:
    """True when the broker URL names this machine by a loopback address or ``localhost``."""
    host = urllib.parse.urlsplit(broker).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def spark_session(
    master: str = "local[2]",
    app: str = "mqlog",
    extra: dict[str, str] | None = None,
    *,
    driver_host: str | None = None,
    log_file: Path | None = None,
) -> SparkSession:
    """A SparkSession with the ``mqlog`` source registered; workers use this interpreter
    (``PYSPARK_PYTHON`` when set), through :func:`spark_sink.worker_python.worker_python`'s
    launcher where it applies.

    ``driver_host``: the address the driver binds to and announces (e.g. 127.0.0.1 when
    everything is local). ``log_file``: the JVM's log (WARN and above) goes there instead
    of the console."""
    home = java_home()
    if home is None:
        raise MqlogSourceError(
            "Spark needs Java 17: no `java` on PATH and JAVA_HOME unset "
            "(Debian: apt-get install openjdk-17-jre-headless)"
        )
    os.environ.setdefault("JAVA_HOME", home)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from spark_sink import register
    from spark_sink.worker_python import worker_python

    # SparkContext reads the workers' executable from the environment when it starts.
    python = os.environ.get("PYSPARK_PYTHON", sys.executable)
    os.environ["PYSPARK_PYTHON"] = worker_python(python, master) or python

    conf = dict(LOCAL_CONF)
    if driver_host is not None:
        # Read by the JVM before any conf: without it Spark logs "Your hostname resolves to
        # a loopback address ... using <another address> instead" and binds there.
        os.environ["SPARK_LOCAL_IP"] = driver_host
        conf["spark.driver.host"] = driver_host
        conf["spark.driver.bindAddress"] = driver_host
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        properties = log_file.with_name(log_file.name + ".log4j2.properties")
        properties.write_text(LOG4J2_TO_FILE.replace("FILE", str(log_file.resolve())))
        conf["spark.driver.extraJavaOptions"] = f"-Dlog4j.configurationFile={properties.resolve()}"
    builder = SparkSession.builder.master(master).appName(app)
    for key, value in {**conf, **(extra or {})}.items():
        builder = builder.config(key, value)
    if log_file is None:
        spark = builder.getOrCreate()
    else:
        # The JVM writes a few lines to its stderr before log4j is up (Java 17's "WARNING:
        # Using incubator modules"): it inherits the file as its stderr, mqlog keeps its own.
        saved = os.dup(2)
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.dup2(fd, 2)
            spark = builder.getOrCreate()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(fd)
    if log_file is None:
        spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def resolve_streams(
    broker: str,
    streams: list[str] | None,
    user: str | None = None,
    password: str | None = None,
) -> list[str]:
    """The streams to drain: those given (checked to exist), else every user stream."""
    with BrokerClient(broker, user=user, password=password) as client:
        known = client.user_streams()
    if not streams:
        if not known:
            raise MqlogSourceError(f"broker {broker} has no user streams to drain")
        return known
    unknown = [s for s in streams if s not in known]
    if unknown:
        raise MqlogSourceError(
            f"unknown stream(s) {', '.join(map(repr, unknown))} on broker "
            f"{broker}; streams: {', '.join(known) or 'none'}"
        )
    return streams


def start_drain(
    spark: SparkSession,
    broker: str,
    output: str,
    checkpoint: str,
    *,
    streams: list[str] | None = None,
    once: bool = False,
    trigger_interval: str = "10 seconds",
    max_records_per_trigger: int | None = None,
    source_format: str = "mqlog",
    user: str | None = None,
    password: str | None = None,
) -> StreamingQuery:
    """Start the drain query; the caller waits on it (``awaitTermination``).

    ``source_format`` names a registered data source with the ``mqlog`` options and schema
    (the benchmark drains through a tuple-returning variant for reference)."""
    from pyspark.sql import functions as F

    names = resolve_streams(broker, streams, user, password)
    reader = (
        spark.readStream.format(source_format)
        .option("broker", broker)
        .option("stream", ",".join(names))
        .option("startingOffsets", "earliest")
    )
    if user is not None:
        reader = reader.option("user", user).option("password", password or "")
    if max_records_per_trigger is not None:
        reader = reader.option("maxRecordsPerTrigger", str(max_records_per_trigger))
    df = reader.load().withColumn("date", F.to_date(F.col("timestamp")))
    writer = (
        df.writeStream.format("parquet")
        .option("path", output)
        # Payloads are nearly all distinct and offsets always are, timestamps nearly
        # (telemetry at 1 ms): a dictionary for them is built, probed (Binary.equals
        # was 7% of the JVM's samples in the 1M drain) and thrown away when it
        # outgrows its page.
        .option("parquet.enable.dictionary#payload", "false")
        .option("parquet.enable.dictionary#offset", "false")
        .option("parquet.enable.dictionary#timestamp", "false")
        .option("checkpointLocation", checkpoint)
        .partitionBy("date")
        .queryName("mqlog_drain")
    )
    writer = (
        writer.trigger(availableNow=True)
        if once
        else writer.trigger(processingTime=trigger_interval)
    )
    return writer.start()


#: Where ``mqlog spark-drain --user`` finds the password (a flag would show it to every
#: local user in the process list).
PASSWORD_ENV = "MQLOG_PASSWORD"

_OUR_ERROR = re.compile(
    r"(?:spark_sink\.\w+\.)?(?:MqlogSourceError|BrokerUnavailable|"
    r"UnknownStream|AccessDenied|OffsetOutOfRange|DataLoss|OptionError): (.+)"
)


def error_message(e: BaseException) -> str:
    """The useful line of a Spark error raised by the data source: our own message when the
    Python traceback carries one, else the error's first line."""
    text = str(e).strip()
    found = _OUR_ERROR.search(text)
    if found:
        return found.group(1).strip()
    return text.splitlines()[0] if text else type(e).__name__


def run_cli(args: argparse.Namespace) -> int:
    """``mqlog spark-drain``: run the drain until it finishes (``--once``) or SIGTERM/SIGINT."""
    # py4j's INFO lines (its gateway connections) are Spark's, not mqlog's.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    password = os.environ.get(PASSWORD_ENV) if args.user is not None else None
    local = args.master.startswith("local") and is_local(args.broker)
    log_file = Path(args.spark_log or Path(args.checkpoint) / "spark-driver.log")
    try:
        streams = resolve_streams(args.broker, args.stream, args.user, password)
        spark = spark_session(
            master=args.master,
            app="mqlog-spark-drain",
            driver_host=LOOPBACK if local else None,
            log_file=log_file,
        )
    except MqlogSourceError as e:
        print(f"mqlog spark-drain: error: {e}", file=sys.stderr)
        return 1
    print(
        f"mqlog spark-drain: Spark's own log (WARN and above) is in {log_file}",
        file=sys.stderr,
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        query = start_drain(
            spark,
            args.broker,
            args.output,
            args.checkpoint,
            streams=streams,
            once=args.once,
            trigger_interval=args.trigger_interval,
            max_records_per_trigger=args.max_records_per_trigger,
            user=args.user,
            password=password,
        )
        print(
            f"mqlog spark-drain: draining {', '.join(streams)} from {args.broker} into "
            f"{args.output}",
            file=sys.stderr,
            flush=True,
        )
        while query.isActive and not stop.is_set():
            query.awaitTermination(1)
        if query.isActive:
            query.stop()
        failure = query.exception()
        if failure is not None:
            raise failure
        progress = query.recentProgress
        rows = sum(p.numInputRows for p in progress)
        print(
            f"mqlog spark-drain: stopped after {len(progress)} micro-batch(es), {rows} record(s)",
            file=sys.stderr,
            flush=True,
        )
        return 0
    except Exception as e:  # Spark wraps the source's errors: show the source's message
        print(f"mqlog spark-drain: error: {error_message(e)}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
