"""The sessions of a dead node: their wills and expiry run on a surviving node.

A client id's session is held by the node its claim in ``$sessions`` names
(broker.workers.replicated_sessions); its will and its expiry are that node's timers
(broker.router.lifecycle). When gossip declares that node dead (or it left without handing
its sessions over: ``mqlog cluster leave`` and a stop), its clients' connections are lost as
surely as if each had dropped, so the cluster treats them that way [MQTT-3.1.2-8]: one
surviving node claims each of its sessions, exactly like a CONNECT would, and holds it
offline from the state last committed, as disconnected at the time gossip declared the node
dead. The router's timers then publish the will after its delay (MQTT 5 s3.1.3.2.2, capped
by the session expiry) and end the session once its expiry interval ran (s3.1.2.11.2),
exactly as on one node; a client that reconnects anywhere first claims the session from this
node as from any other, and its new connection cancels the delayed will [MQTT-3.1.3-9].

**Exactly one node acts.** The live member of the lowest name, as gossip has the members,
proposes the claims (every node checks on each tick), and only while gossip has a majority
of the members (itself included, those that left not counted) alive and unsuspected, and
``$sessions`` has a leader as it knows it: a node cut off from the others sees them
suspect, then dead, one after the other, and itself the lowest live name, and the claims
it proposed would commit once the cut heals (Raft waits for a majority), taking the
sessions of the live nodes' clients away from them. The members on the side of
a majority see the cut-off node dead instead, and its sessions are theirs to adopt.

The claims are fenced by their epoch like any other, and each is made only while the dead
member holds the client id: two nodes that both believe they should act (their gossip views
differ for a moment) propose claims of the same epoch, only the first applied wins and the
other fails, so the will goes out from one node only. A dead node that comes back applies
these claims before it serves: the sessions leave its router unpublished
(replicated_sessions' ``resume``).

With several workers per node, worker 0 (the one that gossips) tells the others what it sees
(:meth:`Orphans.told`), and each worker adopts the client ids homed at it (``crc32 %
workers``), where its session directory records them (broker.workers.sessions).

A node declared dead that is in fact alive but cut off keeps its connections until it applies
the claim (then closes them, 5.0: DISCONNECT 0x8E). A will that falls due there meanwhile (its
client's connection drops) is not published at once: its will record names the epoch the
adopter's claim superseded, so it loses where it is applied, and the adopter alone publishes
that will (broker.workers.will_fence). The adoption counts the will delay from when the dead
node lost the connection if its state says so, else from the death gossip declared.

Called only from the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from broker.cluster.gossip.messages import State
from broker.cluster.placement import node_id_of
from broker.net.context import STATE
from broker.router.state import SESSIONS

if TYPE_CHECKING:
    from broker.cluster.node import ClusterNode
    from broker.router.router import Router

log = logging.getLogger("broker.cluster")

#: The gossip states of a member whose sessions are adopted.
GONE = (State.DEAD, State.LEFT)
LIVE = (State.ALIVE, State.SUSPECT)
#: What gossip says: the members gone (node id -> wall seconds since when) and whether this
#: node is the one that adopts their sessions.
Survey = tuple[dict[int, float], bool]
#: Claims of a dead node's sessions in flight at once (each is one ``$sessions`` proposal).
IN_FLIGHT = 256


class Holders(Protocol):
    """What this needs of broker.workers.replicated_sessions' ``ClusterSessions``."""

    node: ClusterNode
    worker: tuple[int, int]  # this worker's index, the node's worker count
    router: Router | None
    serving: bool
    owners: dict[str, Any]  # client id -> its Owner (node id, epoch)

    def claim(
        self, client_id: str, adopt: Callable[[bytes], None], only_from: int | None = None
    ) -> Awaitable[None]: ...

    def session_ended(self, client_id: str) -> None: ...

    def home(self, client_id: str) -> bool: ...

    def holds(self, client_id: str) -> bool: ...

    def held_here(self, client_id: str) -> None: ...


