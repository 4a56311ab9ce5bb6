"""The device path of the transport (broker.net.transport), compiled
(broker.net._devicelane) and in Python (broker.net.devicepath), changes nothing a client or
the log can see.

Real transports over real routers and logs are fed the same reads: one takes the compiled
device path, one the Python device path, and one has it switched off, so every read goes
through the decoder and ``Router.publish_run``. Whatever the reads hold (PUBLISHes to a few
topics, one of them ``$SYS``, at QoS 0-2, with DUP, retain, properties, a topic alias,
packet id 0, over the 5.0 receive maximum, split across reads or several in one), each
device path must write the same bytes to the client as the full path, close it at the same
point, and leave the same records in the log.
"""

from __future__ import annotations

import dataclasses
import gc
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.auth import AuthService
from broker.commitlog import Record, Streams
from broker.commitlog.config import LogConfig, StreamSpec
from broker.commitlog.small_batch import encode
from broker.config import Config, RouterConfig
from broker.metrics.collector import Metrics
from broker.mqtt.topics import topic_matches
from broker.net import devicepath
from broker.net.keepalive import KeepaliveWheel
from broker.net.parking import ParkingLot
from broker.net.transport import MQTTProtocol
from broker.router.commit import OUTCOME_UNKNOWN
from broker.router.partition import Partition, PartitionBase, SessionWatcher
from broker.router.router import Router
from broker.server import TICK_SECONDS
from tests.integration.rawclient import varint

TOPICS = ["devices/1/telemetry", "devices/2/telemetry", "$SYS/x"]
#: Receive Maximum the server announces (RouterConfig.max_inflight): small, so a 5.0
#: client exceeds it within a few unacknowledged PUBLISHes.
QUOTA = 3


class Transport:
    """What uvloop's transport is to MQTTProtocol, recording writes and the close."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def can_write_eof(self) -> bool:
        return False  # closed at once, as a TLS or WebSocket carrier is (broker.net.closing)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    abort = close

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 50000) if name == "peername" else None

    def set_write_buffer_limits(self, high: int) -> None:
        pass


class Server:
    """The parts of broker.server.Server a transport uses, around a real router."""

    def __init__(self, data: Path) -> None:
        self.config = Config(router=dataclasses.replace(RouterConfig(), max_inflight=QUOTA))
        self.monotonic = lambda: 1000.0
        self.scheduled: list[Any] = []
        self.streams = Streams(
            data,
            [
                StreamSpec("telemetry", ("devices/#",), 4, LogConfig(fsync="never")),
                StreamSpec("default", (), 1, LogConfig(fsync="never")),
            ],
            matches=topic_matches,
        )
        self.router = Router(
            self.streams,
            self.config.router,
            schedule=self.scheduled.append,
            clock=lambda: 1_700_000_000.0,
        )
        self.metrics = Metrics()
        self.auth = AuthService(self.config.auth, self.monotonic)
        self.links: set[Any] = set()
        self.keepalive: KeepaliveWheel[Any] = KeepaliveWheel(TICK_SECONDS, 1000.0)
        self.parking = ParkingLot(None, 0, 1000.0)  # never parks
        self.session_claims = None
        self.handoff = None  # one worker: no hand-off
        self.flush_due: list[MQTTProtocol] = []
        #: What the forwarded batches' acknowledgements got (their first offsets).
        self.forward_answers: list[int | None] = []

    def want_flush(self, link: MQTTProtocol) -> None:
        self.flush_due.append(link)

    def flush_peers(self) -> None:
        pass  # one worker: no peers

    def end_iteration(self) -> None:
        """The end of an event-loop iteration: group commit, then the links' output."""
        while self.scheduled:
            self.scheduled.pop(0)()
        due, self.flush_due = self.flush_due, []
        for link in due:
            link.flush_output()

    def records(self) -> list[tuple[Any, ...]]:
        out = []
        for spec in self.streams.specs.values():
            for p in range(spec.partitions):
                log = self.streams.log(spec.name, p)
                out += [(spec.name, p, *r[2:]) for r in log.read(0, max_records=10_000)]
        return out


