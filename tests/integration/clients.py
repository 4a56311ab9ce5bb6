"""Small synchronous wrappers over real clients: paho-mqtt and mosquitto_pub / mosquitto_sub."""

from __future__ import annotations

import contextlib
import queue
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

V311 = mqtt.MQTTv311
V5 = mqtt.MQTTv5


@dataclass
class Message:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: dict[str, Any] = field(default_factory=dict)
    dup: bool = False


class Client:
    """A paho client on its own network thread; messages land in a queue.

    ``connect()`` waits for CONNACK and returns the reason code (0 = accepted). The client
    never reconnects by itself: a test connects again explicitly, and a refused or lost
    connection ends the network thread at once (paho's own reconnect waits a second first,
    which ``disconnect()`` then waited for).
    """

    def __init__(
        self,
        port: int,
        client_id: str = "",
        protocol: int = V311,
        *,
        host: str = "127.0.0.1",
        clean: bool = True,
        session_expiry: int | None = None,
        keepalive: int = 30,
        will: tuple[str, bytes, int, bool] | None = None,
        will_properties: Properties | None = None,
        connect_properties: Properties | None = None,
        manual_ack: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self.protocol = protocol
        self.clean = clean
        self.session_expiry = session_expiry
        self.keepalive = keepalive
        self.connect_properties = connect_properties
        self.messages: queue.Queue[Message] = queue.Queue()
        self.connacks: queue.Queue[tuple[int, bool, dict[str, Any]]] = queue.Queue()
        self.subacks: queue.Queue[list[int]] = queue.Queue()
        self.unsubacks: queue.Queue[list[int]] = queue.Queue()
        self.disconnects: queue.Queue[int] = queue.Queue()
        self.published: set[int] = set()
        self._pub_lock = threading.Lock()
        kwargs: dict[str, Any] = {
            "client_id": client_id,
            "protocol": protocol,
            "manual_ack": manual_ack,
            "reconnect_on_failure": False,
        }
        if protocol != V5:
            kwargs["clean_session"] = clean
        self.paho = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, **kwargs)
        if will is not None:
            self.paho.will_set(*will, properties=will_properties)
        self.paho.on_connect = self._on_connect
        self.paho.on_message = self._on_message
        self.paho.on_subscribe = self._on_subscribe
        self.paho.on_unsubscribe = self._on_unsubscribe
        self.paho.on_disconnect = self._on_disconnect
        self.paho.on_publish = self._on_publish

    # paho callbacks (network thread)
    def _on_connect(self, c: Any, u: Any, flags: Any, rc: Any, props: Any = None) -> None:
        self.connacks.put((int(rc.value), bool(flags.session_present), _props(props)))

    def _on_message(self, c: Any, u: Any, msg: mqtt.MQTTMessage) -> None:
        self.messages.put(
            Message(
                msg.topic,
                msg.payload,
                msg.qos,
                bool(msg.retain),
                _props(getattr(msg, "properties", None)),
                bool(msg.dup),
            )
        )

    def _on_subscribe(self, c: Any, u: Any, mid: int, rcs: Any, props: Any = None) -> None:
        self.subacks.put([int(r.value) for r in rcs])

    def _on_unsubscribe(self, c: Any, u: Any, mid: int, rcs: Any, props: Any = None) -> None:
        self.unsubacks.put([int(r.value) for r in rcs] if rcs else [])

    def _on_disconnect(self, c: Any, u: Any, flags: Any, rc: Any, props: Any = None) -> None:
        self.disconnects.put(int(rc.value))

    def _on_publish(self, c: Any, u: Any, mid: int, rc: Any, props: Any = None) -> None:
        with self._pub_lock:
            self.published.add(mid)

    # API (test thread)
    def connect(self, timeout: float = 10.0) -> int:
        props = self.connect_properties
        if self.protocol == V5 and self.session_expiry is not None:
            props = props or Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.session_expiry
        kwargs: dict[str, Any] = {"keepalive": self.keepalive, "properties": props}
        if self.protocol == V5:
            kwargs["clean_start"] = self.clean
        self.paho.connect(self.host, self.port, **kwargs)
        self.paho.loop_start()
        rc, self.session_present, self.connack_properties = self.connacks.get(timeout=timeout)
        return rc

    def subscribe(
        self,
        topic: str,
        qos: int = 0,
        timeout: float = 10.0,
        properties: Properties | None = None,
        **options: Any,
    ) -> list[int]:
        """SUBACK reason codes. ``options``: noLocal, retainAsPublished, retainHandling."""
        if self.protocol == V5:
            opts = mqtt.SubscribeOptions(qos=qos, **options)
            self.paho.subscribe(topic, options=opts, properties=properties)
        else:
            self.paho.subscribe(topic, qos)
        return self.subacks.get(timeout=timeout)

    def publish(
        self,
        topic: str,
        payload: bytes | str,
        qos: int = 0,
        retain: bool = False,
        properties: Properties | None = None,
        wait: bool = True,
    ) -> int:
        info = self.paho.publish(topic, payload, qos, retain, properties=properties)
        if wait and qos > 0:
            info.wait_for_publish(timeout=10)
            assert info.is_published(), f"publish to {topic} not acknowledged"
        return info.mid

    def expect(self, n: int, timeout: float = 10.0) -> list[Message]:
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"expected {n} messages, got {len(out)}: {out}")
            out.append(self.messages.get(timeout=remaining))
        return out

    def expect_none(self, wait: float = 0.5) -> None:
        try:
            msg = self.messages.get(timeout=wait)
        except queue.Empty:
            return
        raise AssertionError(f"unexpected message {msg}")

    def disconnect(self) -> None:
        self.paho.disconnect()
        self.paho.loop_stop()

    def drop(self) -> None:
        """Close the socket without DISCONNECT (an abnormal disconnect: the will fires).

        The shutdown wakes the network thread, which sees the connection lost and ends (it
        sends nothing more on a shut socket), instead of ``loop_stop`` waiting out its
        one-second select."""
        sock = self.paho.socket()
        if sock is not None:
            with contextlib.suppress(OSError):  # the broker closed it already
                sock.shutdown(socket.SHUT_RDWR)
        self.paho.loop_stop()
        sock = self.paho.socket()
        if sock is not None:
            sock.close()


