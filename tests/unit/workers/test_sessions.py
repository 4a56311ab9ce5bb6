"""The session directory: claims, hand-overs and restarts between real meshes in one loop,
with a dictionary standing in for each worker's router."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from broker.net.context import HERE, NEW, STATE
from broker.workers.mesh import Mesh
from broker.workers.sessions import ClaimRefused, SessionDirectory, home_of
from tests.unit.workers.test_mesh import run, until


class FakeWorker:
    """A directory whose "router" is a dict client id -> state; ``log`` is $sessions."""

    def __init__(self, tmp: Path, index: int, count: int, log: dict[str, bytes]) -> None:
        self.held: dict[str, bytes] = {}
        self.closed: list[str] = []  # connections closed as "taken over"
        self.log = log
        self.dir = SessionDirectory(index, count)
        self.dir.hand_over = self.hand_over
        self.dir.restore = self.restore
        self.dir.held_ids = lambda: list(self.held)
        self.mesh = Mesh(tmp, index, count, self.dir.handlers(), on_peer_down=self.dir.peer_down)
        self.dir.mesh = self.mesh
        #: Connections being handed from here (broker.workers.handoff): client id -> token;
        #: and the hand-offs' releases asked of this worker.
        self.in_flight: dict[str, int] = {}
        self.released: list[tuple[str, int]] = []
        self.dir.release_handed = self.release_handed
        #: Client ids with a ``$sessions`` record written here not answered yet, and what
        #: waits for it (the router's ``after_written``).
        self.writing: dict[str, list[Callable[[], None]]] = {}
        self.dir.after_written = self.after_written

    def after_written(self, client_id: str, then: Callable[[], None]) -> None:
        if client_id in self.writing:
            self.writing[client_id].append(then)
        else:
            then()

    def answered(self, client_id: str) -> None:
        """The records of ``client_id`` written here are answered."""
        for then in self.writing.pop(client_id):
            then()

    def hand_over(self, client_id: str) -> bytes | None:
        if client_id not in self.held:
            return None
        self.closed.append(client_id)
        return self.held.pop(client_id)

    def release_handed(self, client_id: str, token: int) -> bytes | None:
        self.released.append((client_id, token))
        if self.in_flight.get(client_id) != token or client_id not in self.held:
            return None  # not that connection's session (taken over meanwhile)
        return self.held.pop(client_id)

    def adopt_handed(self, client_id: str) -> Callable[[bytes], bytes]:
        """``adopt`` of a connection handed here: the session comes with its state."""

        def adopt(answer: bytes) -> bytes:
            if answer.startswith(STATE):
                self.held[client_id] = answer[1:]
            return answer

        return adopt

    def load(self) -> list[str]:
        """What a starting worker does after ``held_elsewhere``: the sessions homed here that
        no peer holds come from the log, held here (``Router.load``), and claims are
        decided from then on."""
        ids = [
            c
            for c in self.log
            if home_of(c, self.dir.count) == self.dir.worker and c not in self.dir.registry
        ]
        for c in ids:
            self.held[c] = self.log[c]
        self.dir.loaded(ids)
        return ids

    def restore(self, client_ids: list[str]) -> list[str]:
        found = [c for c in client_ids if c in self.log]
        for c in found:
            self.held[c] = self.log[c]
        return found

    async def connect(self, client_id: str, state: bytes = b"{}") -> bytes:
        """What the transport does on CONNECT: claim, then create or adopt the session."""

        def adopt(answer: bytes) -> bytes:
            if answer == NEW:
                self.held[client_id] = state
            elif answer.startswith(STATE):
                self.held[client_id] = answer[1:]
            else:
                assert answer == HERE and client_id in self.held
            self.log[client_id] = self.held[client_id]
            return answer

        return await self.dir.claim(client_id, adopt)


async def cluster(tmp: Path, count: int, log: dict[str, bytes]) -> list[FakeWorker]:
    workers = [FakeWorker(tmp, i, count, log) for i in range(count)]
    for w in workers:
        await w.mesh.start()
    for w in workers:
        await w.mesh.wait_connected(5)
    for w in workers:
        await w.dir.held_elsewhere()
        w.load()
    return workers


async def held_by_worker_1(tmp_path: Path, state: bytes) -> tuple[list[FakeWorker], str]:
    """Three workers; a client id homed at worker 0 whose session (``state``) worker 1
    holds."""
    w = await cluster(tmp_path, 3, {})
    cid = ids_homed_at(0, 3, 1)[0]
    assert await w[1].connect(cid, state) == NEW
    return w, cid


async def claimant_dying_in_its_claim(
    tmp_path: Path,
) -> tuple[list[FakeWorker], str, asyncio.Future[bytes]]:
    """Worker 1 holds a session homed at worker 0; worker 2 claims it and dies while the
    home waits for worker 1's release (its records not answered yet: ``answered`` lets it
    go on). Returns the workers, the client id and the dead claimant's claim."""
    w, cid = await held_by_worker_1(tmp_path, b'{"subs":1}')
    w[1].writing[cid] = []  # the release's answer waits for its records
    claim = asyncio.ensure_future(w[2].connect(cid))
    await until(lambda: w[1].closed == [cid])
    await w[2].mesh.close()  # the claimant dies
    await until(lambda: 2 not in w[0].mesh.peers)
    return w, cid, claim


