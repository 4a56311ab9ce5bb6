"""The compiled small batch (broker.commitlog._smallbatch) gives the pure-Python forms' bytes
and records: the encoder ``small_batch.encode_small_python`` (itself held to the general
encoder by test_batch.py), the general encoder ``batch.encode_batch`` for a batch of any
size, the decoder ``batch.decode_batch``, and a batch rebased to another
offset is the batch encoded there. What the compiled forms do not take (odd types, values
that do not fit, control batches, gaps) they leave to the Python forms (None), which then
encode it or raise the format's error."""

from __future__ import annotations

import gc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.commitlog import Record, small_batch
from broker.commitlog.batch import (
    BATCH_HEADER,
    decode_batch,
    encode_batch,
    encode_control,
    validate_batch,
)
from broker.commitlog.errors import InvalidRecord
from broker.commitlog.small_batch import (
    SMALL_BATCH,
    decode_records,
    encode,
    encode_small,
    encode_small_python,
    rebased,
)

compiled = pytest.importorskip("broker.commitlog._smallbatch")

_records = st.builds(
    Record,
    offset=st.integers(-1, 5),
    timestamp=st.sampled_from([1_700_000_000_000, 1_700_000_000_001, -5, 2**63 - 1, -(2**63)]),
    topic=st.sampled_from(["devices/d1/telemetry", "devices/d2/telemetry", "c", "", "ü/✓"]),
    payload=st.binary(max_size=70),
    qos=st.integers(0, 255),
    retain=st.one_of(st.booleans(), st.integers(0, 255)),
    client_id=st.sampled_from(["d1", "d2", "c", "", "devices/d1/telemetry", "ü"]),
    properties=st.one_of(st.just(b""), st.binary(max_size=10)),
)


def test_the_compiled_module_is_used() -> None:
    """Built (setup.py), it serves: else the comparisons below compare Python with itself."""
    assert small_batch.IMPLEMENTATION == "compiled"


@settings(max_examples=400, deadline=None)
@given(
    records=st.lists(_records, min_size=1, max_size=SMALL_BATCH),
    base=st.integers(0, 2**62),
    epoch=st.integers(0, 2**31 - 1),
)
def test_encoded_decoded_and_rebased_as_in_python(
    records: list[Record], base: int, epoch: int
) -> None:
    batch = compiled.encode_small(base, records, epoch)
    assert batch == encode_small_python(base, records, leader_epoch=epoch)
    assert encode_small(base, records, leader_epoch=epoch) == batch
    decoded = compiled.decode_records(batch)
    assert decoded == decode_batch(batch)
    assert [type(r) for r in decoded] == [Record] * len(records)
    assert [(type(r.retain), type(r.qos)) for r in decoded] == [(bool, int)] * len(records)
    # Not tracked by the garbage collector (ints, strs and bytes: in no cycle).
    assert not any(map(gc.is_tracked, decoded))
    moved = rebased(batch, base + 7)
    assert (
        moved
        == compiled.rebased(batch, base + 7)
        == encode_small_python(base + 7, records, leader_epoch=epoch)
    )
    validate_batch(moved, 0, base + 7)


@settings(max_examples=50, deadline=None)
@given(records=st.lists(_records, min_size=SMALL_BATCH + 1, max_size=40))
def test_a_large_batch_decodes_as_in_python(records: list[Record]) -> None:
    """The decoder takes any consecutive batch (a forward of many records)."""
    batch = encode(3, records)
    assert type(batch) is bytes and batch == encode_batch(3, records)
    assert compiled.decode_records(batch) == decode_batch(batch)
    assert decode_records(b"xx" + batch, 2) == decode_batch(batch)
    assert decode_records(bytearray(batch)) == decode_batch(batch)  # the Python form