class FullPathOnly(MQTTProtocol):
    compiled_device_path = False

    def _plain_publish(self, data: bytes) -> bool:
        return False


class PythonDevicePath(MQTTProtocol):
    """The reference: the Python device path, even where the compiled one is built."""

    compiled_device_path = False


#: MQTTProtocol takes the compiled path where it is built (tests/unit/net/test_devicepath.py
#: fails where it is not).
DEVICE_PATHS = {"compiled": MQTTProtocol, "python": PythonDevicePath}


def publish(
    version: int,
    topic: str,
    payload: bytes,
    qos: int,
    packet_id: int,
    dup: bool,
    retain: bool,
    props: bytes,
) -> bytes:
    name = topic.encode()
    body = struct.pack("!H", len(name)) + name
    if qos:
        body += struct.pack("!H", packet_id)
    if version == 5:
        body += varint(len(props)) + props
    body += payload
    first = 0x30 | qos << 1 | (0x08 if dup else 0) | (0x01 if retain else 0)
    return bytes([first]) + varint(len(body)) + body


def connect(version: int) -> bytes:
    body = struct.pack("!H", 4) + b"MQTT" + bytes([version, 0x02]) + struct.pack("!H", 60)
    if version == 5:
        body += b"\x00"
    body += struct.pack("!H", 3) + b"dev"
    return b"\x10" + varint(len(body)) + body


PROPERTIES = [
    b"",
    b"\x26\x00\x01k\x00\x01v",  # a user property
    b"\x23\x00\x01",  # topic alias 1 (with the topic: sets it)
    b"\x01\x01",  # payload format indicator
]

packets = st.tuples(
    # "" : only a topic alias names it (5.0); mostly one topic, as a device publishes.
    st.sampled_from([TOPICS[0]] * 4 + TOPICS[1:] + [""]),
    st.binary(max_size=20) | st.just(b"x" * 300),  # 300: two bytes of remaining length
    st.sampled_from([0, 1, 1, 1, 1, 2]),
    st.sampled_from([1, 2, 3, 4, 5, 6, 7, 0]),  # packet id 0 is refused [MQTT-2.2.1-3]
    st.sampled_from([False, False, False, True]),  # DUP (QoS 0 with DUP is malformed)
    st.sampled_from([False, False, False, True]),  # retain
    st.sampled_from([b""] * 4 + PROPERTIES[1:]),
)


@st.composite
def sessions(draw: st.DrawFn) -> tuple[int, list[bytes], list[int]]:
    """A protocol level, the reads after the CONNECT, and after which reads an event-loop
    iteration ends (acknowledgements leave only then)."""
    version = draw(st.sampled_from([4, 5]))
    stream = b""
    cuts = []
    for spec in draw(st.lists(packets, min_size=1, max_size=40)):
        topic, payload, qos, pid, dup, retain, props = spec
        if version == 4:
            props = b""
            topic = topic or TOPICS[0]
        stream += publish(version, topic, payload, qos, pid, dup, retain, props)
        # Mostly one packet per read (a device); sometimes several together (a publisher's
        # burst), or a cut within a packet (its start ends a read, its rest begins the next).
        how = draw(st.sampled_from(["one"] * 6 + ["join"] * 3 + ["split", "cut"]))
        if how == "one":
            cuts.append(len(stream))
        elif how == "split":
            cuts.append(len(stream) - draw(st.integers(1, 3)))
            cuts.append(len(stream))
        elif how == "cut":
            size = len(publish(version, topic, payload, qos, pid, dup, retain, props))
            cuts.append(len(stream) - draw(st.integers(1, size - 1)))
    cuts = sorted({c for c in cuts if 0 < c < len(stream)} | {len(stream)})
    reads = [stream[a:b] for a, b in zip([0, *cuts], cuts, strict=False)]
    ends = sorted(draw(st.sets(st.integers(0, len(reads) - 1))) | {len(reads) - 1})
    return version, reads, ends


