"""A worker's loop keeps serving while its logs' interval fsync waits on a slow disk (issue 23:
the fdatasync ran on the loop and the fleet's p99 latency was the longest fsync of each
second). A real server on a real event loop, with real TCP clients; the disk is made slow by
holding ``os.fdatasync`` until the test lets it go."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest
import uvloop

from broker.config import parse_config
from broker.server import Server
from tests.mqttbytes import connect311, packet, utf8
from tests.unit.net.test_output_after_close import _read_packet


async def _publish_acked(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, packet_id: int
) -> float:
    """Seconds from a QoS 1 PUBLISH to its PUBACK."""
    started = time.monotonic()
    writer.write(packet(0x32, utf8("devices/1/telemetry") + packet_id.to_bytes(2) + b"x" * 64))
    first, body = await asyncio.wait_for(_read_packet(reader), 10)
    assert first == 0x40 and body == packet_id.to_bytes(2)
    return time.monotonic() - started


async def _scenario(data_dir: Path, held: threading.Event, release: threading.Event) -> None:
    config = parse_config(
        {
            "server": {"host": "127.0.0.1", "port": 0},
            "commitlog": {"data_dir": str(data_dir), "fsync": "interval", "fsync_interval": 100},
        }
    )
    server = Server(config)
    await server.start()
    port = server._listeners[0].sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(connect311("device-1"))
        assert (await _read_packet(reader))[0] == 0x20
        await _publish_acked(reader, writer, 1)  # the log now has an unsynced append
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, held.wait, 10), "no interval fsync came"
        # The fsync is held now: the loop still reads, appends and acknowledges.
        assert await _publish_acked(reader, writer, 2) < 1.0
        release.set()
        writer.close()
    finally:
        release.set()
        await server.stop()


def test_the_loop_serves_while_an_interval_fsync_waits_on_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = threading.Event()
    release = threading.Event()
    on_the_loop: list[bool] = []
    real = os.fdatasync
    loop_thread = threading.current_thread()

    def slow_disk(fd: int) -> None:
        if not held.is_set() and not release.is_set():
            on_the_loop.append(threading.current_thread() is loop_thread)
            held.set()
            if not on_the_loop[0]:  # held on the loop, it would stop the test itself
                release.wait(10)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow_disk)
    uvloop.run(_scenario(tmp_path / "data", held, release))
    assert on_the_loop == [False], "the interval fsync ran on the worker's loop"
