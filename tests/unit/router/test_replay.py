"""``$replay/<from>/<filter>``: parsing the start (broker.router.replay) and where the router
starts each partition's cursor for it.

The router side is observed through its public methods only: a 5.0 replay delivery carries
the user properties ``mqlog-partition`` and ``mqlog-offset``, so the first delivery of each
partition names the offset the subscription started at; a refused filter shows in SUBACK.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from broker.commitlog import LogConfig, StreamSpec
from broker.config import RouterConfig
from broker.mqtt.errors import TopicFilterInvalid
from broker.mqtt.packets import SubAck, Subscribe, Subscription
from broker.mqtt.properties import PropertyId
from broker.mqtt.reason_codes import ReasonCode
from broker.router.replay import ReplayStart, is_replay, parse_replay
from broker.router.session import Session
from tests.unit.router.conftest import FakeLink, Harness, Sent

NOW_MS = 1_700_000_000_000

# ============================================================================ parsing


@pytest.mark.parametrize(
    ("topic_filter", "start", "plain"),
    [
        ("$replay/earliest/a/b", ReplayStart("earliest"), "a/b"),
        ("$replay/latest/a/#", ReplayStart("latest"), "a/#"),
        ("$replay/offset:0/a", ReplayStart("offset", offset=0), "a"),
        ("$replay/offset:42/+/x", ReplayStart("offset", offset=42), "+/x"),
        ("$replay/offsets:0=3/d/#", ReplayStart("offsets", offsets=((0, 3),)), "d/#"),
        (
            "$replay/offsets:0=3,2=7,1=0/d/#",
            ReplayStart("offsets", offsets=((0, 3), (2, 7), (1, 0))),
            "d/#",
        ),
        ("$replay/time:1699999999123/a", ReplayStart("time", timestamp_ms=1699999999123), "a"),
        ("$replay/time:0/a", ReplayStart("time", timestamp_ms=0), "a"),
        ("$replay/time:-1h/a", ReplayStart("time", timestamp_ms=NOW_MS - 3_600_000), "a"),
        ("$replay/time:-10m/a", ReplayStart("time", timestamp_ms=NOW_MS - 600_000), "a"),
        ("$replay/time:-500ms/a", ReplayStart("time", timestamp_ms=NOW_MS - 500), "a"),
        ("$replay/time:-2d/a", ReplayStart("time", timestamp_ms=NOW_MS - 2 * 86_400_000), "a"),
        ("$replay/time:-1w/a", ReplayStart("time", timestamp_ms=NOW_MS - 7 * 86_400_000), "a"),
        ("$replay/time:-0s/a", ReplayStart("time", timestamp_ms=NOW_MS), "a"),
        # The filter after <from> keeps its own levels, '$' topics and empty levels.
        ("$replay/earliest/$SYS/broker/#", ReplayStart("earliest"), "$SYS/broker/#"),
        ("$replay/earliest//a//", ReplayStart("earliest"), "/a//"),
        ("$replay/earliest/#", ReplayStart("earliest"), "#"),
        # ;merge: the partitions merged in timestamp order, after any <from>
        ("$replay/earliest;merge/d/#", ReplayStart("earliest", merge=True), "d/#"),
        (
            "$replay/time:-1h;merge/a",
            ReplayStart("time", timestamp_ms=NOW_MS - 3_600_000, merge=True),
            "a",
        ),
        (
            "$replay/offsets:0=3,1=4;merge/d/#",
            ReplayStart("offsets", offsets=((0, 3), (1, 4)), merge=True),
            "d/#",
        ),
    ],
)
def test_parse_replay_forms(topic_filter: str, start: ReplayStart, plain: str) -> None:
    assert is_replay(topic_filter)
    assert parse_replay(topic_filter, NOW_MS) == (start, plain)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-21T10:00:00Z", datetime(2026, 11, 21, 10, tzinfo=UTC)),
        ("2026-11-21T10:00:00z", datetime(2026, 11, 21, 10, tzinfo=UTC)),
        ("2026-11-21T10:00:00+00:00", datetime(2026, 11, 21, 10, tzinfo=UTC)),
        ("2026-11-21T12:00:00+02:00", datetime(2026, 11, 21, 10, tzinfo=UTC)),
        ("2026-11-21T05:30:00-04:30", datetime(2026, 11, 21, 10, tzinfo=UTC)),
        ("2026-11-21T10:00:00.250Z", datetime(2026, 11, 21, 10, 0, 0, 250_000, tzinfo=UTC)),
    ],
)
def test_parse_replay_rfc3339(text: str, expected: datetime) -> None:
    start, plain = parse_replay(f"$replay/time:{text}/a/b", NOW_MS)
    assert start == ReplayStart("time", timestamp_ms=int(expected.timestamp() * 1000))
    assert plain == "a/b"


@pytest.mark.parametrize(
    ("topic_filter", "words"),
    [
        # Shape: $replay/<from>/<filter>
        ("$replay/earliest", "expected $replay/<from>/<filter>"),
        ("$replay/earliest/", "expected $replay/<from>/<filter>"),
        ("$replay/", "expected $replay/<from>/<filter>"),
        # Not a replay of a replay, nor of a shared subscription
        ("$replay/earliest/$share/g/a", "cannot replay a shared or replay filter"),
        ("$replay/earliest/$replay/earliest/a", "cannot replay a shared or replay filter"),
        # <from>
        ("$replay/yesterday/a", "<from> must be"),
        ("$replay/Earliest/a", "<from> must be"),
        ("$replay/offset:/a", "<from> must be"),
        ("$replay/offset:-1/a", "<from> must be"),
        ("$replay/offset:x/a", "<from> must be"),
        ("$replay/offset:1.5/a", "<from> must be"),
        ("$replay/offset/a", "<from> must be"),
        ("$replay/offsets:/a", "<from> must be"),
        ("$replay/offsets:0/a", "<from> must be"),
        ("$replay/offsets:0=/a", "<from> must be"),
        ("$replay/offsets:=3/a", "<from> must be"),
        ("$replay/offsets:0=-1/a", "<from> must be"),
        ("$replay/offsets:-1=0/a", "<from> must be"),
        ("$replay/offsets:0=1,/a", "<from> must be"),
        ("$replay/offsets:a=b/a", "<from> must be"),
        ("$replay/time:/a", "<from> must be"),
        ("$replay/time:-/a", "<from> must be"),
        ("$replay/time:-1y/a", "<from> must be"),
        ("$replay/time:-h/a", "<from> must be"),
        ("$replay/time:2026-11-21T10:00:00/a", "<from> must be"),  # no zone: ambiguous
        ("$replay/time:yesterday/a", "<from> must be"),
        ("$replay/time:1e3/a", "<from> must be"),
        ("$replay/size:3/a", "<from> must be"),
    ],
)
def test_parse_replay_errors_name_the_filter(topic_filter: str, words: str) -> None:
    with pytest.raises(TopicFilterInvalid) as caught:
        parse_replay(topic_filter, NOW_MS)
    assert caught.value.reason_code == ReasonCode.TOPIC_FILTER_INVALID == 0x8F
    assert words in str(caught.value)
    assert repr(topic_filter) in str(caught.value)


@pytest.mark.parametrize("plain", ["a/#/b", "a+", "a/b#", "+a/b"])
def test_parse_replay_checks_the_plain_filter(plain: str) -> None:
    """The filter after <from> follows the ordinary rules (s4.7.1)."""
    with pytest.raises(TopicFilterInvalid) as caught:
        parse_replay(f"$replay/earliest/{plain}", NOW_MS)
    assert caught.value.reason_code == 0x8F


def test_is_replay() -> None:
    assert is_replay("$replay/earliest/a")
    assert is_replay("$replay/")
    assert not is_replay("replay/earliest/a")
    assert not is_replay("$share/g/$replay/earliest/a")
    assert not is_replay("$REPLAY/earliest/a")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="/\x00"), max_size=40))
def test_any_from_parses_or_is_refused_with_0x8f(spec: str) -> None:
    """Whatever a client writes as <from>, the answer is a start or TopicFilterInvalid."""
    try:
        start, plain = parse_replay(f"$replay/{spec}/a/b", NOW_MS)
    except TopicFilterInvalid as e:
        assert e.reason_code == 0x8F
    else:
        assert plain == "a/b"
        assert start.kind in ("earliest", "latest", "offset", "offsets", "time")


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 10**12)), min_size=1, max_size=5),
    st.integers(0, 10**15),
)
def test_offset_forms_round_trip(pairs: list[tuple[int, int]], n: int) -> None:
    assert parse_replay(f"$replay/offset:{n}/t", NOW_MS)[0] == ReplayStart("offset", offset=n)
    spec = ",".join(f"{p}={o}" for p, o in pairs)
    assert parse_replay(f"$replay/offsets:{spec}/t", NOW_MS)[0] == ReplayStart(
        "offsets", offsets=tuple(pairs)
    )
    assert parse_replay(f"$replay/time:{n}/t", NOW_MS)[0] == ReplayStart("time", timestamp_ms=n)


# ============================================================================ the router

#: Stream "devices" (three partitions) beside "default".
DEVICES = StreamSpec("devices", ("devices/#",), 3, LogConfig(fsync="never"))


@pytest.fixture
def hd(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path / "data", specs=[DEVICES])
    yield harness
    harness.streams.close()


def topic_in(h: Harness, partition: int, stream: str = "devices") -> str:
    """A topic of ``stream`` that lands on ``partition``."""
    return next(
        t
        for t in (f"{stream}/d{i}" for i in range(1000))
        if h.streams.partition_for(t) == (stream, partition)
    )


def annotated(sent: list[Sent]) -> list[tuple[int, int, bytes]]:
    """``(partition, offset, payload)`` of 5.0 replay deliveries, from their annotation."""
    out = []
    for p in sent:
        assert p.properties is not None
        user = dict(p.properties[PropertyId.USER_PROPERTY])
        out.append((int(user["mqlog-partition"]), int(user["mqlog-offset"]), p.payload))
    return out


def first_offsets(sent: list[Sent]) -> dict[int, int]:
    """Partition -> offset of its first delivery."""
    firsts: dict[int, int] = {}
    for partition, offset, _ in annotated(sent):
        firsts.setdefault(partition, offset)
    return firsts


def fill(h: Harness, topics: dict[str, int]) -> Session:
    """Publish ``n`` records ``b"<topic>:<i>"`` to each topic (committed)."""
    _, pub = h.connect("pub", 5)
    for topic, n in topics.items():
        for i in range(n):
            h.publish(pub, topic, f"{topic}:{i}".encode())
    h.run()
    return pub


def suback(link: FakeLink) -> list[int]:
    return list(link.of(SubAck)[-1].reason_codes)


def test_earliest_delivers_every_partition_from_its_start(hd: Harness) -> None:
    t0, t1, t2 = (topic_in(hd, p) for p in range(3))
    fill(hd, {t0: 3, t1: 5, t2: 2})
    link, s = hd.connect("r", 5)
    hd.subscribe(s, "$replay/earliest/devices/#", 0)
    got = annotated(link.take())
    for p, n, t in ((0, 3, t0), (1, 5, t1), (2, 2, t2)):
        assert [(o, pl) for q, o, pl in got if q == p] == [
            (i, f"{t}:{i}".encode()) for i in range(n)
        ]


def test_latest_delivers_only_what_follows(hd: Harness) -> None:
    t0 = topic_in(hd, 0)
    pub = fill(hd, {t0: 4})
    link, s = hd.connect("r", 5)
    hd.subscribe(s, "$replay/latest/devices/#", 0)
    assert link.take() == []
    hd.publish(pub, t0, b"new")
    hd.run()
    assert annotated(link.take()) == [(0, 4, b"new")]


def test_offset_applies_to_every_partition_and_clamps_to_the_end(hd: Harness) -> None:
    t0, t1, t2 = (topic_in(hd, p) for p in range(3))
    pub = fill(hd, {t0: 10, t1: 4, t2: 6})
    link, s = hd.connect("r", 5)
    hd.subscribe(s, "$replay/offset:5/devices/#", 0)
    # Partition 1 has 4 records: its cursor starts at its end (offset 4), nothing to send.
    assert first_offsets(link.take()) == {0: 5, 2: 5}
    hd.publish(pub, t1, b"live")
    hd.run()
    assert annotated(link.take()) == [(1, 4, b"live")]


def test_offset_on_a_single_topic_is_exact(h: Harness) -> None:
    fill(h, {"a/b": 8})
    link, s = h.connect("r", 5)
    h.subscribe(s, "$replay/offset:6/a/b", 0)
    assert annotated(link.take()) == [(0, 6, b"a/b:6"), (0, 7, b"a/b:7")]


def test_offset_past_the_end_waits_for_new_records(h: Harness) -> None:
    pub = fill(h, {"a/b": 3})
    link, s = h.connect("r", 5)
    h.subscribe(s, "$replay/offset:1000/a/b", 0)
    assert link.take() == []
    h.publish(pub, "a/b", b"next")
    h.run()
    assert annotated(link.take()) == [(0, 3, b"next")]  # from the end, not from 1000


def test_offsets_per_partition_others_from_earliest(hd: Harness) -> None:
    t0, t1, t2 = (topic_in(hd, p) for p in range(3))
    fill(hd, {t0: 6, t1: 6, t2: 6})
    link, s = hd.connect("r", 5)
    hd.subscribe(s, "$replay/offsets:0=4,2=99/devices/#", 0)
    sent = link.take()
    assert first_offsets(sent) == {0: 4, 1: 0}  # 2 clamps to its end; 1 is not named
    assert len(sent) == 2 + 6


def test_time_epoch_ms_starts_at_the_first_record_at_or_after_it(h: Harness) -> None:
    _, pub = h.connect("pub", 5)
    stamps = []
    for i in range(6):
        stamps.append(int(h.clock() * 1000))
        h.publish(pub, "a/b", b"%d" % i)
        h.run()
        h.clock.advance(10)
    link, s = h.connect("r", 5)
    h.subscribe(s, f"$replay/time:{stamps[3]}/a/b", 0)
    assert [o for _, o, _ in annotated(link.take())] == [3, 4, 5]
    link, s = h.connect("r2", 5)
    h.subscribe(s, f"$replay/time:{stamps[3] - 1}/a/b", 0)  # between 2 and 3
    assert [o for _, o, _ in annotated(link.take())] == [3, 4, 5]


def test_time_relative_and_rfc3339(h: Harness) -> None:
    _, pub = h.connect("pub", 5)
    for i in range(5):  # records 60 s apart; the clock ends 60 s after the last
        h.publish(pub, "a/b", b"%d" % i)
        h.run()
        h.clock.advance(60)
    link, s = h.connect("r", 5)
    h.subscribe(s, "$replay/time:-150s/a/b", 0)  # now - 150 s lies between records 2 and 3
    assert [o for _, o, _ in annotated(link.take())] == [3, 4]
    when = datetime.fromtimestamp(h.clock() - 150, UTC).isoformat().replace("+00:00", "Z")
    link, s = h.connect("r2", 5)
    h.subscribe(s, f"$replay/time:{when}/a/b", 0)
    assert [o for _, o, _ in annotated(link.take())] == [3, 4]


def test_time_after_every_record_starts_at_the_end(h: Harness) -> None:
    pub = fill(h, {"a/b": 3})
    link, s = h.connect("r", 5)
    h.subscribe(s, f"$replay/time:{int(h.clock() * 1000) + 1}/a/b", 0)
    assert link.take() == []
    h.publish(pub, "a/b", b"live")
    h.run()
    assert annotated(link.take()) == [(0, 3, b"live")]


def test_starts_below_the_retained_log_start_are_clamped_to_it(tmp_path: Path) -> None:
    """Retention deleted the oldest segments: offset 0, a time before everything and
    ``offsets`` naming a deleted offset all start at the earliest retained record."""
    small = LogConfig(fsync="never", segment_bytes=300, retention_bytes=600, retention_ms=None)
    h = Harness(tmp_path / "d", specs=[StreamSpec("devices", ("devices/#",), 1, small)])
    try:
        _, pub = h.connect("pub", 5)
        for i in range(40):  # one batch each: several segments
            h.publish(pub, "devices/a", b"%d" % i)
            h.run()
        plog = h.streams.log("devices", 0)
        assert plog.enforce_retention() > 0
        first = plog.log_start_offset
        assert first > 0
        for i, spec in enumerate(("earliest", "offset:0", "offsets:0=1", "time:0")):
            link, s = h.connect(f"r{i}", 5)
            h.subscribe(s, f"$replay/{spec}/devices/#", 0)
            sent = annotated(link.take())
            assert [o for _, o, _ in sent] == list(range(first, 40)), spec
    finally:
        h.streams.close()


def test_replay_continues_live_after_the_history(h: Harness) -> None:
    pub = fill(h, {"a/b": 2})
    link, s = h.connect("r", 5)
    h.subscribe(s, "$replay/earliest/a/#", 1)
    assert [p.payload for p in link.take()] == [b"a/b:0", b"a/b:1"]
    h.publish(pub, "a/c", b"live", 1, 1)
    h.run()
    assert annotated(link.take()) == [(0, 2, b"live")]


def test_resubscribing_starts_the_replay_again(h: Harness) -> None:
    fill(h, {"a/b": 3})
    link, s = h.connect("r", 5)
    h.subscribe(s, "$replay/earliest/a/b", 0)
    assert len(link.take()) == 3
    h.subscribe(s, "$replay/earliest/a/b", 0)
    assert [o for _, o, _ in annotated(link.take())] == [0, 1, 2]


def test_replays_and_the_live_subscription_are_independent(h: Harness) -> None:
    """Each replay filter is a consumer of its own: overlapping ones each get a copy."""
    pub = fill(h, {"a/b": 4})
    link, s = h.connect("r", 5)
    h.subscribe(s, "a/#", 0)
    h.subscribe(s, "$replay/offset:1/a/#", 0)
    h.subscribe(s, "$replay/offset:3/a/b", 0)
    assert sorted(o for _, o, _ in annotated(link.take())) == [1, 2, 3, 3]
    h.publish(pub, "a/b", b"x")
    h.run()
    sent = link.take()
    assert [p.payload for p in sent] == [b"x"] * 3
    assert sum(p.properties is None for p in sent) == 1  # the live copy is not annotated


def test_311_replay_is_not_annotated(h: Harness) -> None:
    fill(h, {"a/b": 3})
    link, s = h.connect("r", 4)
    h.subscribe(s, "$replay/offset:1/a/b", 0)
    sent = link.take()
    assert [p.payload for p in sent] == [b"a/b:1", b"a/b:2"]
    assert all(p.properties is None for p in sent)


@pytest.mark.parametrize(
    "topic_filter",
    ["$replay/yesterday/a", "$replay/offset:-1/a", "$replay/earliest", "$replay/earliest/a/#/b"],
)
def test_refused_replay_in_suback(h: Harness, topic_filter: str) -> None:
    link5, s5 = h.connect("v5", 5)
    link4, s4 = h.connect("v4", 4)
    for s in (s5, s4):
        h.router.subscribe(s, Subscribe(1, [Subscription(topic_filter, 1), Subscription("ok", 1)]))
    assert suback(link5) == [0x8F, 1]
    assert suback(link4) == [0x80, 1]  # 3.1.1 has one failure code [MQTT-3.9.3-2]
    assert set(s5.consumers) <= {""}


def test_max_topic_levels_counts_the_filter_not_the_prefix(tmp_path: Path) -> None:
    h = Harness(tmp_path / "d", RouterConfig(max_topic_levels=3))
    try:
        link, s = h.connect("r", 5)
        h.router.subscribe(
            s,
            Subscribe(
                1,
                [
                    Subscription("$replay/offsets:0=1/a/b/c", 0),
                    Subscription("$replay/earliest/a/b/c/d", 0),
                ],
            ),
        )
        assert suback(link) == [0, 0x8F]
    finally:
        h.streams.close()


# ============================================================================ ;merge


def test_merge_delivers_every_partition_in_timestamp_order(hd: Harness) -> None:
    """Records published round-robin over three partitions, 5 ms apart: a plain replay
    sends them partition by partition, a merged one in the order they were published."""
    topics = [topic_in(hd, p) for p in range(3)]
    _, pub = hd.connect("pub", 5)
    published = []
    for i in range(12):
        topic = topics[i % 3]
        hd.publish(pub, topic, f"{topic}:{i}".encode())
        hd.run()
        hd.clock.advance(0.005)
        published.append(f"{topic}:{i}".encode())
    link, s = hd.connect("plain", 5)
    hd.subscribe(s, "$replay/earliest/devices/#", 0)
    by_partition = [p for _, _, p in annotated(link.take())]
    assert sorted(by_partition) == sorted(published) and by_partition != published
    link, s = hd.connect("merged", 5)
    hd.subscribe(s, "$replay/earliest;merge/devices/#", 0)
    assert [p for _, _, p in annotated(link.take())] == published


def test_merge_ties_go_to_the_lower_partition_and_live_follows(hd: Harness) -> None:
    t0, t1 = topic_in(hd, 0), topic_in(hd, 1)
    _, pub = hd.connect("pub", 5)
    for topic in (t1, t0, t1, t0):  # one instant: every timestamp equal
        hd.publish(pub, topic, topic.encode())
    hd.run()
    link, s = hd.connect("r", 5)
    hd.subscribe(s, "$replay/earliest;merge/devices/#", 1)
    got = annotated(link.take())
    assert [(p, o) for p, o, _ in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    hd.clock.advance(1)
    hd.publish(pub, t1, b"live")
    hd.run()
    assert [(p, pl) for p, _, pl in annotated(link.take())] == [(1, b"live")]


def test_merge_stops_at_the_send_quota_and_resumes_in_order(hd: Harness) -> None:
    """QoS 1 with a receive maximum of 2: two in flight, then each PUBACK lets the next
    earliest record go, still in timestamp order across the partitions."""
    topics = [topic_in(hd, p) for p in range(3)]
    _, pub = hd.connect("pub", 5)
    published = []
    for i in range(6):
        hd.publish(pub, topics[i % 3], b"%d" % i, qos=1, packet_id=i + 1)
        hd.run()
        hd.clock.advance(0.001)
        published.append(b"%d" % i)
    link, s = hd.connect("r", 5, receive_maximum=2)
    hd.subscribe(s, "$replay/earliest;merge/devices/#", 1)
    got = link.take()
    assert [p.payload for p in got] == published[:2]
    while len(got) < 6:
        for p in got[-2:]:
            if p.packet_id is not None:
                hd.router.puback(s, p.packet_id)
        got += link.take()
    assert [p.payload for p in got] == published


def test_merge_survives_persistence(hd: Harness) -> None:
    _, s = hd.connect("r", 5, clean=False, expiry=60)
    hd.subscribe(s, "$replay/earliest;merge/devices/#", 0)
    restored = Session.from_state("r", s.to_state())
    assert restored.consumers["$replay/earliest;merge/devices/#"].merge