def serve(
    cls: type[MQTTProtocol],
    data: Path,
    version: int,
    reads: list[bytes],
    ends: list[int],
    partition: type[PartitionBase] = Partition,
    forwards: dict[int, int] | None = None,
) -> tuple[list[bytes], bool, list[tuple[Any, ...]]]:
    """The client's bytes, whether it was closed, and the records in the log, after
    ``reads``; ``forwards``: before read ``i``, a batch of that many records arrives from
    another worker for TOPICS[0]'s partition (broker.workers.partitions), appended as its
    bytes (``Router.append_forwarded_batch``); a reader watches that partition, and the
    records it keeps in memory for it (its tail) must be the log's, offsets included."""
    server = Server(data)
    if forwards is not None:
        watched = server.router.partition(server.streams.partition_for(TOPICS[0]))
        watched.watchers.add(SessionWatcher("reader", "main"))
    if partition is not Partition:
        for topic in TOPICS:
            key = server.streams.partition_for(topic)
            server.router.partitions[key] = partition(key, server.streams.log(*key))
    proto = cls(server)  # type: ignore[arg-type]
    transport = Transport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.data_received(connect(version))
    server.end_iteration()
    for i, read in enumerate(reads):
        if forwards and i in forwards:
            forward(server, i, forwards[i])
        proto.data_received(read)
        if i in ends:
            server.end_iteration()
        if transport.closed:
            break
    server.end_iteration()
    records = server.records()
    if forwards is not None:
        tail = watched.tail
        assert tail == watched.log.read(watched.tail_base, max_records=len(tail) or 1)[: len(tail)]
    server.streams.close()
    return transport.written, transport.closed, records


def forward(server: Server, seq: int, count: int) -> None:
    """A batch of ``count`` records another worker encoded for TOPICS[0]'s partition."""
    key = server.streams.partition_for(TOPICS[0])
    records = [
        Record(-1, 1_699_999_999_000 + k, TOPICS[0], b"fwd%d.%d" % (seq, k), 1, False, "other")
        for k in range(count)
    ]
    answers = server.forward_answers
    server.router.append_forwarded_batch(key, encode(0, records), count, answers.append)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sessions())
def test_device_path_is_invisible(
    tmp_path_factory: Any, session: tuple[int, list[bytes], list[int]]
) -> None:
    version, reads, ends = session
    base = tmp_path_factory.mktemp("device")
    full = serve(FullPathOnly, base / "full", version, reads, ends)
    for name, cls in DEVICE_PATHS.items():
        fast = serve(cls, base / name, version, reads, ends)
        assert fast[0] == full[0], f"{name}: different bytes written to the client"
        assert fast[1] == full[1], f"{name}: closed on one path and not the other"
        assert fast[2] == full[2], f"{name}: different records in the log"


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sessions(), st.data())
def test_forwarded_batches_among_device_publishes(
    tmp_path_factory: Any, session: tuple[int, list[bytes], list[int]], data: st.DataObject
) -> None:
    """Batches another worker forwards, appended as their bytes among the records the device
    path gathers in the same partition and iteration: each path writes the same bytes to
    the client and leaves the same records in the log, the forwarded ones where they
    arrived (the device path numbers its records after them)."""
    version, reads, ends = session
    forwards = data.draw(st.dictionaries(st.integers(0, len(reads) - 1), st.integers(1, 3)))
    base = tmp_path_factory.mktemp("forwarded")
    full = serve(FullPathOnly, base / "full", version, reads, ends, forwards=forwards)
    for name, cls in DEVICE_PATHS.items():
        fast = serve(cls, base / name, version, reads, ends, forwards=forwards)
        assert fast == full, name
    sent = [b"fwd%d.%d" % (i, k) for i in sorted(forwards) for k in range(forwards[i])]
    stored = [r[3] for r in full[2] if r[3].startswith(b"fwd")]
    assert stored == sent[: len(stored)]  # in the order they came (a closed client: fewer)
    assert full[1] or stored == sent