def ids_homed_at(home: int, count: int, n: int = 3) -> list[str]:
    return [c for c in (f"client-{i}" for i in range(100)) if home_of(c, count) == home][:n]


def test_a_session_follows_its_client_from_worker_to_worker(tmp_path: Path) -> None:
    async def main() -> None:
        log: dict[str, bytes] = {}
        w = await cluster(tmp_path, 3, log)
        for home in range(3):
            cid = ids_homed_at(home, 3, 1)[0]
            assert await w[0].connect(cid, b'{"subs":1}') == NEW
            assert await w[0].connect(cid) == HERE  # a reconnect to the same worker
            # The client comes back through worker 1, then 2: the state goes with it.
            assert await w[1].connect(cid) == STATE + b'{"subs":1}'
            assert cid not in w[0].held and w[0].closed == [cid]
            assert await w[2].connect(cid) == STATE + b'{"subs":1}'
            assert list(w[2].held) == [cid] and w[1].closed == [cid]
            assert w[home].dir.registry[cid] == 2
            w[0].closed.clear()
            w[1].closed.clear()
            w[2].held.clear()
            w[2].dir.ended(cid)
            await until(lambda cid=cid, home=home: cid not in w[home].dir.registry)
        for x in w:
            await x.mesh.close()

    run(main)


def test_a_session_leaves_its_holder_once_its_records_there_are_answered(
    tmp_path: Path,
) -> None:
    """The holder's ``$sessions`` records of a client id (the state its lost connection
    left, a clean session's tombstone) travel to the stream's owner on the holder's socket,
    the next holder's on its own: the release is answered only once the holder's are
    answered, or the older record could be appended last and undo the newer (a will lost
    at the next holder's death). Whether the holder is the home or not."""

    async def main() -> None:
        log: dict[str, bytes] = {}
        w = await cluster(tmp_path, 3, log)
        for home in range(3):
            cid = ids_homed_at(home, 3, 1)[0]
            assert await w[1].connect(cid, b'{"will":1}') == NEW
            w[1].writing[cid] = []  # its connection lost: its state written, not answered
            claim = asyncio.ensure_future(w[2].connect(cid))
            await until(lambda cid=cid: w[1].closed == [cid])  # released at once...
            await asyncio.sleep(0.05)
            assert not claim.done()  # ...but not answered
            w[1].answered(cid)
            assert await claim == STATE + b'{"will":1}'
            assert w[home].dir.registry[cid] == 2
            w[1].closed.clear()
            w[2].held.clear()
            w[2].dir.ended(cid)
            await until(lambda cid=cid, home=home: cid not in w[home].dir.registry)
        for x in w:
            await x.mesh.close()

    run(main)


def test_simultaneous_claims_end_with_one_holder(tmp_path: Path) -> None:
    async def main() -> None:
        log: dict[str, bytes] = {}
        w = await cluster(tmp_path, 3, log)
        cid = ids_homed_at(0, 3, 1)[0]
        answers = await asyncio.gather(*(w[i % 3].connect(cid, b"s") for i in range(12)))
        holders = [i for i in range(3) if cid in w[i].held]
        assert len(holders) == 1
        assert w[0].dir.registry[cid] == holders[0]
        assert answers.count(NEW) == 1  # created once; every later claim took it over
        for x in w:
            await x.mesh.close()

    run(main)


