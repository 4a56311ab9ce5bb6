"""Device fleet simulator: N devices, each its own MQTT connection, publishing JSON telemetry.

Each device publishes ``{"device", "seq", "ts", "temperature", "humidity", "battery"}``
(JSON via orjson) to ``devices/<id>/telemetry`` at ``--rate`` messages per second, with QoS
``--qos``. A line of progress is printed every second and a summary at the end::

    python examples/iot/fleet.py --devices 20 --rate 5 --qos 1 --duration 60

Stops after ``--duration`` seconds (0: until Ctrl-C).
"""

from __future__ import annotations

import argparse
import math
import random
import signal
import sys
import threading
import time
from typing import Any

import orjson
import paho.mqtt.client as mqtt


class Device:
    """One simulated device on its own connection (paho network thread)."""

    def __init__(self, device_id: str, args: argparse.Namespace) -> None:
        self.id = device_id
        self.topic = f"devices/{device_id}/telemetry"
        self.qos = args.qos
        self.seq = 0
        self.acked = 0
        self._lock = threading.Lock()
        self._phase = random.random() * math.tau
        self._battery = random.uniform(60, 100)
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=device_id,
            protocol=mqtt.MQTTv5 if args.mqtt5 else mqtt.MQTTv311,
        )
        self.client.max_queued_messages_set(10_000)
        self.client.on_publish = self._on_publish
        self.client.connect(args.host, args.port, keepalive=30)
        self.client.loop_start()

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any, props: Any = None) -> None:
        with self._lock:
            self.acked += 1

    def reading(self) -> bytes:
        now = time.time()
        self._battery = max(0.0, self._battery - 0.001)
        return orjson.dumps(
            {
                "device": self.id,
                "seq": self.seq,
                "ts": int(now * 1000),
                "temperature": round(
                    21 + 4 * math.sin(now / 30 + self._phase) + random.gauss(0, 0.2), 2
                ),
                "humidity": round(45 + 10 * math.cos(now / 45 + self._phase), 1),
                "battery": round(self._battery, 2),
            }
        )

    def publish(self) -> None:
        self.client.publish(self.topic, self.reading(), qos=self.qos)
        self.seq += 1

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--devices", type=int, default=10, help="number of devices")
    parser.add_argument("--rate", type=float, default=1.0, help="messages/s per device")
    parser.add_argument("--qos", type=int, choices=(0, 1, 2), default=1)
    parser.add_argument("--duration", type=float, default=0, help="seconds; 0 = until Ctrl-C")
    parser.add_argument("--prefix", default="dev", help="device ids are <prefix>-<n>")
    parser.add_argument("--mqtt5", action="store_true", help="connect with MQTT 5.0")
    args = parser.parse_args(argv)
    if args.devices < 1 or args.rate <= 0:
        parser.error("--devices must be >= 1 and --rate > 0")

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        devices = [Device(f"{args.prefix}-{i:03d}", args) for i in range(args.devices)]
    except OSError as e:
        print(f"fleet: cannot connect to {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    print(
        f"fleet: {args.devices} devices -> devices/<id>/telemetry at {args.rate:g} msg/s "
        f"each, QoS {args.qos}",
        flush=True,
    )

    interval = 1.0 / args.rate
    start = time.monotonic()
    next_tick = start
    next_report = start + 1
    while not stop.is_set():
        now = time.monotonic()
        if args.duration and now - start >= args.duration:
            break
        if now >= next_tick:
            for d in devices:
                d.publish()
            next_tick += interval
            if next_tick < now:  # running late: do not burst to catch up
                next_tick = now + interval
        if now >= next_report:
            sent = sum(d.seq for d in devices)
            print(
                f"fleet: {now - start:5.1f}s sent {sent} ({sent / (now - start):.0f} msg/s)",
                flush=True,
            )
            next_report += 1
        stop.wait(max(0.0, min(next_tick, next_report) - time.monotonic()))

    elapsed = time.monotonic() - start
    sent = sum(d.seq for d in devices)
    if args.qos:  # wait (briefly) for the broker to acknowledge what is in flight
        deadline = time.monotonic() + 5
        while sum(d.acked for d in devices) < sent and time.monotonic() < deadline:
            time.sleep(0.02)
    acked = sum(d.acked for d in devices)
    for d in devices:
        d.stop()
    print(
        f"fleet: done: {len(devices)} devices sent {sent} messages in {elapsed:.1f}s "
        f"({sent / elapsed if elapsed else 0:.0f} msg/s), acknowledged {acked}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
