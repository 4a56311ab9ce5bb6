"""Router.publish_run (the batch path of one read's PUBLISHes) against Router.publish one by
one: the same log, the same acknowledgements, sent only after the append [MQTT-4.3.2-2]."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.auth import Acl
from broker.mqtt.packets import PubAck, Publish, PubRec
from broker.mqtt.properties import PropertyId

from .conftest import Harness

_TOPICS = ["a/1", "a/2", "b", "$SYS/x", "secret/1"]


def _packets(draw_list: list[tuple[int, int, int, bool, bool]]) -> list[Publish]:
    out = []
    for n, (topic, payload, qos, retain, props) in enumerate(draw_list):
        properties = {PropertyId.CONTENT_TYPE: "t"} if props else {}
        out.append(
            Publish(
                _TOPICS[topic],
                bytes([payload]),
                qos,
                retain,
                False,
                n + 1 if qos else None,
                properties,
            )
        )
    return out


_PACKET = st.tuples(
    st.integers(0, len(_TOPICS) - 1),
    st.integers(0, 255),
    st.integers(0, 2),
    st.booleans(),
    st.booleans(),
)


def _stored(h: Harness) -> list[tuple[object, ...]]:
    """Every record of every partition, with its offset (order per partition)."""
    out = []
    for key in sorted(h.router.partitions):
        log = h.streams.log(*key)
        for r in log.read(log.log_start_offset, 10_000):
            out.append(
                (key, r.offset, r.topic, r.payload, r.qos, r.retain, r.client_id, r.properties)
            )
    return out


def _run(
    data: Path, packets: list[Publish], batch: bool, acl: str | None
) -> tuple[list[tuple[object, ...]], list[object], list[object]]:
    h = Harness(data)
    if acl is not None:
        h.router.acl = Acl.parse(acl, "acl")
    link, s = h.connect("pub", 5)
    if batch:
        h.router.publish_run(s, list(packets))
    else:
        for p in packets:
            h.router.publish(s, p)
    before = [p for p in link.packets if type(p) in (PubAck, PubRec)]
    h.run()
    acks = [p for p in link.packets if type(p) in (PubAck, PubRec)]
    stored = _stored(h)
    # What caught-up subscribers are fed from: the tail, numbered as the log is.
    tails = [
        (key, r.offset, r.topic, r.payload)
        for key, part in sorted(h.router.partitions.items())
        for r in getattr(part, "tail", [])
    ]
    h.streams.close()
    assert [
        (k, o, t, p) for k, o, t, p, *_ in stored if (k, o) in {(x[0], x[1]) for x in tails}
    ] == tails
    return stored, before, acks


@settings(max_examples=60, deadline=None)
@given(st.lists(_PACKET, max_size=30), st.booleans())
def test_run_equals_one_by_one(
    tmp_path_factory: object, spec: list[tuple[int, int, int, bool, bool]], with_acl: bool
) -> None:
    packets = _packets(spec)
    acl = "topic readwrite a/#\ntopic readwrite b\n" if with_acl else None
    base = tmp_path_factory.mktemp("run")  # type: ignore[attr-defined]
    one = _run(base / "one", packets, False, acl)
    run = _run(base / "run", packets, True, acl)
    assert run[0] == one[0]  # same records, same partitions, same offsets
    assert run[2] == one[2]  # same acknowledgements, same order
    # Nothing stored is acknowledged before the append (a denied one may be answered at once).
    assert all(a.reason_code for a in run[1])


def test_acks_follow_the_append_in_arrival_order(h: Harness) -> None:
    link, s = h.connect("pub", 4)
    packets = [Publish("d/1/t", b"%d" % i, 1, packet_id=i + 1) for i in range(5)]
    packets.insert(2, Publish("d/2/t", b"x", 0))
    h.router.publish_run(s, packets)
    assert link.of(PubAck) == []
    h.run()
    assert [a.packet_id for a in link.of(PubAck)] == [1, 2, 3, 4, 5]
    assert h.log_payloads("d/1/t") == [b"0", b"1", b"2", b"3", b"4"]


def test_one_read_is_stamped_once(h: Harness) -> None:
    """A read's messages that take the one-by-one path (properties, retain) keep the read's
    timestamp: with one per call, a partition's timestamps alternated (a time-based read in
    tests/integration/test_spark.py then started at an earlier record)."""
    h.clock.step = 1.0  # every reading is a second later
    _, s = h.connect("pub", 5)
    props = {PropertyId.CONTENT_TYPE: "t"}
    h.router.publish_run(
        s,
        [
            Publish("d/1/t", b"%d" % i, 1, False, False, i + 1, props if i % 2 else {})
            for i in range(6)
        ],
    )
    h.run()
    key = h.streams.partition_for("d/1/t")
    log = h.streams.log(*key)
    stamps = [r.timestamp for r in log.read(log.log_start_offset, 100)]
    assert len(stamps) == 6 and len(set(stamps)) == 1


def test_a_failed_append_answers_every_message_of_the_run(h: Harness) -> None:
    link, s = h.connect("pub", 5)
    h.router.publish_run(s, [Publish("d/1/t", b"x", 1, packet_id=i) for i in (1, 2)])
    key = h.streams.partition_for("d/1/t")
    h.streams.log(*key).close()  # the append raises
    h.run()
    assert [(a.packet_id, a.reason_code) for a in link.of(PubAck)] == [(1, 0x80), (2, 0x80)]
    part = h.router.partitions[key]
    assert part.next_offset() == 0  # the numbers given to the failed batch are free again


def test_forwarded_rows_follow_what_is_pending_and_ack_their_first_offset(h: Harness) -> None:
    link, s = h.connect("pub", 4)
    h.router.publish_run(s, [Publish("a", b"local", 1, packet_id=1)])
    key = h.streams.partition_for("a")
    firsts: list[int | None] = []
    rows = [(5, "a", b"f%d" % i, 1, False, "peer-client", b"") for i in range(3)]
    h.router.append_forwarded(key, rows, firsts.append)
    h.run()
    assert h.log_payloads("a") == [b"local", b"f0", b"f1", b"f2"]
    assert firsts == [1]
    assert [r.offset for r in h.router.partitions[key].tail] == [0, 1, 2, 3]  # type: ignore[attr-defined]
    assert [a.packet_id for a in link.of(PubAck)] == [1]