#: Records of many publishers to many topics (a table past the scanned strings, MAX_SCANNED
#: in _smallbatch.pyx: 16), in runs that share their string objects as the device path's do,
#: or equal strings that are other objects.
_many = st.builds(
    lambda i, j, payload, props, qos, shared: Record(
        -1,
        1_700_000_000_000 + i,
        f"devices/{i:05d}/telemetry" if shared else "".join(f"devices/{i:05d}/telemetry"),
        payload,
        qos,
        bool(j & 1),
        f"p{j}",
        props,
    ),
    st.integers(0, 40),
    st.integers(0, 40),
    st.binary(max_size=70),
    st.one_of(st.just(b""), st.binary(max_size=4)),
    st.integers(0, 2),
    st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(
    records=st.one_of(
        st.lists(_records, min_size=1, max_size=300),
        st.lists(_many, min_size=1, max_size=300),
        st.lists(_many, min_size=1, max_size=20).map(lambda rs: [r for r in rs for _ in range(30)]),
    ),
    base=st.integers(0, 2**62),
    epoch=st.integers(0, 2**31 - 1),
)
def test_a_batch_of_any_size_encodes_as_in_python(
    records: list[Record], base: int, epoch: int
) -> None:
    """The compiled encoder writes the general encoder's bytes whatever the batch's size and
    string table (a fan-in's iteration appends thousands of records per partition)."""
    batch = compiled.encode_records(base, records, epoch)
    assert batch == encode_batch(base, records, leader_epoch=epoch)
    assert encode(base, records, leader_epoch=epoch) == batch
    assert compiled.encode_records(base, tuple(records), epoch) == batch
    assert compiled.decode_records(batch) == decode_batch(batch)
    validate_batch(batch, 0, base)


def test_what_the_compiled_forms_leave_to_python() -> None:
    good = Record(0, 1, "t", b"p", 1, False, "c", b"")
    odd = [
        [good._replace(payload=bytearray(b"p"))],  # another buffer type
        [good._replace(timestamp=2**63)],  # does not fit 8 bytes: InvalidRecord in Python
        [good._replace(qos=256)],
        [good._replace(topic="x" * 70_000)],
        [good._replace(topic="\ud800")],  # a lone surrogate: no UTF-8
        [good._replace(topic=None)],  # not a string (was indexed as the table's first)
        [good._replace(client_id=None)],
    ]
    for records in odd:
        assert compiled.encode_small(0, records) is None
        assert compiled.encode_records(0, records * 20) is None
    assert compiled.encode_small(0, [good] * (SMALL_BATCH + 1)) is None
    assert compiled.encode_records(0, []) is None
    assert compiled.encode_small(0, [good], 2**31) is None
    assert compiled.encode_records(0, [good], 2**31) is None
    assert encode_small(0, [odd[0][0]]) == encode_small_python(0, [good])
    for records in odd[1:5]:
        with pytest.raises(InvalidRecord):
            encode_small(0, records)
    control = encode_control(4, 1, 1, b"", 5)
    assert compiled.decode_records(control) is None and decode_records(control) == []
    gaps = bytes(encode_batch(0, [good, good._replace(offset=2)], keep_offsets=True))
    assert compiled.decode_records(gaps) is None
    assert [r.offset for r in decode_records(gaps)] == [0, 2]


def test_bytes_that_are_not_a_batch_are_refused() -> None:
    batch = compiled.encode_small(0, [Record(0, 1, "t", b"payload", 1, False, "c", b"")])
    for bad in (batch[:40], batch[:-1], batch[:12] + b"\x09" + batch[13:]):
        with pytest.raises(ValueError):
            compiled.decode_records(bad)
    with pytest.raises(ValueError):
        compiled.rebased(batch[:-1], 5)
    with pytest.raises(ValueError):
        compiled.decode_records(batch, len(batch) - 10)
    assert BATCH_HEADER.unpack_from(rebased(batch, 9))[0] == 9


def test_the_python_forms_serve_where_it_is_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    records = [Record(0, 1, "t", b"a", 1, False, "c", b""), Record(0, 2, "u", b"b", 0, True, "c")]
    batch = compiled.encode_small(5, records)
    monkeypatch.setattr(small_batch, "_smallbatch", None)
    assert encode_small(5, records) == batch
    assert rebased(compiled.encode_small(0, records), 5) == batch
    assert decode_records(batch) == compiled.decode_records(batch)
    with pytest.raises(ValueError):
        rebased(batch[:-1], 5)
