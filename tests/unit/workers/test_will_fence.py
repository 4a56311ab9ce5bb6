"""Wills published once across a cluster's nodes (broker.workers.will_fence).

Real routers on real logs with their :class:`ClusterSessions` (the members of
tests/unit/workers/test_replicated_sessions.py); the Raft group of ``$sessions`` is the test's
log order, and a node cut off from it applies nothing and commits nothing until the heal.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from broker.commitlog import Record
from broker.mqtt.packets import Will
from broker.mqtt.properties import PropertyId
from broker.net.context import STATE
from broker.router.session import Session, will_state
from broker.router.state import SESSIONS
from broker.workers import replicated_sessions, will_fence
from broker.workers.replicated_sessions import CLAIM_PREFIX, ClaimError, Owner
from tests.unit.router.conftest import Harness
from tests.unit.workers.test_replicated_sessions import (
    Log,
    Member,
    cluster_member,
    compacted,
    turns,
)

WILL = Will("wills/dev", b"gone", 1)


class CutLog(Log):
    """:class:`Log` with members cut off: they apply nothing and what they propose is not
    committed; healed, they apply what was committed meanwhile, then their proposals are
    committed after it."""

    def __init__(self, members: list[Member]) -> None:
        super().__init__(members)
        self.cut: set[Member] = set()
        self.missed: dict[Member, list[Record]] = {}

    def commit(self, *order: Member) -> list[Record]:
        batch: list[Record] = []
        for m in order or tuple(self.members):
            if m not in self.cut:
                batch += m.appended()
        for m in self.members:
            if m in self.cut:
                self.missed.setdefault(m, []).extend(batch)
            else:
                m.sessions.apply(batch)
        self.committed += batch
        return batch

    def heal(self) -> None:
        for m in self.cut:
            m.sessions.apply(self.missed.pop(m, []))
        self.cut.clear()


def wills(m: Member) -> list[bytes]:
    """The wills published into ``m``'s own partition log."""
    m.harness.run()
    return m.harness.log_payloads(WILL.topic)


def ownership(log: Log, client_id: str) -> list[dict[str, Any]]:
    """The ownership records of ``client_id`` committed, in order ({} for a tombstone)."""
    key = CLAIM_PREFIX + client_id
    return [orjson.loads(r.payload) if r.payload else {} for r in log.committed if r.topic == key]


async def owned_by(m: Member, log: Log, client_id: str) -> None:
    claim = asyncio.get_running_loop().create_task(m.sessions.claim(client_id, lambda x: x))
    await log.settle()
    await claim


async def connected_with_will(m: Member, log: Log) -> tuple[Any, Session]:
    """``dev`` owned by ``m``, connected there (persistent) with :data:`WILL`, its state
    committed."""
    await owned_by(m, log, "dev")
    link, session = m.harness.connect("dev", clean=False, expiry=300, will=WILL)
    m.harness.tick(0)  # its state written
    log.commit()
    return link, session


async def dev_on_a_with_will(tmp: Path) -> tuple[Member, Member, Log]:
    """Members a and b; ``dev`` connected on a with :data:`WILL` (:func:`connected_with_will`)."""
    loop = asyncio.get_running_loop()
    a, b = (cluster_member(tmp, n, ["a", "b"], loop) for n in ("a", "b"))
    log = Log([a, b])
    await connected_with_will(a, log)
    return a, b, log


async def adopt_orphan(m: Member, log: Log, client_id: str, dead: Member) -> None:
    """``m`` adopts the session of ``dead`` as broker.workers.orphans does."""
    died = m.harness.clock.now

    def take(answer: bytes) -> None:
        if answer[:1] == STATE:
            m.harness.router.adopt(client_id, answer[1:], died)

    m.node.transport.down.add(dead.node.name)
    claim = asyncio.get_running_loop().create_task(
        m.sessions.claim(client_id, take, only_from=dead.node.id)
    )
    await log.settle()
    await claim


