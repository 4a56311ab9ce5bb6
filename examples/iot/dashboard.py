"""Live dashboard: per-device latest readings and message rates, from devices/+/telemetry.

Prints a table every ``--interval`` seconds::

    python examples/iot/dashboard.py --interval 2

With ``--group NAME`` it subscribes as a member of the shared subscription
``$share/NAME/devices/+/telemetry``, so several dashboards split the fleet's messages between
them. Stops after ``--duration`` seconds (0: until Ctrl-C).

``LATENCY ms`` is the end-to-end latency of a device's latest reading: the time it reached
the dashboard minus the time the device stamped in it (``ts``), on this machine's clock.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import orjson
import paho.mqtt.client as mqtt

RATE_WINDOW = 10.0  # seconds over which a device's message rate is measured


@dataclass
class DeviceView:
    latest: dict[str, Any] = field(default_factory=dict)
    count: int = 0
    arrivals: deque[float] = field(default_factory=deque)
    latency_ms: float = 0.0

    def rate(self, now: float) -> float:
        while self.arrivals and self.arrivals[0] < now - RATE_WINDOW:
            self.arrivals.popleft()
        span = min(RATE_WINDOW, max(now - self.arrivals[0], 1.0)) if self.arrivals else 1.0
        return len(self.arrivals) / span


class Dashboard:
    def __init__(self) -> None:
        self.devices: dict[str, DeviceView] = {}
        self.bad = 0
        self.lock = threading.Lock()

    def on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        now = time.monotonic()
        try:
            reading = orjson.loads(msg.payload)
            device = str(reading.get("device") or msg.topic.split("/")[1])
        except (orjson.JSONDecodeError, AttributeError, IndexError):
            with self.lock:
                self.bad += 1
            return
        with self.lock:
            view = self.devices.setdefault(device, DeviceView())
            view.latest = reading
            view.count += 1
            view.arrivals.append(now)
            if isinstance(reading.get("ts"), int):
                view.latency_ms = time.time() * 1000 - reading["ts"]

    def render(self) -> str:
        now = time.monotonic()
        with self.lock:
            rows = [
                (dev, v.count, v.rate(now), v.latest, v.latency_ms)
                for dev, v in sorted(self.devices.items())
            ]
            bad = self.bad
        total = sum(r[1] for r in rows)
        lines = [
            f"{time.strftime('%H:%M:%S')}  {len(rows)} devices, {total} messages"
            + (f", {bad} not JSON" if bad else ""),
            f"{'DEVICE':<12} {'MSGS':>7} {'MSG/S':>6} {'SEQ':>7} {'TEMP':>7} "
            f"{'HUM':>6} {'BATT':>6} {'LATENCY ms':>10}",
        ]
        for dev, count, rate, r, latency in rows:
            lines.append(
                f"{dev:<12} {count:>7} {rate:>6.1f} {r.get('seq', '-'):>7} "
                f"{r.get('temperature', '-'):>7} {r.get('humidity', '-'):>6} "
                f"{r.get('battery', '-'):>6} {latency:>10.0f}"
            )
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--qos", type=int, choices=(0, 1, 2), default=1)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between tables")
    parser.add_argument("--duration", type=float, default=0, help="seconds; 0 = until Ctrl-C")
    parser.add_argument("--group", help="join shared subscription group NAME")
    args = parser.parse_args(argv)

    topic = "devices/+/telemetry"
    if args.group:
        topic = f"$share/{args.group}/{topic}"
    board = Dashboard()
    subscribed = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.on_message = board.on_message

    def on_connect(c: Any, u: Any, flags: Any, rc: Any, props: Any = None) -> None:
        c.subscribe(topic, qos=args.qos)  # again after a reconnect

    client.on_connect = on_connect
    client.on_subscribe = lambda *a: subscribed.set()
    try:
        client.connect(args.host, args.port, keepalive=30)
    except OSError as e:
        print(f"dashboard: cannot connect to {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    client.loop_start()
    if not subscribed.wait(10):
        print("dashboard: no SUBACK from the broker", file=sys.stderr)
        return 1
    print(f"dashboard: subscribed to {topic} (QoS {args.qos})", flush=True)

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    start = time.monotonic()
    while not stop.wait(args.interval):
        print(board.render() + "\n", flush=True)
        if args.duration and time.monotonic() - start >= args.duration:
            break
    client.disconnect()
    client.loop_stop()
    print(board.render(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
