"""The asyncio driver of the SWIM core: one UDP socket (the gossip port), the event loop's
clock, and the codec at the edge.

``GossipEndpoint`` is a ``DatagramProtocol``: each datagram is decoded (``codec.decode``, then
the sender's ``ReplayWindow``) and handed to ``Swim.receive``; one timer handle is kept at the
core's ``deadline`` for ``Swim.tick``. Whatever the codec refuses is dropped and counted under
``counters["dropped_<reason>"]`` (bad_magic, bad_version, bad_mac, malformed, replayed), and
so is an authenticated datagram the driver's ``accept`` refuses (``dropped_stranger``: the
node's allowlist in user space, ``broker.cluster.membership_service``); a
bug while handling a well-formed packet is logged with its traceback and counted as
``errors``, and the endpoint keeps serving. Every member state change is logged (one line)
and passed to ``on_change``. ``prefilter(host, data)``, when given, sees each datagram before
the codec and drops those it refuses (``counters["filtered"]``): the user-space twin of the
XDP program (broker.xdp: member allowlist and magic) where the kernel program cannot run.

Time is ``loop.time()`` in integer ms (monotonic). Runs on one event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, cast

from broker.cluster.gossip.codec import CodecError, ReplayWindow, decode, encode
from broker.cluster.gossip.messages import Addr, Changed, Effect, Packet, Send
from broker.cluster.gossip.options import SwimConfig
from broker.cluster.gossip.swim import Swim

__all__ = ["GossipEndpoint", "open_endpoint"]

log = logging.getLogger("broker.cluster.gossip")


class GossipEndpoint(asyncio.DatagramProtocol):
    def __init__(
        self,
        node_id: str,
        secret: bytes,
        config: SwimConfig | None = None,
        rng: random.Random | None = None,
        on_change: Callable[[Changed], None] | None = None,
        meta: bytes = b"",
        accept: Callable[[Addr, Packet], bool] | None = None,
        prefilter: Callable[[str, bytes], bool] | None = None,
    ) -> None:
        self.node_id = node_id
        self._meta = meta
        self._accept = accept
        self._prefilter = prefilter
        self._secret = secret
        self._config = config
        self._rng = rng or random.Random()
        self._on_change = on_change
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.DatagramTransport | None = None
        self._core: Swim | None = None
        #: The pending tick and when it is due (loop time, s). The time is kept here: uvloop
        #: hands back a plain Handle, without ``when()``, for a time already past.
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0
        self._replay = ReplayWindow()
        #: This run's epoch (its start time): a restart's datagrams are never taken for replays.
        self._epoch = time.time_ns() // 1_000_000
        self._seq = 0
        self._waiters: list[asyncio.Future[None]] = []
        self.counters: Counter[str] = Counter()

    @property
    def core(self) -> Swim:
        if self._core is None:
            raise RuntimeError("the gossip endpoint is not bound yet")
        return self._core

    def _now(self) -> int:
        return int(self._loop.time() * 1000)

    # -- asyncio -----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector loop's datagram transport is not registered as a DatagramTransport.
        self._transport = cast(asyncio.DatagramTransport, transport)
        host, port = self._transport.get_extra_info("sockname")[:2]
        self._core = Swim(
            self.node_id, (host, port), self._rng, self._config, now=self._now(), meta=self._meta
        )
        self._schedule()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if self._prefilter is not None and not self._prefilter(addr[0], data):
            self.counters["filtered"] += 1
            return
        self.counters["received"] += 1
        try:
            packet, stamp = decode(data, self._secret)
            self._replay.check(packet.sender, stamp)
        except CodecError as exc:
            self.counters[f"dropped_{exc.reason}"] += 1
            log.debug("gossip datagram from %s dropped: %s", addr, exc)
            return
        if self._accept is not None and not self._accept((addr[0], addr[1]), packet):
            self.counters["dropped_stranger"] += 1
            return
        try:
            self._apply(self.core.receive((addr[0], addr[1]), packet, self._now()))
        except Exception:
            self.counters["errors"] += 1
            log.exception("gossip: handling %r from %s failed", packet, addr)
        self._wake()

    def error_received(self, exc: Exception) -> None:
        # An ICMP port unreachable from a dead member, for instance: UDP carries on.
        self.counters["socket_errors"] += 1

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None
        self._wake()

    # -- driving the core --------------------------------------------------------------------

    def join(self, seeds: Iterable[Addr]) -> None:
        """Join through ``seeds`` (resolved IP addresses); none for the first member."""
        self._apply(self.core.join(seeds, self._now()))

    def announce(self, meta: bytes) -> None:
        """Announce ``meta`` of this member from now on (``Swim.announce``)."""
        self._apply(self.core.announce(meta, self._now()))

    def probe_soon(self, node: str) -> None:
        """Probe ``node`` next (``Swim.probe_soon``: a hint, e.g. its TCP link closed)."""
        if self._transport is not None:
            self._apply(self.core.probe_soon(node, self._now()))

    async def leave(self, timeout: float) -> None:
        """Say goodbye, wait until it has been gossiped (or ``timeout`` s), then close."""
        self._apply(self.core.leave(self._now()))
        try:
            await self.until(lambda: self.core.left, timeout)
        except TimeoutError:
            log.warning("gossip: left before the goodbye was sent to enough members")
        self.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    async def until(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait until ``predicate()`` holds, checked after every datagram and timer; raises
        ``TimeoutError`` after ``timeout`` seconds."""
        async with asyncio.timeout(timeout):
            while not predicate():
                waiter = self._loop.create_future()
                self._waiters.append(waiter)
                await waiter

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _tick(self) -> None:
        self._timer = None
        try:
            self._apply(self.core.tick(self._now()))
        except Exception:
            self.counters["errors"] += 1
            log.exception("gossip: tick failed")
            self._schedule()
        self._wake()

    def _schedule(self) -> None:
        if self._transport is None:
            return
        when = self.core.deadline / 1000
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._tick)

    def _apply(self, effects: list[Effect]) -> None:
        transport = self._transport
        for effect in effects:
            if isinstance(effect, Send):
                if transport is None:
                    continue
                self._seq = (self._seq + 1) & 0xFFFF_FFFF
                data = encode(effect.packet, self._secret, self._epoch, self._seq)
                transport.sendto(data, effect.addr)
                self.counters["sent"] += 1
            else:
                log.info(
                    "gossip: member %s (%s:%d) %s -> %s, incarnation %d",
                    effect.node,
                    effect.addr[0],
                    effect.addr[1],
                    "new" if effect.previous is None else effect.previous.name.lower(),
                    effect.state.name.lower()
                    if effect.state is not effect.previous
                    else f"{effect.state.name.lower()} (moved or new meta)",
                    effect.incarnation,
                )
                if self._on_change is not None:
                    self._on_change(effect)
        self._schedule()


async def open_endpoint(
    node_id: str,
    bind: Addr,
    secret: bytes,
    config: SwimConfig | None = None,
    rng: random.Random | None = None,
    on_change: Callable[[Changed], None] | None = None,
    meta: bytes = b"",
    accept: Callable[[Addr, Packet], bool] | None = None,
    prefilter: Callable[[str, bytes], bool] | None = None,
) -> GossipEndpoint:
    """A ``GossipEndpoint`` bound to ``bind`` (port 0: any free port; ``core.addr`` says which).
    ``meta``: what this member announces of itself (``Update.meta``); ``accept(addr, packet)``:
    whether an authenticated datagram is let in (None: all are)."""
    loop = asyncio.get_running_loop()
    _, endpoint = await loop.create_datagram_endpoint(
        lambda: GossipEndpoint(node_id, secret, config, rng, on_change, meta, accept, prefilter),
        local_addr=bind,
    )
    return endpoint