def _props(props: Any) -> dict[str, Any]:
    if props is None:
        return {}
    return {k: v for k, v in props.json().items()}


def mosquitto_pub(
    port: int, topic: str, message: str, qos: int = 0, *extra: str, version: str = "mqttv311"
) -> None:
    subprocess.run(
        [
            "mosquitto_pub",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-t",
            topic,
            "-m",
            message,
            "-q",
            str(qos),
            "-V",
            version,
            *extra,
        ],
        check=True,
        timeout=15,
        capture_output=True,
    )


def mosquitto_sub(
    port: int, topic: str, count: int, *extra: str, version: str = "mqttv311", timeout: int = 15
) -> list[str]:
    """Run mosquitto_sub -v until ``count`` messages arrived; returns its output lines."""
    out = subprocess.run(
        [
            "mosquitto_sub",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-t",
            topic,
            "-v",
            "-C",
            str(count),
            "-W",
            str(timeout),
            "-V",
            version,
            *extra,
        ],
        check=True,
        timeout=timeout + 5,
        capture_output=True,
        text=True,
    )
    return out.stdout.splitlines()


class SubProcess:
    """A long-running mosquitto_sub; ``lines()`` gives what it printed so far."""

    def __init__(self, port: int, topic: str, *extra: str, version: str = "mqttv311") -> None:
        self.proc = subprocess.Popen(
            [
                "mosquitto_sub",
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-t",
                topic,
                "-v",
                "-V",
                version,
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.append(line.rstrip("\n"))

    def wait_for(self, n: int, timeout: float = 10.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self._lines) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return list(self._lines)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)