def test_a_cut_off_owners_will_loses_to_the_adopters_which_goes_out_once(tmp_path: Path) -> None:
    """a holds dev's connection and is cut off; b, on the majority's side, adopts the
    session and publishes its will; dev's connection on a drops during the cut. Before the
    fence a published the will as well (twice in all)."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (cluster_member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = CutLog([a, b])
        link, session = await connected_with_will(a, log)
        log.cut.add(a)
        await adopt_orphan(b, log, "dev", a)
        assert b.sessions.owners["dev"] == Owner(b.node.id, 2)
        b.harness.tick(1)  # the adopted will is due at once (no delay)
        await log.settle()
        assert wills(b) == [WILL.payload]
        a.harness.drop(session, link)  # on the cut-off node, its connection drops
        await turns()
        assert wills(a) == []  # fenced: not published before its record is applied
        log.heal()
        await log.settle()
        a.harness.tick(1)
        b.harness.tick(1)
        await log.settle()
        assert wills(a) == [] and wills(b) == [WILL.payload]
        records = ownership(log, "dev")
        stale = [r for r in records if "will" in r and r["node"] == "a"]
        assert stale and stale[0]["epoch"] == 1  # a's will record, committed after the heal
        # a left it to b, in its release, which b, gone on without it, does not wait for.
        release = [r for r in records if "released_by" in r]
        assert (
            release[0][will_fence.LEFT] == will_state(WILL) and "dev" not in a.sessions.fence.left
        )
        assert a.sessions.owners["dev"] == b.sessions.owners["dev"] == Owner(b.node.id, 2)
        # What compaction leaves names b as the owner, with no will pending.
        last = [r for r in compacted(log.committed) if r.topic == CLAIM_PREFIX + "dev"]
        assert orjson.loads(last[0].payload)["node"] == "b"
        assert "will" not in orjson.loads(last[0].payload)

    asyncio.run(run())


def test_a_stale_will_committed_after_the_adopter_ended_the_session_leaves_nothing(
    tmp_path: Path,
) -> None:
    """As above with a clean session (3.1.1): b publishes its will and ends it (tombstones)
    before a's will record, of the old epoch, is committed: a publishes nothing, and the
    records after it (a's release, b's end again) leave nothing of the client id."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (cluster_member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = CutLog([a, b])
        await owned_by(a, log, "dev")
        link, session = a.harness.connect("dev", 4, will=WILL)  # its state written at once
        log.commit()
        log.cut.add(a)
        await adopt_orphan(b, log, "dev", a)
        for _ in range(3):
            b.harness.tick(1)
            await log.settle()
        assert wills(b) == [WILL.payload]
        assert "dev" not in b.sessions.owners  # ended: a clean session's expiry is 0
        a.harness.drop(session, link)
        await turns()
        log.heal()
        await log.settle()
        assert wills(a) == [] and wills(b) == [WILL.payload]
        assert ownership(log, "dev")[-1] == {}
        assert not [r for r in compacted(log.committed) if "dev" in r.topic]
        assert not a.sessions.owners and not b.sessions.owners

    asyncio.run(run())


