"""Per-device aggregates of the fleet's telemetry with Spark SQL, from an exactly-once drain.

Three steps, each optional:

1. run the fleet simulator (``fleet.py``) for ``--fleet-duration`` seconds (0: skip);
2. drain the ``telemetry`` stream into Parquet (``OUTPUT/``, partitioned by date) with the
   ``mqlog`` Spark source and ``Trigger.AvailableNow``, exactly as
   ``mqlog spark-drain --stream telemetry --once`` does; the checkpoint makes re-runs append
   only new records (``--no-drain`` skips this and reads what an earlier drain wrote);
3. parse the JSON payloads and print one row per device: readings, first/last reading, min /
   mean / max temperature, mean humidity, last battery level, and readings missing from the
   device's ``seq`` sequence::

    python examples/iot/spark_aggregates.py --fleet-duration 20 --output /tmp/telemetry
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: The fleet's payload: {"device", "seq", "ts", "temperature", "humidity", "battery"}.
PAYLOAD_SCHEMA = (
    "device string, seq long, ts long, temperature double, humidity double, battery double"
)

AGGREGATES_SQL = """
SELECT reading.device                              AS device,
       count(*)                                    AS readings,
       min(timestamp)                              AS first_seen,
       max(timestamp)                              AS last_seen,
       round(min(reading.temperature), 2)          AS temp_min,
       round(avg(reading.temperature), 2)          AS temp_avg,
       round(max(reading.temperature), 2)          AS temp_max,
       round(avg(reading.humidity), 1)             AS humidity_avg,
       max_by(reading.battery, reading.seq)        AS battery,
       max(reading.seq) - min(reading.seq) + 1 - count(DISTINCT reading.seq) AS missing
FROM (SELECT timestamp, from_json(CAST(payload AS STRING), '{schema}') AS reading
      FROM telemetry
      WHERE topic LIKE 'devices/%/telemetry')
GROUP BY reading.device
ORDER BY device
"""


def device_aggregates(spark: Any, output: str) -> Any:
    """The per-device aggregates (a DataFrame) of the drained Parquet at ``output``."""
    spark.read.parquet(output).createOrReplaceTempView("telemetry")
    return spark.sql(AGGREGATES_SQL.format(schema=PAYLOAD_SCHEMA))


def run_fleet(args: argparse.Namespace) -> None:
    cmd = [
        sys.executable,
        str(HERE / "fleet.py"),
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--devices",
        str(args.devices),
        "--rate",
        str(args.rate),
        "--qos",
        "1",
        "--duration",
        str(args.fleet_duration),
    ]
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0:
        raise SystemExit(f"spark_aggregates: the fleet simulator failed ({done.returncode})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--broker",
        default="http://127.0.0.1:8080",
        help="the broker's HTTP API (default http://127.0.0.1:8080)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="MQTT host for the fleet")
    parser.add_argument("--port", type=int, default=1883, help="MQTT port for the fleet")
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--rate", type=float, default=5.0, help="messages/s per device")
    parser.add_argument(
        "--fleet-duration",
        type=float,
        default=0,
        help="seconds to run the fleet first (default 0: do not run it)",
    )
    parser.add_argument("--stream", default="telemetry")
    parser.add_argument(
        "--output",
        default="spark-output/telemetry",
        help="Parquet directory (default spark-output/telemetry)",
    )
    parser.add_argument("--checkpoint", help="default: OUTPUT + '-checkpoint'")
    parser.add_argument(
        "--no-drain", action="store_true", help="aggregate what is already in OUTPUT"
    )
    args = parser.parse_args(argv)

    if args.fleet_duration > 0:
        run_fleet(args)

    from spark_sink.client import MqlogSourceError
    from spark_sink.drain import error_message, spark_session, start_drain

    try:
        spark = spark_session(app="mqlog-iot-aggregates")
    except MqlogSourceError as e:
        print(f"spark_aggregates: error: {e}", file=sys.stderr)
        return 1
    try:
        if not args.no_drain:
            query = start_drain(
                spark,
                args.broker,
                args.output,
                args.checkpoint or args.output.rstrip("/") + "-checkpoint",
                streams=[args.stream],
                once=True,
            )
            query.awaitTermination()
            drained = sum(p.numInputRows for p in query.recentProgress)
            print(
                f"spark_aggregates: drained {drained} new record(s) of stream "
                f"{args.stream!r} into {args.output}",
                flush=True,
            )
        rows = device_aggregates(spark, args.output).collect()
    except Exception as e:  # the source's own message, not the JVM stack
        print(f"spark_aggregates: error: {error_message(e)}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
    columns = [
        "device",
        "readings",
        "temp_min",
        "temp_avg",
        "temp_max",
        "humidity_avg",
        "battery",
        "missing",
        "last_seen",
    ]
    table = [[str(r[c]) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in table)]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    print(f"spark_aggregates: {len(rows)} device(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
