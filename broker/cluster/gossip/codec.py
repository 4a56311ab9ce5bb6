"""The gossip datagram: authenticated, compact, decoded strictly.

Layout (network byte order)::

    magic    4  b"MQGS" (the XDP filter and a stranger's packets are told apart by it)
    version  1  VERSION
    mac     16  HMAC-SHA256(cluster secret, magic + version + body), first 16 bytes
    body:
      epoch  8  the sender's start time (ms since the Unix epoch)    } replay protection,
      seq    4  the sender's datagram counter since that start       } see ReplayWindow
      sender str8 (u8 length + UTF-8, 1-255 bytes)
      kind   1  PING | ACK | PING_REQ | NACK | GOSSIP | SYNC, then its fields:
                PING: probe seq u32, target str8; ACK, NACK: probe seq u32;
                PING_REQ: probe seq u32, target str8, addr; SYNC: reply u8 (0 or 1)
      count  1  piggybacked updates, each:
                state u8, incarnation u32, node str8, origin str8 (empty: the node itself),
                and for ALIVE only the addr and the meta (u8 length + bytes, 0-255)
    addr = u8 4 or 16, the IPv4/IPv6 address, u16 port

A truncated 128-bit HMAC-SHA256 is what RFC 4868 keeps for IPsec (HMAC-SHA-256-128). The MAC
is checked before anything of the body is read: a stranger (no secret) gets no further than
``BadMac``. ``decode`` raises only ``CodecError`` subclasses, each with a ``reason`` the
endpoint counts (``dropped_<reason>``); it never returns a partial packet.

Replay: an attacker on the path can resend a member's datagram. SWIM itself shrugs most of it
off (an old probe's ack names a probe seq that is no longer awaited; an old update loses to the
current incarnation under the precedence rules, since suspicions and deaths only ever lead to
higher incarnations), but a replayed ping or ping-req still makes members send, and an old
ALIVE could undo a death that was not refuted. So each datagram carries its sender's (epoch,
seq) and ``ReplayWindow`` drops one already seen or older than a 64-datagram sliding window
(RFC 4303 s3.4.3's anti-replay window), per sender; a sender's restart gets a newer epoch
(its start time), which resets the window. A receiver that restarts accepts at most one old
datagram per sender before that sender's newer ones move the window past it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import struct
from dataclasses import dataclass, field
from functools import lru_cache

from broker.cluster.gossip.messages import (
    Ack,
    Addr,
    Gossip,
    Message,
    Nack,
    Packet,
    Ping,
    PingReq,
    State,
    Sync,
    Update,
)

__all__ = [
    "BadMac",
    "BadMagic",
    "BadVersion",
    "CodecError",
    "Malformed",
    "ReplayWindow",
    "Replayed",
    "base_size",
    "decode",
    "encode",
    "update_size",
]

MAGIC = b"MQGS"
VERSION = 1
MAC_BYTES = 16
#: magic, version, mac, epoch, seq, the sender's length byte, kind, count.
_FIXED = len(MAGIC) + 1 + MAC_BYTES + 8 + 4 + 1 + 1 + 1
_HEAD = len(MAGIC) + 1 + MAC_BYTES
MAX_UPDATES = 255
REPLAY_WINDOW = 64

_PING, _ACK, _PING_REQ, _NACK, _GOSSIP, _SYNC = range(6)
_U32 = struct.Struct("!I")
_STAMP = struct.Struct("!QI")
_UPDATE = struct.Struct("!BI")
_PORT = struct.Struct("!H")


class CodecError(Exception):
    reason = "malformed"


class BadMagic(CodecError):
    reason = "bad_magic"


class BadVersion(CodecError):
    reason = "bad_version"


class BadMac(CodecError):
    reason = "bad_mac"


class Malformed(CodecError):
    reason = "malformed"


class Replayed(CodecError):
    reason = "replayed"


def _str8(text: str) -> bytes:
    raw = text.encode()
    if not 0 < len(raw) < 256:
        raise ValueError(f"a node id must be 1-255 bytes of UTF-8: {text!r}")
    return bytes((len(raw),)) + raw


@lru_cache(maxsize=1024)
def _addr(addr: Addr) -> bytes:
    packed = ipaddress.ip_address(addr[0]).packed
    return bytes((len(packed),)) + packed + _PORT.pack(addr[1])


def _message(message: Message) -> bytes:
    match message:
        case Ping(seq, target):
            return bytes((_PING,)) + _U32.pack(seq) + _str8(target)
        case Ack(seq):
            return bytes((_ACK,)) + _U32.pack(seq)
        case PingReq(seq, target, target_addr):
            return bytes((_PING_REQ,)) + _U32.pack(seq) + _str8(target) + _addr(target_addr)
        case Nack(seq):
            return bytes((_NACK,)) + _U32.pack(seq)
        case Gossip():
            return bytes((_GOSSIP,))
        case Sync(reply):
            return bytes((_SYNC, int(reply)))
    raise TypeError(f"not a gossip message: {message!r}")


def _update(update: Update) -> bytes:
    origin = b"\x00" if update.origin == update.node else _str8(update.origin)
    out = _UPDATE.pack(update.state, update.incarnation) + _str8(update.node) + origin
    if update.state is State.ALIVE:
        if update.addr is None:
            raise ValueError(f"an ALIVE update needs an address: {update!r}")
        if len(update.meta) > 255:
            raise ValueError(f"meta of {len(update.meta)} bytes (at most 255): {update!r}")
        out += _addr(update.addr) + bytes((len(update.meta),)) + update.meta
    return out


def update_size(update: Update) -> int:
    """Bytes ``update`` takes in a datagram."""
    return len(_update(update))


def base_size(sender: str, message: Message) -> int:
    """Bytes of a datagram from ``sender`` carrying ``message`` and no update."""
    return _FIXED + len(sender.encode()) + len(_message(message)) - 1


def encode(packet: Packet, key: bytes, epoch: int, seq: int) -> bytes:
    """The datagram for ``packet`` (at most 255 updates), authenticated with ``key``."""
    if len(packet.updates) > MAX_UPDATES:
        raise ValueError(f"at most {MAX_UPDATES} updates per datagram")
    body = b"".join(
        (
            _STAMP.pack(epoch, seq),
            _str8(packet.sender),
            _message(packet.message),
            bytes((len(packet.updates),)),
            *map(_update, packet.updates),
        )
    )
    head = MAGIC + bytes((VERSION,))
    return head + hmac.digest(key, head + body, hashlib.sha256)[:MAC_BYTES] + body


@dataclass(frozen=True, slots=True)
class Stamp:
    """The sender's (epoch, seq) of a decoded datagram (for ``ReplayWindow``)."""

    epoch: int
    seq: int


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes, pos: int) -> None:
        self.data = data
        self.pos = pos

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise Malformed(f"truncated at byte {self.pos} (wanted {n} more)")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        value: int = _U32.unpack(self.take(4))[0]
        return value

    def str8(self, empty: str | None = None) -> str:
        n = self.u8()
        if n == 0:
            if empty is None:
                raise Malformed(f"empty node id at byte {self.pos - 1}")
            return empty
        try:
            return self.take(n).decode()
        except UnicodeDecodeError:
            raise Malformed(f"node id not UTF-8 at byte {self.pos - n}") from None

    def addr(self) -> Addr:
        n = self.u8()
        if n not in (4, 16):
            raise Malformed(f"address of {n} bytes (4 or 16)")
        host = str(ipaddress.ip_address(self.take(n)))
        port: int = _PORT.unpack(self.take(2))[0]
        return host, port