@pytest.mark.parametrize("path", DEVICE_PATHS)
def test_device_path_is_taken(tmp_path: Path, path: str) -> None:
    """The second and later plain PUBLISHes to one topic skip the decoder (else the test
    above compares the full path with itself), and are stored and acknowledged; on the
    compiled path by the compiled lane, the first one too (devicepath.burst_lane)."""
    decoded: list[bytes | None] = []

    class Spy(DEVICE_PATHS[path]):  # type: ignore[misc,valid-type]
        def _receive(self, data: bytes | None, packets: Any) -> None:
            decoded.append(data)
            super()._receive(data, packets)

    server = Server(tmp_path)
    proto = Spy(server)  # type: ignore[arg-type]
    transport = Transport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.data_received(connect(4))
    first, second, other = (
        publish(4, topic, payload, 1, pid, False, False, b"")
        for topic, payload, pid in [
            (TOPICS[0], b"a", 1),
            (TOPICS[0], b"b", 2),
            (TOPICS[1], b"c", 3),
        ]
    )
    for read in (first, second, second.replace(b"b", b"B"), other):
        proto.data_received(read)
    compiled = proto._lane is not None
    gathered = server.router.partition(server.streams.partition_for(TOPICS[0])).pending[:3]
    server.end_iteration()
    assert compiled == (path == "compiled" and devicepath.lane_class() is not None)
    # The records the lane gathers are not tracked by the garbage collector (in no cycle:
    # ints, strs, bytes), which a fan-in's collections traversed in the partitions' tails
    # (the first went through Router.publish_plain: it made the partition).
    assert [gc.is_tracked(r) for r in gathered[1:]] == [not compiled] * 2
    assert decoded == [connect(4), other] if compiled else [connect(4), first, other]
    assert sorted(r[3] for r in server.records()) == sorted([b"a", b"b", b"B", b"c"])
    acks = b"".join(transport.written)[4:]  # after the CONNACK
    assert acks == b"".join(b"\x40\x02\x00" + bytes([pid]) for pid in (1, 2, 2, 3))
    server.streams.close()


@pytest.mark.parametrize("path", DEVICE_PATHS)
def test_reads_of_several_plain_publishes(tmp_path: Path, path: str) -> None:
    """A publisher's burst: reads of several plain PUBLISHes, cut by the socket within a
    fixed header, a topic, a payload. The compiled lane takes them, the first read's
    included (made for its topic: devicepath.burst_lane), the start of a packet at a read's
    end too (the decoder keeps it; the lane takes it back with the next read); a read with
    another topic's PUBLISH is the decoder's. The Python device path leaves the first read
    and every read of several to the decoder. Both answer as the full path does."""
    decoded: list[bytes | None] = []

    class Spy(DEVICE_PATHS[path]):  # type: ignore[misc,valid-type]
        def _receive(self, data: bytes | None, packets: Any) -> None:
            decoded.append(data)
            super()._receive(data, packets)

    burst = [publish(4, TOPICS[0], b"m%d" % i, i % 2, i, False, False, b"") for i in range(1, 11)]
    stream = b"".join(burst)  # packets end at 27, 52, 79, 104, ..., 183, 208, ..., 261
    reads = [
        burst[0],  # the full path's on the Python device path: it sets the plain topic
        stream[27:53],  # one packet and the first byte of the next
        stream[53:90],  # its rest, the next to within its topic
        stream[90:207],  # its rest, three more, the next to within its payload
        stream[207:],  # its rest, two more
        publish(4, TOPICS[1], b"o", 1, 11, False, False, b""),  # the decoder's
    ]
    fast = serve(Spy, tmp_path / "fast", 4, reads, [len(reads) - 1])
    full = serve(FullPathOnly, tmp_path / "full", 4, reads, [len(reads) - 1])
    assert fast == full
    assert sorted(r[3] for r in fast[2]) == sorted([b"m%d" % i for i in range(1, 11)] + [b"o"])
    assert not fast[1]
    compiled = path == "compiled" and devicepath.lane_class() is not None
    assert decoded == [connect(4), reads[-1]] if compiled else [connect(4), *reads]


