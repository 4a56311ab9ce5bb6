"""A link's output held (``Link.hold``) leaves only when released, in order, and a close
meanwhile drops it: what an outgoing QoS 2 PUBLISH to a persistent session waits on until its
state is stored (broker.router.delivery). A real server on a real event loop, with real TCP
clients; the session store's acknowledgement is made to come later, as a replicated
``$sessions`` gives it (at the quorum commit)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvloop

from broker.config import parse_config
from broker.router.commit import OUTCOME_UNKNOWN
from broker.server import Server
from tests.mqttbytes import connect311, packet, utf8
from tests.unit.net.test_output_after_close import _read_packet


async def _scenario(data_dir: Path) -> None:
    config = parse_config(
        {
            "server": {"host": "127.0.0.1", "port": 0},
            "commitlog": {"data_dir": str(data_dir), "fsync": "never"},
        }
    )
    server = Server(config)
    await server.start()
    port = server._listeners[0].sockets[0].getsockname()[1]
    commit: Any = server.router.flush.__self__  # type: ignore[attr-defined]
    write = commit.persist
    later: list[Callable[[int | None], None]] = []

    def replicated(session: Any, ack: Callable[[int | None], None] | None) -> None:
        write(session, None)
        if ack is not None and session.client_id == "sub":
            later.append(ack)
        elif ack is not None:
            ack(0)

    commit.persist = replicated
    try:
        sub_r, sub_w = await asyncio.open_connection("127.0.0.1", port)
        sub_w.write(connect311("sub", flags=0x00))  # a persistent session
        assert (await _read_packet(sub_r))[0] == 0x20
        sub_w.write(packet(0x82, b"\x00\x01" + utf8("t/#") + b"\x02"))  # SUBSCRIBE, QoS 2
        assert (await _read_packet(sub_r))[0] == 0x90
        pub_r, pub_w = await asyncio.open_connection("127.0.0.1", port)
        pub_w.write(connect311("pub"))
        assert (await _read_packet(pub_r))[0] == 0x20
        pub_w.write(packet(0x30, utf8("t/x") + b"one"))  # QoS 0 in, QoS 0 out: not held
        first, _ = await asyncio.wait_for(_read_packet(sub_r), 5)
        assert first == 0x30
        pub_w.write(packet(0x34, utf8("t/x") + b"\x00\x01" + b"two"))  # QoS 2 in and out
        assert (await _read_packet(pub_r))[0] == 0x50  # PUBREC: the message is stored
        pub_w.write(packet(0x30, utf8("t/x") + b"three"))  # behind the held one, in order
        await asyncio.sleep(0.3)
        assert len(later) == 1
        reading = asyncio.ensure_future(_read_packet(sub_r))
        await asyncio.sleep(0.3)
        assert not reading.done(), "the QoS 2 PUBLISH left before its state was stored"
        later.pop()(5)
        first, body = await asyncio.wait_for(reading, 5)
        assert first & 0xF6 == 0x34 and body.endswith(b"two")
        first, body = await asyncio.wait_for(_read_packet(sub_r), 5)
        assert first == 0x30 and body.endswith(b"three")
        # Not stored (a lost $sessions leadership): the connection closes, nothing sent.
        pub_w.write(packet(0x34, utf8("t/x") + b"\x00\x02" + b"four"))
        assert (await _read_packet(pub_r))[0] == 0x50
        await asyncio.sleep(0.3)
        later.pop()(OUTCOME_UNKNOWN)
        assert await asyncio.wait_for(sub_r.read(), 5) == b""  # closed, "four" never sent
        pub_w.close()
        sub_w.close()
    finally:
        await server.stop()


def test_held_output_leaves_on_release_in_order_and_a_close_drops_it(tmp_path: Path) -> None:
    uvloop.run(_scenario(tmp_path / "data"))