def _read_message(r: _Reader) -> Message:
    kind = r.u8()
    if kind == _PING:
        return Ping(r.u32(), r.str8())
    if kind == _ACK:
        return Ack(r.u32())
    if kind == _PING_REQ:
        return PingReq(r.u32(), r.str8(), r.addr())
    if kind == _NACK:
        return Nack(r.u32())
    if kind == _GOSSIP:
        return Gossip()
    if kind == _SYNC:
        reply = r.u8()
        if reply > 1:
            raise Malformed(f"sync reply flag {reply}")
        return Sync(bool(reply))
    raise Malformed(f"unknown message kind {kind}")


def _read_update(r: _Reader) -> Update:
    state_byte, incarnation = _UPDATE.unpack(r.take(_UPDATE.size))
    if state_byte > State.LEFT:
        raise Malformed(f"unknown member state {state_byte}")
    state = State(state_byte)
    node = r.str8()
    origin = r.str8(empty=node)
    if state is not State.ALIVE:
        return Update(state, node, incarnation, origin)
    addr = r.addr()
    return Update(state, node, incarnation, origin, addr, r.take(r.u8()))


def decode(data: bytes, key: bytes) -> tuple[Packet, Stamp]:
    """The packet in ``data`` and its sender's stamp; ``CodecError`` for anything else."""
    if len(data) < _FIXED or data[:4] != MAGIC:
        raise BadMagic("not a gossip datagram (short or wrong magic)")
    if data[4] != VERSION:
        raise BadVersion(f"gossip version {data[4]} (this member speaks {VERSION})")
    mac = hmac.digest(key, data[:5] + data[_HEAD:], hashlib.sha256)[:MAC_BYTES]
    if not hmac.compare_digest(mac, data[5:_HEAD]):
        raise BadMac("bad MAC (another cluster's secret, or altered)")
    r = _Reader(data, _HEAD)
    epoch, seq = _STAMP.unpack(r.take(_STAMP.size))
    sender = r.str8()
    message = _read_message(r)
    updates = tuple(_read_update(r) for _ in range(r.u8()))
    if r.pos != len(data):
        raise Malformed(f"{len(data) - r.pos} bytes after the last update")
    return Packet(sender, message, updates), Stamp(epoch, seq)


@dataclass(slots=True)
class _Window:
    epoch: int
    top: int
    seen: int = 1  # bit i: top - i was seen


@dataclass(slots=True)
class ReplayWindow:
    """Per sender, the datagrams already accepted (the module docstring says why)."""

    _senders: dict[str, _Window] = field(default_factory=dict)

    def check(self, sender: str, stamp: Stamp) -> None:
        """Record ``stamp``, or raise ``Replayed`` if it was seen or is too old."""
        window = self._senders.get(sender)
        if window is None or stamp.epoch > window.epoch:
            self._senders[sender] = _Window(stamp.epoch, stamp.seq)
            return
        if stamp.epoch < window.epoch:
            raise Replayed(f"{sender}: datagram from an earlier start")
        if stamp.seq > window.top:
            shift = stamp.seq - window.top
            window.seen = ((window.seen << shift) | 1) & ((1 << REPLAY_WINDOW) - 1)
            window.top = stamp.seq
            return
        back = window.top - stamp.seq
        if back >= REPLAY_WINDOW or window.seen >> back & 1:
            raise Replayed(f"{sender}: datagram {stamp.seq} already seen or too old")
        window.seen |= 1 << back
