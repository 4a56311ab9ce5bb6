"""Codec throughput: mqlog's sans-IO codec against amqtt 0.12.1's, in the same run.

Workload: QoS 1 PUBLISH, topic "devices/123/telemetry", 64-byte payload, packet id varying,
at protocol levels 4 (3.1.1) and 5 (5.0, no properties). amqtt speaks 3.1.1 only, so the
ratio is taken at level 4.

* mqlog decode: the stream is pre-cut into 64 KiB reads (packets split across reads, as
  from a socket); each read is ``feed()``-ed and drained with ``packets()``.
* amqtt decode: the same bytes fed to one ``asyncio.StreamReader`` (wrapped in the
  ``StreamReaderAdapter`` amqtt's broker uses), then ``PublishPacket.from_stream`` N times
  inside one running event loop, so no time is spent waiting for I/O.
* mqlog encode: ``encode_publish(...)`` (the delivery path) and ``encode(Publish(...))``.
* amqtt encode: ``PublishPacket.build(...).to_bytes()``, its equivalent of the former.

Every figure is the median of several timed runs (after one warm-up). Prints a table and one
JSON line (``orjson``) with the rates and the mqlog/amqtt ratios.

Run: ``.venv/bin/python -m bench.codec [--runs 5] [--packets 50000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable

import orjson

from broker.mqtt import Decoder, Publish, encode, encode_publish

TOPIC = "devices/123/telemetry"
PAYLOAD = bytes(range(64))
READ_SIZE = 65536


def _stream(count: int, version: int) -> bytes:
    return b"".join(
        encode_publish(TOPIC, PAYLOAD, 1, False, False, i % 65535 + 1, None, version)
        for i in range(count)
    )


def _median_rate(count: int, runs: int, once: Callable[[], None]) -> float:
    once()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return count / statistics.median(times)


def mqlog_decode(count: int, runs: int, version: int) -> float:
    data = _stream(count, version)
    reads = [data[i : i + READ_SIZE] for i in range(0, len(data), READ_SIZE)]

    def once() -> None:
        decoder = Decoder(version=version)
        got = 0
        for chunk in reads:
            decoder.feed(chunk)
            got += len(decoder.packets())
        if got != count:
            raise RuntimeError(f"decoded {got} packets, expected {count}")

    return _median_rate(count, runs, once)


def mqlog_encode_publish(count: int, runs: int, version: int) -> float:
    def once() -> None:
        for i in range(count):
            encode_publish(TOPIC, PAYLOAD, 1, False, False, i % 65535 + 1, None, version)

    return _median_rate(count, runs, once)


def mqlog_encode_packet(count: int, runs: int, version: int) -> float:
    packets = [Publish(TOPIC, PAYLOAD, 1, False, False, i % 65535 + 1, {}) for i in range(count)]

    def once() -> None:
        for packet in packets:
            encode(packet, version)

    return _median_rate(count, runs, once)


def amqtt_decode(count: int, runs: int) -> float:
    from amqtt.adapters import StreamReaderAdapter
    from amqtt.mqtt.publish import PublishPacket

    data = _stream(count, 4)

    async def decode_all() -> None:
        reader = asyncio.StreamReader(limit=len(data) + 1)
        reader.feed_data(data)
        reader.feed_eof()
        adapter = StreamReaderAdapter(reader)
        for _ in range(count):
            await PublishPacket.from_stream(adapter)

    loop = asyncio.new_event_loop()
    try:
        return _median_rate(count, runs, lambda: loop.run_until_complete(decode_all()))
    finally:
        loop.close()


def amqtt_encode(count: int, runs: int) -> float:
    from amqtt.mqtt.publish import PublishPacket

    def once() -> None:
        for i in range(count):
            PublishPacket.build(TOPIC, PAYLOAD, i % 65535 + 1, False, 1, False).to_bytes()

    return _median_rate(count, runs, once)


def _check_same_bytes() -> None:
    """Both codecs must produce identical bytes for the workload, or the race is unfair."""
    from amqtt.mqtt.publish import PublishPacket

    ours = encode_publish(TOPIC, PAYLOAD, 1, False, False, 7, None, 4)
    theirs = PublishPacket.build(TOPIC, PAYLOAD, 7, False, 1, False).to_bytes()
    if ours != theirs:
        raise RuntimeError(f"encodings differ: {ours!r} != {theirs!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5, help="timed runs per figure (median)")
    parser.add_argument("--packets", type=int, default=50_000, help="packets per mqlog run")
    parser.add_argument("--amqtt-packets", type=int, default=10_000, help="packets per amqtt run")
    args = parser.parse_args(argv)
    n, runs, an = args.packets, args.runs, args.amqtt_packets
    _check_same_bytes()
    # One discarded round first: the first timed figure of a fresh process otherwise comes
    # out well below the rest (allocator arenas, CPU frequency ramp-up).
    mqlog_decode(n, 2, 4)

    rates = {
        "mqlog_decode_v4": mqlog_decode(n, runs, 4),
        "mqlog_decode_v5": mqlog_decode(n, runs, 5),
        "mqlog_encode_publish_v4": mqlog_encode_publish(n, runs, 4),
        "mqlog_encode_publish_v5": mqlog_encode_publish(n, runs, 5),
        "mqlog_encode_packet_v4": mqlog_encode_packet(n, runs, 4),
        "mqlog_encode_packet_v5": mqlog_encode_packet(n, runs, 5),
        "amqtt_decode_v4": amqtt_decode(an, runs),
        "amqtt_encode_v4": amqtt_encode(an, runs),
    }
    ratio_decode = rates["mqlog_decode_v4"] / rates["amqtt_decode_v4"]
    ratio_encode = rates["mqlog_encode_publish_v4"] / rates["amqtt_encode_v4"]

    print(f"QoS 1 PUBLISH, topic {TOPIC!r}, {len(PAYLOAD)}-byte payload; median of {runs} runs")
    print(f"{'codec':<8} {'operation':<24} {'version':>7} {'packets/s':>12}")
    print("-" * 54)
    rows = [
        ("mqlog", "decode (feed+packets)", 4, "mqlog_decode_v4"),
        ("mqlog", "decode (feed+packets)", 5, "mqlog_decode_v5"),
        ("mqlog", "encode_publish", 4, "mqlog_encode_publish_v4"),
        ("mqlog", "encode_publish", 5, "mqlog_encode_publish_v5"),
        ("mqlog", "encode(Publish)", 4, "mqlog_encode_packet_v4"),
        ("mqlog", "encode(Publish)", 5, "mqlog_encode_packet_v5"),
        ("amqtt", "PublishPacket.from_stream", 4, "amqtt_decode_v4"),
        ("amqtt", "build().to_bytes()", 4, "amqtt_encode_v4"),
    ]
    for codec, operation, version, key in rows:
        print(f"{codec:<8} {operation:<24} {version:>7} {rates[key]:>12,.0f}")
    print("-" * 54)
    print(f"ratio mqlog/amqtt (v4): decode x{ratio_decode:.1f}, encode x{ratio_encode:.1f}")
    result = {
        "bench": "codec",
        "runs": runs,
        "rates": {key: round(value) for key, value in rates.items()},
        "ratio_decode_v4": round(ratio_decode, 2),
        "ratio_encode_v4": round(ratio_encode, 2),
    }
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
