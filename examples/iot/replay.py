"""Replay telemetry from the log, from a time or an offset, then follow it live.

Subscribes (MQTT 5.0) to ``$replay/<from>/<filter>`` and prints each message with the
``mqlog-partition`` / ``mqlog-offset`` user properties the broker adds, so a consumer knows
exactly where to resume::

    python examples/iot/replay.py --since 10m              # the last ten minutes, then live
    python examples/iot/replay.py --from earliest --count 100
    python examples/iot/replay.py --from offsets:0=120,1=98 --filter 'devices/#'

``--from`` takes the broker's forms: earliest, latest, offset:<n>, offsets:<p>=<n>,...,
time:<RFC 3339 | epoch-ms | -<duration>>. Stops after ``--count`` messages, or when nothing
arrived for ``--idle`` seconds (0: keep following).
"""

from __future__ import annotations

import argparse
import queue
import signal
import sys
import threading
import time
from typing import Any

import orjson
import paho.mqtt.client as mqtt


def user_properties(msg: mqtt.MQTTMessage) -> dict[str, str]:
    props = getattr(msg, "properties", None)
    return dict(getattr(props, "UserProperty", None) or [])


def describe(payload: bytes) -> str:
    """Short form of a telemetry payload (JSON), or its raw text."""
    try:
        r = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return payload.decode(errors="replace")
    if isinstance(r, dict) and "device" in r:
        return (
            f"seq={r.get('seq')} ts={r.get('ts')} temperature={r.get('temperature')} "
            f"humidity={r.get('humidity')} battery={r.get('battery')}"
        )
    return orjson.dumps(r).decode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--filter", default="devices/+/telemetry", help="topic filter")
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--from",
        dest="start",
        default="earliest",
        help="earliest | latest | offset:N | offsets:P=N,... | time:...",
    )
    start.add_argument("--since", help="how far back: 10m, 1h, 2d (= --from time:-10m ...)")
    start.add_argument("--offset", type=int, help="shorthand for --from offset:N")
    parser.add_argument("--count", type=int, default=0, help="stop after N messages")
    parser.add_argument(
        "--idle", type=float, default=0, help="stop when nothing arrived for this many seconds"
    )
    parser.add_argument("--qos", type=int, choices=(0, 1, 2), default=1)
    args = parser.parse_args(argv)
    origin = args.start
    if args.since:
        # "10m" means ten minutes ago; "-10m" is accepted too (written --since=-10m).
        ago = args.since if args.since.startswith("-") else "-" + args.since
        origin = f"time:{ago}"
    elif args.offset is not None:
        origin = f"offset:{args.offset}"
    topic = f"$replay/{origin}/{args.filter}"

    messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
    subscribed: queue.Queue[int] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.on_message = lambda c, u, msg: messages.put(msg)

    def on_subscribe(c: Any, u: Any, mid: int, rcs: Any, props: Any = None) -> None:
        subscribed.put(int(rcs[0].value))

    client.on_subscribe = on_subscribe
    try:
        client.connect(args.host, args.port, keepalive=30)
    except OSError as e:
        print(f"replay: cannot connect to {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    client.loop_start()
    client.subscribe(topic, qos=args.qos)
    try:
        rc = subscribed.get(timeout=10)
    except queue.Empty:
        print("replay: no SUBACK from the broker", file=sys.stderr)
        return 1
    if rc >= 0x80:
        print(f"replay: the broker refused {topic!r} (reason 0x{rc:02X})", file=sys.stderr)
        return 1
    print(f"replay: {topic}", flush=True)

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    n = 0
    last = time.monotonic()
    while not stop.is_set() and (not args.count or n < args.count):
        try:
            msg = messages.get(timeout=0.1)
        except queue.Empty:
            if args.idle and time.monotonic() - last >= args.idle:
                break
            continue
        last = time.monotonic()
        n += 1
        up = user_properties(msg)
        print(
            f"partition={up.get('mqlog-partition', '?')} offset={up.get('mqlog-offset', '?')} "
            f"{msg.topic} {describe(bytes(msg.payload))}",
            flush=True,
        )
    client.disconnect()
    client.loop_stop()
    print(f"replay: {n} messages", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