def test_a_dead_workers_sessions_are_restored_by_their_homes(tmp_path: Path) -> None:
    async def main() -> None:
        log: dict[str, bytes] = {}
        w = await cluster(tmp_path, 2, log)
        homed_at_0 = ids_homed_at(0, 2)
        homed_at_1 = ids_homed_at(1, 2)
        for cid in homed_at_0 + homed_at_1:
            await w[1].connect(cid, cid.encode())
        # Worker 1 dies: worker 0 takes back the sessions homed at 0, from the log.
        await w[1].mesh.close()
        await until(lambda: all(c in w[0].held for c in homed_at_0))
        assert all(w[0].dir.registry[c] == 0 for c in homed_at_0)
        # Its replacement holds nothing yet: it learns what worker 0 holds of its home
        # sessions (nothing) and would load the rest from the log itself.
        again = FakeWorker(tmp_path, 1, 2, log)
        await again.mesh.start()
        await again.mesh.wait_connected(5)
        assert await again.dir.held_elsewhere() == {}
        again.load()
        # A client homed at 0 reconnecting through the new worker 1 gets its state back.
        assert await again.connect(homed_at_0[0]) == STATE + homed_at_0[0].encode()
        await again.mesh.close()
        await w[0].mesh.close()

    run(main)


def test_a_restarted_worker_learns_which_of_its_sessions_live_elsewhere(tmp_path: Path) -> None:
    async def main() -> None:
        log: dict[str, bytes] = {}
        w = await cluster(tmp_path, 2, log)
        homed_at_1 = ids_homed_at(1, 2)
        for cid in homed_at_1:
            await w[0].connect(cid, cid.encode())
        await w[1].mesh.close()  # worker 1 (their home) dies; worker 0 keeps serving them
        again = FakeWorker(tmp_path, 1, 2, log)
        await again.mesh.start()
        await again.mesh.wait_connected(5)
        held = await again.dir.held_elsewhere()
        assert held == dict.fromkeys(homed_at_1, 0)
        assert again.load() == []  # all of them live elsewhere
        # So a reconnect through worker 1 takes them over from worker 0, state and all.
        assert await again.connect(homed_at_1[0]) == STATE + homed_at_1[0].encode()
        assert w[0].closed == [homed_at_1[0]]
        await again.mesh.close()
        await w[0].mesh.close()

    run(main)


def test_a_claim_reaching_a_restarting_home_waits_for_its_sessions_from_the_log(
    tmp_path: Path,
) -> None:
    """Worker 1, home and holder of some sessions, dies; their clients reconnect through
    worker 0, whose claims reach the new worker 1 as soon as its mesh is up, before it has
    loaded its sessions from the log: they wait for them and take them over, state and
    all. Deciding them on the empty registry answered "new": the sessions were lost."""

    async def main() -> None:
        log: dict[str, bytes] = {}
        w = await cluster(tmp_path, 2, log)
        homed_at_1 = ids_homed_at(1, 2)
        for cid in homed_at_1:
            await w[1].connect(cid, cid.encode())
        await w[1].mesh.close()  # dies holding them
        again = FakeWorker(tmp_path, 1, 2, log)
        await again.mesh.start()
        await again.mesh.wait_connected(5)
        claims = [asyncio.ensure_future(w[0].connect(cid)) for cid in homed_at_1]
        await asyncio.sleep(0.2)
        assert not any(c.done() for c in claims), "decided before the home knew its sessions"
        assert await again.dir.held_elsewhere() == {}
        assert sorted(again.load()) == sorted(homed_at_1)
        answers = await asyncio.gather(*claims)
        assert answers == [STATE + cid.encode() for cid in homed_at_1]
        assert sorted(w[0].held) == sorted(homed_at_1) and not again.held
        await again.mesh.close()
        await w[0].mesh.close()

    run(main)


class NodeClaims:
    """The node's claims as a cluster makes them (broker.workers.replicated_sessions):
    ``answers`` says what the next claim of a client id gets; an Exception is raised."""

    def __init__(self) -> None:
        self.answers: dict[str, bytes | Exception] = {}
        self.claimed: list[str] = []
        self.ended: list[str] = []
        self.left: dict[str, bytes] = {}

    async def claim(self, client_id: str, adopt: Callable[[bytes], bytes]) -> bytes:
        self.claimed.append(client_id)
        answer = self.answers.pop(client_id, HERE)
        if isinstance(answer, Exception):
            raise answer
        return adopt(answer)

    def session_ended(self, client_id: str) -> None:
        self.ended.append(client_id)

    @property
    def fence(self) -> NodeClaims:
        return self

    def hand_left(self, client_id: str, state: bytes) -> bytes:
        """broker.workers.will_fence: a will left to an orphan's adopter goes with the state."""
        will = self.left.pop(client_id, None)
        return state if will is None else state + will


