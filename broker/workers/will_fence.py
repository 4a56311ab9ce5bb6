"""Wills in a cluster: published by exactly one node, fenced by the owner's epoch.

A client id's session is held by the node its claim in ``$sessions`` names, at an epoch
(broker.workers.replicated_sessions). Gossip can declare a node dead while it is alive but
cut off: a survivor then adopts its sessions (broker.workers.orphans) and publishes their
wills, while the cut-off node, until it applies that claim, still holds the connections and
would publish a will too when one drops. So in a cluster a due will (broker.router.lifecycle)
is not published at once: the node holding the session first commits a *will record* on the
client id's ownership key (NUL + the client id: an MQTT string never contains U+0000
[MQTT-1.5.4-2]) naming itself, the epoch it holds, the will and an id. Applied on every node
in log order, the record wins only if its ``(node, epoch)`` is the owner's at that point
(a stale epoch loses, like a stale claim; so does one applied after the session ended): the
winner's worker that proposed it publishes the will, as an ordinary publish to its
partition log, and once that is committed writes an *out* record (an assertion of the owner
naming the will's id). Exactly one node publishes a given will, whatever gossip believes.

**At least once across a crash.** MQTT publishes a will once [MQTT-3.1.2-8]; a node that
dies between its will record and the commit of the publish may or may not have published.
Losing the will is the worse fault (it is how the others learn of the client's end), so a
won will record not followed by its out record is *pending* on every node, with the will in
it: the node that claims the session next without the previous owner's release (the adopter
of a dead node, or a CONNECT whose old node did not answer) fences and publishes it again at
its own epoch, and the holder itself does so on restart. A duplicate is possible only then.
The end of a session whose will is being fenced here waits for the out record, so no
tombstone removes a pending will.

**Compaction** (replicated_sessions' "Ownership records and compaction"). The out record is
an assertion, so the last ownership record names the owner. A will record kept last (no out
yet) names the owner and the will still pending, as the history says. A will record that lost
is answered like a stale claim: by the owner's assertion, or, if the session ended (its
tombstone came first: an adopter ended a clean session before the cut-off node's record was
committed), by the release its proposer wrote as it applied the claim that superseded it,
which the owner it names ends again, so that compaction removes the key. As for other
records, a compaction of the range between a record and that answer (one commit) can keep
the record alone: a node reading that copy learns the owner from the answer that follows (a
will record is never taken as the owner by itself: it would let the stale one win).

**A connection taken over by a CONNECT on another node** publishes its will (no delay) on
the node that held it, unfenced: the claimant's new connection replaces the will, so nobody
else has it. So does a will whose record lost to such a claim, or to a claim after it by a
third node (the connection dropped, its will being fenced, and the client connected again on
another node at once): the session's state left without it. That node's release of the
session waits for them (at most the claimant's wait), since the claimant, released, trusts
it for them. A claimant that goes on without the release (the old node killed, or cut off)
publishes the will of the connection that the state committed *before its claim* names
(written with the will at that connection's CONNECT; every node applies the claim after that
same state): the old node may have written the state without the will, and been killed
before the will's append (the claimant found no will: bench.churn --cluster 3, node kills).
A duplicate is possible then (at least once). An orphan's claim (``"orphan"`` in the claim)
is not such: the adopter runs the will, and the node it was taken from (paused or cut off
past its death) never does. A will that falls due there once the claim is applied (the live
connection it closes) or whose record lost to it is *left* to the adopter: it goes in that
node's release (:data:`LEFT`), and an adopter that waited for the release publishes it,
fenced at its own epoch; one that went on without (the node still away after its wait) ran
the will of the state it adopted, written at the connection's CONNECT, and ignores the late
release's, unless that state had none (written once the will fell due, the will record
losing): then it publishes the late release's; so does an adopter whose claim a later one
superseded before it resumed (the client back on the old node at once), unfenced. Dropped
instead, as before, the will was lost whenever the node came back within the adopter's wait:
its release carried a state without the will (bench.churn --cluster 3 --kill pause, seed 43:
4-6 wills).

**Cost.** A will waits for one ``$sessions`` commit, applied on the node that proposed it:
on a node that does not lead ``$sessions``, one message after the commit (the leader tells
its followers at once, ``broker.cluster.commits``; it used to wait for the next heartbeat, up
to 100 ms). Measured on three nodes (heartbeat 100 ms): a will reached a subscriber on another
node in a median 202 ms after its client's connection dropped, 102 ms before the fence. With
commit notices (bench/commit_latency.py, two interleaved runs of 20 wills each against the
code before them): 24 ms against 166 ms (medians; 125 ms against 227 ms in an earlier run on
a machine loaded several times over).
One node (no cluster) has none of this: its router publishes a due will at once.

Called only from the worker's event loop.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import orjson

from broker.mqtt.packets import Will
from broker.mqtt.properties import PropertyId
from broker.router.commit import OUTCOME_UNKNOWN
from broker.router.session import will_of, will_state
from broker.router.state import SESSIONS
from broker.router.store import OWNERSHIP

if TYPE_CHECKING:
    from broker.cluster.node import ClusterNode
    from broker.router.router import Router

log = logging.getLogger("broker.cluster")

#: Seconds between proposals of a will record not committed (no ``$sessions`` leader).
RETRY = 1.0

#: The key of a handed state that carries a will left to an orphan's adopter.
LEFT = "left_will"


class Fenced(NamedTuple):
    """A will record that won: the owner's epoch, the will's id, the will (its state)."""

    epoch: int
    id: str
    will: list[Any]
    worker: int


class Holder(Protocol):
    """What this needs of broker.workers.replicated_sessions' ``ClusterSessions``."""

    node: ClusterNode
    worker: tuple[int, int]  # this worker's index, the node's worker count
    router: Router | None
    serving: bool
    owners: dict[str, Any]  # client id -> its Owner (node id, epoch)
    states: dict[str, bytes]  # client id -> its latest state record's payload

    def home(self, client_id: str) -> bool: ...  # this worker acts for ``client_id``


