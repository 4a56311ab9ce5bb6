"""The run path fed from the log's columns (PartitionBase.read_columns, Delivery.send_run) sends
the same bytes as the general path, message by message, whatever the records, options and
limits: checked through a router :class:`Partition` and through a :class:`RemotePartition`
reading the files with a :class:`LogReader`, as another worker does.

The link is a real :class:`ServerConnection` (the encoder, topic aliases and maximum packet
size of the transport) with the transport's per-iteration output budget; the general path is
the same router with runs disabled (``RUN_MIN`` out of reach).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import broker.router.delivery as delivery_module
from broker.commitlog import Record, Streams
from broker.commitlog.config import LogConfig, StreamSpec
from broker.commitlog.keys import PartitionKey
from broker.commitlog.reader import LogReader
from broker.config import RouterConfig
from broker.mqtt.connection import ServerConnection
from broker.mqtt.decode import Decoder
from broker.mqtt.encode import encode
from broker.mqtt.packets import Connect, Publish, Subscribe, Subscription
from broker.mqtt.properties import PropertyId, encode_properties
from broker.router.partition import READ_BATCH, Partition, PartitionBase
from broker.router.router import Router
from broker.workers.partitions import RemotePartition

KEY = ("default", 0)
SPEC = [StreamSpec("default", (), 1, LogConfig(fsync="never"))]
NOW = 1_700_000_000.0


@dataclass
class BytesLink:
    """broker.router.link.Link over a ServerConnection: the bytes the transport would write,
    with its output budget per iteration (:meth:`flush` ends one)."""

    conn: ServerConnection
    budget: int
    client_id: str = "sub"
    version: int = 4
    out: list[bytes] = field(default_factory=list)
    queued: int = 0
    runs: int = 0
    holds: int = 0
    releases: int = 0

    def send(self, packet: Any) -> None:
        self._write(self.conn.send(packet))

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
        data = self.conn.send_publish(topic, payload, qos, retain, dup, packet_id, properties)
        if data is None:
            return False
        self._write(data)
        return True

    def send_publish_run(
        self,
        topics: Sequence[str],
        payloads: Sequence[bytes],
        retains: Sequence[bool] | None,
        qos: int,
        first_packet_id: int | None,
    ) -> bool:
        data = self.conn.send_publish_run(topics, payloads, retains, qos, first_packet_id)
        if data is None:
            return False
        # A run stays within the iteration's output room; one record may pass it.
        assert len(data) <= self.output_room() or len(topics) == 1
        self.runs += 1
        self._write(data)
        return True

    def _write(self, data: bytes) -> None:
        self.out.append(data)
        self.queued += len(data)

    def can_write(self) -> bool:
        return self.queued < self.budget

    def output_room(self) -> int:
        return max(0, self.budget - self.queued)

    def flush(self) -> None:
        self.queued = 0

    def close(self, reason_code: int | None = None, reason: str = "") -> None:
        raise AssertionError(f"closed: {reason_code} {reason}")


@dataclass
class Case:
    batches: list[list[Record]]
    version: int
    sub_qos: int
    replay: bool
    no_local: bool
    rap: bool
    sub_id: int | None
    max_inflight: int
    receive_maximum: int | None
    max_packet_size: int | None
    alias_maximum: int
    budget: int
    first_packet_id: int
    acks: list[int]


#: Topics of the subscription's filter ("a/+"), and one it does not match.
TOPICS = ["a/x", "a/y", "a/" + "l" * 40]
OTHER = "b/z"


@st.composite
def records(draw: st.DrawFn) -> Record:
    props = b""
    kind = draw(st.sampled_from(["none"] * 6 + ["expiry", "expired", "user"]))
    if kind == "expiry":
        props = encode_properties({PropertyId.MESSAGE_EXPIRY_INTERVAL: 3600})
    elif kind == "expired":
        props = encode_properties({PropertyId.MESSAGE_EXPIRY_INTERVAL: 1})
    elif kind == "user":
        props = encode_properties({PropertyId.USER_PROPERTY: [("k", "v")]})
    return Record(
        0,
        int((NOW - 10) * 1000),
        draw(st.sampled_from([*TOPICS, OTHER])),
        draw(st.binary(max_size=80)),
        draw(st.sampled_from([0, 1, 1, 1, 2])),
        draw(st.booleans()),
        draw(st.sampled_from(["p1", "p1", "p2", "sub"])),
        props,
    )


@st.composite
def cases(draw: st.DrawFn) -> Case:
    version = draw(st.sampled_from([4, 5]))
    # Mostly records a run can take (no properties, one QoS), with a few that force the
    # general path in some cases; else any mix.
    if draw(st.integers(0, 3)):
        qos = draw(st.sampled_from([0, 1, 1, 2]))
        mine = draw(st.integers(0, 3)) == 0  # the subscriber published some (no-local)
        odd = records().map(lambda r: r._replace(qos=qos))
        plain = records().map(
            lambda r: r._replace(
                properties=b"",
                qos=qos,
                topic=r.topic.replace(OTHER, TOPICS[0]),
                client_id=r.client_id if mine else r.client_id.replace("sub", "p1"),
            )
        )
        record = st.integers(0, 15).flatmap(lambda i: odd if i == 0 else plain)
    else:
        record = records()
    if draw(st.integers(0, 3)) == 0:  # payloads of one size (telemetry: send_run's shortcut)
        record = record.map(lambda r: r._replace(payload=r.payload.ljust(24, b".")[:24]))
    batches = draw(
        st.lists(st.lists(record, min_size=1, max_size=40), min_size=1, max_size=6).filter(
            lambda bs: sum(map(len, bs)) >= 8
        )
    )
    return Case(
        batches=batches,
        version=version,
        sub_qos=draw(st.sampled_from([0, 1, 1, 2])),
        replay=draw(st.booleans()) if version == 4 else draw(st.integers(0, 3)) == 0,
        no_local=version == 5 and draw(st.booleans()),
        rap=version == 5 and draw(st.booleans()),
        sub_id=draw(st.sampled_from([None, None, None, 7])) if version == 5 else None,
        max_inflight=draw(st.sampled_from([1, 3, 10, 100, 65535])),
        receive_maximum=draw(st.sampled_from([None, 2, 50])) if version == 5 else None,
        max_packet_size=draw(st.sampled_from([None, None, None, 60, 1000]))
        if version == 5
        else None,
        alias_maximum=draw(st.sampled_from([0, 0, 0, 2])) if version == 5 else 0,
        budget=draw(st.sampled_from([40, 300, 5000, 1 << 20])),
        first_packet_id=draw(st.sampled_from([1, 65530, 65535])),
        acks=draw(st.lists(st.integers(0, 5), min_size=1, max_size=4)),
    )


class Reader:
    """A router reading partition KEY, written beforehand in ``written``: through a
    Partition on that log, or (``remote``) through a RemotePartition and a LogReader."""

    def __init__(self, tmp: Path, written: Path, config: RouterConfig, remote: bool) -> None:
        self.scheduled: list[Callable[[], None]] = []
        factory: Callable[[PartitionKey], PartitionBase] | None = None
        if remote:
            self.streams = Streams(tmp / "own", SPEC, clock=lambda: NOW)
            mine = self.streams
            owner_log = Streams(written, SPEC, clock=lambda: NOW)
            directory = owner_log.log(*KEY).directory
            config_of = owner_log.log(*KEY).config
            end = owner_log.log(*KEY).end_offset
            owner_log.close()

            def factory(key: PartitionKey) -> PartitionBase:
                if key != KEY:
                    return Partition(key, mine.log(*key))
                reader = LogReader(directory, config_of, end)
                return RemotePartition(key, reader, 1, lambda *a: None)
        else:
            self.streams = Streams(written, SPEC, clock=lambda: NOW)
        self.router = Router(
            self.streams,
            config,
            schedule=self.scheduled.append,
            clock=lambda: NOW,
            monotonic=lambda: NOW,
            partition_factory=factory,
        )

    def run(self) -> None:
        while self.scheduled:
            self.scheduled.pop(0)()


def _write(path: Path, batches: list[list[Record]]) -> None:
    streams = Streams(path, SPEC, clock=lambda: NOW)
    log = streams.log(*KEY)
    for batch in batches:
        log.append(batch)
    streams.close()


def _deliver(
    tmp: Path,
    written: Path,
    case: Case,
    *,
    remote: bool,
    runs: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[bytes, Any, int]:
    """Every delivery of the case's records, as bytes; plus the end state and run count."""
    monkeypatch.setattr(delivery_module, "RUN_MIN", 8 if runs else 1 << 30)
    reader = Reader(tmp, written, RouterConfig(max_inflight=case.max_inflight), remote)
    router = reader.router
    props: dict[int, Any] = {}
    if case.receive_maximum:
        props[PropertyId.RECEIVE_MAXIMUM] = case.receive_maximum
    if case.max_packet_size:
        props[PropertyId.MAXIMUM_PACKET_SIZE] = case.max_packet_size
    if case.alias_maximum:
        props[PropertyId.TOPIC_ALIAS_MAXIMUM] = case.alias_maximum
    connect = Connect("sub", case.version, clean_start=True, keepalive=60, properties=props)
    conn = ServerConnection(max_packet_size=1 << 20)
    conn.receive_data(encode(connect, case.version))
    link = BytesLink(conn, case.budget, version=case.version)
    result = router.connect(link, connect)
    assert result is not None
    session = result[0]
    reader.run()
    session.next_packet_id = case.first_packet_id
    link.out.clear()
    sub_props = {PropertyId.SUBSCRIPTION_IDENTIFIER: [case.sub_id]} if case.sub_id else {}
    topic_filter = ("$replay/earliest/" if case.replay else "") + "a/+"
    router.subscribe(
        session,
        Subscribe(
            1, [Subscription(topic_filter, case.sub_qos, case.no_local, case.rap)], sub_props
        ),
    )
    reader.run()
    if not case.replay:
        # A live subscription starts at the end: rewind it over the records written.
        for consumer in session.consumers.values():
            consumer.cursors[KEY] = 0
    for step in range(10_000):
        link.flush()
        sent = len(link.out)
        router.pump_session(session)
        reader.run()
        for pid in list(session.inflight)[: case.acks[step % len(case.acks)] + 1]:
            if session.inflight_entry(pid)[2] == 1:  # type: ignore[index]
                router.puback(session, pid)
            else:
                router.pubrec(session, pid, 0)
                router.pubcomp(session, pid)
        if len(link.out) == sent and not session.inflight:
            break
    state = (
        sorted(session.inflight),
        session.next_packet_id,
        [dict(c.cursors) for c in session.consumers.values()],
    )
    out = b"".join(link.out)
    router.close()
    reader.streams.close()
    return out, state, link.runs