def test_the_owners_will_goes_out_once_even_if_its_record_is_applied_twice(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (cluster_member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = Log([a, b])
        await owned_by(a, log, "dev")
        link, session = a.harness.connect("dev", clean=False, expiry=300, will=WILL)
        a.harness.tick(0)  # its state written
        log.commit()
        a.harness.drop(session, link)
        assert wills(a) == []
        (record,) = [r for r in log.commit() if r.topic[:1] == "\0" and b'"will"' in r.payload]
        assert "dev" in b.sessions.fence.pending  # every node knows it is going out
        await log.settle()
        assert wills(a) == [WILL.payload] and wills(b) == []
        assert not b.sessions.fence.pending  # its out record followed
        # Proposed again (its leader lost office with it in flight): the same will.
        for m in (a, b):
            m.sessions.apply([record])
        await log.settle()
        assert wills(a) == [WILL.payload]
        out = ownership(log, "dev")[-1]
        assert out["asserted"] and out["will_out"] == orjson.loads(record.payload)["id"]

    asyncio.run(run())


def test_a_will_record_not_committed_is_proposed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``$sessions`` leader for a while: the will record is refused, then proposed again
    (the will is not lost), and its out record likewise."""
    monkeypatch.setattr(will_fence, "RETRY", 0.01)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a = cluster_member(tmp_path, "a", ["a", "b"], loop)
        log = Log([a])
        await owned_by(a, log, "dev")
        router = a.harness.router
        append = router.append_forwarded
        refused: list[bytes] = []

        def no_leader_for_each_first(key: Any, rows: list[tuple[Any, ...]], ack: Any) -> None:
            payload = rows[0][2]
            if payload not in refused:
                refused.append(payload)
                ack(None)  # refused: no leader for too long
                return
            append(key, rows, ack)

        router.append_forwarded = no_leader_for_each_first  # type: ignore[method-assign]
        link, session = a.harness.connect("dev", clean=False, expiry=300, will=WILL)
        a.harness.drop(session, link)
        for _ in range(5):
            await asyncio.sleep(0.02)
            await log.settle()
        assert wills(a) == [WILL.payload]
        kinds = [next(iter(set(r) & {"will", "will_out"}), "claim") for r in ownership(log, "dev")]
        assert kinds == ["claim", "will", "will_out"]
        assert ["will_out" in orjson.loads(p) for p in refused] == [False, True]  # each once

    asyncio.run(run())


def test_a_will_fenced_by_a_node_that_died_before_publishing_is_published_by_the_adopter(
    tmp_path: Path,
) -> None:
    """a's will record committed, then a died before publishing it: b, adopting the session,
    publishes it (at least once), and only once although the state it adopted was written
    before the will was due."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (cluster_member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = Log([a, b])
        await owned_by(a, log, "dev")
        a.harness.connect("dev", clean=False, expiry=300, will=WILL)
        a.harness.tick(0)  # its state written
        log.commit()  # dev's state, with its will, as written at CONNECT
        a.sessions.will_now("dev", WILL)  # the will is due on a: its record only
        Log([b]).commit(a)  # committed; a dies before applying it
        assert b.sessions.fence.pending["dev"].epoch == 1
        await adopt_orphan(b, Log([b]), "dev", a)
        await Log([b]).settle()
        for _ in range(3):
            b.harness.tick(1)
            await Log([b]).settle()
        assert wills(b) == [WILL.payload]
        assert b.harness.router.sessions["dev"].will is None
        assert not b.sessions.fence.pending

    asyncio.run(run())


def held_with_will(now: float) -> dict[str, Any]:
    """The state of an offline session whose will is due, as a restarted node loads it."""
    session = Session("dev", persistent=True, expiry_interval=300)
    session.will = WILL
    session.disconnected_at = now
    session.will_due = 0.0
    return session.to_state()


def test_a_will_fenced_before_a_restart_goes_out_once_the_node_serves(tmp_path: Path) -> None:
    """a's will record is applied while a catches up after a restart (its earlier process
    proposed it and died): a publishes it once it serves, once."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a = cluster_member(tmp_path, "a", ["a", "b"], loop)
        log = Log([a])
        await owned_by(a, log, "dev")
        a.sessions.serving = False
        # The state it wrote while its client was connected, then its will record.
        state = Record(0, 0, "dev", orjson.dumps(held_with_will(a.harness.clock.now)))
        earlier = {"node": "a", "epoch": 1, "will": will_state(WILL), "id": "earlier-0", "w": 0}
        record = Record(0, 0, CLAIM_PREFIX + "dev", orjson.dumps(earlier))
        a.sessions.apply([state, record])
        log.committed += [state, record]
        assert wills(a) == []
        a.sessions.resume()  # it holds the session, as loaded from that state
        await log.settle()  # the will is out before the router's timer runs
        for _ in range(3):
            a.harness.tick(1)  # the will the loaded state held is the one fenced: gone
            await log.settle()
        assert wills(a) == [WILL.payload]
        assert ownership(log, "dev")[-1]["will_out"] == "earlier-0"
        assert "dev" in a.harness.router.sessions

    asyncio.run(run())


def test_a_will_out_leaves_the_state_of_the_session(tmp_path: Path) -> None:
    """b adopts dead a's session and publishes its will: the state it writes holds the will
    no more, so whoever holds the session next (a claimant that gets no release from b)
    does not publish it again."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b, c = (cluster_member(tmp_path, n, ["a", "b", "c"], loop) for n in ("a", "b", "c"))
        log = Log([a, b, c])
        await owned_by(a, log, "dev")
        a.harness.connect("dev", clean=False, expiry=300, will=WILL)
        a.harness.tick(0)
        log.commit()
        log = Log([b, c])  # a died
        await adopt_orphan(b, log, "dev", a)
        b.harness.tick(1)
        await log.settle()
        b.harness.tick(1)
        await log.settle()
        assert wills(b) == [WILL.payload]
        assert orjson.loads(c.sessions.states["dev"])["will"] is None
        await adopt_orphan(c, log, "dev", b)  # b died too
        for _ in range(3):
            c.harness.tick(1)
            await log.settle()
        assert wills(c) == []

    asyncio.run(run())


def test_a_connection_taken_over_by_a_connect_elsewhere_publishes_its_will_where_it_was(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        a, b, log = await dev_on_a_with_will(tmp_path)
        await owned_by(b, log, "dev")  # dev connects on b: a closes its connection
        await log.settle()
        assert wills(a) == [WILL.payload] and wills(b) == []
        assert a.sessions.fence.dropped == b.sessions.fence.dropped == 0


def test_a_connection_ended_with_disconnect_as_a_connect_elsewhere_claims_has_no_will(
    tmp_path: Path,
) -> None:
    """The client disconnects normally and connects at once on b, whose claim is committed
    before a's state without the will: the state before the claim still names the will, but
    a, releasing the session, says what became of it; nothing is published
    [MQTT-3.1.2-10] (a version that published that state's will from the claimant did so 5
    times in a 20 s churn run without faults)."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (cluster_member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = Log([a, b])
        link, session = await connected_with_will(a, log)
        a.harness.disconnect(session, link)
        claim = loop.create_task(b.sessions.claim("dev", lambda x: x))
        await turns()
        log.commit(b, a)  # b's claim first, then a's state without the will
        await log.settle()
        await claim
        await log.settle()
        assert wills(a) == wills(b) == []

    asyncio.run(run())


def test_a_taken_over_connections_will_survives_its_node_killed_after_its_final_state(
    tmp_path: Path,
) -> None:
    """A CONNECT on b takes the session from a, which closes its connection, writes the
    session's final state (without the will) and is killed before its release: the state
    was committed, a's append of the will was not (it went out unfenced from a), and b, going
    on without the release, found no will in the state it adopted: the will was lost
    (bench.churn --cluster 3, seed 61). The will is the claimant's to publish, as the state
    before its claim names it."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b, log = await dev_on_a_with_will(tmp_path)
        claim = loop.create_task(b.sessions.claim("dev", lambda x: x))
        await turns()
        log.commit(b)  # b's claim: a closes its connection
        await turns()
        final = [r for r in a.appended() if r.topic == "dev"]
        assert final and b"gone" not in final[0].payload  # the state without the will
        log.members = [b]  # a is killed: its final state committed, nothing after it
        b.sessions.apply(final)
        b.node.transport.down.add("a")
        await log.settle()
        assert (await claim)[:1] == STATE
        await log.settle()
        assert wills(b) == [WILL.payload]

    asyncio.run(run())


def test_a_will_being_fenced_when_a_connect_elsewhere_takes_the_session_still_goes_out(
    tmp_path: Path,
) -> None:
    """The connection drops without DISCONNECT and its will is being fenced (its record
    proposed, not applied) when the client connects again on another node, whose claim is
    committed first: the will record loses, and the will must still go out once, from the
    node where the connection dropped (the state the claimant adopts no longer has it),
    whether that state was written before the claim or after it. It was dropped ("the session
    moved on"): 52 wills of 889 in a 20-second churn run."""

    async def run(state_first: bool) -> None:
        loop = asyncio.get_running_loop()
        a, b = (
            cluster_member(tmp_path / str(state_first), n, ["a", "b"], loop) for n in ("a", "b")
        )
        log = Log([a, b])
        link, session = await connected_with_will(a, log)
        a.harness.drop(session, link)  # the will is due: its record is proposed
        claim = loop.create_task(b.sessions.claim("dev", lambda x: x))
        await turns()
        if state_first:  # a's state without the will, then b's claim, then a's will record
            records = a.appended()
            for m in (a, b):
                m.sessions.apply([r for r in records if r.topic == "dev"])
            log.commit(b)
            for m in (a, b):
                m.sessions.apply([r for r in records if r.topic != "dev"])
        else:
            log.commit(b, a)  # b's claim first, then a's state and will record
        await log.settle()
        await claim
        assert wills(a) == [WILL.payload] and wills(b) == []
        assert a.sessions.fence.dropped == 0

    asyncio.run(run(state_first=False))
    asyncio.run(run(state_first=True))


def test_a_will_whose_record_is_committed_late_goes_out_after_a_newer_one(
    tmp_path: Path,
) -> None:
    """A connection taken over on its own node has its will fenced, and the record waits
    (its leader lost, the outcome unknown); the next connection drops too and its will's
    record commits first; then another node takes the session, and the first record is
    committed at last, lost to that claim. Both wills must go out: the worker kept only
    the last will it proposed per client id, and the first was lost without a word."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (cluster_member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = Log([a, b])
        await owned_by(a, log, "dev")
        first, second = Will("wills/dev", b"first", 1), Will("wills/dev", b"second", 1)
        a.harness.connect("dev", clean=False, expiry=300, will=first)
        a.harness.tick(0)
        log.commit()
        link, session = a.harness.connect("dev", clean=False, expiry=300, will=second)
        key = CLAIM_PREFIX + "dev"
        late = [r for r in a.appended() if r.topic == key]  # the first's record, delayed
        assert [orjson.loads(r.payload)["will"][1] for r in late] == [will_state(first)[1]]
        a.harness.drop(session, link)  # the second's record is committed
        await log.settle()
        assert wills(a) == [b"second"]
        await owned_by(b, log, "dev")  # a CONNECT on b takes the session
        for m in (a, b):
            m.sessions.apply(late)
        await log.settle()
        assert sorted(wills(a)) == [b"first", b"second"] and wills(b) == []

    asyncio.run(run())


def test_a_connect_that_takes_a_dead_nodes_session_publishes_its_connections_will(
    tmp_path: Path,
) -> None:
    """Node a dies with the session's connection (its will in the committed state, no
    delay); the client connects to b, whose claim goes on without a's release: the will
    of the connection that died must go out (from b); the new connection replaced it
    unpublished. A delayed will is cancelled by the new connection [MQTT-3.1.3-9]."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (cluster_member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = Log([a, b])
        for cid, delay in (("dev", 0), ("slow", 60)):
            await owned_by(a, log, cid)
            props = {PropertyId.WILL_DELAY_INTERVAL: delay} if delay else {}
            will = Will(f"wills/{cid}", b"gone " + cid.encode(), 1, False, props)
            a.harness.connect(cid, 5, clean=False, expiry=300, will=will)
            a.harness.tick(0)  # its state, with the will, committed
            log.commit()
        log.members = [b]  # a is dead: it applies and proposes nothing more
        b.node.transport.down.add("a")
        for cid in ("dev", "slow"):
            await owned_by(b, log, cid)
        await log.settle()
        b.harness.run()
        assert b.harness.log_payloads("wills/dev") == [b"gone dev"]
        assert b.harness.log_payloads("wills/slow") == []

    asyncio.run(run())


def test_a_clean_sessions_claim_ends_after_its_will_is_out(tmp_path: Path) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (cluster_member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = Log([a, b])
        await owned_by(a, log, "dev")
        link, session = a.harness.connect("dev", 4, will=WILL)  # 3.1.1, clean session
        log.commit()
        a.harness.drop(session, link)
        await turns()
        await log.settle()
        assert wills(a) == [WILL.payload]
        kinds = [next(iter(set(r) & {"will", "will_out"}), "end") for r in ownership(log, "dev")]
        assert kinds[1:] == ["will", "will_out", "end"]
        assert not [r for r in compacted(log.committed) if "dev" in r.topic]
        assert not a.sessions.owners and not b.sessions.owners

    asyncio.run(run())


def test_one_node_publishes_a_will_at_once(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    link, session = h.connect("dev", will=WILL)
    h.drop(session, link)
    assert h.log_payloads(WILL.topic) == [WILL.payload]
    assert not [r for r in h.streams.log(*SESSIONS).read(0, 100) if r.topic[:1] == "\0"]


def test_a_release_waits_for_the_wills_its_node_still_sends(tmp_path: Path) -> None:
    """A will of the session goes out from a (its record lost to b's claim, the state before
    the claim without it) as b's claim takes the session: a's release, after which b trusts
    a for it, is written only once that will is stored; killed before, a leaves no release,
    and b goes on from the last state."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (cluster_member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = Log([a, b])
        link, session = await connected_with_will(a, log)
        a.harness.drop(session, link)  # its will record proposed, its state without the will
        claim = loop.create_task(b.sessions.claim("dev", lambda x: x))
        await turns()
        records = a.appended()
        for m in (a, b):
            m.sessions.apply([r for r in records if r.topic == "dev"])
        log.commit(b)  # b's claim
        await turns()

        def released() -> bool:
            return any(b"released_by" in r.payload for r in log.commit(a))

        assert not released() and "dev" in a.sessions.fence.mine
        for m in (a, b):
            m.sessions.apply([r for r in records if r.topic != "dev"])  # a's record: lost
        await turns()
        assert not released() or wills(a) == [WILL.payload]
        await log.settle()
        await claim
        assert wills(a) == [WILL.payload] and wills(b) == []
        assert any(r.payload and b"released_by" in r.payload for r in log.committed)

    asyncio.run(run())


def test_a_wait_for_wills_bounded_in_time_ends_once(tmp_path: Path) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        fence = cluster_member(tmp_path, "a", ["a"], loop).sessions.fence
        calls: list[str] = []
        fence.mine["dev"] = {"w1"}
        fence.after_will("dev", lambda: calls.append("bounded"), 0.01)
        fence.after_will("dev", lambda: calls.append("unbounded"))
        await asyncio.sleep(0.05)
        assert calls == ["bounded"]  # the will not out in time: goes on without it
        fence._done("dev", "w1")
        assert calls == ["bounded", "unbounded"]
        fence.after_will("dev", lambda: calls.append("none going out"), 0.01)
        await asyncio.sleep(0.05)
        assert calls == ["bounded", "unbounded", "none going out"]

    asyncio.run(run())


def test_a_taken_over_connections_will_goes_out_once_when_a_third_connect_overtakes_the_claim(
    tmp_path: Path,
) -> None:
    """b's CONNECT takes the session from a, and a third CONNECT, on c, takes it from b
    before b's claim resumed: b's claim fails, the state before c's claim (a's final one)
    has no will. The will goes out once, from a (a version where the claimant published it
    lost it here: bench.churn --cluster 3, seed 62)."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        names = ["a", "b", "c"]
        a, b, c = (cluster_member(tmp_path, n, names, loop) for n in names)
        log = Log([a, b, c])
        await connected_with_will(a, log)
        claims = [loop.create_task(m.sessions.claim("dev", lambda x: x)) for m in (b, c)]
        await turns()
        log.commit(b, c)  # b's claim of epoch 2 wins, c's loses: c claims epoch 3
        await turns()
        log.commit(a)  # a's final state (without the will) and its release
        log.commit(c)  # c's claim, before b's resumed
        await log.settle()
        outcomes = await asyncio.gather(*claims, return_exceptions=True)
        assert isinstance(outcomes[0], ClaimError) and outcomes[1][:1] == STATE
        await log.settle()
        assert wills(a) == [WILL.payload] and wills(b) == wills(c) == []

    asyncio.run(run())


def test_a_taken_over_connections_will_not_named_by_a_late_state_goes_out_from_its_node(
    tmp_path: Path,
) -> None:
    """An older connection's state record (without a will) is committed late, after the
    state of the connection a CONNECT on b now takes over (a worker's batch held through a
    pause): the state before b's claim names no will. a publishes its connection's will (a
    version where the claimant published the will that state named lost it: bench.churn
    --cluster 3 --kill pause, seed 42)."""

    async def run() -> None:
        a, b, log = await dev_on_a_with_will(tmp_path)
        late = dict(orjson.loads(a.sessions.states["dev"]), will=None)
        for m in (a, b):
            m.sessions.apply([Record(0, 0, "dev", orjson.dumps(late))])
        await owned_by(b, log, "dev")
        await log.settle()
        assert wills(a) == [WILL.payload] and wills(b) == []

    asyncio.run(run())


async def adopt_waiting(m: Member, log: Log, client_id: str, gone: Member) -> None:
    """:func:`adopt_orphan`, with ``gone`` reachable again as the claim commits: ``m``
    waits for its release (a node paused past its death, resumed within the wait)."""
    died = m.harness.clock.now

    def take(answer: bytes) -> None:
        if answer[:1] == STATE:
            m.harness.router.adopt(client_id, answer[1:], died)

    claim = asyncio.get_running_loop().create_task(
        m.sessions.claim(client_id, take, only_from=gone.node.id)
    )
    await log.settle()
    await claim


def test_a_live_connection_an_orphans_claim_closes_has_its_will_go_out_from_the_adopter(
    tmp_path: Path,
) -> None:
    """a, paused long enough for gossip to declare it dead, resumes while b's orphan claim
    of dev waits for a's release: a applies the claim, closes dev's live connection and
    leaves its will to b; its release hands it over, and b publishes it, once. Before, a
    dropped the will as the adopter's and released a state without it: b published none
    (bench.churn --cluster 3 --kill pause, seed 43)."""

    async def run() -> None:
        a, b, log = await dev_on_a_with_will(tmp_path)
        await adopt_waiting(b, log, "dev", a)
        assert b.sessions.owners["dev"] == Owner(b.node.id, 2)
        release = [r for r in ownership(log, "dev") if "released_by" in r]
        assert release and release[0][will_fence.LEFT] == will_state(WILL)
        b.harness.tick(1)
        await log.settle()
        a.harness.tick(1)
        await log.settle()
        assert wills(a) == [] and wills(b) == [WILL.payload]
        assert "dev" not in a.sessions.fence.left and "dev" not in b.sessions.fence.given
        assert "dev" not in b.harness.router.sessions or not b.harness.router.sessions["dev"].will

    asyncio.run(run())


def test_a_will_whose_record_loses_to_an_orphans_claim_goes_out_from_the_adopter(
    tmp_path: Path,
) -> None:
    """dev's connection on a drops just before a's pause: its will record, proposed at a's
    epoch, is committed after b's orphan claim and loses. a leaves that will to b with its
    release (which waits for the record), and b publishes it once."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (cluster_member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = Log([a, b])
        link, session = await connected_with_will(a, log)
        a.harness.drop(session, link)  # its will record proposed, not committed yet
        held = a.appended()
        claim = loop.create_task(b.sessions.claim("dev", lambda x: x, only_from=a.node.id))
        await turns()
        log.commit(b)  # b's orphan claim, before a's will record
        await turns()
        for m in (a, b):
            m.sessions.apply(held)  # a's will record: lost
        await log.settle()
        await claim
        release = [r for r in ownership(log, "dev") if "released_by" in r]
        assert release and release[0][will_fence.LEFT] == will_state(WILL)
        await log.settle()
        assert wills(a) == [] and wills(b) == [WILL.payload]
        assert a.sessions.fence.dropped == 0

    asyncio.run(run())


def test_a_will_left_to_an_adopter_that_went_on_without_the_release_goes_out_once(
    tmp_path: Path,
) -> None:
    """As above, but b went on without a's release (a still paused after b's wait) and ran
    dev's will from the state it adopted; a's late release hands the will over again: b,
    no longer waiting for it, does not publish it twice."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (cluster_member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = CutLog([a, b])
        await connected_with_will(a, log)
        log.cut.add(a)
        await adopt_orphan(b, log, "dev", a)
        b.harness.tick(1)
        await log.settle()
        assert wills(b) == [WILL.payload]
        log.heal()  # a applies b's claim: closes dev's connection, leaves the will to b
        await log.settle()
        release = [r for r in ownership(log, "dev") if "released_by" in r]
        assert release and release[0][will_fence.LEFT] == will_state(WILL)
        a.harness.tick(1)
        b.harness.tick(1)
        await log.settle()
        assert wills(a) == [] and wills(b) == [WILL.payload]
        assert "dev" not in b.sessions.fence.given

    asyncio.run(run())


def test_a_will_left_to_an_adopter_that_went_on_without_one_goes_out_from_it_late(
    tmp_path: Path,
) -> None:
    """dev's connection on a dropped just before a was cut off: a's state without the will
    was committed, its will record not. b adopts that state (no will) without a's release;
    healed, a's will record loses to b's claim and a's release hands the will over late:
    b, which found none, publishes it, once."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (cluster_member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = CutLog([a, b])
        link, session = await connected_with_will(a, log)
        a.harness.drop(session, link)
        records = a.appended()
        for m in (a, b):
            m.sessions.apply([r for r in records if r.topic == "dev"])  # committed
        log.cut.add(a)
        await adopt_orphan(b, log, "dev", a)
        b.harness.tick(1)
        await log.settle()
        assert wills(b) == [] and b.sessions.fence.adopting == {"dev": 2}
        log.heal()
        for m in (a, b):
            m.sessions.apply([r for r in records if r.topic != "dev"])  # the record: lost
        await log.settle()
        release = [r for r in ownership(log, "dev") if "released_by" in r]
        assert release and release[0][will_fence.LEFT] == will_state(WILL)
        b.harness.tick(1)
        await log.settle()
        assert wills(a) == [] and wills(b) == [WILL.payload]
        assert b.sessions.fence.adopting == {}

    asyncio.run(run())


def test_a_will_whose_record_loses_to_a_third_nodes_claim_goes_out_from_its_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dev's connection on a drops, and its will record waits for a leader (a paused): b's
    CONNECT claims the session, then c's takes it from b, before a's record is applied. The
    will is a's connection's (the state left without it): a sends it, unfenced, once. Before,
    a third node's claim made a forget that the session was taken from it, and the will was
    dropped (bench.churn --cluster 3 --kill pause, seed 44)."""
    monkeypatch.setattr(replicated_sessions, "TAKEOVER_TIMEOUT", 0.05)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        names = ["a", "b", "c"]
        a, b, c = (cluster_member(tmp_path, n, names, loop) for n in names)
        log = Log([a, b, c])
        link, session = await connected_with_will(a, log)
        a.harness.drop(session, link)  # its will record proposed, its state without the will
        records = a.appended()
        for m in (a, b, c):
            m.sessions.apply([r for r in records if r.topic == "dev"])
        claim_b = loop.create_task(b.sessions.claim("dev", lambda x: x))
        await turns()
        log.commit(b)  # b's claim (epoch 2)
        await turns()
        claim_c = loop.create_task(c.sessions.claim("dev", lambda x: x))
        await turns()
        log.commit(c)  # c's claim (epoch 3), before a's will record
        await turns()
        assert {m.sessions.owners["dev"] for m in (a, b, c)} == {Owner(c.node.id, 3)}
        for m in (a, b, c):
            m.sessions.apply([r for r in records if r.topic != "dev"])  # a's record: lost
        await log.settle()
        await asyncio.gather(claim_b, claim_c, return_exceptions=True)
        await asyncio.sleep(0.1)
        await log.settle()
        assert wills(a) == [WILL.payload] and wills(b) == wills(c) == []
        assert a.sessions.fence.dropped == 0

    asyncio.run(run())


def test_a_will_record_given_up_on_once_an_orphans_claim_applied_is_left_to_the_adopter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dev's connection on a drops as a resumes from a pause: its will record finds no
    leader (refused), and b's orphan claim is applied before it is proposed again. a gives
    the record up (the session moved on) and leaves the will to b, in its release. Before,
    giving up dropped the will, silently (bench.churn --cluster 3 --kill pause, seed 43,
    nodes of two workers: the will's record proposed by a worker that had not yet applied
    the claim, 3 wills)."""
    monkeypatch.setattr(will_fence, "RETRY", 0.01)

    async def run() -> None:
        a, b, log = await dev_on_a_with_will(tmp_path)
        router = a.harness.router
        forward = router.append_forwarded
        refused: list[bytes] = []

        def no_leader_for_wills(key: Any, rows: list[Any], ack: Any) -> None:
            if b'"will":[' in rows[0][2]:
                refused.append(rows[0][2])
                return ack(None)
            forward(key, rows, ack)

        router.append_forwarded = no_leader_for_wills  # type: ignore[method-assign]
        session = router.sessions["dev"]
        a.harness.drop(session, session.link)  # type: ignore[arg-type]
        assert refused and "dev" in a.sessions.fence.mine
        await adopt_waiting(b, log, "dev", a)
        await asyncio.sleep(0.05)
        await log.settle()
        release = [r for r in ownership(log, "dev") if "released_by" in r]
        assert release and release[0].get(will_fence.LEFT) == will_state(WILL)
        b.harness.tick(1)
        await log.settle()
        assert wills(a) == [] and wills(b) == [WILL.payload]
        assert a.sessions.fence.dropped == 0 and "dev" not in a.sessions.fence.mine

    asyncio.run(run())


@pytest.mark.parametrize("release_first", [True, False])
def test_a_will_left_to_an_adopter_whose_claim_a_connect_supersedes_goes_out_from_it(
    tmp_path: Path, release_first: bool
) -> None:
    """a resumes from a pause: it applies b's orphan claim, closes dev's live connection and
    leaves its will to b in its release; dev connects to a again at once, and a's claim is
    applied before b's claim resumed (after a's release, or before it). b's claim fails (or
    adopts, then loses the session to a), and b, which alone has that will, publishes it,
    once. Before, it went nowhere
    (bench.churn --cluster 3 --kill pause, seed 43: 2 wills)."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b, log = await dev_on_a_with_will(tmp_path)
        adopting = loop.create_task(b.sessions.claim("dev", lambda x: x, only_from=a.node.id))
        await turns()
        log.commit(b)  # b's orphan claim (epoch 2): a leaves the will in its release
        await turns()
        back = loop.create_task(a.sessions.claim("dev", lambda x: x))  # dev back on a
        await turns()
        records = a.appended()
        release = [r for r in records if b"released_by" in r.payload]
        claim = [r for r in records if orjson.loads(r.payload or b"{}").get("epoch") == 3]
        assert release and orjson.loads(release[0].payload)[will_fence.LEFT] == will_state(WILL)
        assert claim and "released_by" not in orjson.loads(claim[0].payload)
        rest = [r for r in records if r not in release and r not in claim]
        for batch in (release, claim) if release_first else (claim, release):
            for m in (a, b):
                m.sessions.apply(batch + rest)
            log.committed += batch + rest
            rest = []
            await turns()
        await log.settle()
        outcomes = await asyncio.gather(adopting, back, return_exceptions=True)
        # (b's claim may resume between the two, adopt, and lose the session to a's claim.)
        assert release_first or isinstance(outcomes[0], ClaimError)
        assert not isinstance(outcomes[1], Exception)
        await log.settle()
        assert wills(a) == [] and wills(b) == [WILL.payload]
        assert not b.sessions.fence.adopting and not b.sessions.fence.given

    asyncio.run(run())