def test_on_a_cluster_node_the_home_claims_for_the_node_first(tmp_path: Path) -> None:
    async def main() -> None:
        log: dict[str, bytes] = {}
        w = await cluster(tmp_path, 2, log)
        node = NodeClaims()
        for x in w:
            x.dir.cluster = node
        cid = ids_homed_at(0, 2, 1)[0]
        # Held by another node: its final state comes with the node's claim.
        node.answers[cid] = STATE + b'{"from":"n2"}'
        assert await w[1].connect(cid) == STATE + b'{"from":"n2"}'
        assert w[0].dir.registry[cid] == 1 and node.claimed == [cid]
        # Held here: the workers decide as without a cluster.
        assert await w[0].connect(cid) == STATE + b'{"from":"n2"}'
        assert w[1].closed == [cid] and w[0].dir.registry[cid] == 0
        # Another node takes it: the worker holding it gives it up, with its state.
        assert await w[0].dir.surrender(cid) == b'{"from":"n2"}'
        assert w[0].closed == [cid] and cid not in w[0].dir.registry
        # A node claim that fails refuses the CONNECT, also through another worker.
        node.answers[cid] = RuntimeError("no leader")
        with pytest.raises(ClaimRefused):
            await w[1].connect(cid)
        # Taken from another worker than its home: the will that worker left to an
        # orphan's adopter comes with its state.
        assert await w[1].connect(cid) == NEW
        node.left[cid] = b"+will"
        assert await w[0].dir.surrender(cid) == b"{}+will" and not node.left
        # Not to a CONNECT on another worker of this node (it claims it back first).
        assert await w[1].connect(cid) == NEW
        node.left[cid] = b"+will"
        assert await w[0].connect(cid) == STATE + b"{}" and node.left == {cid: b"+will"}
        node.left.clear()
        assert await w[0].dir.surrender(cid) == b"{}"
        # A session that ends ends the node's claim.
        assert await w[1].connect(cid) == NEW
        w[1].held.clear()
        w[1].dir.ended(cid)
        await until(lambda: node.ended == [cid])
        for x in w:
            await x.mesh.close()

    run(main)


def test_a_handed_connections_claim_holds_only_while_its_sender_holds_the_session(
    tmp_path: Path,
) -> None:
    """broker.workers.handoff: worker 0 hands a connection to worker 1, which claims the
    session on the condition that worker 0 still holds it for that hand-off (its token)."""

    async def main() -> None:
        log: dict[str, bytes] = {}
        w = await cluster(tmp_path, 3, log)

        for home in range(3):  # the home: the sender, the taker, or a third worker
            cid = ids_homed_at(home, 3, 1)[0]
            assert await w[0].connect(cid, b'{"s":1}') == NEW
            w[0].in_flight[cid] = 5
            answer = await w[1].dir.claim_handed(cid, 0, 5, w[1].adopt_handed(cid))
            assert answer == STATE + b'{"s":1}'
            assert w[home].dir.registry[cid] == 1 and w[1].held[cid] == b'{"s":1}'
            assert cid not in w[0].held and w[0].closed == []  # nothing closed: it moved
            # Taken over (a new connection at worker 2) before a hand-off from worker 1
            # to worker 0 claims: that claim is refused, the sender not even asked.
            assert await w[2].connect(cid) == STATE + b'{"s":1}'
            w[1].in_flight[cid] = 6
            asked = sum(len(x.released) for x in w)
            refused = await w[0].dir.claim_handed(cid, 1, 6, w[0].adopt_handed(cid))
            assert refused == b"X" and sum(len(x.released) for x in w) == asked
            assert w[home].dir.registry[cid] == 2
            # The sender no longer holds it for that hand-off (its token is another's):
            # refused, and the registry stays.
            w[2].in_flight[cid] = 7
            assert await w[0].dir.claim_handed(cid, 2, 8, w[0].adopt_handed(cid)) == b"X"
            assert w[home].dir.registry[cid] == 2 and cid in w[2].held
        for x in w:
            await x.mesh.close()

    run(main)