class WillFence:
    """This worker's part in publishing wills once across the cluster (module docstring)."""

    def __init__(self, sessions: Holder) -> None:
        self.sessions = sessions
        #: Client id -> its will fenced in ``$sessions`` and not out yet (every node).
        self.pending: dict[str, Fenced] = {}
        #: Client id -> the ids of the wills this worker proposed that are not out yet
        #: (several: a new connection's may go out while an older one's record waits for a
        #: leader; keeping only the last lost the older one when its record lost, in churn).
        self.mine: dict[str, set[str]] = {}
        #: Client ids whose session a CONNECT on another node took from this node.
        self.taken: set[str] = set()
        #: Client id -> the will of the connection the state before this node's CONNECT's
        #: claim of it names (:meth:`claimed`), published if the claim goes on unreleased.
        self.handed: dict[str, list[Any]] = {}
        #: Client ids an orphan's claim took from this node (:meth:`claimed`), and their
        #: wills that fell due here since: the adopter's, handed to it with the release.
        self.orphaned: set[str] = set()
        self.left: dict[str, list[Any]] = {}
        #: Client id -> the epoch of this node's orphan claim of it whose release may hand
        #: it a will (:meth:`released`); the will a release handed a claim not resumed yet.
        self.adopting: dict[str, int] = {}
        self.given: dict[str, list[Any] | None] = {}
        #: Client id -> what waits for this worker's will of it to be out (or lost).
        self._after: dict[str, list[Callable[[], None]]] = {}
        self._out: dict[str, str] = {}
        self._ids = (f"{uuid.uuid4().hex[:8]}-{n}" for n in itertools.count())
        self.published = 0
        self.dropped = 0

    def busy(self, client_id: str) -> bool:
        """Whether this worker fences or publishes a will of ``client_id`` (its end waits)."""
        return client_id in self.mine

    def after_will(
        self, client_id: str, then: Callable[[], None], within: float | None = None
    ) -> None:
        """``then()`` once this worker's wills of ``client_id`` are out or lost (at once if
        none is going out), or after ``within`` seconds: with several workers, the end of a
        session held by a worker other than its home, so that its tombstone follows the will
        record; a release of the session (broker.workers.replicated_sessions)."""
        if client_id not in self.mine:
            return then()
        waiting = self._after.setdefault(client_id, [])
        waiting.append(then)
        if within is not None:

            def late() -> None:
                if then in waiting:
                    waiting.remove(then)
                    then()

            self.sessions.node.loop.call_later(within, late)

    def _done(self, client_id: str, wid: str) -> None:
        """This worker's will ``wid`` of ``client_id`` is out, or lost."""
        ids = self.mine.get(client_id)
        if ids is None or wid not in ids:
            return
        ids.discard(wid)
        if ids:
            return
        del self.mine[client_id]
        waiting = self._after.pop(client_id, [])
        ready, waiting[:] = list(waiting), []  # (none left for a late() to call)
        for then in ready:
            then()

    def _is_mine(self, client_id: str, wid: str) -> bool:
        return wid in self.mine.get(client_id, ())

    # -- a will is due here (the router) ----------------------------------------------------

    def will_now(self, client_id: str, will: Will) -> bool:
        """The router's will of ``client_id`` is due: False, it is fenced first, or goes out
        unfenced if a CONNECT elsewhere took the connection over, or is dropped (another
        node holds the session); True only where the log names no owner (a session written
        before the cluster)."""
        s = self.sessions
        owner = s.owners.get(client_id)
        if owner is None or s.router is None:
            return True
        state = will_state(will)
        if owner.node != s.node.id:
            if client_id in self.taken:
                # A CONNECT there took the connection over: nobody else has this will (the
                # claimant's connection replaces it). Out from here, unfenced; the release
                # waits for it (module docstring).
                wid = next(self._ids)
                self.mine.setdefault(client_id, set()).add(wid)
                self._send(client_id, state, partial(self._done, client_id, wid))
                return False
            if client_id in self.orphaned:
                self.left[client_id] = state  # the adopter's (module docstring)
                return False
            self.dropped += 1
            log.info(
                "cluster: %s: will not published here: node %s holds the session (epoch %d)",
                client_id,
                s.node.names.get(owner.node, owner.node),
                owner.epoch,
            )
            return False
        pending = self.pending.get(client_id)
        if pending is not None and pending.will == state:
            return False  # already fenced (the state adopted still had it)
        self._propose(client_id, owner.epoch, state)
        return False

    def _propose(self, client_id: str, epoch: int, state: list[Any]) -> None:
        s = self.sessions
        wid = next(self._ids)
        self.mine.setdefault(client_id, set()).add(wid)
        body = {"node": s.node.name, "epoch": epoch, "will": state, "id": wid, "w": s.worker[0]}

        def again() -> bool:  # while this node holds the session at that epoch, as applied
            if not self._is_mine(client_id, wid):
                return False
            if s.owners.get(client_id) == (s.node.id, epoch):
                return True
            pending = self.pending.get(client_id)
            if pending is not None and pending.id == wid:
                self._done(client_id, wid)  # it won: out from here, or from the next holder
            else:
                self._lost(client_id, wid, state)  # not committed, or lost: as applied
            return False

        self._append(client_id, body, again)

    def _append(self, client_id: str, body: dict[str, Any], again: Callable[[], bool]) -> None:
        """Append an ownership record of ``client_id`` to ``$sessions``; if it is not
        committed (no leader), or not known to be (its leader lost office with it in flight:
        a copy applied twice is recognised by its id), again after :data:`RETRY` while
        ``again()``."""
        s = self.sessions
        router = s.router
        assert router is not None
        row = (router.state.now_ms(), OWNERSHIP + client_id, orjson.dumps(body), 0, False, "", b"")

        def committed(offset: int | None) -> None:
            if (offset is None or offset == OUTCOME_UNKNOWN) and again():
                s.node.loop.call_later(RETRY, router.append_forwarded, SESSIONS, [row], committed)

        router.append_forwarded(SESSIONS, [row], committed)

    # -- applying will records (every node) -------------------------------------------------

    def applied(self, client_id: str, node: int, epoch: int, body: dict[str, Any]) -> bool:
        """A will or out record applied: whether it is a will record (then done here)."""
        wid = body.get("will_out")
        if wid is not None:
            pending = self.pending.get(client_id)
            if pending is not None and pending.id == wid:
                del self.pending[client_id]
            self._out[client_id] = wid
            self._done(client_id, wid)
            return False  # an assertion of the owner besides
        if "will" not in body:
            return False
        s = self.sessions
        wid = body["id"]
        current = s.owners.get(client_id)
        if current != (node, epoch):
            if self._is_mine(client_id, wid):
                self._lost(client_id, wid, body["will"])
            return True
        if wid == self._out.get(client_id) or (
            client_id in self.pending and self.pending[client_id].id == wid
        ):
            return True  # proposed again after an unknown outcome: the same will
        fenced = Fenced(epoch, wid, body["will"], body.get("w", 0))
        self.pending[client_id] = fenced
        if node == s.node.id and s.serving:
            self._publish(client_id, fenced)
        return True

    def _lost(self, client_id: str, wid: str, will: list[Any]) -> None:
        """This worker's will record ``wid`` lost: applied after a claim that superseded its
        epoch, or given up on once that claim was applied (not committed, or not known to
        be). If a CONNECT on another node took the session from here, as for a connection
        taken over (:meth:`will_now`), nobody else has this will (the state left here
        without it): it goes out from here, unfenced [MQTT-3.1.2-8], and this node's release
        waits for it (:meth:`after_will`; dropped, 52 wills of 889 were lost in a 20 s churn
        run of three nodes). So too if this node holds the session again (its client back
        here at once): the will of its connection before. If an orphan's claim took the
        session, it is left to the adopter."""
        s = self.sessions
        owner = s.owners.get(client_id)
        if client_id in self.taken or (owner is not None and owner.node == s.node.id):
            self._send(client_id, will, partial(self._done, client_id, wid))
            return
        if client_id in self.orphaned:
            self.left[client_id] = will
        else:
            self.dropped += 1
            log.info("cluster: %s: will not published: the session moved on", client_id)
        self._done(client_id, wid)

    def claimed(
        self, client_id: str, node: int, previous: int | None, orphan: bool, epoch: int
    ) -> None:
        """A claim of ``client_id`` by ``node`` won (every node applies it in log order, after
        the same state): by a CONNECT that takes it from this node, or not. On the claimant
        of a CONNECT's claim from another node, the will of the connection the state before
        it names (no delay; not fenced already) is kept for :meth:`claimed_here`. A delayed
        one is cancelled by the new connection [MQTT-3.1.3-9]."""
        me = self.sessions.node.id
        self.handed.pop(client_id, None)
        if node == me and orphan and self.sessions.home(client_id):  # (the claim's worker)
            self.adopting[client_id] = epoch
        if previous == me and not orphan:
            self.taken.add(client_id)
        elif node == me or previous == me:
            # (Kept through a claim by a third node: a will of this node's connection whose
            # record is still to be applied is this node's to send; dropped there, it was
            # lost: bench.churn --cluster 3 --kill pause, seed 44.)
            self.taken.discard(client_id)
        if previous == me and orphan:
            self.orphaned.add(client_id)
        else:
            self.orphaned.discard(client_id)
        if node == me and (left := self.left.pop(client_id, None)) is not None:
            self._send(client_id, left)  # back before the adopter's release took it: here
        if orphan or node != me or previous in (None, me):
            return
        state = self.sessions.states.get(client_id)
        will = orjson.loads(state).get("will") if state else None
        pending = self.pending.get(client_id)
        if (
            will
            and not will_of(will).properties.get(PropertyId.WILL_DELAY_INTERVAL)
            and (pending is None or pending.will != will)
        ):
            self.handed[client_id] = will

    def ended(self, client_id: str) -> None:
        """The ownership of ``client_id`` ended (a tombstone): nothing of it is pending."""
        self.pending.pop(client_id, None)
        self._out.pop(client_id, None)
        self.taken.discard(client_id)
        self.orphaned.discard(client_id)

    def _publish(self, client_id: str, fenced: Fenced) -> None:
        """The fenced will goes out from the worker that proposed it (after a restart: the
        worker of that index), then its out record."""
        s = self.sessions
        router = s.router
        if router is None or fenced.worker != s.worker[0]:
            return
        self.mine.setdefault(client_id, set()).add(fenced.id)
        session = router.sessions.get(client_id)
        if session is not None and session.will and will_state(session.will) == fenced.will:
            # Loaded at a restart from a state written before the will record: the same will.
            session.will = session.will_due = None
            router.mark_dirty(session)

        self._send(client_id, fenced.will, partial(self._write_out, client_id, fenced))

    def _send(
        self, client_id: str, state: list[Any], done: Callable[[], None] | None = None
    ) -> None:
        """Publish the will ``state`` of ``client_id`` from here, again after :data:`RETRY`
        while its append fails (at least once); then ``done()`` (also when it is dropped,
        not authorized): a fenced will's writes its out record."""
        s = self.sessions
        router = s.router
        if router is None:
            if done is not None:
                done()
            return

        def published(offset: int | None) -> None:
            if offset is None or offset == OUTCOME_UNKNOWN:
                s.node.loop.call_later(RETRY, send)
            elif done is not None:
                done()

        def send() -> None:
            if not router.send_will(client_id, will_of(state), published) and done is not None:
                done()  # not authorized: dropped, done

        self.published += 1
        send()

    def _write_out(self, client_id: str, fenced: Fenced) -> None:
        s = self.sessions
        body = {"node": s.node.name, "epoch": fenced.epoch, "asserted": True, "will_out": fenced.id}
        # Again while the will is pending: whoever holds the session next would publish it.
        self._append(client_id, body, lambda: self.pending.get(client_id) == fenced)

    # -- a claim that found a will pending ------------------------------------------------

    def claimed_here(
        self, client_id: str, epoch: int, state: bytes | None, released: bool
    ) -> bytes | None:
        """This node's claim of ``client_id`` won and resumes; ``state`` is what it adopts.
        Without the previous owner's release: a will that owner fenced and did not see out
        is published again from here, or else the will of the connection the state before
        the claim names (:meth:`claimed`; that connection ended with its node, or that node
        is cut off and publishes it too once it applies the claim: at least once) (module
        docstring). Returns the state, without that will."""
        handed = self.handed.pop(client_id, None)
        given = self.given.pop(client_id, None)
        if released:
            # The previous owner published its wills before its release, but the one it
            # left to this node, an orphan's adopter (module docstring).
            self.adopting.pop(client_id, None)
            if given is not None:
                self._propose(client_id, epoch, given)
            return state
        pending = self.pending.get(client_id)
        if pending is not None:
            if pending.epoch >= epoch:
                return state
            del self.pending[client_id]
            will = pending.will
        elif handed is None:
            if state and orjson.loads(state).get("will"):
                self.adopting.pop(client_id, None)  # it goes out here (the old node's: left)
            return state
        else:
            will = handed
        self._propose(client_id, epoch, will)
        if state:
            body = orjson.loads(state)
            if body.get("will") == will:
                body["will"] = body["will_left"] = None
                state = orjson.dumps(body)
        return state

    # -- a will left to an orphan's adopter, handed with the release -----------------------

    def released(self, client_id: str, epoch: int, will: list[Any] | None, waiting: bool) -> None:
        """A release of ``client_id`` to this node's claim of ``epoch`` is applied, with the
        will the old node left to it (:data:`LEFT`; this node an orphan's adopter) or None.
        Kept for the claim while it has not resumed (``waiting``: :meth:`claimed_here`, or
        :meth:`claim_failed`); else published here: the claim went on without the release
        and found no will (the state it adopted was written after that connection's will
        fell due, its will record losing), or a later claim superseded it (the client back
        on the old node at once: bench.churn --cluster 3 --kill pause, seed 43)."""
        if self.adopting.get(client_id) != epoch:
            return  # not an orphan's claim, or its will went out otherwise
        if waiting:
            self.given[client_id] = will
            return
        del self.adopting[client_id]
        if will is not None:
            self._publish_given(client_id, epoch, will)

    def claim_failed(self, client_id: str) -> None:
        """This node's claim of ``client_id`` was superseded before it resumed: a will its
        release handed it goes out from here, unfenced (nobody else has it)."""
        if client_id in self.given:
            self.adopting.pop(client_id, None)
            if (will := self.given.pop(client_id)) is not None:
                self._send(client_id, will)

    def _publish_given(self, client_id: str, epoch: int, will: list[Any]) -> None:
        s = self.sessions
        if s.owners.get(client_id) == (s.node.id, epoch):
            self._propose(client_id, epoch, will)
        else:
            self._send(client_id, will)

    def hand_left(self, client_id: str, state: bytes | None) -> bytes | None:
        """The state the holder of ``client_id``'s session hands over for its release, with
        the will it left to an orphan's adopter (under :data:`LEFT`), if any."""
        will = self.left.pop(client_id, None)
        if will is None:
            return state
        body = orjson.loads(state) if state else {}
        body[LEFT] = will
        return orjson.dumps(body)

    def take_left(
        self, client_id: str, state: bytes | None
    ) -> tuple[bytes | None, list[Any] | None]:
        """For the release of ``client_id``: the state (None if the session ended) and the
        will left to an orphan's adopter, from the state another worker handed over
        (:meth:`hand_left`), or this worker's own."""
        if not state or LEFT.encode() not in state:
            return state, self.left.pop(client_id, None)
        body = orjson.loads(state)
        will = body.pop(LEFT, None)
        return (orjson.dumps(body) if body else None), will

    def resume(self) -> None:
        """The node serves again: the wills it fenced before a restart and did not see out."""
        s = self.sessions
        for client_id, fenced in list(self.pending.items()):
            if s.owners.get(client_id) == (s.node.id, fenced.epoch):
                self._publish(client_id, fenced)