def _both(
    tmp: Path, written: Path, case: Case, remote: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[bytes, int]:
    """The case delivered by the general path and with runs: the same bytes and end state
    (asserted); returns the bytes and how many runs went out."""
    general, general_state, general_runs = _deliver(
        tmp / "g", written, case, remote=remote, runs=False, monkeypatch=monkeypatch
    )
    ran, ran_state, runs = _deliver(
        tmp / "r", written, case, remote=remote, runs=True, monkeypatch=monkeypatch
    )
    assert general_runs == 0
    assert ran == general
    assert ran_state == general_state
    return general, runs


@pytest.mark.slow  # hypothesis over the general path's bytes: ~6 s
@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(case=cases(), remote=st.booleans())
def test_column_runs_send_the_bytes_of_the_general_path(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    case: Case,
    remote: bool,
) -> None:
    tmp = tmp_path_factory.mktemp("runs")
    written = tmp / "written"
    _write(written, case.batches)
    _both(tmp, written, case, remote, monkeypatch)


@pytest.mark.parametrize("remote", [False, True])
def test_a_plain_replay_goes_out_as_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remote: bool
) -> None:
    """The case the run path is for (3.1.1, QoS 1, no properties) does take it, across
    batches, packet id wrap and a read-ahead shared by several quota-bounded reads."""
    batches = [
        [Record(0, 0, f"a/{i % 3}", b"%d" % i, 1, False, "p1") for i in range(j, j + 1000)]
        for j in range(0, 5000, 1000)
    ]
    _write(tmp_path / "w", batches)
    case = Case(batches, 4, 1, True, False, False, None, 100, None, None, 0, 1 << 20, 65000, [99])
    general, runs = _both(tmp_path, tmp_path / "w", case, remote, monkeypatch)
    assert runs >= 5000 // 100 - 2  # the window at the wrap goes one by one
    assert general.count(b"\x32") >= 5000  # every record went out, QoS 1 heads


