"""The binary encoding of a ``Frame`` (``broker.cluster.frames``): what one node's Raft traffic to
another looks like on the wire.

Fixed-width big-endian fields packed with ``struct``; no pickle, no JSON. ``u32`` ids (node
and group ids are ``0 <= id < 2**32``), ``u64`` terms and indexes (the core's are
``< 2**63``: a set top bit is refused both ways), ``u8`` booleans (0 or 1, nothing else).
Layout, in order (sizes in bytes)::

    frame      version u8 (=2) | frm u32 | to u32 | beats u32 | acks u32 | notices u32
               | messages u32                                                           25
               then the beats, the acks, the notices, the messages; nothing after them
    beat       group u32 | term u64 | commit u64 | prev_index u64 | prev_term u64
               | quiesce u8                                                             37
    ack        group u32 | term u64 | match u64 | flushed u64                              28
    notice     group u32 | term u64 | commit u64                                           20
    message    group u32 | type u8 | body
      1 PreVote        frm u32 | to u32 | term u64 | last_index u64 | last_term u64        32
      2 PreVoteResp    frm u32 | to u32 | term u64 | granted u8                            17
      3 Vote           frm u32 | to u32 | term u64 | last_index u64 | last_term u64
                       | transfer u8                                                    33
      4 VoteResp       frm u32 | to u32 | term u64 | granted u8                            17
      5 AppendEntries  frm u32 | to u32 | term u64 | prev_index u64 | prev_term u64
                       | commit u64 | entries u32                                       44
                       then per entry: term u64 | kind u8 | count u32 | length u32     17
                       | payload (length bytes)
      6 AppendResp     frm u32 | to u32 | term u64 | success u8 | match_index u64
                       | flushed_index u64 | hint_index u64 | hint_term u64             49
                       (hint_term None is 2**64 - 1)
      7 TimeoutNow     frm u32 | to u32 | term u64                                         16
      8 InstallSnapshot frm u32 | to u32 | term u64 | last_index u64 | last_term u64
                       | length u32 | configuration (length bytes,
                       ``membership.Configuration.encode``)                             36

An entry's ``kind`` is an ``EntryKind`` value and its ``count`` is at least 1. The encoding is
canonical: ``decode_frame`` accepts exactly what ``encode_frame`` can produce (a test holds it),
so the receiver refuses a frame the sender could not have built. Every count is checked against
the bytes that remain before anything is allocated for it, so a short or hostile input costs at
most its own size. Errors either way are ``WireError``, naming what is wrong and where.
Version 2 added the notices (``broker.cluster.commits``); a node refuses a frame of another
version, so every node of a cluster runs the same one.

An entry's payload is copied once on decode (``bytes`` of a slice of the input's view); a
decoded frame holds no reference to the input buffer, which the caller may reuse at once.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from itertools import repeat, starmap
from typing import Any, TypeVar

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

VERSION = 2
#: ``hint_term`` None on the wire (a term is < 2**63, so this is no term).
NO_TERM = 2**64 - 1
ID_LIMIT = 2**32
TERM_LIMIT = 2**63

_FRAME = struct.Struct(">BIIIIII")
_BEAT = struct.Struct(">IQQQQ?")
_ACK = struct.Struct(">IQQQ")
_NOTICE = struct.Struct(">IQQ")
_MSG = struct.Struct(">IB")
_PREVOTE = struct.Struct(">IIQQQ")
_GRANT = struct.Struct(">IIQB")  # PreVoteResp and VoteResp
_VOTE = struct.Struct(">IIQQQB")
_APPEND = struct.Struct(">IIQQQQI")
_ENTRY = struct.Struct(">QBII")
_RESP = struct.Struct(">IIQBQQQQ")
_TIMEOUT = struct.Struct(">IIQ")
_SNAPSHOT = struct.Struct(">IIQQQI")

#: Offsets of the u64 fields inside a beat and an ack (their top bit must be clear).
_BEAT_U64 = (4, 12, 20, 28)
_ACK_U64 = (4, 12, 20)
_NOTICE_U64 = (4, 12)
_BEAT_QUIESCE = 36
#: A byte string holding only 0 and 1 translates to nothing with this deletion set.
_BOOLS = b"\x00\x01"
#: The smallest encoded message (TimeoutNow), to bound the message count.
_MIN_MESSAGE = _MSG.size + _TIMEOUT.size
_KINDS = tuple(EntryKind)


class WireError(ValueError):
    """A frame that cannot be encoded (a field out of range, an unknown message type) or
    decoded (truncated, malformed, an unknown type or version)."""


# --- encoding ------------------------------------------------------------------------------


def encode_frame(frame: Frame) -> bytes:
    """The bytes of ``frame`` (layout in the module docstring); ``WireError`` naming the field
    if one is out of range or of the wrong type."""
    try:
        parts = [
            _FRAME.pack(
                VERSION, frame.frm, frame.to, len(frame.beats), len(frame.acks),
                len(frame.notices), len(frame.messages),
            ),
            b"".join(starmap(_BEAT.pack, frame.beats)),
            b"".join(starmap(_ACK.pack, frame.acks)),
            b"".join(starmap(_NOTICE.pack, frame.notices)),
        ]  # fmt: skip
        for group, m in frame.messages:
            encoder = _ENCODERS.get(type(m))
            if encoder is None:
                raise WireError(f"cannot encode a {type(m).__name__} (group {group})")
            parts.append(_MSG.pack(group, encoder[0]))
            encoder[1](m, parts)
    except (struct.error, TypeError, KeyError) as e:
        raise _explain(frame) from e
    if (
        _top_bit_set(parts[1], _BEAT.size, _BEAT_U64)
        or _top_bit_set(parts[2], _ACK.size, _ACK_U64)
        or _top_bit_set(parts[3], _NOTICE.size, _NOTICE_U64)
    ):
        raise _explain(frame)
    return b"".join(parts)


def _u63(*values: int) -> None:
    """Refuse a term or index with its top bit set (``_explain`` says which)."""
    if max(values) >= TERM_LIMIT:
        raise struct.error("u63 out of range")


def _enc_prevote(m: PreVote, parts: list[bytes]) -> None:
    _u63(m.term, m.last_index, m.last_term)
    parts.append(_PREVOTE.pack(m.frm, m.to, m.term, m.last_index, m.last_term))


def _enc_grant(m: PreVoteResp | VoteResp, parts: list[bytes]) -> None:
    _u63(m.term)
    parts.append(_GRANT.pack(m.frm, m.to, m.term, _BOOL[m.granted]))


def _enc_vote(m: Vote, parts: list[bytes]) -> None:
    _u63(m.term, m.last_index, m.last_term)
    parts.append(_VOTE.pack(m.frm, m.to, m.term, m.last_index, m.last_term, _BOOL[m.transfer]))


def _enc_append(m: AppendEntries, parts: list[bytes]) -> None:
    _u63(m.term, m.prev_index, m.prev_term, m.commit)
    parts.append(
        _APPEND.pack(m.frm, m.to, m.term, m.prev_index, m.prev_term, m.commit, len(m.entries))
    )
    for e in m.entries:
        _u63(e.term)
        if e.count < 1:
            raise struct.error("count out of range")
        parts.append(_ENTRY.pack(e.term, e.kind, e.count, len(e.payload)))
        parts.append(e.payload)


def _enc_resp(m: AppendResp, parts: list[bytes]) -> None:
    hint_term = NO_TERM if m.hint_term is None else m.hint_term
    _u63(m.term, m.match_index, m.flushed_index, m.hint_index, m.hint_term or 0)
    parts.append(
        _RESP.pack(
            m.frm, m.to, m.term, _BOOL[m.success], m.match_index, m.flushed_index,
            m.hint_index, hint_term,
        )
    )  # fmt: skip


def _enc_timeout(m: TimeoutNow, parts: list[bytes]) -> None:
    _u63(m.term)
    parts.append(_TIMEOUT.pack(m.frm, m.to, m.term))


def _enc_snapshot(m: InstallSnapshot, parts: list[bytes]) -> None:
    _u63(m.term, m.last_index, m.last_term)
    conf = m.configuration.encode()
    parts.append(_SNAPSHOT.pack(m.frm, m.to, m.term, m.last_index, m.last_term, len(conf)))
    parts.append(conf)


#: A bool's byte (a KeyError for anything else, which ``_explain`` then names).
_BOOL = {False: 0, True: 1}

#: Per message type: its code on the wire and the function appending its body to ``parts``.
_ENCODERS: dict[type, tuple[int, Callable[[Any, list[bytes]], None]]] = {
    PreVote: (1, _enc_prevote),
    PreVoteResp: (2, _enc_grant),
    Vote: (3, _enc_vote),
    VoteResp: (4, _enc_grant),
    AppendEntries: (5, _enc_append),
    AppendResp: (6, _enc_resp),
    TimeoutNow: (7, _enc_timeout),
    InstallSnapshot: (8, _enc_snapshot),
}

#: Per message type, its id fields, its term/index fields and its boolean fields, for
#: ``_explain`` (the slow path that names what the fast path refused).
_FIELDS: dict[type, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    PreVote: (("frm", "to"), ("term", "last_index", "last_term"), ()),
    PreVoteResp: (("frm", "to"), ("term",), ("granted",)),
    Vote: (("frm", "to"), ("term", "last_index", "last_term"), ("transfer",)),
    VoteResp: (("frm", "to"), ("term",), ("granted",)),
    AppendEntries: (("frm", "to"), ("term", "prev_index", "prev_term", "commit"), ()),
    AppendResp: (
        ("frm", "to"),
        ("term", "match_index", "flushed_index", "hint_index"),
        ("success",),
    ),
    TimeoutNow: (("frm", "to"), ("term",), ()),
    InstallSnapshot: (("frm", "to"), ("term", "last_index", "last_term"), ()),
}


def _explain(frame: Frame) -> WireError:
    """The error naming the first field of ``frame`` that cannot be encoded."""

    def check(where: str, ids: dict[str, object], u63: dict[str, object]) -> None:
        for name, v in ids.items():
            if type(v) is not int or not 0 <= v < ID_LIMIT:
                raise WireError(f"{where}: {name} {v!r} is not an id in [0, 2**32)")
        for name, v in u63.items():
            if type(v) is not int or not 0 <= v < TERM_LIMIT:
                raise WireError(f"{where}: {name} {v!r} is not a term or index in [0, 2**63)")

    check("frame", {"frm": frame.frm, "to": frame.to}, {})
    for i, b in enumerate(frame.beats):
        check(f"beat {i}", {"group": b.group}, b._asdict() | {"group": 0, "quiesce": 0})
        if type(b.quiesce) is not bool:
            raise WireError(f"beat {i}: quiesce {b.quiesce!r} is not a bool")
    for i, a in enumerate(frame.acks):
        check(f"ack {i}", {"group": a.group}, a._asdict() | {"group": 0})
    for i, notice in enumerate(frame.notices):
        check(f"notice {i}", {"group": notice.group}, notice._asdict() | {"group": 0})
    for i, (group, m) in enumerate(frame.messages):
        where = f"message {i} ({type(m).__name__}, group {group!r})"
        check(where, {"group": group}, {})
        if type(m) not in _FIELDS:
            raise WireError(f"{where}: cannot encode a {type(m).__name__}")
        ids, u63, bools = _FIELDS[type(m)]
        check(where, {n: getattr(m, n) for n in ids}, {n: getattr(m, n) for n in u63})
        for n in bools:
            if type(getattr(m, n)) is not bool:
                raise WireError(f"{where}: {n} {getattr(m, n)!r} is not a bool")
        if isinstance(m, AppendResp) and m.hint_term is not None:
            check(where, {}, {"hint_term": m.hint_term})
        if isinstance(m, AppendEntries):
            for j, e in enumerate(m.entries):
                check(f"{where} entry {j}", {}, {"term": e.term})
                if type(e.count) is not int or not 1 <= e.count < ID_LIMIT:
                    raise WireError(f"{where} entry {j}: count {e.count!r} not in [1, 2**32)")
                if e.kind not in _KINDS:
                    raise WireError(f"{where} entry {j}: kind {e.kind!r} is not an EntryKind")
                if not isinstance(e.payload, bytes | bytearray | memoryview):
                    raise WireError(f"{where} entry {j}: payload is a {type(e.payload).__name__}")
        if isinstance(m, InstallSnapshot):
            for n, v in (("voter", m.configuration.voters), ("learner", m.configuration.learners)):
                check(where, {f"{n} {x!r}": x for x in v}, {})
    return WireError("frame cannot be encoded (a field is out of range or of the wrong type)")


def _top_bit_set(records: bytes | memoryview, size: int, offsets: tuple[int, ...]) -> bool:
    """True if a u64 at one of ``offsets`` of any ``size``-byte record has its top bit set."""
    if not records:
        return False
    view = memoryview(records)
    return not all(view[o::size].tobytes().isascii() for o in offsets)


# --- decoding ------------------------------------------------------------------------------


def decode_frame(data: bytes | bytearray | memoryview) -> Frame:
    """The frame ``data`` holds, whole (nothing may follow it); ``WireError`` saying what is
    wrong and at which byte otherwise."""
    view = memoryview(data)
    if not view.c_contiguous:
        raise WireError("frame buffer is not contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    end = len(view)
    if end < _FRAME.size:
        raise WireError(f"frame of {end} bytes: shorter than its {_FRAME.size}-byte header")
    version, frm, to, n_beats, n_acks, n_notices, n_messages = _FRAME.unpack_from(view)
    if version != VERSION:
        raise WireError(f"frame version {version}, expected {VERSION}")
    o = _FRAME.size
    beats = _records(view, o, n_beats, "beat", _BEAT, Beat, _BEAT_U64)
    quiesce = view[o + _BEAT_QUIESCE : o + n_beats * _BEAT.size : _BEAT.size]
    if quiesce.tobytes().translate(None, _BOOLS):
        raise WireError("a beat's quiesce flag is neither 0 nor 1")
    o += n_beats * _BEAT.size
    acks = _records(view, o, n_acks, "ack", _ACK, Ack, _ACK_U64)
    o += n_acks * _ACK.size
    notices = _records(view, o, n_notices, "notice", _NOTICE, Notice, _NOTICE_U64)
    o += n_notices * _NOTICE.size
    if n_messages * _MIN_MESSAGE > end - o:
        raise WireError(f"{n_messages} messages cannot fit in the {end - o} bytes left at {o}")
    messages: list[tuple[int, Message]] = []
    for i in range(n_messages):
        if end - o < _MSG.size:
            raise WireError(f"message {i} at byte {o}: truncated header")
        group, code = _MSG.unpack_from(view, o)
        decode = _DECODERS.get(code)
        if decode is None:
            raise WireError(f"message {i} at byte {o}: unknown type {code}")
        try:
            m, o = decode(view, o + _MSG.size, end)
        except WireError as e:
            raise WireError(f"message {i} (group {group}) at byte {o}: {e}") from None
        messages.append((group, m))
    if o != end:
        raise WireError(f"{end - o} bytes after the frame's last message")
    return Frame(frm, to, beats, acks, messages, notices)


_T = TypeVar("_T", Beat, Ack, Notice)


def _records(
    view: memoryview,
    o: int,
    n: int,
    what: str,
    s: struct.Struct,
    cls: type[_T],
    u64: tuple[int, ...],
) -> list[_T]:
    size = n * s.size
    if size > len(view) - o:
        raise WireError(f"{n} {what}s need {size} bytes, {len(view) - o} left at byte {o}")
    region = view[o : o + size]
    if _top_bit_set(region, s.size, u64):
        raise WireError(f"a {what}'s term or index is >= 2**63")
    return list(map(tuple.__new__, repeat(cls), s.iter_unpack(region)))


def _need(view: memoryview, o: int, end: int, s: struct.Struct, what: str) -> tuple[int, ...]:
    if end - o < s.size:
        raise WireError(f"{what} truncated: {end - o} of {s.size} bytes")
    return s.unpack_from(view, o)


def _check_u63(*values: int) -> None:
    if max(values) >= TERM_LIMIT:
        raise WireError("a term or index is >= 2**63")


def _flag(b: int, name: str) -> bool:
    if b > 1:
        raise WireError(f"{name} is {b}, neither 0 nor 1")
    return b == 1


_Decoded = tuple[Message, int]


def _dec_prevote(view: memoryview, o: int, end: int) -> _Decoded:
    frm, to, term, last_index, last_term = _need(view, o, end, _PREVOTE, "PreVote")
    _check_u63(term, last_index, last_term)
    return PreVote(frm, to, term, last_index, last_term), o + _PREVOTE.size


def _dec_prevote_resp(view: memoryview, o: int, end: int) -> _Decoded:
    frm, to, term, granted = _need(view, o, end, _GRANT, "PreVoteResp")
    _check_u63(term)
    return PreVoteResp(frm, to, term, _flag(granted, "granted")), o + _GRANT.size


def _dec_vote(view: memoryview, o: int, end: int) -> _Decoded:
    frm, to, term, last_index, last_term, transfer = _need(view, o, end, _VOTE, "Vote")
    _check_u63(term, last_index, last_term)
    m = Vote(frm, to, term, last_index, last_term, _flag(transfer, "transfer"))
    return m, o + _VOTE.size


def _dec_vote_resp(view: memoryview, o: int, end: int) -> _Decoded:
    frm, to, term, granted = _need(view, o, end, _GRANT, "VoteResp")
    _check_u63(term)
    return VoteResp(frm, to, term, _flag(granted, "granted")), o + _GRANT.size


def _dec_append(view: memoryview, o: int, end: int) -> _Decoded:
    frm, to, term, prev_index, prev_term, commit, n = _need(view, o, end, _APPEND, "AppendEntries")
    _check_u63(term, prev_index, prev_term, commit)
    o += _APPEND.size
    if n * _ENTRY.size > end - o:
        raise WireError(f"{n} entries cannot fit in the {end - o} bytes left")
    entries = []
    for j in range(n):
        if end - o < _ENTRY.size:
            raise WireError(f"entry {j}: truncated header")
        e_term, kind, count, length = _ENTRY.unpack_from(view, o)
        o += _ENTRY.size
        if length > end - o:
            raise WireError(f"entry {j}: payload of {length} bytes, {end - o} left")
        if e_term >= TERM_LIMIT or kind >= len(_KINDS) or count < 1:
            raise WireError(f"entry {j}: term {e_term}, kind {kind}, count {count}")
        entries.append(Entry(e_term, bytes(view[o : o + length]), _KINDS[kind], count))
        o += length
    return AppendEntries(frm, to, term, prev_index, prev_term, tuple(entries), commit), o


def _dec_resp(view: memoryview, o: int, end: int) -> _Decoded:
    frm, to, term, success, match, flushed, hint_index, hint_term = _need(
        view, o, end, _RESP, "AppendResp"
    )
    _check_u63(term, match, flushed, hint_index)
    if hint_term >= TERM_LIMIT and hint_term != NO_TERM:
        raise WireError(f"hint_term {hint_term} is >= 2**63 and not None's {NO_TERM}")
    m = AppendResp(
        frm, to, term, _flag(success, "success"), match, flushed, hint_index,
        None if hint_term == NO_TERM else hint_term,
    )  # fmt: skip
    return m, o + _RESP.size


def _dec_timeout(view: memoryview, o: int, end: int) -> _Decoded:
    frm, to, term = _need(view, o, end, _TIMEOUT, "TimeoutNow")
    _check_u63(term)
    return TimeoutNow(frm, to, term), o + _TIMEOUT.size


def _dec_snapshot(view: memoryview, o: int, end: int) -> _Decoded:
    frm, to, term, last_index, last_term, length = _need(view, o, end, _SNAPSHOT, "InstallSnapshot")
    _check_u63(term, last_index, last_term)
    o += _SNAPSHOT.size
    if length > end - o:
        raise WireError(f"configuration of {length} bytes, {end - o} left")
    encoded = bytes(view[o : o + length])
    try:
        conf = Configuration.decode(encoded)
    except ValueError as e:
        raise WireError(str(e)) from None
    if conf.encode() != encoded:  # ids out of order or repeated: not what encode writes
        raise WireError("configuration ids are not ascending and distinct")
    return InstallSnapshot(frm, to, term, last_index, last_term, conf), o + length


_DECODERS: dict[int, Callable[[memoryview, int, int], _Decoded]] = {
    1: _dec_prevote,
    2: _dec_prevote_resp,
    3: _dec_vote,
    4: _dec_vote_resp,
    5: _dec_append,
    6: _dec_resp,
    7: _dec_timeout,
    8: _dec_snapshot,
}
