"""MQTT over WebSocket (subprotocol "mqtt"): paho's websockets transport and a raw
aiohttp client sending hand-built MQTT bytes in binary frames."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import paho.mqtt.client as mqtt

from tests.integration.clients import V5, V311, Client
from tests.integration.conftest import BrokerFactory, BrokerProcess, free_port
from tests.integration.test_auth import make_password_file
from tests.mqttbytes import connect_bytes, packet, utf8

_CALLBACKS = (
    "on_connect",
    "on_message",
    "on_subscribe",
    "on_unsubscribe",
    "on_disconnect",
    "on_publish",
)


def ws_broker(factory: BrokerFactory, config: str = "") -> tuple[BrokerProcess, int]:
    port = free_port()
    broker = factory(server=f"ws_port = {port}\n", config=config)
    assert f"listening on ws://127.0.0.1:{port}/mqtt" in broker.log()
    return broker, port


def ws_client(port: int, client_id: str, protocol: int = V311) -> Client:
    """The test wrapper around a paho client using the websockets transport."""
    c = Client(port, client_id, protocol)
    kwargs = {"clean_session": True} if protocol != V5 else {}
    p = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=protocol,
        transport="websockets",
        **kwargs,
    )
    p.ws_set_options(path="/mqtt")
    for name in _CALLBACKS:
        setattr(p, name, getattr(c.paho, name))
    c.paho = p
    return c


def test_paho_websocket_pub_sub_with_tcp(broker_factory: BrokerFactory) -> None:
    broker, port = ws_broker(broker_factory)
    ws_sub = ws_client(port, "ws-sub", V5)
    assert ws_sub.connect() == 0
    assert ws_sub.subscribe("web/#", 1) == [1]
    tcp = Client(broker.port, "tcp-pub")
    assert tcp.connect() == 0
    tcp.publish("web/a", "from tcp", qos=1)
    big = bytes(range(256)) * 1000  # 256 kB: several TCP segments, one MQTT packet
    tcp.publish("web/big", big, qos=1)
    got = ws_sub.expect(2)
    assert [(m.topic, m.payload) for m in got] == [("web/a", b"from tcp"), ("web/big", big)]
    ws_pub = ws_client(port, "ws-pub")
    assert ws_pub.connect() == 0
    assert tcp.subscribe("web/#", 2) == [2]
    ws_pub.publish("web/q2", "from ws", qos=2)
    assert tcp.expect(1)[0].payload == b"from ws"
    assert ws_sub.expect(1)[0].payload == b"from ws"
    for c in (ws_sub, tcp, ws_pub):
        c.disconnect()


def test_websocket_logins_use_the_password_file(
    broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    pw = make_password_file(tmp_path / "passwd", {"web": "socket"})
    _, port = ws_broker(
        broker_factory, f'[auth]\nallow_anonymous = false\npassword_file = "{pw}"\n'
    )
    good = ws_client(port, "ws-good")
    good.paho.username_pw_set("web", "socket")
    assert good.connect() == 0
    bad = ws_client(port, "ws-bad", V5)
    bad.paho.username_pw_set("web", "plug")
    assert bad.connect() == 0x86
    good.disconnect()
    bad.disconnect()


async def _raw_session(port: int) -> tuple[str | None, bytes, bool]:
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(f"http://127.0.0.1:{port}/mqtt", protocols=("mqtt",)) as ws,
    ):
        data = connect_bytes("raw-ws")
        # One packet split over two frames, then two packets in one frame [MQTT-6.0.0-2].
        await ws.send_bytes(data[:5])
        await ws.send_bytes(data[5:])
        connack = await asyncio.wait_for(ws.receive_bytes(), 5)
        await ws.send_bytes(
            packet(0x82, b"\x00\x01" + utf8("raw/#") + b"\x00")
            + packet(0x30, utf8("raw/x") + b"hi")
        )
        frames = b""
        while len(frames) < 5 + 11:
            frames += await asyncio.wait_for(ws.receive_bytes(), 5)
        assert frames[:5] == b"\x90\x03\x00\x01\x00", frames.hex()  # SUBACK
        assert frames[5:] == packet(0x30, utf8("raw/x") + b"hi")
        # A text frame is a protocol violation: the broker closes [MQTT-6.0.0-1].
        await ws.send_str("hello")
        msg = await asyncio.wait_for(ws.receive(), 5)
        return ws.protocol, connack, msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)


def test_raw_websocket_frames(broker_factory: BrokerFactory) -> None:
    broker, port = ws_broker(broker_factory)
    protocol, connack, closed = asyncio.run(_raw_session(port))
    assert protocol == "mqtt", "the server selects the mqtt subprotocol [MQTT-6.0.0-4]"
    assert connack == b"\x20\x02\x00\x00"
    assert closed
    deadline = time.monotonic() + 5
    while "text frame; MQTT uses binary frames" not in broker.log():
        assert time.monotonic() < deadline, broker.log()
        time.sleep(0.05)


async def _plain_get(port: int) -> int:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/mqtt") as resp:
        return resp.status


def test_plain_http_request_is_refused(broker_factory: BrokerFactory) -> None:
    _, port = ws_broker(broker_factory)
    assert asyncio.run(_plain_get(port)) == 400


def test_shutdown_disconnects_websocket_clients(broker_factory: BrokerFactory) -> None:
    broker, port = ws_broker(broker_factory)
    c = ws_client(port, "ws-bye", V5)
    assert c.connect() == 0
    started = time.monotonic()
    assert broker.stop() == 0
    assert time.monotonic() - started < 5, "the WebSocket did not hold the shutdown"
    assert c.disconnects.get(timeout=5) == 0x8B, "server shutting down"
    c.paho.loop_stop()