class Orphans:
    """This node's adoption of the sessions of dead members (module docstring)."""

    def __init__(self, sessions: Holders) -> None:
        self.sessions = sessions
        #: Client ids being claimed here now, and their claims (a task needs a reference).
        self.claiming: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.adopted = 0
        #: The dead members whose sessions the last sweep found none left of (None: sweep
        #: on the next tick), so that a member dead for long costs no pass over every owner.
        self._swept: frozenset[int] | None = None
        #: What worker 0 last said (several workers: :meth:`told`).
        self._told: Survey = ({}, False)
        #: Worker 0 with several workers: tells the other workers each survey (set by the
        #: server).
        self.tell: Callable[[Any], None] | None = None

    def survey(self) -> Survey:
        """What gossip says now (module docstring): on worker 0, from its membership;
        on another worker, what worker 0 last told it."""
        node = self.sessions.node
        membership = node.membership
        if membership is None:
            return self._told
        behind = node.loop.time() - time.time()  # loop seconds minus wall seconds
        members = [m for m in membership.core_members() if m.node != node.name]
        gone = {node_id_of(m.node): m.since / 1000 - behind for m in members if m.state in GONE}
        alive = {m.node for m in members if m.state in LIVE} | {node.name}
        # Suspects count against: a cut-off node suspects every other member before it
        # declares the first dead.
        heard = 1 + sum(1 for m in members if m.state == State.ALIVE)
        known = 1 + sum(1 for m in members if m.state != State.LEFT)
        acting = min(alive) == node.name and 2 * heard > known and self._sessions_led()
        return gone, acting

    def _sessions_led(self) -> bool:
        """Whether ``$sessions`` has a leader as this node knows it, if it holds a replica:
        a cut-off follower forgets its leader after its election timeout (it stands for
        election, Raft s5.2), a cut-off leader steps down after one (CheckQuorum), both
        before gossip declares the others dead (its suspicion alone can outlast them all
        only with fewer probes than members)."""
        node = self.sessions.node
        group = next((g for g, key in node.group_keys.items() if key == SESSIONS), None)
        if group is None or group not in node.storages:
            return True  # no replica here: gossip's majority alone
        return node.leader(group) is not None

    def told(self, survey: Any) -> None:
        """Worker 0's survey (JSON: ``[[node id, since], ...], acting``)."""
        gone, acting = survey
        self._told = ({int(n): float(t) for n, t in gone}, bool(acting))

    def tick(self) -> None:
        """If this node adopts: claim the sessions dead members hold (homed here)."""
        sessions = self.sessions
        node = sessions.node
        gone, acting = self.survey()
        if self.tell is not None and (gone or self._told != (gone, acting)):
            self._told = (gone, acting)  # told again while a member is gone: a restarted
            self.tell([list(gone.items()), acting])  # worker learns it within a tick
        if not acting or not sessions.serving or sessions.router is None:
            self._swept = None  # one that acts later sweeps again
            return
        if not gone or self._swept == frozenset(gone):
            return
        found = False
        for client_id, owner in list(sessions.owners.items()):
            died = gone.get(owner.node)
            if died is None or not sessions.home(client_id):
                continue
            found = True
            if len(self.claiming) >= IN_FLIGHT:
                break
            if client_id in self.claiming:
                continue
            self.claiming.add(client_id)
            task = node.loop.create_task(self._adopt(client_id, owner.node, died))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        # A dead member that comes back is alive again (not in ``gone``): the set changes.
        self._swept = None if found else frozenset(gone)

    async def _adopt(self, client_id: str, dead: int, died: float) -> None:
        sessions = self.sessions
        router = sessions.router
        assert router is not None

        def take(answer: bytes) -> None:
            # Runs as the claim is applied, before a CONNECT's claim could follow it.
            if sessions.holds(client_id):
                return
            if answer[:1] == STATE:
                router.adopt(client_id, answer[1:], died)
                sessions.held_here(client_id)
                self.adopted += 1
            else:  # a clean session without a will: nothing to run, the claim ends
                sessions.session_ended(client_id)

        name = sessions.node.names.get(dead, str(dead))
        try:
            await sessions.claim(client_id, take, only_from=dead)
        except Exception as e:  # another claim won, or no commit: the next tick sees
            log.info("cluster: %s: session of gone node %s not adopted: %s", client_id, name, e)
            return
        finally:
            self.claiming.discard(client_id)
        log.info("cluster: %s: session of gone node %s held here, offline", client_id, name)