def test_a_takeover_at_the_sender_racing_its_hand_off_leaves_one_holder(tmp_path: Path) -> None:
    """A new connection of the client reaches the worker handing its old one (0 -> 1) while
    that hand-off claims: the home answers the new connection's claim ("here") and, right
    behind it, asks the sender to release the session for the hand-off. The release waits
    until the new connection has the session (as a takeover's release does): the hand-off
    is refused and the session held once [MQTT-3.1.4-3]. Released first, the session went
    to worker 1 with the old connection while worker 0 served the new one."""

    async def main() -> None:
        log: dict[str, bytes] = {}
        w = await cluster(tmp_path, 3, log)

        async def new_connection(cid: str) -> bytes:
            def adopt(answer: bytes) -> bytes:
                w[0].in_flight.pop(cid, None)  # the new connection takes the session here
                if answer.startswith(STATE):
                    w[0].held[cid] = answer[1:]
                else:  # "new", or "here": the session held here, or a new one if none is
                    w[0].held.setdefault(cid, b"new")
                return answer

            return await w[0].dir.claim(cid, adopt)

        for cid in ids_homed_at(2, 3, 20):
            assert await w[0].connect(cid, b"s") == NEW
            w[0].in_flight[cid] = 5
            answers = await asyncio.gather(
                new_connection(cid), w[1].dir.claim_handed(cid, 0, 5, w[1].adopt_handed(cid))
            )
            holders = [i for i in range(3) if cid in w[i].held]
            assert len(holders) == 1, (cid, answers, holders)
            assert w[2].dir.registry[cid] == holders[0]
        for x in w:
            await x.mesh.close()

    run(main)


def test_a_holder_claiming_again_while_another_claim_takes_it_does_not_wait_forever(
    tmp_path: Path,
) -> None:
    """The client reconnects at the worker holding its session (0) and at another (1) at
    once. When 1's claim is decided first, the home asks 0 to release while 0's own claim
    waits at the home behind that decision: 0 releases at once (its claim is not
    answered yet), then its claim takes the session back. Held once, no claim stuck."""

    async def main() -> None:
        log: dict[str, bytes] = {}
        w = await cluster(tmp_path, 3, log)
        for n, cid in enumerate(ids_homed_at(2, 3, 20)):
            assert await w[0].connect(cid, b"s") == NEW
            first, second = (w[1], w[0]) if n % 2 else (w[0], w[1])
            await asyncio.wait_for(asyncio.gather(first.connect(cid), second.connect(cid)), 3)
            holders = [i for i in range(3) if cid in w[i].held]
            assert len(holders) == 1 and w[2].dir.registry[cid] == holders[0]
            assert log[cid] == b"s"  # the state went along each time
        for x in w:
            await x.mesh.close()

    run(main)


@pytest.mark.timeout(30)
def test_a_claimant_dying_while_its_claim_is_decided_leaves_the_session_at_its_home(
    tmp_path: Path,
) -> None:
    """The claimant dies while the home waits for the holder's release: the registry must
    not name the dead worker (every later claim would ask it, fail at once and ask again,
    without the home's loop ever yielding: the worker hung); the session comes back to its
    home from the log, as the sessions a dead worker held do."""

    async def main() -> None:
        w, cid, claim = await claimant_dying_in_its_claim(tmp_path)
        w[1].answered(cid)
        await until(lambda: cid in w[0].held)
        assert w[0].dir.registry[cid] == 0
        claim.cancel()  # (its worker is dead: it would retry until its patience ran out)
        # A later claim is decided at once, with the state from the log.
        assert await asyncio.wait_for(w[1].connect(cid), 5) == STATE + b'{"subs":1}'
        for x in w[:2]:
            await x.mesh.close()

    run(main)


def test_a_claimant_dead_and_restarted_while_its_claim_is_decided_does_not_keep_the_session(
    tmp_path: Path,
) -> None:
    """As above, but the claimant's replacement is up before the decision ends: the entry
    must not name it (it holds nothing, and would answer the next claim "new": the session
    lost); the session comes back to its home from the log."""

    async def main() -> None:
        w, cid, claim = await claimant_dying_in_its_claim(tmp_path)
        claim.cancel()
        again = FakeWorker(tmp_path, 2, 3, w[0].log)  # and is restarted
        await again.mesh.start()
        await again.mesh.wait_connected(5)
        await until(lambda: 2 in w[0].mesh.peers)
        w[1].answered(cid)
        await until(lambda: cid in w[0].held)
        assert w[0].dir.registry[cid] == 0
        assert await asyncio.wait_for(again.connect(cid), 5) == STATE + b'{"subs":1}'
        for x in (w[0], w[1], again):
            await x.mesh.close()

    run(main)


