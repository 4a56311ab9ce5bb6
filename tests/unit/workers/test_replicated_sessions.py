"""Session ownership through the replicated ``$sessions`` log (broker.workers.replicated_sessions).

Two or three "nodes", each a real router on a real log (tests/unit/router/conftest.py's
Harness) with its :class:`ClusterSessions`; the Raft group in between is replaced by the test:
what each node appends to its own ``$sessions`` is collected and applied to every node in one
order, the log order a Raft group would have committed. Only the network is simulated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from broker.cluster.placement import node_id_of
from broker.commitlog import Record
from broker.commitlog.config import LogConfig, StreamSpec
from broker.mqtt.packets import ConnAck
from broker.mqtt.reason_codes import ReasonCode
from broker.net.context import HERE, NEW, STATE
from broker.router.commit import OUTCOME_UNKNOWN
from broker.router.session import Session
from broker.router.state import SESSIONS
from broker.workers import replicated_sessions
from broker.workers.cluster_hooks import ClusterHooks
from broker.workers.forwards import Claim
from broker.workers.replicated_sessions import (
    CLAIM_PREFIX,
    ClaimError,
    ClusterSessions,
    Owner,
)
from tests.unit.router.conftest import Harness


class Transport:
    #: The ClusterGroupPeers of these nodes never tick (their groups are not tested here).
    closed = True

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.on_link_lost: Callable[[str], None] = lambda name: None

    def connected(self, name: str) -> bool:
        return name not in self.down


class Node:
    """What ClusterSessions reads of its ClusterNode."""

    def __init__(self, name: str, names: list[str], loop: asyncio.AbstractEventLoop) -> None:
        self.name = name
        self.id = node_id_of(name)
        self.names = {node_id_of(n): n for n in names}
        self.loop = loop
        self.transport = Transport()
        # What its ClusterGroupPeers registers, and looks $sessions' group up in.
        self.handlers: dict[int, object] = {}
        self.group_keys: dict[int, object] = {}
        self.host = None  # no Raft groups: nothing registers before their hand-overs


SPECS = [StreamSpec("default", (), 1, LogConfig(fsync="never"))]


class Member:
    """One node: its router (a Harness) and its ClusterSessions."""

    def __init__(self, tmp: Path, name: str, names: list[str], loop: Any) -> None:
        self.node = Node(name, names, loop)
        self.harness = Harness(tmp / name, specs=list(SPECS))
        self.sessions = ClusterSessions(
            self.node,  # type: ignore[arg-type]
            self.harness.streams.log(*SESSIONS),
        )
        self.sessions.router = self.harness.router
        self.sessions.serving = True
        self.sent = self.harness.streams.log(*SESSIONS).high_watermark

    def appended(self) -> list[Record]:
        """What this node appended to its ``$sessions`` since the last call."""
        self.harness.run()
        part = self.harness.router.partition(SESSIONS)
        out: list[Record] = []
        while self.sent < part.end_offset:
            records = part.read(self.sent)
            out += records
            self.sent = records[-1].offset + 1
        return out


class Log:
    """The replicated ``$sessions``: records proposed by the members, committed in the order
    :meth:`commit` takes them, applied to every member."""

    def __init__(self, members: list[Member]) -> None:
        self.members = members
        self.committed: list[Record] = []

    def commit(self, *order: Member) -> list[Record]:
        batch: list[Record] = []
        for m in order or tuple(self.members):
            batch += m.appended()
        for m in self.members:
            m.sessions.apply(batch)
        self.committed += batch
        return batch

    async def settle(self, rounds: int = 20) -> None:
        """Commit, and let the claims resume, round after round."""
        for _ in range(rounds):
            self.commit()
            await asyncio.sleep(0)


async def turns(n: int = 5) -> None:
    """Let the tasks resumed by what was applied run."""
    for _ in range(n):
        await asyncio.sleep(0)


async def claimed(m: Member, log: Log, client_id: str) -> bytes:
    """``m`` claims ``client_id`` (its connection's answer), the log committing meanwhile."""
    claim = asyncio.get_running_loop().create_task(m.sessions.claim(client_id, lambda x: x))
    await log.settle()
    return await claim


def claim_record(node: str, epoch: int, client_id: str, **extra: Any) -> Record:
    body = orjson.dumps({"node": node, "epoch": epoch, **extra})
    return Record(0, 0, CLAIM_PREFIX + client_id, body)


def test_racing_claims_of_one_epoch_the_first_in_the_log_wins_everywhere(tmp_path: Path) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        names = ["a", "b", "c"]
        a, b, c = (Member(tmp_path, n, names, loop) for n in names)
        log = Log([a, b, c])
        b_claim = loop.create_task(b.sessions.claim("dev", lambda answer: answer))
        c_claim = loop.create_task(c.sessions.claim("dev", lambda answer: answer))
        await turns()  # both proposed epoch 1
        log.commit(c, b)  # c's first: b's claim of epoch 1 loses, b claims epoch 2
        await turns()
        assert not b_claim.done()
        assert c_claim.done() and c_claim.result() == NEW
        assert {m.sessions.owners["dev"] for m in (a, b, c)} == {Owner(c.node.id, 1)}
        await log.settle()
        # b's second claim took it over from c, which released it (nothing held there yet)
        assert await b_claim == NEW
        assert {m.sessions.owners["dev"] for m in (a, b, c)} == {Owner(b.node.id, 2)}
        releases = [r for r in log.committed if b"released_by" in r.payload]
        assert [orjson.loads(r.payload)["released_by"] for r in releases] == ["c"]

    asyncio.run(run())


def test_a_takeover_closes_the_old_connection_and_moves_the_state(tmp_path: Path) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        names = ["a", "b"]
        a, b = (Member(tmp_path, n, names, loop) for n in names)
        log = Log([a, b])
        first = loop.create_task(a.sessions.claim("dev", lambda answer: answer))
        await log.settle()
        assert await first == NEW
        link, session = a.harness.connect("dev", clean=False, expiry=300)
        a.harness.subscribe(session, "t/#", 2)
        log.commit()
        assert b.sessions.states["dev"]  # the subscription is known on b

        adopted: list[bytes] = []

        def adopt(answer: bytes) -> bytes:
            adopted.append(answer)
            if answer[:1] == STATE:
                b.harness.router.adopt("dev", answer[1:])
            return answer

        second = loop.create_task(b.sessions.claim("dev", adopt))
        await log.settle()
        answer = await second
        assert answer[:1] == STATE
        assert link.closed == ReasonCode.SESSION_TAKEN_OVER  # [MQTT-3.1.4-3]
        assert "dev" not in a.harness.router.sessions
        new_link, resumed = b.harness.connect("dev", clean=False, expiry=300)
        assert "t/#" in resumed.main.subscriptions
        assert new_link.of(ConnAck)[0].session_present  # [MQTT-3.2.2-2]
        # Ownership, as every node applied it, and as a restarted node loads it.
        assert a.sessions.owners["dev"] == b.sessions.owners["dev"] == Owner(b.node.id, 2)
        # The latest claim, with its time: a leader fences what a took before it
        # (broker.workers.forwards.zombies).
        claim = [r for r in log.committed if r.topic == CLAIM_PREFIX + "dev"][-2]
        assert orjson.loads(claim.payload) == {"node": "b", "epoch": 2}
        first = next(r for r in log.committed if r.topic == CLAIM_PREFIX + "dev")
        assert a.sessions.claims.get("dev") == Claim(b.node.id, claim.timestamp, first.timestamp)
        assert not ClusterHooks(a.sessions).is_home("dev")
        assert ClusterHooks(b.sessions).is_home("dev")
        assert not ClusterHooks(b.sessions).is_home(CLAIM_PREFIX + "dev")
        # Reconnecting where it is owned needs no claim.
        assert await b.sessions.claim("dev", lambda answer: answer) == HERE

    asyncio.run(run())


def test_a_dead_previous_owner_is_not_waited_for(tmp_path: Path) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        names = ["a", "b"]
        a, b = (Member(tmp_path, n, names, loop) for n in names)
        # "a" owned the session at epoch 4 and is gone: b knows its last state.
        state = orjson.dumps({"last": True})
        for m in (a, b):
            m.sessions.apply([claim_record("a", 4, "dev"), Record(0, 0, "dev", state)])
        b.node.transport.down.add("a")
        log = Log([b])
        claim = loop.create_task(b.sessions.claim("dev", lambda answer: answer))
        await log.settle()
        assert await claim == STATE + state
        assert b.sessions.owners["dev"] == Owner(b.node.id, 5)

    asyncio.run(run())


def test_an_orphans_claim_and_its_clients_connect_on_one_node_both_finish(
    tmp_path: Path,
) -> None:
    """b adopts dead a's session (broker.workers.orphans) while the client reconnects to b:
    both claims are made on b at once. Before they were taken one at a time, both proposed
    epoch 5 and the first one's waiter was lost: that CONNECT waited for the claim timeout."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (Member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        for m in (a, b):
            m.sessions.apply([claim_record("a", 4, "dev")])
        b.node.transport.down.add("a")
        orphan = loop.create_task(b.sessions.claim("dev", lambda x: x, only_from=a.node.id))
        connect = loop.create_task(b.sessions.claim("dev", lambda x: x))
        await Log([a, b]).settle()
        assert orphan.done() and connect.done()
        assert await orphan == NEW
        assert await connect == HERE  # the orphan's claim made b the owner
        assert b.sessions.owners == {"dev": Owner(b.node.id, 5)}
        assert not b.sessions._claiming

    asyncio.run(run())


def test_stale_claims_and_releases_change_nothing(tmp_path: Path) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        a = Member(tmp_path, "a", ["a", "b"], loop)
        s = a.sessions
        s.apply([claim_record("b", 3, "x")])
        s.apply([claim_record("a", 3, "x"), claim_record("a", 2, "x")])  # not above 3
        assert s.owners["x"] == Owner(node_id_of("b"), 3)
        s.apply([claim_record("a", 2, "x", released_by="b")])  # another epoch's release
        assert "x" not in s.released
        s.apply([claim_record("b", 3, "x", released_by="a")])
        assert s.released["x"] == 3
        s.apply([Record(0, 0, "x", b"{}"), Record(0, 0, "x", b"")])  # a tombstone ends it
        assert "x" not in s.states
        s.apply([Record(0, 0, "$share/g/t", b"{}")])  # a shared group: not a session
        assert "$share/g/t" not in s.states

    asyncio.run(run())


def test_a_claim_without_a_commit_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replicated_sessions, "CLAIM_TIMEOUT", 0.05)

    async def run() -> None:
        a = Member(tmp_path, "a", ["a", "b"], asyncio.get_running_loop())
        with pytest.raises(ClaimError, match="not committed"):
            await a.sessions.claim("lonely", lambda answer: answer)

    asyncio.run(run())


def test_the_knowledge_is_rebuilt_from_the_log_at_start(tmp_path: Path) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        a = Member(tmp_path, "a", ["a", "b"], loop)
        rows = [
            (0, CLAIM_PREFIX + "dev", orjson.dumps({"node": "b", "epoch": 7}), 0, False, "", b""),
            (0, "dev", orjson.dumps(Session("dev", persistent=True).to_state()), 0, False, "", b""),
        ]
        a.harness.router.append_forwarded(SESSIONS, rows, None)  # type: ignore[arg-type]
        a.harness.run()
        a.harness.restart()
        again = ClusterSessions(a.node, a.harness.streams.log(*SESSIONS))  # type: ignore[arg-type]
        assert again.owners["dev"] == Owner(node_id_of("b"), 7)
        assert orjson.loads(again.states["dev"])["version"] == 4
        # a router without the cluster loads the session, not the ownership record
        assert list(a.harness.router.sessions) == ["dev"]

    asyncio.run(run())


def test_resume_leaves_the_router_with_the_sessions_this_node_owns(tmp_path: Path) -> None:
    async def run() -> None:
        a = Member(tmp_path, "a", ["a", "b"], asyncio.get_running_loop())
        a.sessions.serving = False
        router = a.harness.router
        _link, moved = a.harness.connect("moved", clean=False, expiry=300)
        a.harness.router.connection_lost(moved, _link, graceful=True)
        state = orjson.dumps(Session("mine", persistent=True, expiry_interval=60).to_state())
        # Committed while the node caught up: "mine" is owned here, "moved" by b.
        a.sessions.apply(
            [
                claim_record("a", 3, "mine"),
                Record(0, 0, "mine", state),
                claim_record("b", 2, "moved"),
            ]
        )
        assert "moved" not in router.sessions  # handed over (silently: not serving yet)
        assert not [r for r in a.appended() if r.topic.startswith(CLAIM_PREFIX)]
        a.sessions.resume()
        assert a.sessions.serving
        assert list(router.sessions) == ["mine"]
        assert router.sessions["mine"].expiry_interval == 60

    asyncio.run(run())


def test_a_claim_overwritten_when_its_leader_lost_office_is_proposed_again(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        a = Member(tmp_path, "a", ["a", "b"], asyncio.get_running_loop())
        router = a.harness.router
        append = router.append_forwarded
        proposed: list[list[tuple[Any, ...]]] = []

        def leader_lost_the_first(key: Any, rows: list[tuple[Any, ...]], ack: Any) -> None:
            proposed.append(rows)
            if len(proposed) == 1:
                ack(OUTCOME_UNKNOWN)  # in flight when its leader stepped down; overwritten
                return
            append(key, rows, ack)

        router.append_forwarded = leader_lost_the_first  # type: ignore[method-assign]
        claim = asyncio.get_running_loop().create_task(a.sessions.claim("dev", lambda x: x))
        await Log([a]).settle()
        assert await claim == NEW
        assert len(proposed) == 2 and proposed[0] == proposed[1]
        assert a.sessions.owners["dev"] == Owner(a.node.id, 1)

    asyncio.run(run())


def compacted(records: list[Record]) -> list[Record]:
    """``records`` as compaction leaves them (broker.commitlog.policy): the last record of
    each key, none of a key whose last record is a tombstone."""
    last = {r.topic: i for i, r in enumerate(records)}
    return [r for i, r in enumerate(records) if last[r.topic] == i and r.payload]


def owners_from(tmp: Path, records: list[Record], loop: Any) -> dict[str, Owner]:
    """The owners a node that applies ``records`` alone knows."""
    fresh = Member(tmp, "fresh", ["a", "b"], loop)
    fresh.sessions.serving = False
    fresh.sessions.apply(records)
    return fresh.sessions.owners


def cluster_member(tmp: Path, name: str, names: list[str], loop: Any) -> Member:
    """A member whose router tells its ClusterSessions of each session it ends."""
    m = Member(tmp, name, names, loop)
    m.harness.router.state.hooks = ClusterHooks(m.sessions)
    return m


def test_sessions_that_end_leave_no_claim_after_compaction(tmp_path: Path) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        names = ["a", "b"]
        a, b = (cluster_member(tmp_path, n, names, loop) for n in names)
        log = Log([a, b])
        for i in range(20):
            m, cid = (a, b)[i % 2], f"short-{i}"
            claim = loop.create_task(m.sessions.claim(cid, lambda answer: answer))
            await log.settle()
            assert await claim == NEW
            link, session = m.harness.connect(cid, clean=i % 4 < 2, expiry=0 if i % 3 else 5)
            if i % 3:
                m.harness.disconnect(session, link)  # a clean session: it ends now
            else:
                m.harness.disconnect(session, link)
                m.harness.tick(6)  # past its expiry [MQTT-3.1.2-11.2]
            await turns()
            await log.settle()
        keys = {r.topic for r in compacted(log.committed)}
        assert not {k for k in keys if "short-" in k}, sorted(keys)
        assert all(not m.sessions.owners for m in (a, b))
        assert all(not m.sessions.claims.live for m in (a, b))  # nor their latest claims
        assert len(a.sessions.claims.over) == 20  # kept a while (forwards.zombies)

    asyncio.run(run())


def test_an_end_committed_after_another_nodes_claim_leaves_that_claim(tmp_path: Path) -> None:
    """Node a ends its session (a clean session disconnects) while its client connects on b:
    b's claim is committed before a's tombstone. b still owns the client id, everywhere, and
    in what compaction leaves of the log."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        names = ["a", "b"]
        a, b = (cluster_member(tmp_path, n, names, loop) for n in names)
        log = Log([a, b])
        first = loop.create_task(a.sessions.claim("dev", lambda answer: answer))
        await log.settle()
        assert await first == NEW
        link, session = a.harness.connect("dev")
        log.commit()
        a.harness.disconnect(session, link)
        await turns()  # a proposed the end of its ownership (epoch 1)
        second = loop.create_task(b.sessions.claim("dev", lambda answer: answer))
        await turns()  # b proposed its claim (epoch 2)
        log.commit(b, a)  # b's claim first, then a's end
        await log.settle()
        assert await second == NEW
        assert a.sessions.owners["dev"] == b.sessions.owners["dev"] == Owner(b.node.id, 2)
        assert owners_from(tmp_path, compacted(log.committed), loop) == {"dev": Owner(b.node.id, 2)}

    asyncio.run(run())


def test_racing_claims_leave_the_winner_in_the_compacted_log(tmp_path: Path) -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        names = ["a", "b"]
        a, b = (Member(tmp_path, n, names, loop) for n in names)
        log = Log([a, b])
        a_claim = loop.create_task(a.sessions.claim("dev", lambda answer: answer))
        b_claim = loop.create_task(b.sessions.claim("dev", lambda answer: answer))
        await turns()
        log.commit(a, b)  # b's claim of epoch 1 loses: the last record is stale
        await log.settle()
        await a_claim
        await b_claim  # b claimed again above a, which released it
        want = {"dev": Owner(b.node.id, 2)}
        assert a.sessions.owners == b.sessions.owners == want
        assert owners_from(tmp_path, compacted(log.committed), loop) == want
        # A release alone (its claim compacted away) names the owner too.
        release = claim_record("a", 7, "x", released_by="b")
        assert owners_from(tmp_path / "r", [release], loop) == {"x": Owner(a.node.id, 7)}
        # A stale claim compaction kept (the winner's dropped), then the winner's assertion.
        kept = [claim_record("a", 1, "y"), claim_record("b", 1, "y", asserted=True)]
        assert owners_from(tmp_path / "s", kept, loop) == {"y": Owner(b.node.id, 1)}

    asyncio.run(run())


def test_a_release_committed_after_the_end_ends_the_claim_again(tmp_path: Path) -> None:
    """A release applied where nobody holds the client id names its owner; if that owner's
    session ended already, it writes the end again, so no claim outlives the session."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a = cluster_member(tmp_path, "a", ["a", "b"], loop)
        log = Log([a])
        claim = loop.create_task(a.sessions.claim("dev", lambda answer: answer))
        await log.settle()
        assert await claim == NEW
        link, session = a.harness.connect("dev")
        a.harness.disconnect(session, link)
        await turns()
        await log.settle()
        assert "dev" not in a.sessions.owners
        late = claim_record("a", 1, "dev", released_by="b")  # b's release, committed late
        a.sessions.apply([late])
        log.committed.append(late)
        assert a.sessions.owners["dev"] == Owner(a.node.id, 1)
        await turns()
        await log.settle()
        assert "dev" not in a.sessions.owners
        assert not [r for r in compacted(log.committed) if "dev" in r.topic]

    asyncio.run(run())


class Directory:
    """What ClusterSessions asks of a node's session directory (several workers): who holds
    each client id here, and the surrenders it asked for."""

    def __init__(self, held: dict[str, int]) -> None:
        self.registry = held
        self.surrendered: list[str] = []

    async def surrender(self, client_id: str) -> bytes | None:
        self.surrendered.append(client_id)
        self.registry.pop(client_id, None)
        return b"{}"


def test_claims_applied_while_catching_up_take_nothing_from_the_session_held_now(
    tmp_path: Path,
) -> None:
    """A node of several workers catching up at start applies its client id's old claims,
    among them others' claims that took the session from it back then. The surrenders they
    asked for ran once the node served again, took the session from the connection holding
    it now, at its later epoch (a persistent session lost), and wrote stale releases."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a = Member(tmp_path, "a", ["a", "b"], loop)
        s = a.sessions
        s.serving = False  # catching up
        s.directory = Directory({"dev": 0})  # type: ignore[assignment]
        s.apply([claim_record("a", 1, "dev"), claim_record("b", 2, "dev")])
        s.apply([claim_record("b", 2, "dev", released_by="a"), claim_record("a", 3, "dev")])
        s.serving = True  # caught up: it holds dev at epoch 3
        await turns()
        assert s.directory.surrendered == []  # type: ignore[union-attr]
        assert s.directory.registry == {"dev": 0}
        assert not [r for r in a.appended() if b"released_by" in r.payload]

        # A current claim from elsewhere is surrendered to (also while catching up: a
        # connection the node took meanwhile must close [MQTT-3.1.4-3]).
        s.apply([claim_record("b", 4, "dev")])
        await turns()
        assert s.directory.surrendered == ["dev"]  # type: ignore[union-attr]
        released = [orjson.loads(r.payload) for r in a.appended() if b"released_by" in r.payload]
        assert released == [{"node": "b", "epoch": 4, "released_by": "a"}]

    asyncio.run(run())


def test_a_client_back_here_while_this_nodes_end_of_its_ownership_is_in_flight_claims_anew(
    tmp_path: Path,
) -> None:
    """A clean session ends on a (its ownership's tombstone proposed) and its client is
    back on a at once, and on b too. a took the connection as still held ("here") and,
    once its end applied, asserted the ownership at the epoch b's claim had taken right
    after the end: the assertion took the ownership back from b, both connections went on
    and a will was lost. a now waits for its end and claims anew: the log decides."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a, b = (Member(tmp_path, n, ["a", "b"], loop) for n in ("a", "b"))
        log = Log([a, b])
        assert await claimed(a, log, "dev") == NEW
        a.sessions.session_ended("dev")
        await turns()
        at_a = loop.create_task(a.sessions.claim("dev", lambda answer: answer))
        await turns()
        assert not at_a.done(), "taken as held here while its end was in flight"
        log.commit(a)  # the end applies: a's claim is made anew
        await turns()
        at_b = loop.create_task(b.sessions.claim("dev", lambda answer: answer))
        await turns()
        log.commit(b, a)  # b's claim first (epoch 1), a's of the same epoch loses
        await log.settle()
        assert await at_b == NEW and await at_a == NEW  # a took it from b (epoch 2)
        assert {m.sessions.owners["dev"] for m in (a, b)} == {Owner(a.node.id, 2)}
        asserted = [orjson.loads(r.payload) for r in log.committed if b"asserted" in r.payload]
        assert [x for x in asserted if x["node"] == "a"] == []  # (b answered a's lost claim)

    asyncio.run(run())


def test_a_client_back_while_its_end_never_applies_is_taken_as_held_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``$sessions`` leader: the end of the ownership is not applied within the wait,
    and the connection is taken as held here, as before; the next one does not wait."""
    monkeypatch.setattr(replicated_sessions, "TAKEOVER_TIMEOUT", 0.05)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        a = Member(tmp_path, "a", ["a", "b"], loop)
        log = Log([a])
        assert await claimed(a, log, "dev") == NEW
        a.sessions.session_ended("dev")
        await turns()
        assert await asyncio.wait_for(a.sessions.claim("dev", lambda x: x), 2) == HERE
        assert "dev" not in a.sessions._ending
        assert await asyncio.wait_for(a.sessions.claim("dev", lambda x: x), 0.04) == HERE

    asyncio.run(run())


def test_another_nodes_claim_refuses_what_this_node_holds_of_the_clients_records(
    tmp_path: Path,
) -> None:
    """A's held records of "dev" (a leader election under way) would go out after what its
    client publishes on b once b's claim won: every worker of a refuses them as it applies the
    claim (broker.workers.forwards.refuse_held); b, the claimant, refuses nothing."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        names = ["a", "b"]
        a, b = (Member(tmp_path, n, names, loop) for n in names)
        outcomes: list[int | None] = []
        held = {}
        for m in (a, b):
            record = Record(-1, 0, "t", b"1", 1, False, "dev")
            held[m] = SimpleNamespace(held=[([record], [outcomes.append], 9.0)])
            m.harness.router.partitions[("held here", 0)] = held[m]  # type: ignore[index]
        log = Log([a, b])
        assert await claimed(a, log, "dev") == NEW
        assert held[b].held == [] and outcomes == [None]  # b applied a's claim
        assert len(held[a].held) == 1
        a.harness.connect("dev", clean=False, expiry=300)
        assert (await claimed(b, log, "dev"))[:1] == STATE
        assert held[a].held == [] and outcomes == [None, None]

    asyncio.run(run())
