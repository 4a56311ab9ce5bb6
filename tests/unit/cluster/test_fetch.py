"""The fetch protocol's codec and bounds (broker.cluster.fetch): requests and answers round
trip, a malformed or oversized request is refused, an answer's batches are verified (CRC,
continuity, never past the high-water mark it states) before a record is handed out."""

from __future__ import annotations

import pytest

from broker.cluster.fetch import (
    ANSWER,
    MAX_FETCH_BYTES,
    MAX_WAIT_MS,
    NOT_REPLICA,
    OK,
    REQUEST,
    FetchError,
    FetchRequest,
    decode_answer,
    decode_request,
    encode_answer,
    encode_request,
    verified_records,
)
from broker.commitlog import Record
from broker.commitlog.batch import encode_batch, encode_control


def rec(offset: int, payload: bytes = b"x") -> Record:
    return Record(offset, 1000 + offset, f"t/{offset % 3}", payload, 1, False, "c", b"")


def batch(base: int, n: int) -> bytes:
    return bytes(encode_batch(base, [rec(base + i) for i in range(n)], leader_epoch=2))


def test_request_round_trips() -> None:
    req = FetchRequest(7, 0xDEADBEEF, 123, 1 << 20, 1000)
    assert decode_request(encode_request(req)) == req


@pytest.mark.parametrize(
    "body",
    [
        b"",
        encode_request(FetchRequest(1, 2, 3, 4, 5))[:-1],
        encode_request(FetchRequest(1, 2, 3, 4, 5)) + b"\0",
        REQUEST.pack(1, 2, -1, 0, 0),  # negative offset
        REQUEST.pack(1, 2, 0, MAX_FETCH_BYTES + 1, 0),  # oversized
        REQUEST.pack(1, 2, 0, 0, MAX_WAIT_MS + 1),  # held too long
    ],
)
def test_malformed_or_oversized_requests_are_refused(body: bytes) -> None:
    with pytest.raises(FetchError):
        decode_request(body)


def test_answer_round_trips_with_its_batches() -> None:
    batches = [batch(10, 3), batch(13, 2)]
    body = encode_answer(9, 4, OK, 77, 5, 15, batches, term=6)
    answer = decode_answer(body)
    assert answer[:7] == (9, 4, OK, 77, 6, 5, 15)
    records, end = verified_records(answer, 11)
    assert [r.offset for r in records] == [11, 12, 13, 14] and end == 15
    assert records[0] == rec(11)
    no_leader = decode_answer(encode_answer(9, 4, NOT_REPLICA, None, 0, 0))
    assert no_leader.leader is None and no_leader.error == NOT_REPLICA
    assert no_leader.term is None
    # A term is stated with a leader only: the one it leads in (cluster_groups follows both).
    assert decode_answer(encode_answer(9, 4, OK, None, 0, 0, term=6)).term is None


@pytest.mark.parametrize(
    "body",
    [
        b"\0" * (ANSWER.size - 1),
        ANSWER.pack(1, 2, 99, -1, -1, 0, 0),  # unknown error code
        ANSWER.pack(1, 2, OK, -1, -1, 10, 5),  # log start past the mark
        ANSWER.pack(1, 2, NOT_REPLICA, -1, -1, 0, 0) + b"junk",  # a refusal with batches
    ],
)
def test_malformed_answers_are_refused(body: bytes) -> None:
    with pytest.raises(FetchError):
        decode_answer(body)


def test_a_corrupt_batch_fails_the_whole_answer() -> None:
    good = batch(0, 3)
    bad = bytearray(good)
    bad[-1] ^= 0xFF  # a payload byte: the CRC no longer matches
    answer = decode_answer(encode_answer(1, 1, OK, None, 0, 3, [bytes(bad)]))
    with pytest.raises(FetchError, match="CRC"):
        verified_records(answer, 0)


def test_batches_past_the_stated_mark_are_refused() -> None:
    # Never an uncommitted record: the batch ends at 5, the answer says 4 are committed.
    answer = decode_answer(encode_answer(1, 1, OK, None, 0, 4, [batch(0, 5)]))
    with pytest.raises(FetchError, match="past the mark"):
        verified_records(answer, 0)


def test_batches_must_follow_each_other_and_hold_the_offset_asked() -> None:
    gap = decode_answer(encode_answer(1, 1, OK, None, 0, 10, [batch(0, 3), batch(5, 2)]))
    with pytest.raises(FetchError):
        verified_records(gap, 0)
    elsewhere = decode_answer(encode_answer(1, 1, OK, None, 0, 10, [batch(4, 3)]))
    with pytest.raises(FetchError, match="not 2"):
        verified_records(elsewhere, 2)


def test_control_batches_are_passed_over_and_counted_in_the_end() -> None:
    # A new leader's no-op (one offset, no record) between two batches.
    noop = encode_control(3, 3, 1, b"", 0)
    answer = decode_answer(encode_answer(1, 1, OK, 3, 0, 6, [batch(0, 3), noop, batch(4, 2)]))
    records, end = verified_records(answer, 0)
    assert [r.offset for r in records] == [0, 1, 2, 4, 5] and end == 6
    only_noop = decode_answer(encode_answer(1, 1, OK, 3, 0, 6, [noop]))
    assert verified_records(only_noop, 3) == ([], 4)