def test_a_worker_replaced_before_its_end_was_read_is_handled_as_dead_first(
    tmp_path: Path,
) -> None:
    """A restarted worker's channel can reach a peer before the old channel's end is read
    (a paused peer reads both in one pass): the old worker's death is handled first (its
    sessions taken back from the log), or the registry would name the replacement for
    sessions it never held."""

    async def main() -> None:
        log: dict[str, bytes] = {}
        w = await cluster(tmp_path, 2, log)
        cid = ids_homed_at(0, 2, 1)[0]
        assert await w[1].connect(cid, b'{"subs":1}') == NEW
        old = w[0].mesh.peers[1]
        old.transport.pause_reading()  # its end is not read before the replacement's HELLO
        await w[1].mesh.close()
        again = FakeWorker(tmp_path, 1, 2, log)
        await again.mesh.start()
        await again.mesh.wait_connected(5)
        await until(lambda: w[0].mesh.peers.get(1) not in (None, old))
        assert w[0].dir.registry[cid] == 0 and w[0].held[cid] == b'{"subs":1}'
        assert await asyncio.wait_for(again.connect(cid), 5) == STATE + b'{"subs":1}'
        await again.mesh.close()
        await w[0].mesh.close()

    run(main)


@pytest.mark.timeout(30)
def test_a_registry_entry_naming_a_dead_worker_is_taken_back_not_asked_forever(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        w, cid = await held_by_worker_1(tmp_path, b'{"subs":1}')
        await w[2].mesh.close()
        await until(lambda: 2 not in w[0].mesh.peers)
        w[1].held.clear()
        w[0].dir.registry[cid] = 2  # named after its death was seen
        assert await asyncio.wait_for(w[1].connect(cid), 5) == STATE + b'{"subs":1}'
        assert w[0].dir.registry[cid] == 1
        for x in w[:2]:
            await x.mesh.close()

    run(main)


def test_an_end_told_while_a_new_claim_from_the_same_worker_is_under_way_is_not_sent(
    tmp_path: Path,
) -> None:
    """A session ends on worker 1 and its end is told to the home late (once its tombstone
    is answered), while a new connection there already claims the client id: the home
    answered that claim "here", and an end read after it took the entry away, so that the
    next claim, on another worker, started a second session while the first connection
    went on (two holders [MQTT-3.1.4-3], its will never published)."""

    async def main() -> None:
        w, cid = await held_by_worker_1(tmp_path, b"a")
        del w[1].held[cid]  # its session ended with its connection (a clean session)

        def adopt(answer: bytes) -> bytes:
            w[1].dir.ended(cid)  # the end, told between the claim's answer and its adoption
            w[1].held[cid] = b"b"
            return answer

        assert await w[1].dir.claim(cid, adopt) == HERE
        await asyncio.sleep(0.1)  # (an ENDED sent would have been read by now)
        assert w[0].dir.registry.get(cid) == 1
        assert await w[2].connect(cid) == STATE + b"b"
        assert w[1].closed == [cid]  # the connection on worker 1 closed as taken over
        for x in w:
            await x.mesh.close()

    run(main)


def test_a_release_waits_for_the_records_the_holder_forwarded(tmp_path: Path) -> None:
    """The old connection's last publishes, forwarded by the holder to their partitions'
    owners, are answered before the session is handed to the next connection's worker: the
    new connection's records, forwarded on another socket, could overtake them (a retained
    message acknowledged on the new connection replaced by an older one of the old: one
    churn run with paused workers)."""

    async def main() -> None:
        w, cid = await held_by_worker_1(tmp_path, b"s")
        answered = asyncio.Event()
        w[1].dir.settled = answered.wait  # its forwards not answered yet
        claim = asyncio.ensure_future(w[2].connect(cid))
        await until(lambda: w[1].closed == [cid])
        await asyncio.sleep(0.05)
        assert not claim.done()
        answered.set()
        assert await claim == STATE + b"s"
        for x in w:
            await x.mesh.close()

    run(main)
