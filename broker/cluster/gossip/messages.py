"""What members exchange (a ``Packet``: one message and the piggybacked ``Update``s) and what the
core hands its driver (``Send``, ``Changed``).

A member is named by its node id (``[cluster] node_id``: stable, unique); its address is the
UDP ``(host, port)`` it gossips on, host an IP address. Updates are SWIM's dissemination
messages (SWIM s4.2): Alive, Suspect and Confirm (here DEAD), plus LEFT (a member that said
goodbye, memberlist's dead-from-itself). Which update wins is decided in ``members``.

Probe messages carry a sequence number chosen by the prober; an Ack or Nack names it:
- ``Ping(seq, target)``: "ack if you are ``target``" (a restarted process on the same address
  under another id must not answer for the old one).
- ``PingReq(seq, target, target_addr)``: "ping ``target`` for me" (SWIM s3.1); the intermediary
  pings with its own seq and relays the ack under ``seq``, or sends ``Nack(seq)`` if none came
  in time (Lifeguard, "Local Health Aware Probe": the prober learns that its intermediaries
  are alive and listening, so a missing nack says that the prober itself is slow).
- ``Gossip()``: updates only.
- ``Sync(reply)``: the sender's whole member table is in the updates (several packets if it
  does not fit one); ``reply`` asks the receiver for its table in return (a join, and
  memberlist's periodic push-pull).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

Addr = tuple[str, int]


class State(enum.IntEnum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


@dataclass(frozen=True, slots=True)
class Update:
    """``node`` is in ``state`` at ``incarnation``. ``addr`` is set for ALIVE (how to reach the
    member), None otherwise; ``origin`` is the member that suspected or declared it dead (for
    ALIVE and LEFT, the member itself): Lifeguard counts independent suspicions by origin.
    ``meta`` (ALIVE only, at most 255 bytes) is what the member says of itself beyond its
    gossip address, opaque here (memberlist's node meta; the node puts its Raft port and
    worker count there, ``broker.cluster.nodemeta``)."""

    state: State
    node: str
    incarnation: int
    origin: str
    addr: Addr | None = None
    meta: bytes = b""


@dataclass(frozen=True, slots=True)
class Ping:
    seq: int
    target: str


@dataclass(frozen=True, slots=True)
class Ack:
    seq: int


@dataclass(frozen=True, slots=True)
class PingReq:
    seq: int
    target: str
    target_addr: Addr


@dataclass(frozen=True, slots=True)
class Nack:
    seq: int


@dataclass(frozen=True, slots=True)
class Gossip:
    pass


@dataclass(frozen=True, slots=True)
class Sync:
    reply: bool


Message = Ping | Ack | PingReq | Nack | Gossip | Sync


@dataclass(frozen=True, slots=True)
class Packet:
    """One datagram's content: ``sender`` is the node id of the member that built it."""

    sender: str
    message: Message
    updates: tuple[Update, ...] = ()


@dataclass(frozen=True, slots=True)
class Send:
    """Put ``packet`` on the wire to ``addr`` (best effort: UDP may lose it)."""

    addr: Addr
    packet: Packet


@dataclass(frozen=True, slots=True)
class Changed:
    """``node`` moved from ``previous`` (None: first heard of) to ``state`` at
    ``incarnation`` (or, ALIVE still, announced another address or ``meta``); the node logs
    one line per change and re-places replicas on deaths."""

    node: str
    addr: Addr
    state: State
    incarnation: int
    previous: State | None
    meta: bytes = b""


Effect = Send | Changed
