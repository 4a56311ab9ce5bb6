"""Sans-IO MQTT decoder: bytes in, complete packets out.

Usage (one decoder per connection; not thread-safe, call it from the connection's loop)::

    dec = Decoder(max_packet_size=1 << 20)   # server side: version learnt from CONNECT
    dec.feed(data)
    for packet in dec.packets():
        ...

Invariants:

* Incomplete input is never an error: :meth:`Decoder.next_packet` returns ``None`` and
  :meth:`Decoder.packets` returns what is complete so far.
* Malformed input raises an :class:`~broker.mqtt.errors.MQTTError` subclass carrying the
  reason code to answer with. No other exception type escapes, whatever the bytes.
* After an error the decoder is dead: every later call raises the same error again
  (the connection must be closed, [MQTT-4.8.0-1] / s4.13).
* A packet whose total size (fixed header + remaining length) exceeds ``max_packet_size`` is
  rejected with :class:`PacketTooLarge` as soon as its fixed header is complete, before its
  body is buffered (s3.1.2.11.4, [MQTT-3.2.2-15]).
* The server side (``version=None``) requires CONNECT first [MQTT-3.1.0-1]; the CONNECT's
  protocol level becomes :attr:`Decoder.version`.

Buffering: received chunks are kept as a list and only joined once the bytes they hold
complete a fixed header or a whole packet, so a large packet arriving in many small reads is
copied O(1) times, not once per read. A chunk arriving when nothing is left over becomes the
buffer itself. Packets are parsed in place from an immutable ``bytes``
buffer using a read position; consumed bytes are dropped (the "compaction") only when the
next join happens, which costs a copy of the unconsumed tail, at most one partial packet.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, NamedTuple

from broker.mqtt.bodies import BODY_DECODERS, decode_publish_props, short
from broker.mqtt.errors import (
    MalformedPacket,
    MQTTError,
    PacketTooLarge,
    ProtocolError,
)
from broker.mqtt.packets import (
    Packet,
    Publish,
)
from broker.mqtt.properties import (
    MAX_VBI,
)

__all__ = ["DEFAULT_MAX_PACKET_SIZE", "Decoder", "PubAckRun"]

#: The largest remaining length the fixed header can express (s2.2.3).
DEFAULT_MAX_PACKET_SIZE = MAX_VBI

# Required low nibble of the first byte per packet type (s2.2.2, Table 2-2): PUBREL,
# SUBSCRIBE and UNSUBSCRIBE use 0b0010 [MQTT-3.6.1-1] [MQTT-3.8.1-1] [MQTT-3.10.1-1];
# PUBLISH (-1) carries DUP/QoS/RETAIN; type 0 (None) is reserved and always malformed.
_FLAGS: tuple[int | None, ...] = (None, 0, 0, -1, 0, 0, 2, 0, 2, 0, 2, 0, 0, 0, 0, 0)

_EMPTY = b""

#: PUBACKs taken by one :class:`PubAckRun` at most (bounds the bytes one scan looks at).
PUBACK_RUN_MAX = 4096


class PubAckRun(NamedTuple):
    """Consecutive PUBACKs of the 4-byte form (packet id only, reason Success: s3.4.2.1),
    decoded in one step: stands for ``PubAck(packet_id)`` for each id, in order.

    A subscriber acknowledging a window of QoS 1 deliveries sends one read full of them;
    decoding and dispatching each as a packet cost ~25% of a QoS 1 replay (measured).
    Returned only by a decoder made with ``puback_runs=True`` (the server's).
    """

    packet_ids: array[int]


def _puback_run(buf: bytes, pos: int, n: int) -> PubAckRun | None:
    """The 4-byte PUBACKs from ``pos`` on, if at least two: the count of ``0x40 0x02``
    heads in a row (a C scan of every fourth byte) up to the first packet identifier 0,
    which the one-by-one decoder then refuses [MQTT-2.2.1-3]."""
    stop = pos + min(n - pos, 4 * PUBACK_RUN_MAX) // 4 * 4
    chunk = buf[pos:stop]
    firsts = chunk[0::4]
    lengths = chunk[1::4]
    count = min(
        len(firsts) - len(firsts.lstrip(b"\x40")), len(lengths) - len(lengths.lstrip(b"\x02"))
    )
    if count < 2:
        return None
    words = array("H", chunk[: 4 * count])
    if sys.byteorder == "little":
        words.byteswap()  # the packet ids are big-endian (s1.5.2)
    ids = words[1::2]
    if 0 in ids:
        count = ids.index(0)
        if count < 2:
            return None
        ids = ids[:count]
    return PubAckRun(ids)


# Protocol (name, level) pairs a CONNECT may carry (s3.1.2.1-3.1.2.2; 3.1 used "MQIsdp").
class Decoder:
    """Incremental MQTT packet decoder for one connection (see the module docstring).

    ``version=None`` is the server side: the first packet must be CONNECT and sets
    :attr:`version`. A client passes the version it connected with (3, 4 or 5).
    ``max_packet_size`` bounds the total packet size in bytes, fixed header included, as
    MQTT 5's Maximum Packet Size does (s3.1.2.11.4).
    """

    __slots__ = (
        "_buf",
        "_chunks",
        "_error",
        "_pending",
        "_pos",
        "max_packet_size",
        "puback_runs",
        "version",
    )

    def __init__(
        self,
        max_packet_size: int = DEFAULT_MAX_PACKET_SIZE,
        version: int | None = None,
        *,
        puback_runs: bool = False,
    ) -> None:
        if version not in (None, 3, 4, 5):
            raise ValueError(f"unsupported MQTT protocol version {version!r}")
        if max_packet_size < 2:
            raise ValueError("max_packet_size must be at least 2 (the smallest packet)")
        self.max_packet_size = max_packet_size
        self.version: int | None = version
        self._buf: bytes = _EMPTY  # parsed in place from self._pos
        self._pos = 0
        #: Received, not yet joined into _buf; None while there are none (an idle
        #: connection's decoder holds no list).
        self._chunks: list[bytes] | None = None
        self._pending = 0  # total length of _chunks
        self._error: MQTTError | None = None
        #: :meth:`packets` returns consecutive 4-byte PUBACKs as one :class:`PubAckRun`.
        self.puback_runs = puback_runs and max_packet_size >= 4

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as packets."""
        return len(self._buf) - self._pos + self._pending

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Add received bytes. Copies ``bytearray``/``memoryview`` input, not ``bytes``."""
        if self._error is not None:
            raise self._error
        if data:
            chunk = bytes(data)
            if not self._pending and self._pos >= len(self._buf):
                # Nothing left over (a device's read is one whole packet): parse this chunk
                # in place, without the list and the join.
                self._buf = chunk
                self._pos = 0
                return
            if self._chunks is None:
                self._chunks = [chunk]
            else:
                self._chunks.append(chunk)
            self._pending += len(chunk)

    def take(self) -> bytes:
        """Every buffered byte (the start of a packet, after :meth:`packets`), leaving none:
        for a caller that parses them together with what follows (the compiled device path,
        broker.net._devicelane); :meth:`feed` gives them back unchanged."""
        if self._error is not None:
            raise self._error
        rest = self._buf[self._pos :]
        if self._chunks is not None:
            rest = _EMPTY.join([rest, *self._chunks])
        self._buf, self._pos, self._chunks, self._pending = _EMPTY, 0, None, 0
        return rest

    def next_packet(self) -> Packet | None:
        """The next complete packet, or ``None`` if more data is needed."""
        out: list[Packet | PubAckRun] = []
        self._decode(out, 1)
        return out[0] if out else None  # type: ignore[return-value]  # one: no run

    def packets(self) -> list[Packet | PubAckRun]:
        """Every complete packet buffered now, in order (possibly empty); with
        ``puback_runs``, runs of PUBACKs as :class:`PubAckRun` s.

        If a malformed packet follows good ones, the error is raised and the good ones
        decoded in this call are lost with the connection, which is closed anyway.
        """
        out: list[Packet | PubAckRun] = []
        self._decode(out, -1)
        return out

    def _join(self, need: int) -> bool:
        """Make ``_buf[_pos:]`` hold every received byte if that gives at least ``need``."""
        avail = len(self._buf) - self._pos
        if avail + self._pending < need or not self._pending:
            return False
        parts = self._chunks
        assert parts is not None  # _pending > 0
        if avail:
            parts.insert(0, self._buf[self._pos :])
        self._buf = _EMPTY.join(parts)
        self._pos = 0
        self._chunks = None
        self._pending = 0
        return True

    def _decode(self, out: list[Packet | PubAckRun], limit: int) -> None:
        if self._error is not None:
            raise self._error
        try:
            self._decode_loop(out, limit)
        except MQTTError as exc:
            self._error = exc
            raise
        except (LookupError, ValueError, TypeError, ArithmeticError) as exc:
            # Every read is bounds-checked against the packet end, so reaching this is a
            # missed check in the codec. The bytes still came from the peer and the contract
            # is that only MQTTError escapes, so report them as malformed; the original
            # exception stays attached as __cause__ for the log.
            err = MalformedPacket(f"malformed packet ({type(exc).__name__}: {exc})")
            self._error = err
            raise err from exc

    def _decode_loop(self, out: list[Packet | PubAckRun], limit: int) -> None:
        buf = self._buf
        pos = self._pos
        n = len(buf)
        version = self.version
        max_size = self.max_packet_size
        append = out.append
        runs = self.puback_runs and limit < 0
        while limit:
            if n - pos < 5 and self._pending:
                self._pos = pos
                self._join(1)
                buf, pos, n = self._buf, 0, len(self._buf)
            if n - pos < 2:
                break
            # ---- fixed header (s2.1): type/flags byte + remaining length (1-4 bytes)
            first = buf[pos]
            length = buf[pos + 1]
            if length < 0x80:
                body = pos + 2
            else:
                length &= 0x7F
                shift = 7
                body = pos + 2
                while True:
                    if body >= n:
                        body = -1
                        break
                    byte = buf[body]
                    body += 1
                    length |= (byte & 0x7F) << shift
                    if byte < 0x80:
                        break
                    if shift == 21:
                        raise MalformedPacket("remaining length longer than four bytes")
                    shift += 7
                if body < 0:
                    break  # header incomplete; _join already merged everything received
            ptype = first >> 4
            if version is None and ptype != 1:
                raise ProtocolError("the first packet must be CONNECT [MQTT-3.1.0-1]")
            end = body + length
            if end - pos > max_size:
                raise PacketTooLarge(
                    f"packet of {end - pos} bytes exceeds the maximum of {max_size}"
                )
            required = _FLAGS[ptype]
            if required is None or (ptype == 15 and version != 5):
                raise MalformedPacket(f"reserved packet type {ptype}")
            if required >= 0 and first & 0x0F != required:
                raise MalformedPacket(
                    f"packet type {ptype}: reserved fixed-header flags 0x{first & 0x0F:X}"
                )
            if end > n:
                self._pos = pos
                if not self._join(end - pos):
                    break
                body -= pos  # the join moved the unconsumed tail to offset 0
                end -= pos
                buf, pos, n = self._buf, 0, len(self._buf)
            # ---- body
            if ptype == 3:
                # PUBLISH hot path (s3.3), parsed inline.
                qos = (first >> 1) & 0x03
                if qos == 3:
                    raise MalformedPacket("PUBLISH with QoS 3 [MQTT-3.3.1-4]")
                p = body + 2
                if p > end:
                    raise short("PUBLISH")
                stop = p + ((buf[body] << 8) | buf[body + 1])
                if stop > end:
                    raise MalformedPacket("PUBLISH topic runs past the end of the packet")
                try:
                    topic = buf[p:stop].decode("utf-8")
                except UnicodeDecodeError:
                    raise MalformedPacket("PUBLISH topic is not well-formed UTF-8") from None
                if "\x00" in topic:
                    raise MalformedPacket("PUBLISH topic contains U+0000 [MQTT-1.5.4-2]")
                packet_id: int | None
                if qos:
                    if stop + 2 > end:
                        raise short("PUBLISH")
                    packet_id = (buf[stop] << 8) | buf[stop + 1]
                    if not packet_id:
                        raise ProtocolError("PUBLISH: packet identifier 0 [MQTT-2.2.1-3]")
                    stop += 2
                else:
                    if first & 0x08:
                        raise MalformedPacket("PUBLISH QoS 0 with DUP set [MQTT-3.3.1-2]")
                    packet_id = None
                if version == 5:
                    if stop < end and buf[stop] == 0:
                        props: dict[int, Any] = {}
                        stop += 1
                    else:
                        props, stop = decode_publish_props(buf, stop, end)
                else:
                    props = {}
                append(
                    Publish(
                        topic,
                        buf[stop:end],
                        qos,
                        bool(first & 0x01),
                        bool(first & 0x08),
                        packet_id,
                        props,
                    )
                )
            elif (
                first == 0x40
                and length == 2
                and runs
                and version is not None
                and end + 4 <= n
                and buf[end] == 0x40
                and (run := _puback_run(buf, pos, n)) is not None
            ):
                append(run)
                end = pos + 4 * len(run.packet_ids)
            else:
                decoded = BODY_DECODERS[ptype](buf, body, end, version or 4)
                if ptype == 1 and version is None:
                    version = self.version = decoded.protocol_level
                append(decoded)
            pos = end
            limit -= 1
        if pos == n:  # every byte parsed: the read is not kept (an idle connection's 60 bytes)
            self._buf, self._pos = _EMPTY, 0
        else:
            self._pos = pos