@pytest.mark.parametrize("version", [4, 5])
def test_a_first_burst_takes_the_lane(tmp_path: Path, version: int) -> None:
    """A publisher's first read holding its whole burst (its socket filled while the loop
    served the others): the compiled lane is made for the first PUBLISH's topic and takes
    the read, the start of the next packet at its end included; the decoder sees none of
    them. As the full path answers."""
    decoded: list[bytes | None] = []

    class Spy(MQTTProtocol):
        def _receive(self, data: bytes | None, packets: Any) -> None:
            decoded.append(data)
            super()._receive(data, packets)

    pids = [1 + i % QUOTA for i in range(60)] if version == 5 else range(1, 61)
    burst = [
        publish(version, TOPICS[0], b"m%d" % i, i % 2, pid, False, False, b"")
        for i, pid in enumerate(pids)
    ]
    stream = b"".join(burst)
    cut = len(stream) - 5  # within the last packet
    # 5.0: no more in flight than our Receive Maximum (every QoS 1 id is acknowledged
    # after each iteration; the ids of one read differ).
    reads = [stream[:cut], stream[cut:]] if version == 4 else burst[:5]
    ends = [0, 1] if version == 4 else list(range(5))
    fast = serve(Spy, tmp_path / "fast", version, reads, ends)
    full = serve(FullPathOnly, tmp_path / "full", version, reads, ends)
    assert fast == full
    assert not fast[1] and len(fast[2]) == len(reads if version == 5 else burst)
    if devicepath.lane_class() is not None:
        assert decoded == [connect(version)]


def _plain(pid: int, payload: bytes = b"p", version: int = 5) -> bytes:
    return publish(version, TOPICS[0], payload, 1, pid, False, False, b"")


_INNER = _plain(9, version=4)


def _subscribe(topic_filter: str, qos: int) -> bytes:
    name = topic_filter.encode()
    body = struct.pack("!HH", 1, len(name)) + name + bytes([qos])
    return b"\x82" + varint(len(body)) + body


#: Named read sequences the generator above rarely makes: (version, reads, iteration ends,
#: whether the client is disconnected).
SCENARIOS = {
    # One more unacknowledged QoS 1 PUBLISH than our Receive Maximum: DISCONNECT 0x93.
    "over the receive maximum": (5, [_plain(i) for i in range(1, QUOTA + 2)], [QUOTA], True),
    # Acknowledged ones give their quota back (s4.9): no disconnect.
    "quota given back": (
        5,
        [_plain(i) for i in range(1, 2 * QUOTA + 1)],
        [QUOTA - 1, 2 * QUOTA - 1],
        False,
    ),
    # The device reads its own messages: deliveries and PUBACKs leave in one write per
    # iteration (the compiled path's AckFlush leaves a buffer with more in it to the link).
    "subscribed to its own topic": (
        4,
        [_subscribe(TOPICS[0], 0), *(_plain(i, bytes([i]), version=4) for i in range(1, 6))],
        [0, 2, 3, 5],
        False,
    ),
    # First reads of several PUBLISHes to one topic (a first burst, devicepath.burst_lane)
    # that the decoder refuses: after plain ones, a QoS 0 PUBLISH with DUP [MQTT-3.3.1-2];
    # over the Receive Maximum; a wildcard in the topic [MQTT-3.3.2-2]; a topic over the
    # maximum levels; not UTF-8; with U+0000 [MQTT-1.5.4-2]. None of the read is stored.
    "a first burst ending in a malformed packet": (
        4,
        [
            _plain(1, version=4)
            + _plain(2, version=4)
            + publish(4, TOPICS[0], b"x", 0, 0, True, False, b"")
        ],
        [0],
        True,
    ),
    "a first burst over the receive maximum": (
        5,
        [b"".join(_plain(i) for i in range(1, QUOTA + 2))],
        [0],
        True,
    ),
    "a first burst with a wildcard": (
        4,
        [publish(4, "devices/+/t", b"x", 0, 0, False, False, b"") * 3],
        [0],
        True,
    ),
    "a first burst to too many levels": (
        4,
        [publish(4, "devices" + "/x" * 40, b"x", 0, 0, False, False, b"") * 3],
        [0],
        True,
    ),
    "a first burst with a topic not UTF-8": (
        4,
        [publish(4, TOPICS[0], b"x", 0, 0, False, False, b"").replace(b"/1/", b"/\xff/") * 3],
        [0],
        True,
    ),
    "a first burst with U+0000 in the topic": (
        4,
        [publish(4, "devices/\x00/t", b"x", 0, 0, False, False, b"") * 3],
        [0],
        True,
    ),
    # ... and ones it takes, the router refusing or not the plain route: to $SYS (dropped),
    # a 5.0 first PUBLISH with properties (the lane refuses the read: the decoder's).
    "a first burst to $SYS": (
        4,
        [publish(4, "$SYS/x", b"x", 1, 1, False, False, b"") * 3],
        [0],
        False,
    ),
    "a first burst with properties first": (
        5,
        [publish(5, TOPICS[0], b"x", 0, 0, False, False, PROPERTIES[1]) + _plain(1) + _plain(2)],
        [0],
        False,
    ),
    # A PUBLISH (to "t") whose payload is a plain PUBLISH, the payload in its own read: it
    # completes the buffered packet, it is not a packet of its own.
    "a publish in a payload": (
        4,
        [_plain(1, version=4), b"\x30" + varint(3 + len(_INNER)) + b"\x00\x01t", _INNER],
        [2],
        False,
    ),
}


