"""Runs of 4-byte PUBACKs decoded in one step (Decoder(puback_runs=True) -> PubAckRun) give
what the one-by-one decoder gives: the same PUBACKs in the same order among the other
packets, and the same error (type, reason code) at the same read, however the bytes are split
into reads. Input bytes are hand-built, not produced by our encoder.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.mqtt import MQTTError, PubAck, ReasonCode
from broker.mqtt.connection import ServerConnection
from broker.mqtt.decode import PUBACK_RUN_MAX, Decoder, PubAckRun

CONNECT4 = bytes.fromhex("100d00044d5154540402003c000163")
CONNECT5 = bytes.fromhex("100e00044d5154540502003c00000163")


def puback(pid: int) -> bytes:
    return bytes([0x40, 2, pid >> 8, pid & 0xFF])


#: Packets a subscriber may send among its PUBACKs, and malformed ones.
OTHERS = {
    "pingreq": bytes.fromhex("c000"),
    "publish": bytes.fromhex("3005000174616263"),  # QoS 0, topic "t", "abc"
    "puback5_code": bytes.fromhex("4003000710"),  # 5.0: No matching subscribers
    "pubrec": bytes.fromhex("50020009"),
    "pid0": bytes.fromhex("40020000"),  # [MQTT-2.2.1-3]
    "flags": bytes.fromhex("41020001"),  # reserved flags
    "long311": bytes.fromhex("4003000100"),  # 3.1.1: a byte too many
    "short": bytes.fromhex("400100"),
}


def events(decoder: Decoder, reads: list[bytes]) -> list[object]:
    """Per read, the packets (a PubAckRun spelt out as PubAcks) or the error it raised."""
    out: list[object] = []
    for data in reads:
        try:
            decoder.feed(data)
            got = decoder.packets()
        except MQTTError as exc:
            out.append((type(exc), exc.reason_code))
            break
        for packet in got:
            if isinstance(packet, PubAckRun):
                out.extend(PubAck(pid) for pid in packet.packet_ids)
            else:
                out.append(packet)
    return out


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    return [data[a:b] for a, b in pairwise(bounds)]


@st.composite
def streams(draw: st.DrawFn) -> tuple[int, bytes]:
    version = draw(st.sampled_from([4, 5]))
    parts = [CONNECT4 if version == 4 else CONNECT5]
    for _ in range(draw(st.integers(1, 8))):
        if draw(st.integers(0, 3)):
            first = draw(st.integers(1, 65535))
            ids = [first + i if first + i <= 65535 else 1 for i in range(draw(st.integers(1, 40)))]
            parts += map(puback, ids)
        else:
            parts.append(OTHERS[draw(st.sampled_from(sorted(OTHERS)))])
    return version, b"".join(parts)


@settings(max_examples=300, deadline=None)
@given(stream=streams(), cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_runs_decode_as_the_one_by_one_decoder(stream: tuple[int, bytes], cuts: list[int]) -> None:
    _, data = stream
    reads = split(data, cuts)
    assert events(Decoder(puback_runs=True), reads) == events(Decoder(), reads)


def test_every_split_of_a_run_followed_by_other_packets() -> None:
    data = (
        CONNECT4
        + b"".join(puback(i) for i in range(1, 31))
        + OTHERS["pingreq"]
        + puback(40)
        + puback(41)
        + OTHERS["pid0"]
        + puback(42)
    )
    for cut in range(len(data) + 1):
        for cut2 in range(cut, len(data) + 1, 7):
            reads = [data[:cut], data[cut:cut2], data[cut2:]]
            assert events(Decoder(puback_runs=True), reads) == events(Decoder(), reads)


def test_a_read_full_of_pubacks_is_one_run() -> None:
    decoder = Decoder(puback_runs=True)
    decoder.feed(CONNECT4 + b"".join(puback(i) for i in range(1, 101)) + puback(7)[:3])
    _connect, run = decoder.packets()
    assert isinstance(run, PubAckRun)
    assert list(run.packet_ids) == list(range(1, 101))
    decoder.feed(puback(7)[3:] + puback(8))
    (run,) = decoder.packets()
    assert list(run.packet_ids) == [7, 8]
    decoder.feed(b"".join(puback(1 + i % 65535) for i in range(PUBACK_RUN_MAX + 5)))
    runs = decoder.packets()
    assert [len(r.packet_ids) for r in runs] == [PUBACK_RUN_MAX, 5]  # type: ignore[union-attr]


def test_one_puback_and_next_packet_do_not_need_a_run() -> None:
    decoder = Decoder(puback_runs=True)
    decoder.feed(CONNECT4 + puback(5) + OTHERS["pingreq"])
    assert [type(p).__name__ for p in decoder.packets()] == ["Connect", "PubAck", "PingReq"]


def test_pubacks_before_connect_are_refused() -> None:
    decoder = Decoder(puback_runs=True)
    decoder.feed(puback(1) + puback(2))
    with pytest.raises(MQTTError) as info:
        decoder.packets()
    assert info.value.reason_code == ReasonCode.PROTOCOL_ERROR


@pytest.mark.parametrize(
    ("name", "version", "code"),
    [
        ("pid0", 4, ReasonCode.PROTOCOL_ERROR),
        ("flags", 5, ReasonCode.MALFORMED_PACKET),
        ("long311", 4, ReasonCode.MALFORMED_PACKET),
    ],
)
def test_a_bad_packet_after_a_run_closes_with_its_reason(
    name: str, version: int, code: int
) -> None:
    """The server's connection: the bad packet is refused with the reason code of the
    one-by-one path; the PUBACKs of that read are lost with the connection (s4.13)."""
    conn = ServerConnection(max_packet_size=1 << 20)
    conn.receive_data(CONNECT4 if version == 4 else CONNECT5)
    (run,) = conn.receive_data(b"".join(puback(i) for i in range(1, 9)))
    assert isinstance(run, PubAckRun) and list(run.packet_ids) == list(range(1, 9))
    with pytest.raises(MQTTError) as info:
        conn.receive_data(puback(9) + puback(10) + OTHERS[name] + puback(11))
    assert info.value.reason_code == code
    with pytest.raises(MQTTError):
        conn.receive_data(puback(12))  # the decoder is dead after an error
