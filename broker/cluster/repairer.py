"""The repair of corrupt batches on the node's event loop (the protocol and its rules:
:mod:`broker.cluster.repair`).

:class:`Repairer` listens to the commit log's damage reports (any thread: the scrubber's too,
handed over to the loop), runs one task per damaged range of a group hosted here (ask a peer,
check, rewrite, or try again later), answers the peers' requests, and counts what it
repaired. Called on the node's event loop only, but for the report listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from broker.cluster.multiraft import MultiRaft
from broker.cluster.repair import (
    ANSWER,
    ANSWER_HEAD,
    ASK,
    ASK_BODY,
    MAX_ANSWER_BYTES,
    OK,
    STATUS,
    TIMEOUT,
    UNAVAILABLE,
    UNREACHABLE,
    answer,
    check_answer,
    describe,
    split_batches,
)
from broker.cluster.storage import GroupStorage
from broker.commitlog import LogClosed, LogIOError, RewriteRefused, integrity
from broker.commitlog.batch import read_header
from broker.commitlog.integrity import DamagedRange

logger = logging.getLogger("broker.cluster")

#: Seconds an asker waits for an answer before it asks the next peer.
ANSWER_TIMEOUT = 5.0
#: Seconds before a range no peer could help with is tried again; doubled each time up to
#: :data:`MAX_RETRY_SECONDS`.
FIRST_RETRY_SECONDS = 0.5
MAX_RETRY_SECONDS = 30.0


class RepairHost(Protocol):
    """What the repair needs of its node (``broker.cluster.node.ClusterNode``)."""

    id: int
    loop: asyncio.AbstractEventLoop
    host: MultiRaft | None
    storages: dict[int, GroupStorage]
    group_keys: dict[int, tuple[str, int]]
    names: dict[int, str]
    handlers: dict[int, Callable[[int, memoryview], None]]

    def leader(self, group: int) -> int | None: ...

    def send(self, node: int, kind: int, payload: bytes) -> bool: ...


@dataclass(slots=True)
class RepairStats:
    """Counters since the node started."""

    #: Damaged ranges taken on, and those repaired or given up.
    started: int = 0
    repaired: int = 0
    given_up: int = 0
    #: Requests sent to peers, and requests answered for peers.
    asked: int = 0
    answered: int = 0


class Repairer:
    """The repair of every damaged range of the groups ``node`` hosts; see the module doc."""

    def __init__(self, node: RepairHost) -> None:
        self.node = node
        self.loop = node.loop
        self.stats = RepairStats()
        #: Batches rewritten per (stream, partition).
        self.repaired: dict[tuple[str, int], int] = {}
        #: Called with a group after a range of its log was rewritten: its readers go on (the
        #: node's driver sets it to what a commit does, which wakes them).
        self.on_repaired: Callable[[int], None] = lambda g: None
        self._jobs: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._waiting: dict[int, tuple[int, asyncio.Future[tuple[int, list[bytes]]]]] = {}
        self._next_request = 1
        self._closed = False
        node.handlers[ASK] = self._on_ask
        node.handlers[ANSWER] = self._on_answer
        integrity.add_listener(self._on_report)

    # -- damage found ------------------------------------------------------------------------

    def _on_report(self, damage: DamagedRange) -> None:
        """The integrity listener (any thread): hand the range to the loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the node is gone
            self.loop.call_soon_threadsafe(self.add, damage)

    def add(self, damage: DamagedRange) -> None:
        """Repair ``damage`` if it is a range of a group's log here (once per range)."""
        key = (os.fspath(damage.path), damage.position)
        if self._closed or key in self._jobs:
            return
        group = self._group_of(damage)
        if group is None:
            return
        self.stats.started += 1
        task = self.loop.create_task(self._repair(group, damage))
        self._jobs[key] = task
        task.add_done_callback(lambda _t: self._jobs.pop(key, None))

    def _group_of(self, damage: DamagedRange) -> int | None:
        for g, (stream, partition) in self.node.group_keys.items():
            if stream == damage.stream and str(partition) == damage.partition:
                return g
        return None

    async def _repair(self, group: int, damage: DamagedRange) -> None:
        delay = FIRST_RETRY_SECONDS
        try:
            while not await self._attempt(group, damage):
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_RETRY_SECONDS)
        except Exception:  # a bug must not go unnoticed, nor stop the other repairs
            logger.exception("repair of %s failed", describe(damage))

    async def _attempt(self, group: int, damage: DamagedRange) -> bool:
        """One try; True when the range is repaired or cannot be, False to try again later."""
        storage = self.node.storages.get(group)
        host = self.node.host
        if storage is None or host is None:
            return False  # not hosted yet (start-up)
        if storage.log.directory != damage.path.parent:
            return True  # another node's log (nodes sharing a process: tests)
        try:
            bounds = storage.log.damaged_offsets(damage)
        except LogClosed:
            return True
        if bounds is None:
            if damage.end <= damage.position and damage.first_offset >= 0:
                self.stats.given_up += 1
                logger.error(
                    "%s: not repaired: the segment file was cut short, there are no bytes to "
                    "rewrite in place",
                    describe(damage),
                )
            else:
                logger.info("%s: nothing to repair (its segment is gone)", describe(damage))
            return True
        first, last = bounds
        if last + 1 > storage.commit:
            return False  # above the commit index: Raft's until committed (module doc)
        tried: list[str] = []
        misfits: list[str] = []
        for peer in self._peers(group, host):
            name = self.node.names.get(peer, str(peer))
            status, batches = await self._ask(peer, group, first, last)
            if status != OK:
                tried.append(f"{name} {STATUS.get(status, f'answered {status}')}")
                continue
            try:
                check_answer(storage, damage, first, last, batches)
                written = storage.log.rewrite(damage, batches)
            except RewriteRefused as exc:
                misfits.append(f"{name}: {exc}")
                continue
            except LogClosed:
                return True
            except LogIOError as exc:
                logger.error("%s: repair from %s not written: %s", describe(damage), name, exc)
                return False
            self._repaired(group, damage, first, last, batches, name, written)
            return True
        if misfits and not tried:
            self.stats.given_up += 1
            logger.error(
                "%s: not repaired in place, no replica's batches fit it (%s); its reads skip or "
                "hold per on_corruption",
                describe(damage),
                "; ".join(misfits),
            )
            return True
        logger.info(
            "%s: no replica could repair it yet (%s); trying again",
            describe(damage),
            "; ".join(tried + misfits) or "no other replica",
        )
        return False

    def _peers(self, group: int, host: MultiRaft) -> list[int]:
        """The group's other replicas, its leader first."""
        others = sorted(host.core(group).configuration.members - {self.node.id})
        leader = self.node.leader(group)
        if leader in others:
            others.remove(leader)
            others.insert(0, leader)
        return others

    def _repaired(
        self,
        group: int,
        damage: DamagedRange,
        first: int,
        last: int,
        batches: list[bytes],
        peer: str,
        written: int,
    ) -> None:
        self.stats.repaired += 1
        stream, partition = self.node.group_keys[group]
        key = (stream, partition)
        self.repaired[key] = self.repaired.get(key, 0) + written
        epochs = sorted({read_header(b).leader_epoch for b in batches})
        logger.warning(
            "repaired corrupt record batches from node %s: stream %s partition %d, segment %s, "
            "bytes %d..%d, offsets %d..%d (%d batches, epoch %s)%s",
            peer,
            stream,
            partition,
            damage.path,
            damage.position,
            damage.end,
            first,
            last,
            len(batches),
            ", ".join(map(str, epochs)),
            "" if written else "; already rewritten",
        )
        self.on_repaired(group)

    # -- requests ------------------------------------------------------------------------

    async def _ask(self, peer: int, group: int, first: int, last: int) -> tuple[int, list[bytes]]:
        request = self._next_request
        self._next_request += 1
        body = ASK_BODY.pack(request, group, first, last, MAX_ANSWER_BYTES)
        if not self.node.send(peer, ASK, body):
            return UNREACHABLE, []
        self.stats.asked += 1
        future: asyncio.Future[tuple[int, list[bytes]]] = self.loop.create_future()
        self._waiting[request] = (peer, future)
        try:
            return await asyncio.wait_for(future, ANSWER_TIMEOUT)
        except TimeoutError:
            return TIMEOUT, []
        finally:
            self._waiting.pop(request, None)

    def _on_ask(self, frm: int, body: memoryview) -> None:
        if len(body) != ASK_BODY.size:
            logger.warning("cluster: bad repair request from node %d dropped", frm)
            return
        request, group, first, last, max_bytes = ASK_BODY.unpack_from(body)
        storage = self.node.storages.get(group)
        host = self.node.host
        status, batches = UNAVAILABLE, list[bytes]()
        if (
            storage is not None
            and host is not None
            and frm in host.core(group).configuration.members
        ):
            status, batches = answer(storage, first, last, min(max_bytes, MAX_ANSWER_BYTES))
        self.stats.answered += 1
        self.node.send(frm, ANSWER, ANSWER_HEAD.pack(request, status) + b"".join(batches))

    def _on_answer(self, frm: int, body: memoryview) -> None:
        if len(body) < ANSWER_HEAD.size:
            return
        request, status = ANSWER_HEAD.unpack_from(body)
        waiting = self._waiting.get(request)
        if waiting is None or waiting[0] != frm or waiting[1].done():
            return  # timed out meanwhile, or not from the peer asked
        batches = split_batches(body[ANSWER_HEAD.size :]) if status == OK else []
        waiting[1].set_result((UNAVAILABLE, []) if batches is None else (status, batches))

    # -- views and shutdown ------------------------------------------------------------------

    def view(self) -> list[dict[str, object]]:
        """Batches rewritten per partition held here (0 included), for the node's status."""
        keys = sorted(
            self.node.group_keys[g] for g in self.node.storages if g in self.node.group_keys
        )
        return [
            {"stream": s, "partition": p, "batches": self.repaired.get((s, p), 0)} for s, p in keys
        ]

    def close(self) -> None:
        """Stop listening and cancel the repairs in progress (a range left damaged is found
        again by the next reader or scrub after a restart)."""
        self._closed = True
        integrity.remove_listener(self._on_report)
        for task in list(self._jobs.values()):
            task.cancel()
        for _peer, future in self._waiting.values():
            if not future.done():
                future.cancel()
