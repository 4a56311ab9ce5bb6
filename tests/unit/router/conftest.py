"""A router on a real log in a temporary directory, driven without sockets or sleeping.

:class:`FakeLink` records what the router sends; :class:`Clock` is both the wall clock and
the monotonic clock, moved by hand; scheduled callbacks (the group commit) run when a test
calls :meth:`Harness.run`.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from broker.commitlog import Streams
from broker.commitlog.config import LogConfig, StreamSpec
from broker.commitlog.errors import LogIOError
from broker.config import RouterConfig
from broker.mqtt.packets import (
    Connect,
    Disconnect,
    Packet,
    Publish,
    Subscribe,
    Subscription,
    Will,
)
from broker.mqtt.properties import PropertyId
from broker.mqtt.topics import topic_matches
from broker.router.hooks import SingleWorker, WorkerHooks
from broker.router.router import Router
from broker.router.session import Session


@dataclass
class Sent:
    """A PUBLISH as the router handed it to the link."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    packet_id: int | None
    properties: dict[int, Any] | None


@dataclass
class FakeLink:
    """Implements broker.router.link.Link by recording calls."""

    client_id: str = ""
    version: int = 4
    packets: list[Packet] = field(default_factory=list)
    publishes: list[Sent] = field(default_factory=list)
    closed: int | bool | None = False
    writable: bool = True
    runs: int = 0  # send_publish_run calls
    holds: int = 0
    releases: int = 0

    def send(self, packet: Packet) -> None:
        self.packets.append(packet)

    def hold(self) -> None:
        self.holds += 1

    def release(self) -> None:
        self.releases += 1

    def send_publish(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        dup: bool,
        packet_id: int | None,
        properties: dict[int, Any] | None,
    ) -> bool:
        self.publishes.append(Sent(topic, payload, qos, retain, dup, packet_id, properties))
        return True

    def send_publish_run(
        self,
        topics: Sequence[str],
        payloads: Sequence[bytes],
        retains: Sequence[bool] | None,
        qos: int,
        first_packet_id: int | None,
    ) -> bool:
        self.runs += 1
        for i, (topic, payload) in enumerate(zip(topics, payloads, strict=True)):
            pid = None if first_packet_id is None else first_packet_id + i
            retain = bool(retains and retains[i])
            self.publishes.append(Sent(topic, payload, qos, retain, False, pid, None))
        return True

    def can_write(self) -> bool:
        return self.writable

    def output_room(self) -> int:
        return 1 << 20 if self.writable else 0

    def close(self, reason_code: int | None = None, reason: str = "") -> None:
        self.closed = reason_code

    def of(self, kind: type) -> list[Any]:
        return [p for p in self.packets if type(p) is kind]

    def take(self) -> list[Sent]:
        out, self.publishes = self.publishes, []
        return out


class Clock:
    """Wall and monotonic clock in seconds, moved by :meth:`advance` (or by ``step`` at
    every reading, when set)."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0
        self.step = 0.0

    def __call__(self) -> float:
        now = self.now
        self.now += self.step
        return now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Harness:
    def __init__(
        self,
        data: Path,
        config: RouterConfig | None = None,
        specs: list[StreamSpec] | None = None,
    ) -> None:
        self.data = data
        self.config = config or RouterConfig()
        self.specs = specs or [StreamSpec("default", (), 1, LogConfig(fsync="never"))]
        self.clock = Clock()
        #: The other workers, as the router sees them (:meth:`open` passes them in).
        self.hooks: WorkerHooks = SingleWorker()
        self.open()

    def open(self) -> None:
        self.scheduled: list[Callable[[], None]] = []
        self.streams = Streams(self.data, self.specs, clock=self.clock, matches=topic_matches)
        self.router = Router(
            self.streams,
            self.config,
            schedule=self.scheduled.append,
            clock=self.clock,
            monotonic=self.clock,
            hooks=self.hooks,
        )

    def restart(self) -> None:
        """A clean shutdown and a new router over the same data directory."""
        self.router.close()
        self.streams.close()
        self.open()

    def run(self) -> None:
        """Run the scheduled group commits (the end of an event-loop iteration)."""
        while self.scheduled:
            self.scheduled.pop(0)()

    def connect(
        self,
        client_id: str,
        version: int = 5,
        *,
        clean: bool = True,
        expiry: int | None = None,
        will: Will | None = None,
        receive_maximum: int | None = None,
    ) -> tuple[FakeLink, Session]:
        props: dict[int, Any] = {}
        if expiry is not None:
            props[PropertyId.SESSION_EXPIRY_INTERVAL] = expiry
        if receive_maximum is not None:
            props[PropertyId.RECEIVE_MAXIMUM] = receive_maximum
        link = FakeLink(client_id, version)
        result = self.router.connect(
            link,
            Connect(
                client_id, version, clean_start=clean, keepalive=60, will=will, properties=props
            ),
        )
        assert result is not None
        self.run()
        return link, result[0]

    def subscribe(self, session: Session, topic_filter: str, qos: int) -> None:
        self.router.subscribe(session, Subscribe(1, [Subscription(topic_filter, qos)]))
        self.run()

    def publish(
        self,
        session: Session,
        topic: str,
        payload: bytes,
        qos: int = 0,
        packet_id: int | None = None,
        *,
        dup: bool = False,
        retain: bool = False,
        properties: dict[int, Any] | None = None,
    ) -> None:
        self.router.publish(
            session, Publish(topic, payload, qos, retain, dup, packet_id, properties or {})
        )

    def drop(self, session: Session, link: FakeLink) -> None:
        """The network connection closed without DISCONNECT."""
        self.router.connection_lost(session, link, graceful=False)
        self.run()

    def disconnect(self, session: Session, link: FakeLink, reason: int = 0) -> None:
        self.router.disconnect(session, Disconnect(reason))
        self.router.connection_lost(session, link, graceful=reason != 0x04)
        self.run()

    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.router.tick()
        self.run()

    def log_payloads(self, topic: str) -> list[bytes]:
        key = self.streams.partition_for(topic)
        log = self.streams.log(*key)
        return [r.payload for r in log.read(log.log_start_offset, 10_000) if r.topic == topic]


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path / "data")
    yield harness
    harness.streams.close()


def fail_appends(
    h: Harness, monkeypatch: pytest.MonkeyPatch, key: tuple[str, int], failures: int
) -> list[int]:
    """The next ``failures`` appends to partition ``key`` fail (an I/O error, as a refused
    forward fails them with several workers); returns [appends tried], counting on."""
    log = h.streams.log(*key)
    real = log.append
    tried = [0]

    def append(records: Any, **kw: Any) -> int:
        tried[0] += 1
        if tried[0] <= failures:
            raise LogIOError(log.directory, "append to segment", OSError(errno.EIO, "I/O error"))
        return real(records, **kw)

    monkeypatch.setattr(log, "append", append)
    return tried
