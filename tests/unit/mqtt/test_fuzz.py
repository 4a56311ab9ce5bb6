"""Property tests for the decoder: hostile bytes, mutated packets, arbitrary stream chunking.

What must hold for *any* input (the decoder's invariants, broker/mqtt/decode.py):

* the decoder raises nothing but :class:`MQTTError` subclasses, whether fed random bytes,
  mutated golden packets or mutated whole sessions;
* work is bounded: every call returns, and a feed of N bytes yields at most N/2 packets;
* once dead, it stays dead with the same error;
* a prefix of a valid stream is "need more data", never an error;
* a valid stream decodes to the same packets however it is cut into reads.

Seeds for mutation are the hand-written golden vectors of test_golden.py; streams for the
chunking tests are built from hypothesis-generated packets and checked against the packets
themselves (so they are also encode -> decode round trips). This is the decoder's one fuzzing
module; test_decoder.py holds the hand-picked cases.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.mqtt.decode import Decoder
from broker.mqtt.encode import encode
from broker.mqtt.errors import MQTTError
from broker.mqtt.packets import (
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
)
from broker.mqtt.properties import PropertyId as P
from tests.mqttbytes import packet, varint
from tests.unit.mqtt.test_golden import CLIENT, CONNECT_HEX, VECTORS, Vector

pytestmark = pytest.mark.timeout(60)

#: Raise for a deeper local run: MQLOG_FUZZ_EXAMPLES=20000 pytest tests/unit/mqtt/test_fuzz.py
FUZZ_EXAMPLES = int(os.environ.get("MQLOG_FUZZ_EXAMPLES", "200"))

FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: Valid-stream tests generate whole packet lists: fewer examples, each doing more.
STREAM = settings(FUZZ, max_examples=max(FUZZ_EXAMPLES // 4, 30))


# --------------------------------------------------------------------------- harness


def _decoder_and_bytes(v: Vector) -> tuple[Decoder, bytes]:
    """A fresh decoder and the byte stream it should see for vector ``v``."""
    if isinstance(v.packet, Connect):
        return Decoder(), v.data
    if v.side == CLIENT:
        return Decoder(version=4 if v.version == 3 else v.version), v.data
    return Decoder(), bytes.fromhex(CONNECT_HEX[v.version]) + v.data


def _feed_all(dec: Decoder, chunks: list[bytes]) -> tuple[list[Packet], MQTTError | None]:
    """Feed chunks, draining after each; bounded: at most one packet per two bytes fed."""
    packets: list[Packet] = []
    fed = 0
    for chunk in chunks:
        fed += len(chunk)
        try:
            dec.feed(chunk)
            while (p := dec.next_packet()) is not None:
                packets.append(p)
                assert len(packets) <= fed // 2, "more packets than bytes allow: a loop?"
        except MQTTError as err:
            return packets, err
    return packets, None


def _check_hostile(dec: Decoder, data: bytes, cut: int) -> None:
    _, err = _feed_all(dec, [data[:cut], data[cut:]])
    if err is not None:
        # Dead decoder: same error class again, for every entry point.
        with pytest.raises(type(err)):
            dec.next_packet()
        with pytest.raises(type(err)):
            dec.feed(b"\xc0\x00")
            dec.packets()


# --------------------------------------------------------------------------- random bytes

_DECODER_KINDS = st.sampled_from(
    ["fresh-server", "server-3", "server-4", "server-5", "client-4", "client-5"]
)


def _make(kind: str) -> Decoder:
    if kind == "fresh-server":
        return Decoder()
    side, version = kind.split("-")
    if side == "client":
        return Decoder(version=int(version))
    dec = Decoder()
    dec.feed(bytes.fromhex(CONNECT_HEX[int(version)]))
    assert isinstance(dec.next_packet(), Connect)
    return dec


@FUZZ
@given(kind=_DECODER_KINDS, data=st.binary(max_size=300), cut=st.integers(0, 300))
def test_random_bytes_raise_only_mqtt_errors(kind: str, data: bytes, cut: int) -> None:
    _check_hostile(_make(kind), data, cut)


@FUZZ
@given(
    kind=_DECODER_KINDS,
    first=st.integers(0, 255),
    body=st.binary(max_size=120),
    small_limit=st.booleans(),
)
def test_random_bodies_behind_a_right_length_raise_only_mqtt_errors(
    kind: str, first: int, body: bytes, small_limit: bool
) -> None:
    """Random bytes rarely get past the fixed header; give them a correct Remaining Length."""
    dec = _make(kind) if not small_limit else Decoder(max_packet_size=64)
    data = packet(first, body)
    _check_hostile(dec, data, len(data))


# --------------------------------------------------------------------------- mutations

_SEEDS = [v for v in VECTORS if len(v.data) < 400]


def _mutate(draw: st.DrawFn, data: bytes, times: int) -> bytes:
    """``data`` with ``times`` random edits: bit flips, byte changes, truncation, insertion,
    deletion, or a rewritten length field."""
    buf = bytearray(data)
    for _ in range(times):
        how = draw(st.sampled_from(["flip", "byte", "truncate", "insert", "delete", "length"]))
        if not buf:
            buf.append(draw(st.integers(0, 255)))
            continue
        i = draw(st.integers(0, len(buf) - 1))
        if how == "flip":
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif how == "byte":
            buf[i] = draw(st.integers(0, 255))
        elif how == "truncate":
            del buf[i:]
        elif how == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif how == "delete":
            del buf[i : i + draw(st.integers(1, 4))]
        else:
            # Rewrite a length field: the Remaining Length (offset 1) or, more often, some
            # two-byte string/binary length or one-byte property length inside the body.
            j = draw(st.sampled_from([1, i]))
            new = draw(
                st.one_of(
                    st.integers(0, 0xFF).map(lambda n: bytes([n])),
                    st.integers(0, 0xFFFF).map(lambda n: n.to_bytes(2, "big")),
                    st.integers(0, 268_435_455).map(varint),
                )
            )
            buf[j : j + len(new)] = new
    return bytes(buf)


@st.composite
def _mutated(draw: st.DrawFn) -> tuple[Vector, bytes]:
    v = draw(st.sampled_from(_SEEDS))
    _, data = _decoder_and_bytes(v)
    return v, _mutate(draw, data, draw(st.integers(1, 3)))


@FUZZ
@given(case=_mutated(), cut=st.integers(0, 400))
def test_mutated_valid_packets_raise_only_mqtt_errors(case: tuple[Vector, bytes], cut: int) -> None:
    v, data = case
    dec, _ = _decoder_and_bytes(v)
    _check_hostile(dec, data, cut)


@FUZZ
@given(case=_mutated())
def test_mutated_packets_with_small_limit(case: tuple[Vector, bytes]) -> None:
    v, data = case
    if isinstance(v.packet, Connect) or v.side != CLIENT:
        dec = Decoder(max_packet_size=40)
    else:
        dec = Decoder(version=v.version if v.version != 3 else 4, max_packet_size=40)
    _check_hostile(dec, data, len(data))


@pytest.mark.parametrize("v", _SEEDS, ids=lambda v: v.id)
def test_every_prefix_of_a_valid_packet_needs_more_data(v: Vector) -> None:
    """Truncation of valid bytes is never an error: each prefix decodes to nothing yet."""
    _, data = _decoder_and_bytes(v)
    for n in range(len(data)):
        dec, _ = _decoder_and_bytes(v)
        packets, err = _feed_all(dec, [data[:n]])
        assert err is None, f"prefix of {n} bytes raised {err!r}"
        assert len(packets) <= 1  # only the leading CONNECT may be complete


# --------------------------------------------------------------------------- valid streams

_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
_TEXT = st.text(_CHARS, max_size=12)
_NAME = st.text(_CHARS, min_size=1, max_size=12)
_PID = st.integers(1, 0xFFFF)
_USER = st.lists(st.tuples(_TEXT, _TEXT), min_size=1, max_size=3)


def _props(**options: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[int, Any]]:
    return st.fixed_dictionaries({}, optional={int(P[k]): s for k, s in options.items()})


_PUBLISH_PROPS = _props(
    PAYLOAD_FORMAT_INDICATOR=st.integers(0, 1),
    MESSAGE_EXPIRY_INTERVAL=st.integers(0, 0xFFFFFFFF),
    CONTENT_TYPE=_TEXT,
    RESPONSE_TOPIC=_NAME,
    CORRELATION_DATA=st.binary(max_size=8),
    TOPIC_ALIAS=st.integers(1, 0xFFFF),
    USER_PROPERTY=_USER,
)
_ACK_PROPS = _props(REASON_STRING=_TEXT, USER_PROPERTY=_USER)


@st.composite
def _publish(draw: st.DrawFn, version: int) -> Publish:
    qos = draw(st.integers(0, 2))
    return Publish(
        topic=draw(_NAME),
        payload=draw(st.binary(max_size=40)),
        qos=qos,
        retain=draw(st.booleans()),
        dup=draw(st.booleans()) if qos else False,
        packet_id=draw(_PID) if qos else None,
        properties=draw(_PUBLISH_PROPS) if version == 5 else {},
    )


def _ack(cls: type, codes: list[int], version: int) -> st.SearchStrategy[Packet]:
    if version != 5:
        return st.builds(cls, _PID)
    return st.builds(cls, _PID, st.sampled_from(codes), _ACK_PROPS)


@st.composite
def _subscribe(draw: st.DrawFn, version: int) -> Subscribe:
    subs = []
    for _ in range(draw(st.integers(1, 3))):
        if version == 5:
            subs.append(
                Subscription(
                    draw(_NAME),
                    draw(st.integers(0, 2)),
                    draw(st.booleans()),
                    draw(st.booleans()),
                    draw(st.integers(0, 2)),
                )
            )
        else:
            subs.append(Subscription(draw(_NAME), draw(st.integers(0, 2))))
    props = (
        draw(
            _props(
                SUBSCRIPTION_IDENTIFIER=st.integers(1, 268_435_455).map(lambda n: [n]),
                USER_PROPERTY=_USER,
            )
        )
        if version == 5
        else {}
    )
    return Subscribe(draw(_PID), subs, props)


def _client_packets(version: int) -> st.SearchStrategy[Packet]:
    """Packets a client sends a server (decoded by a server-side decoder)."""
    kinds: list[st.SearchStrategy[Packet]] = [
        _publish(version),
        _ack(PubAck, [0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99], version),
        _ack(PubRec, [0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99], version),
        _ack(PubRel, [0x00, 0x92], version),
        _ack(PubComp, [0x00, 0x92], version),
        _subscribe(version),
        st.builds(
            Unsubscribe,
            _PID,
            st.lists(_NAME, min_size=1, max_size=3),
            _props(USER_PROPERTY=_USER) if version == 5 else st.just({}),
        ),
        st.just(PingReq()),
    ]
    if version == 5:
        kinds.append(
            st.builds(
                Disconnect,
                st.sampled_from([0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x95]),
                _props(SESSION_EXPIRY_INTERVAL=st.integers(0, 0xFFFFFFFF), REASON_STRING=_TEXT),
            )
        )
        kinds.append(
            st.builds(
                Auth,
                st.sampled_from([0x00, 0x18, 0x19]),
                _props(
                    AUTHENTICATION_METHOD=_NAME,
                    AUTHENTICATION_DATA=st.binary(max_size=8),
                    REASON_STRING=_TEXT,
                ),
            )
        )
    else:
        kinds.append(st.just(Disconnect()))
    return st.one_of(kinds)


_U16 = st.integers(0, 0xFFFF)
_U32 = st.integers(0, 0xFFFFFFFF)
_WILL_PROPS = _props(
    PAYLOAD_FORMAT_INDICATOR=st.integers(0, 1),
    MESSAGE_EXPIRY_INTERVAL=_U32,
    CONTENT_TYPE=_TEXT,
    RESPONSE_TOPIC=_NAME,
    CORRELATION_DATA=st.binary(max_size=8),
    WILL_DELAY_INTERVAL=_U32,
    USER_PROPERTY=_USER,
)
_CONNECT_PROPS = _props(
    SESSION_EXPIRY_INTERVAL=_U32,
    RECEIVE_MAXIMUM=st.integers(1, 0xFFFF),
    MAXIMUM_PACKET_SIZE=st.integers(1, 0xFFFFFFFF),
    TOPIC_ALIAS_MAXIMUM=_U16,
    REQUEST_RESPONSE_INFORMATION=st.integers(0, 1),
    REQUEST_PROBLEM_INFORMATION=st.integers(0, 1),
    USER_PROPERTY=_USER,
    AUTHENTICATION_METHOD=_NAME,
)


@st.composite
def _connect(draw: st.DrawFn, version: int) -> Connect:
    v5 = version == 5
    will = None
    if draw(st.booleans()):
        will = Will(
            draw(_NAME),
            draw(st.binary(max_size=20)),
            draw(st.integers(0, 2)),
            draw(st.booleans()),
            draw(_WILL_PROPS) if v5 else {},
        )
    username = draw(st.none() | _TEXT)
    # 3.1.1 [MQTT-3.1.2-22]: no password without a user name (5.0 allows it).
    password = draw(st.none() | st.binary(max_size=10)) if username is not None or v5 else None
    props = draw(_CONNECT_PROPS) if v5 else {}
    if P.AUTHENTICATION_METHOD in props and draw(st.booleans()):
        props[P.AUTHENTICATION_DATA] = draw(st.binary(max_size=8))
    return Connect(
        client_id=draw(_TEXT if version != 3 else _NAME),
        protocol_level=version,
        protocol_name="MQIsdp" if version == 3 else "MQTT",
        clean_start=draw(st.booleans()),
        keepalive=draw(_U16),
        will=will,
        username=username,
        password=password,
        properties=props,
    )


@st.composite
def _stream(draw: st.DrawFn) -> tuple[int, list[Packet], bytes]:
    """A server-side stream: a random CONNECT, then packets a client may send."""
    version = draw(st.sampled_from([3, 4, 5]))
    connect = draw(_connect(version))
    packets = draw(st.lists(_client_packets(4 if version == 3 else version), max_size=8))
    data = encode(connect, version) + b"".join(encode(p, version) for p in packets)
    return version, [connect, *packets], data


_CONNACK_PROPS = _props(
    SESSION_EXPIRY_INTERVAL=_U32,
    ASSIGNED_CLIENT_IDENTIFIER=_NAME,
    SERVER_KEEP_ALIVE=_U16,
    RESPONSE_INFORMATION=_TEXT,
    SERVER_REFERENCE=_NAME,
    REASON_STRING=_TEXT,
    RECEIVE_MAXIMUM=st.integers(1, 0xFFFF),
    TOPIC_ALIAS_MAXIMUM=_U16,
    MAXIMUM_QOS=st.integers(0, 1),
    RETAIN_AVAILABLE=st.integers(0, 1),
    USER_PROPERTY=_USER,
    MAXIMUM_PACKET_SIZE=st.integers(1, 0xFFFFFFFF),
    WILDCARD_SUBSCRIPTION_AVAILABLE=st.integers(0, 1),
    SUBSCRIPTION_IDENTIFIER_AVAILABLE=st.integers(0, 1),
    SHARED_SUBSCRIPTION_AVAILABLE=st.integers(0, 1),
)


@st.composite
def _server_publish(draw: st.DrawFn, version: int) -> Publish:
    p = draw(_publish(version))
    if version == 5 and draw(st.booleans()):
        ids = draw(st.lists(st.integers(1, 268_435_455), min_size=1, max_size=3))
        p = Publish(
            p.topic, p.payload, p.qos, p.retain, p.dup, p.packet_id,
            {**p.properties, P.SUBSCRIPTION_IDENTIFIER: ids},
        )  # fmt: skip
    return p


def _server_packets(version: int) -> st.SearchStrategy[Packet]:
    """Packets a server sends a client (decoded by Decoder(version=...))."""
    v5 = version == 5
    connack_codes = [0x00, 0x80, 0x81, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x9C]
    suback_codes = [0x00, 0x01, 0x02, 0x80]
    if v5:
        suback_codes += [0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2]
    unsuback_codes = [0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91]
    kinds: list[st.SearchStrategy[Packet]] = [
        st.builds(
            ConnAck,
            st.booleans(),
            st.sampled_from(connack_codes) if v5 else st.integers(0, 5),
            _CONNACK_PROPS if v5 else st.just({}),
        ),
        _server_publish(version),
        _ack(PubAck, [0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99], version),
        _ack(PubRel, [0x00, 0x92], version),
        st.builds(
            SubAck,
            _PID,
            st.lists(st.sampled_from(suback_codes), min_size=1, max_size=4),
            _ACK_PROPS if v5 else st.just({}),
        ),
        st.builds(
            UnsubAck,
            _PID,
            st.lists(st.sampled_from(unsuback_codes), min_size=1, max_size=4)
            if v5
            else st.just([]),
            _ACK_PROPS if v5 else st.just({}),
        ),
        st.just(PingResp()),
    ]
    if v5:
        kinds.append(
            st.builds(
                Disconnect,
                st.sampled_from([0x00, 0x80, 0x81, 0x82, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x9C]),
                _props(SERVER_REFERENCE=_NAME, REASON_STRING=_TEXT, USER_PROPERTY=_USER),
            )
        )
    return st.one_of(kinds)


@STREAM
@given(
    version=st.sampled_from([4, 5]),
    data=st.data(),
    sizes=st.lists(st.integers(0, 30), max_size=40),
)
def test_client_side_stream_round_trip(version: int, data: st.DataObject, sizes: list[int]) -> None:
    packets = data.draw(st.lists(_server_packets(version), min_size=1, max_size=8))
    raw = b"".join(encode(p, version) for p in packets)
    chunks, pos = [], 0
    for n in sizes:
        chunks.append(raw[pos : pos + n])
        pos += n
    chunks.append(raw[pos:])
    out, err = _feed_all(Decoder(version=version), chunks)
    assert err is None, f"valid stream raised {err!r}"
    assert out == packets


def _decode_stream(chunks: list[bytes], version: int) -> list[Packet]:
    """Decode a server-side stream; returns every packet, the leading CONNECT included."""
    dec = Decoder()
    packets, err = _feed_all(dec, chunks)
    assert err is None, f"valid stream raised {err!r}"
    assert isinstance(packets[0], Connect) and packets[0].protocol_level == version
    assert dec.version == version
    return packets


@STREAM
@given(_stream())
def test_stream_split_at_every_point(case: tuple[int, list[Packet], bytes]) -> None:
    version, packets, data = case
    assert _decode_stream([data], version) == packets
    for i in range(len(data) + 1):
        assert _decode_stream([data[:i], data[i:]], version) == packets, f"split at {i}"


@STREAM
@given(case=_stream(), sizes=st.lists(st.integers(0, 40), min_size=1, max_size=60))
def test_stream_random_chunking(case: tuple[int, list[Packet], bytes], sizes: list[int]) -> None:
    version, packets, data = case
    chunks, pos = [], 0
    for n in sizes:
        chunks.append(data[pos : pos + n])
        pos += n
    chunks.append(data[pos:])
    assert _decode_stream(chunks, version) == packets


@STREAM
@given(case=_stream(), step=st.integers(1, 7))
def test_stream_fed_in_memoryview_and_bytearray_chunks(
    case: tuple[int, list[Packet], bytes], step: int
) -> None:
    """feed() accepts bytes | bytearray | memoryview (contract); the caller may reuse buffers."""
    _, packets, data = case
    dec = Decoder()
    out: list[Packet] = []
    scratch = bytearray(step)
    for i in range(0, len(data), step):
        piece = data[i : i + step]
        scratch[: len(piece)] = piece
        view = memoryview(scratch)[: len(piece)]
        dec.feed(view if i % 2 else bytearray(view))
        out.extend(dec.packets())
        scratch[:] = b"\xff" * step  # the decoder must have copied what it needs
    assert out == packets


@st.composite
def _mutated_stream(draw: st.DrawFn) -> tuple[bytes, int]:
    """A valid session (CONNECT, then several packets) with edits anywhere, and a cut."""
    _, _, raw = draw(_stream())
    edited = _mutate(draw, raw, draw(st.integers(1, 4)))
    return edited, draw(st.integers(0, len(edited)))


@STREAM
@given(_mutated_stream())
def test_mutated_valid_streams_raise_only_mqtt_errors(case: tuple[bytes, int]) -> None:
    """Edits anywhere in a whole session, not only in a single packet: an error found
    mid-stream must leave the decoder dead, not confused."""
    data, cut = case
    _check_hostile(Decoder(), data, cut)


def test_golden_stream_split_at_every_point() -> None:
    """All server-bound golden vectors of 5.0 in one stream, split at every byte."""
    vs = [v for v in VECTORS if v.version == 5 and v.side != CLIENT and len(v.data) < 400]
    vs = [v for v in vs if not isinstance(v.packet, Connect)]
    data = bytes.fromhex(CONNECT_HEX[5]) + b"".join(v.data for v in vs)
    expected = [Connect("abc", 5, keepalive=60), *(v.packet for v in vs)]
    for i in range(len(data) + 1):
        assert _decode_stream([data[:i], data[i:]], 5) == expected, f"split at {i}"