@pytest.mark.parametrize("path", DEVICE_PATHS)
@pytest.mark.parametrize("name", SCENARIOS)
def test_device_path_scenarios(tmp_path: Path, name: str, path: str) -> None:
    version, reads, ends, closed = SCENARIOS[name]
    fast = serve(DEVICE_PATHS[path], tmp_path / "fast", version, reads, ends)
    full = serve(FullPathOnly, tmp_path / "full", version, reads, ends)
    assert fast == full
    assert fast[1] is closed


class OwnAdd(Partition):
    """A partition type with an ``add`` of its own (as a replicated partition has): the
    compiled lane hands its records to ``Router.publish_plain`` instead of gathering them
    itself."""

    def add(self, record: Any, ack: Any) -> None:
        super().add(record, ack)


class Forwarded(PartitionBase):
    """Another worker's partition as this one sees it (broker.workers.partitions'
    RemotePartition: PartitionBase's ``add``, records without offsets), with the owner's
    append done in place of the forward: the records gathered go to the log, each ack gets
    its offset."""

    def commit(self) -> tuple[int, int]:
        records, acks = self.pending, self.acks
        self.pending, self.acks = [], []
        assert all(r[0] == -1 for r in records), "the owner numbers forwarded records"
        first = self.log.append(records)
        for i, ack in enumerate(acks):
            if ack is not None:
                ack(first + i)
        return first, self.log.end_offset


@pytest.mark.parametrize("partition", [OwnAdd, Forwarded])
@pytest.mark.parametrize("path", DEVICE_PATHS)
def test_partitions_of_other_kinds(
    tmp_path: Path, path: str, partition: type[PartitionBase]
) -> None:
    reads = [_plain(i, bytes([i]), version=4) for i in range(1, 6)]
    ends = [0, 2, 4]
    fast = serve(DEVICE_PATHS[path], tmp_path / "fast", 4, reads, ends, partition)
    full = serve(FullPathOnly, tmp_path / "full", 4, reads, ends, partition)
    assert fast == full
    assert [r[3] for r in fast[2]] == [bytes([i]) for i in range(1, 6)]


class UnknownOutcome(Partition):
    """A partition whose appends, once ``unknown`` is set, end with an unknown outcome, as a
    replicated partition's do when its leader loses office with them in flight
    (broker.workers.replicated)."""

    unknown = False

    def commit(self) -> tuple[int, int]:
        if not self.unknown:
            return super().commit()
        acks, self.pending, self.acks = self.acks, [], []
        for ack in acks:
            if ack is not None:
                ack(OUTCOME_UNKNOWN)
        end = self.log.end_offset
        return end, end


