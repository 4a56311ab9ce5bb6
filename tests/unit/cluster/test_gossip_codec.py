"""The gossip datagram: round trips, a stranger's and a mangled datagram refused with the right
reason, random bytes never raising anything but ``CodecError``, the replay window, and the size
budget kept by the core."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.cluster.gossip.codec import (
    MAGIC,
    BadMac,
    BadMagic,
    BadVersion,
    CodecError,
    Malformed,
    Replayed,
    ReplayWindow,
    Stamp,
    decode,
    encode,
    update_size,
)
from broker.cluster.gossip.messages import (
    Ack,
    Gossip,
    Nack,
    Packet,
    Ping,
    PingReq,
    Send,
    State,
    Sync,
    Update,
)
from broker.cluster.gossip.options import SwimConfig
from broker.cluster.gossip.swim import Swim

KEY = b"0123456789abcdef-cluster-secret"
UPDATES = (
    Update(State.ALIVE, "n1", 3, "n1", ("10.0.0.1", 7946)),
    Update(State.ALIVE, "n-ü", 0, "n-ü", ("fd00::2", 65535)),
    Update(State.SUSPECT, "n2", 7, "n1"),
    Update(State.DEAD, "n3", 2**32 - 1, "n4"),
    Update(State.LEFT, "n5", 1, "n5"),
    Update(State.ALIVE, "n6", 1, "n6", ("10.0.0.6", 7946), b'{"raft":7950,"workers":2}'),
    Update(State.ALIVE, "n7", 2, "n7", ("10.0.0.7", 7946), bytes(range(255))),
)
MESSAGES = [
    Ping(1, "n2"),
    Ack(2**32 - 1),
    PingReq(5, "n3", ("::1", 1)),
    Nack(6),
    Gossip(),
    Sync(True),
    Sync(False),
]


@pytest.mark.parametrize("message", MESSAGES)
def test_round_trip(message: object) -> None:
    packet = Packet("n0", message, UPDATES)  # type: ignore[arg-type]
    data = encode(packet, KEY, epoch=1_700_000_000_000, seq=42)
    assert data[:4] == MAGIC
    assert decode(data, KEY) == (packet, Stamp(1_700_000_000_000, 42))


def remac(data: bytes) -> bytes:
    """``data`` with a correct MAC again (to reach the parser with a bad body)."""
    mac = hmac.digest(KEY, data[:5] + data[21:], hashlib.sha256)[:16]
    return data[:5] + mac + data[21:]


def test_refusals_carry_their_reason() -> None:
    good = encode(Packet("n0", Ping(1, "n1"), UPDATES), KEY, 1, 1)
    cases: list[tuple[bytes, type[CodecError], str]] = [
        (b"", BadMagic, "bad_magic"),
        (b"GET / HTTP/1.1\r\n\r\n" + bytes(40), BadMagic, "bad_magic"),
        (good[:20], BadMagic, "bad_magic"),
        (good[:4] + b"\x02" + good[5:], BadVersion, "bad_version"),
        (encode(Packet("n0", Gossip()), b"another cluster's secret", 1, 1), BadMac, "bad_mac"),
        (good[:-1] + bytes((good[-1] ^ 1,)), BadMac, "bad_mac"),
        (remac(good + b"\x00"), Malformed, "malformed"),
        (remac(good[:-3]), Malformed, "malformed"),
    ]
    for data, error, reason in cases:
        with pytest.raises(error) as caught:
            decode(data, KEY)
        assert caught.value.reason == reason


def test_an_unknown_state_or_kind_is_malformed() -> None:
    good = encode(Packet("n0", Gossip(), UPDATES[2:3]), KEY, 1, 1)
    at = good.index(b"\x01\x00\x00\x00\x07")  # SUSPECT, incarnation 7
    with pytest.raises(Malformed, match="state 9"):
        decode(remac(good[:at] + b"\x09" + good[at + 1 :]), KEY)
    kind_at = 21 + 12 + 3
    with pytest.raises(Malformed, match="kind 200"):
        decode(remac(good[:kind_at] + b"\xc8" + good[kind_at + 1 :]), KEY)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_codec_errors(data: bytes) -> None:
    for candidate in (data, MAGIC + b"\x01" + data, remac(MAGIC + b"\x01" + bytes(16) + data)):
        with contextlib.suppress(CodecError):
            decode(candidate, KEY)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(MESSAGES), st.integers(0, 200), st.binary(min_size=1, max_size=4))
def test_mangled_bodies_with_a_valid_mac_raise_only_codec_errors(
    message: object, at: int, junk: bytes
) -> None:
    good = encode(Packet("n0", message, UPDATES), KEY, 9, 9)  # type: ignore[arg-type]
    at = 21 + at % (len(good) - 21)
    for body in (good[:at] + junk + good[at + len(junk) :], good[:at], good[:at] + junk):
        with contextlib.suppress(CodecError):
            decode(remac(body), KEY)


def test_the_replay_window() -> None:
    window = ReplayWindow()
    window.check("n1", Stamp(5, 100))
    with pytest.raises(Replayed):
        window.check("n1", Stamp(5, 100))  # the same datagram again
    window.check("n1", Stamp(5, 98))  # reordered, not seen yet: fine
    with pytest.raises(Replayed):
        window.check("n1", Stamp(5, 98))
    window.check("n1", Stamp(5, 200))
    with pytest.raises(Replayed):
        window.check("n1", Stamp(5, 136))  # 64 behind the newest: too old to tell
    window.check("n1", Stamp(5, 137))
    with pytest.raises(Replayed):
        window.check("n1", Stamp(4, 1000))  # an earlier run of n1
    window.check("n1", Stamp(6, 0))  # n1 restarted
    window.check("n2", Stamp(1, 0))  # senders are independent


def test_every_packet_the_core_builds_fits_the_datagram_budget() -> None:
    """200 members with long ids: Sync spreads the table over several datagrams, piggybacked
    updates stop at the budget, and nothing is lost doing so."""
    config = SwimConfig()
    swim = Swim("a" * 60 + "0", ("10.0.0.1", 7946), random.Random(3), config, now=0)
    updates = [
        Update(State.ALIVE, "a" * 60 + str(i), i, "a" * 60 + str(i), ("fd00::" + hex(i)[2:], i))
        for i in range(1, 200)
    ]
    effects = swim.receive(("10.0.0.2", 7946), Packet("x", Sync(True), tuple(updates)), 0)
    sizes, learned = [], set()
    for _ in range(30):
        for effect in effects:
            if isinstance(effect, Send):
                data = encode(effect.packet, KEY, 1, 1)
                sizes.append(len(data))
                if isinstance(effect.packet.message, Sync):
                    learned |= {u.node for u in effect.packet.updates}
        effects = swim.tick(swim.deadline)
    assert max(sizes) <= config.max_datagram
    assert max(sizes) > config.max_datagram - 200  # and the budget is used, not wasted
    assert len(learned) == 200


def test_meta_rides_on_alive_only_and_at_most_255_bytes() -> None:
    with pytest.raises(ValueError, match="at most 255"):
        encode(
            Packet("n0", Gossip(), (Update(State.ALIVE, "n1", 0, "n1", ("::1", 1), bytes(256)),)),
            KEY,
            1,
            1,
        )
    meta = Update(State.ALIVE, "n1", 0, "n1", ("10.0.0.1", 7946), b"m" * 10)
    bare = Update(State.ALIVE, "n1", 0, "n1", ("10.0.0.1", 7946))
    assert update_size(meta) == update_size(bare) + 10
    # A truncated meta is malformed, not a shorter one.
    good = encode(Packet("n0", Gossip(), (meta,)), KEY, 1, 1)
    with pytest.raises(Malformed):
        decode(remac(good[:-1]), KEY)