def test_a_mark_inside_a_batch_bounds_the_columns(tmp_path: Path) -> None:
    """A remote partition's mark learnt from a peer may fall inside a batch: read_columns
    stops there, as read does."""
    _write(tmp_path / "w", [[Record(0, 0, "a/x", b"%d" % i) for i in range(50)]])
    streams = Streams(tmp_path / "w", SPEC, clock=lambda: NOW)
    log = streams.log(*KEY)
    part = RemotePartition(KEY, LogReader(log.directory, log.config, 0), 1, lambda *a: None)
    part.committed_through(19)
    cols = part.read_columns(0)
    assert len(cols) == 20 == len(part.read(0))
    assert list(cols.offsets[cols.start : cols.stop]) == list(range(20))
    part.committed_through(49)
    cols = part.read_columns(10)
    assert len(cols) == 40
    assert list(cols.built().payloads[cols.start : cols.stop]) == [b"%d" % i for i in range(10, 50)]
    assert READ_BATCH >= 50
    streams.close()


@pytest.mark.parametrize("remote", [False, True])
@pytest.mark.parametrize("rule", ["no_local", "properties", "qos2", "rap"])
def test_each_rule_of_the_run_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remote: bool, rule: str
) -> None:
    """One case per rule that keeps records off a run (or changes what it sends), each
    compared with the general path: no-local [MQTT-3.8.3-3] (the subscriber's own records
    skipped), properties (expiry [MQTT-3.3.2-5], forwarded user properties), QoS 2 records
    under a QoS 2 subscription, retain-as-published."""
    expired = encode_properties({PropertyId.MESSAGE_EXPIRY_INTERVAL: 1})
    user = encode_properties({PropertyId.USER_PROPERTY: [("k", "v")]})
    batch = [
        Record(
            0,
            int((NOW - 10) * 1000),
            "a/x",
            b"%d" % i,
            2 if rule == "qos2" and i % 5 == 0 else 1,
            rule == "rap" and i % 2 == 0,
            "sub" if rule == "no_local" and i % 3 == 0 else "p1",
            (expired if i % 4 == 0 else user if i % 4 == 1 else b"")
            if rule == "properties"
            else b"",
        )
        for i in range(60)
    ]
    _write(tmp_path / "w", [batch[:25], batch[25:]])
    case = Case(
        [batch],
        5,
        2 if rule == "qos2" else 1,
        False,
        rule == "no_local",
        rule == "rap",
        None,
        100,
        None,
        None,
        0,
        1 << 20,
        1,
        [3],
    )
    general, runs = _both(tmp_path, tmp_path / "w", case, remote, monkeypatch)
    decoder = Decoder(version=5)
    decoder.feed(general)
    got = {int(p.payload) for p in decoder.packets() if isinstance(p, Publish)}
    if rule == "no_local":
        assert got == {i for i in range(60) if i % 3}  # not the subscriber's own
    elif rule == "properties":
        assert got == {i for i in range(60) if i % 4}  # not the expired
    else:
        assert got == set(range(60))
    if rule == "rap":
        assert runs  # retained flags go out in runs too


@pytest.mark.parametrize("remote", [False, True])
def test_reads_of_other_topics_are_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remote: bool
) -> None:
    """A replay behind records of topics it does not want passes over whole reads (from
    their string tables) and delivers the same as the general path."""
    batches = [[Record(0, 0, OTHER, b"x", 1, False, "p1") for _ in range(1000)] for _ in range(9)]
    batches.append([Record(0, 0, "a/x", b"%d" % i, 1, False, "p1") for i in range(50)])
    batches.append(
        [Record(0, 0, OTHER if i % 2 else "a/y", b"%d" % i, 1, False, "p1") for i in range(50)]
    )
    _write(tmp_path / "w", batches)
    case = Case(batches, 4, 1, True, False, False, None, 100, None, None, 0, 1 << 20, 1, [99])
    general, _ = _both(tmp_path, tmp_path / "w", case, remote, monkeypatch)
    decoder = Decoder(version=4)
    decoder.feed(general)
    got = [p.payload for p in decoder.packets() if isinstance(p, Publish)]
    assert got == [b"%d" % i for i in range(50)] + [b"%d" % i for i in range(0, 50, 2)]
