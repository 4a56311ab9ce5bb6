"""The frame codec (broker.cluster.wire): exact round trips, canonical decoding, every malformed
input refused with WireError and nothing else, and a golden vector that pins the format."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.cluster.frames import Ack, Beat, Frame, Notice
from broker.cluster.membership import Configuration
from broker.cluster.messages import (
    AppendEntries,
    AppendResp,
    Entry,
    EntryKind,
    InstallSnapshot,
    Message,
    PreVote,
    PreVoteResp,
    TimeoutNow,
    Vote,
    VoteResp,
)
from broker.cluster.wire import WireError, decode_frame, encode_frame

# Edge values are drawn often: 0, 1 and the largest of each range.
ids = st.one_of(st.sampled_from([0, 1, 2**32 - 1]), st.integers(0, 2**32 - 1))
u63 = st.one_of(st.sampled_from([0, 1, 2**63 - 1]), st.integers(0, 2**63 - 1))
entries = st.builds(
    Entry,
    u63,
    st.binary(max_size=64),
    st.sampled_from(list(EntryKind)),
    st.one_of(st.just(1), st.integers(1, 2**32 - 1)),
)
configurations = st.sets(ids, max_size=5).flatmap(
    lambda v: st.builds(Configuration.of, st.just(v), st.sets(ids, max_size=3).map(lambda x: x - v))
)
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(PreVote, ids, ids, u63, u63, u63),
    st.builds(PreVoteResp, ids, ids, u63, st.booleans()),
    st.builds(Vote, ids, ids, u63, u63, u63, st.booleans()),
    st.builds(VoteResp, ids, ids, u63, st.booleans()),
    st.builds(
        AppendEntries, ids, ids, u63, u63, u63, st.lists(entries, max_size=4).map(tuple), u63
    ),
    st.builds(AppendResp, ids, ids, u63, st.booleans(), u63, u63, u63, st.none() | u63),
    st.builds(TimeoutNow, ids, ids, u63),
    st.builds(InstallSnapshot, ids, ids, u63, u63, u63, configurations),
)
frames = st.builds(
    Frame,
    ids,
    ids,
    st.lists(st.builds(Beat, ids, u63, u63, u63, u63, st.booleans()), max_size=5),
    st.lists(st.builds(Ack, ids, u63, u63, u63), max_size=5),
    st.lists(st.tuples(ids, messages), max_size=6),
    st.lists(st.builds(Notice, ids, u63, u63), max_size=5),
)

EVERY_TYPE = Frame(
    1,
    2,
    [Beat(7, 3, 10, 9, 3, False), Beat(8, 4, 0, 0, 0, True)],
    [Ack(9, 3, 12, 11)],
    [
        (1, PreVote(1, 2, 5, 10, 3)),
        (1, PreVoteResp(1, 2, 5, True)),
        (2, Vote(1, 2, 5, 10, 3, True)),
        (2, VoteResp(1, 2, 5, False)),
        (3, AppendEntries(1, 2, 5, 10, 3, (Entry(5, b"abc", EntryKind.DATA, 3),), 9)),
        (4, AppendResp(1, 2, 5, False, 10, 8, 7, None)),
        (4, AppendResp(1, 2, 5, False, 10, 8, 7, 2)),
        (5, TimeoutNow(1, 2, 5)),
        (6, InstallSnapshot(1, 2, 5, 100, 4, Configuration.of([1, 2, 3], [4]))),
    ],
    [Notice(10, 5, 99)],
)


@settings(max_examples=150, deadline=None)
@given(frames)
def test_every_frame_round_trips_exactly(frame: Frame) -> None:
    data = encode_frame(frame)
    decoded = decode_frame(data)
    assert decoded == frame
    for (_, got), (_, sent) in zip(decoded.messages, frame.messages, strict=True):
        assert type(got) is type(sent)
        if isinstance(got, AppendEntries):
            assert all(type(e.payload) is bytes for e in got.entries)
            assert all(type(e.kind) is EntryKind for e in got.entries)
    assert all(type(b.quiesce) is bool for b in decoded.beats)
    assert decode_frame(memoryview(data)) == frame
    assert decode_frame(bytearray(data)) == frame


def test_every_message_type_round_trips() -> None:
    assert decode_frame(encode_frame(EVERY_TYPE)) == EVERY_TYPE
    assert decode_frame(encode_frame(Frame(0, 0))) == Frame(0, 0)


def test_the_golden_vector_pins_the_format() -> None:
    frame = Frame(
        1,
        2,
        [Beat(7, 3, 10, 9, 3, True)],
        [Ack(8, 3, 12, 11)],
        [
            (9, AppendEntries(1, 2, 3, 10, 3, (Entry(3, b"hi", EntryKind.DATA, 2),), 9)),
            (9, AppendResp(2, 1, 3, False, 4, 4, 5, None)),
            (9, InstallSnapshot(1, 2, 3, 4, 2, Configuration.of([1, 2], [3]))),
        ],
        [Notice(10, 3, 8)],
    )
    golden = bytes.fromhex(
        # version, frm, to, 1 beat, 1 ack, 1 notice, 3 messages
        "02" "00000001" "00000002" "00000001" "00000001" "00000001" "00000003"
        # beat: group 7, term 3, commit 10, prev_index 9, prev_term 3, quiesce
        "00000007" "0000000000000003" "000000000000000a" "0000000000000009"
        "0000000000000003" "01"
        # ack: group 8, term 3, match 12, flushed 11
        "00000008" "0000000000000003" "000000000000000c" "000000000000000b"
        # notice: group 10, term 3, commit 8
        "0000000a" "0000000000000003" "0000000000000008"
        # group 9, AppendEntries: 1 -> 2, term 3, prev 10/3, commit 9, 1 entry
        "00000009" "05" "00000001" "00000002" "0000000000000003" "000000000000000a"
        "0000000000000003" "0000000000000009" "00000001"
        # entry: term 3, DATA, count 2, 2 bytes "hi"
        "0000000000000003" "00" "00000002" "00000002" "6869"
        # group 9, AppendResp: 2 -> 1, term 3, rejected, match 4, flushed 4, hint 5/None
        "00000009" "06" "00000002" "00000001" "0000000000000003" "00" "0000000000000004"
        "0000000000000004" "0000000000000005" "ffffffffffffffff"
        # group 9, InstallSnapshot: 1 -> 2, term 3, last 4/2, configuration of 17 bytes
        "00000009" "08" "00000001" "00000002" "0000000000000003" "0000000000000004"
        "0000000000000002" "00000011" "01" "0002" "0001" "00000001" "00000002" "00000003"
    )  # fmt: skip
    assert encode_frame(frame) == golden
    assert decode_frame(golden) == frame


def test_every_truncation_is_refused() -> None:
    data = encode_frame(EVERY_TYPE)
    for n in range(len(data)):
        with pytest.raises(WireError):
            decode_frame(data[:n])
    with pytest.raises(WireError, match="1 bytes after"):
        decode_frame(data + b"\x00")


@settings(max_examples=500)
@given(st.binary(max_size=300))
def test_garbage_raises_wire_error_only(data: bytes) -> None:
    for candidate in (data, b"\x02" + data):  # also past the version byte
        try:
            frame = decode_frame(candidate)
        except WireError:
            continue
        assert encode_frame(frame) == candidate  # what decodes is canonical


@settings(max_examples=300)
@given(st.data())
def test_a_corrupted_byte_is_refused_or_decodes_canonically(data: st.DataObject) -> None:
    encoded = bytearray(encode_frame(EVERY_TYPE))
    i = data.draw(st.integers(0, len(encoded) - 1))
    encoded[i] = data.draw(st.integers(0, 255))
    try:
        frame = decode_frame(encoded)
    except WireError:
        return
    assert encode_frame(frame) == encoded


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"\x01" + bytes(24), "version 1, expected 2"),
        (b"\x02" + bytes(8) + b"\xff\xff\xff\xff" + bytes(12), "beats need"),
        (b"\x02" + bytes(12) + b"\x00\x00\xff\xff" + bytes(8), "acks need"),
        (b"\x02" + bytes(16) + b"\x00\x00\xff\xff" + bytes(4), "notices need"),
        (b"\x02" + bytes(20) + b"\x7f\xff\xff\xff", "messages cannot fit"),
        (b"\x02" + bytes(20) + b"\x00\x00\x00\x01" + bytes(4) + b"\x09" + bytes(16), "type 9"),
    ],
)
def test_bad_headers_are_named(data: bytes, error: str) -> None:
    with pytest.raises(WireError, match=error):
        decode_frame(data)


def test_a_huge_entry_count_is_refused_before_allocating() -> None:
    data = bytearray(encode_frame(Frame(1, 2, messages=[(1, EVERY_TYPE.messages[4][1])])))
    count_at = 25 + 5 + 40  # frame header, message header, AppendEntries up to its count
    data[count_at : count_at + 4] = b"\xff\xff\xff\xff"
    with pytest.raises(WireError, match="4294967295 entries cannot fit"):
        decode_frame(data)


def test_a_set_top_bit_and_a_non_boolean_are_refused() -> None:
    beat = bytearray(encode_frame(Frame(1, 2, [Beat(1, 2, 3, 4, 5, False)])))
    beat[25 + 4] |= 0x80
    with pytest.raises(WireError, match="2\\*\\*63"):
        decode_frame(beat)
    beat[25 + 4] &= 0x7F
    beat[-1] = 2
    with pytest.raises(WireError, match="quiesce"):
        decode_frame(beat)
    vote = bytearray(encode_frame(Frame(1, 2, messages=[(1, VoteResp(1, 2, 3, True))])))
    vote[-1] = 2
    with pytest.raises(WireError, match="granted is 2"):
        decode_frame(vote)


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (Frame(-1, 2), "frame: frm -1 is not an id"),
        (Frame(1, 2**32), "frame: to 4294967296 is not an id"),
        (Frame(1, 2, [Beat(2**32, 1, 1, 1, 1, False)]), "beat 0: group 4294967296"),
        (Frame(1, 2, [Beat(1, -1, 1, 1, 1, False)]), "beat 0: term -1 is not a term"),
        (Frame(1, 2, acks=[Ack(1, 1, 2**63, 1)]), "ack 0: match 9223372036854775808"),
        (Frame(1, 2, notices=[Notice(1, 1, 2**63)]), "notice 0: commit 9223372036854775808"),
        (Frame(1, 2, messages=[(1, TimeoutNow(1, 2, 2**63))]), "TimeoutNow.*term 92233"),
        (Frame(1, 2, messages=[(1, PreVote(1, -2, 1, 1, 1))]), "PreVote.*to -2"),
        (Frame(1, 2, messages=[(2**32, VoteResp(1, 2, 1, True))]), "group 4294967296"),
        (Frame(1, 2, messages=[(1, Vote(1, 2, 1, 1, 1, 2))]), "transfer 2 is not a bool"),  # type: ignore[arg-type]
        (
            Frame(1, 2, messages=[(1, AppendResp(1, 2, 1, True, 1, 1, 1, -1))]),
            "hint_term -1",
        ),
        (
            Frame(1, 2, messages=[(1, AppendEntries(1, 2, 1, 1, 1, (Entry(1, b"", count=0),), 1))]),
            "entry 0: count 0",
        ),
        (
            Frame(1, 2, messages=[(1, InstallSnapshot(1, 2, 1, 1, 1, Configuration.of([-1])))]),
            "InstallSnapshot.*voter",
        ),
        (Frame(1, 2, messages=[(1, "not a message")]), "cannot encode a str"),  # type: ignore[list-item]
    ],
)
def test_an_unencodable_field_is_named(frame: Frame, error: str) -> None:
    with pytest.raises(WireError, match=error):
        encode_frame(frame)


def test_a_decoded_payload_does_not_hold_the_input_buffer() -> None:
    buffer = bytearray(encode_frame(Frame(1, 2, messages=[EVERY_TYPE.messages[4]])))
    frame = decode_frame(memoryview(buffer))
    buffer[:] = bytes(len(buffer))  # the caller reuses its buffer at once
    message = frame.messages[0][1]
    assert isinstance(message, AppendEntries)
    assert message.entries[0].payload == b"abc"
    buffer.extend(b"more")  # no view of it is left alive (a live view would forbid resizing)