def test_a_will_whose_record_loses_to_an_orphans_claim_goes_out_once_its_node_claims_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dev's connection on a drops as a is paused (its will record in flight); b's orphan
    claim, then a's own claim (dev back on a at once) are applied before a's record, which
    loses to both: nobody else has that will (b's claim failed, a's release carried none),
    so a publishes it."""
    monkeypatch.setattr(replicated_sessions, "TAKEOVER_TIMEOUT", 0.05)
    monkeypatch.setattr(will_fence, "RETRY", 0.01)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b, log = await dev_on_a_with_will(tmp_path)
        session = a.harness.router.sessions["dev"]
        a.harness.drop(session, session.link)  # type: ignore[arg-type]
        held = a.appended()  # the will record and the state, not committed yet
        adopting = loop.create_task(b.sessions.claim("dev", lambda x: x, only_from=a.node.id))
        await turns()
        log.commit(b)  # b's orphan claim (epoch 2)
        await turns()
        back = loop.create_task(a.sessions.claim("dev", lambda x: x))
        await turns()
        log.commit(a)  # a's claim (epoch 3); a's release waits for its will record
        await turns()
        assert {m.sessions.owners["dev"].epoch for m in (a, b)} == {3}
        for m in (a, b):
            m.sessions.apply(held)  # a's will record: lost
        log.committed += held
        await log.settle()
        await asyncio.gather(adopting, back, return_exceptions=True)
        await log.settle()
        assert wills(a) + wills(b) == [WILL.payload]
        assert a.sessions.fence.dropped == 0

    asyncio.run(run())