@pytest.mark.parametrize("version", [4, 5])
@pytest.mark.parametrize("cls", [MQTTProtocol, PythonDevicePath, FullPathOnly])
def test_an_unknown_outcome_is_never_acknowledged(
    tmp_path: Path, cls: type[MQTTProtocol], version: int
) -> None:
    """OUTCOME_UNKNOWN gets no PUBACK on either path: the connection is closed (5.0: after a
    DISCONNECT) so that the client publishes again. The device path once PUBACKed it, and a
    chaos run lost the acknowledged messages an isolated leader had never committed."""
    server = Server(tmp_path)
    key = server.streams.partition_for(TOPICS[0])
    part = UnknownOutcome(key, server.streams.log(*key))
    server.router.partitions[key] = part
    proto = cls(server)  # type: ignore[arg-type]
    transport = Transport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.data_received(connect(version))
    proto.data_received(publish(version, TOPICS[0], b"a", 1, 1, False, False, b""))
    server.end_iteration()
    acked = b"".join(transport.written)
    assert acked.endswith(b"\x40\x02\x00\x01") and not transport.closed
    part.unknown = True  # the next publish takes the device path on MQTTProtocol
    proto.data_received(publish(version, TOPICS[0], b"b", 1, 2, False, False, b""))
    server.end_iteration()
    after = b"".join(transport.written)[len(acked) :]
    assert transport.closed
    assert after == b"" if version == 4 else after[:1] == b"\xe0", after  # 5.0: DISCONNECT
    server.streams.close()


class FailedAppend(Partition):
    """A partition whose appends fail once ``failing`` is set (a full disk): Partition's
    commit calls every ack with None."""

    failing = False

    def commit(self) -> tuple[int, int]:
        if not self.failing:
            return super().commit()
        acks, self.pending, self.acks = self.acks, [], []
        for ack in acks:
            if ack is not None:
                ack(None)
        raise OSError("disk full")


@pytest.mark.parametrize("version", [4, 5])
def test_a_failed_append_is_answered_alike(tmp_path: Path, version: int) -> None:
    """5.0: a PUBACK with Unspecified Error and a Reason String; 3.1.1 (no negative ack):
    the connection closed. The same bytes on the compiled and the Python path."""
    outputs = []
    for name, cls in DEVICE_PATHS.items():
        server = Server(tmp_path / name)
        key = server.streams.partition_for(TOPICS[0])
        part = FailedAppend(key, server.streams.log(*key))
        server.router.partitions[key] = part
        proto = cls(server)  # type: ignore[arg-type]
        transport = Transport()
        proto.connection_made(transport)  # type: ignore[arg-type]
        proto.data_received(connect(version))
        proto.data_received(publish(version, TOPICS[0], b"a", 1, 1, False, False, b""))
        server.end_iteration()
        part.failing = True
        proto.data_received(publish(version, TOPICS[0], b"b", 1, 2, False, False, b""))
        server.end_iteration()
        outputs.append((b"".join(transport.written), transport.closed))
        server.streams.close()
    assert outputs[0] == outputs[1]
    written, closed = outputs[0]
    assert closed == (version == 4)
    if version == 5:
        assert written[-4:] != b"\x40\x02\x00\x02" and b"the log append failed" in written


@pytest.mark.parametrize("path", DEVICE_PATHS)
def test_the_real_clocks(tmp_path: Path, path: str) -> None:
    """With the real clocks (time.time, time.monotonic) the compiled lane reads them in C:
    the record's timestamp and the connection's last read time fall where the Python
    calls put them."""
    server = Server(tmp_path)
    server.router.clock = time.time
    server.monotonic = time.monotonic
    proto = DEVICE_PATHS[path](server)  # type: ignore[arg-type]
    transport = Transport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.data_received(connect(4))
    proto.data_received(publish(4, TOPICS[0], b"a", 1, 1, False, False, b""))
    server.end_iteration()
    lane = proto._lane
    before_ms, before = int(time.time() * 1000), time.monotonic()
    proto.data_received(publish(4, TOPICS[0], b"b", 1, 2, False, False, b""))
    after_ms, after = int(time.time() * 1000), time.monotonic()
    server.end_iteration()
    assert (lane is not None) == (path == "compiled" and devicepath.lane_class() is not None)
    assert before <= proto.last_received <= after
    stamps = {
        r[3]: r[1] for r in server.streams.log(*server.streams.partition_for(TOPICS[0])).read(0)
    }
    assert before_ms <= stamps[b"b"] <= after_ms
    server.streams.close()
