"""Output queued for a connection after it half-closed (broker.net.closing) is dropped, and
never keeps the other connections' output from leaving.

A client that publishes at QoS 1 and sends DISCONNECT at once (paho's ``publish`` without
waiting, then ``disconnect``) is half-closed (``write_eof``) on the DISCONNECT, while the
PUBACK of its PUBLISH is written at the end of the iteration, after the group commit. uvloop
refuses that write (``RuntimeError: Cannot call write() after write_eof()``); the end of the
iteration stopped at it, and the connections queued after that one kept their output (a
subscriber's deliveries) unwritten until they wrote something else. A real server on a real
event loop, with real TCP clients.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import uvloop

from broker.config import parse_config
from broker.server import Server
from tests.mqttbytes import connect311, packet, utf8


async def _read_packet(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    first = (await reader.readexactly(1))[0]
    length, shift = 0, 0
    while True:
        byte = (await reader.readexactly(1))[0]
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return first, await reader.readexactly(length)


async def _scenario(data_dir: Path, rounds: int) -> list[bytes]:
    config = parse_config(
        {
            "server": {"host": "127.0.0.1", "port": 0},
            "commitlog": {"data_dir": str(data_dir), "fsync": "always"},
        }
    )
    server = Server(config)
    await server.start()
    port = server._listeners[0].sockets[0].getsockname()[1]
    try:
        sub_r, sub_w = await asyncio.open_connection("127.0.0.1", port)
        sub_w.write(connect311("sub"))
        assert (await _read_packet(sub_r))[0] == 0x20  # CONNACK
        sub_w.write(packet(0x82, b"\x00\x01" + utf8("t/#") + b"\x00"))  # SUBSCRIBE, QoS 0
        assert (await _read_packet(sub_r))[0] == 0x90  # SUBACK
        got = []
        for i in range(rounds):
            pub_r, pub_w = await asyncio.open_connection("127.0.0.1", port)
            pub_w.write(connect311(f"pub{i}"))
            assert (await _read_packet(pub_r))[0] == 0x20
            body = utf8("t/x") + b"\x00\x01" + b"m%d" % i
            pub_w.write(packet(0x32, body) + b"\xe0\x00")  # PUBLISH QoS 1, DISCONNECT
            first, body = await asyncio.wait_for(_read_packet(sub_r), 5)
            assert first == 0x30, hex(first)
            got.append(body[2 + len(b"t/x") :])
            pub_w.close()
        sub_w.close()
        return got
    finally:
        await server.stop()


def test_puback_after_disconnect_is_dropped_and_others_flush(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    got = uvloop.run(_scenario(tmp_path / "data", 5))
    assert got == [b"m%d" % i for i in range(5)]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
