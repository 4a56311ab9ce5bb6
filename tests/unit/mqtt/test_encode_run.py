"""encode_publish_run: the same bytes as encode_publish message by message."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.mqtt.encode import encode_publish, encode_publish_run
from broker.mqtt.errors import LocalProtocolError

topics = st.sampled_from(["a", "devices/1/t", "é/ü", "x" * 300])
payloads = st.one_of(st.binary(max_size=200), st.sampled_from([b"", b"x" * 20_000]))


@given(
    st.lists(st.tuples(topics, payloads, st.booleans()), min_size=1, max_size=40),
    st.sampled_from([0, 1, 2]),
    st.sampled_from([3, 4, 5]),
    st.integers(1, 65535),
    st.booleans(),
)
def test_same_bytes_as_one_by_one(
    msgs: list[tuple[str, bytes, bool]], qos: int, version: int, first: int, with_retain: bool
) -> None:
    first = min(first, 65536 - len(msgs))
    pid = first if qos else None
    t, p, r = zip(*msgs, strict=True)
    retains = r if with_retain else None
    expected = b"".join(
        encode_publish(
            topic,
            payload,
            qos,
            retain and with_retain,
            False,
            first + i if qos else None,
            None,
            version,
        )
        for i, (topic, payload, retain) in enumerate(msgs)
    )
    assert encode_publish_run(t, p, retains, qos, pid, version) == expected


def test_packet_ids_must_not_wrap() -> None:
    with pytest.raises(LocalProtocolError):
        encode_publish_run(["a", "b"], [b"", b""], None, 1, 65535, 4)  # [MQTT-2.2.1-3]
    with pytest.raises(LocalProtocolError):
        encode_publish_run(["a"], [b""], None, 0, 1, 4)  # QoS 0 has no packet id


def test_empty_run() -> None:
    assert encode_publish_run([], [], None, 0, None, 4) == b""
