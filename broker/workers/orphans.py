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

**Exactly one node acts: the leader of ``$sessions``.** It proposes the claims (every node
checks on each tick), for the members gossip has dead or left, less those its Raft host
heard from lately. Why the leader: there is at most one per term (Raft s5.2), it
is always on the side of a majority (a leader cut off from one steps down within an election
timeout, CheckQuorum, thesis s6.2, long before gossip declares anyone dead; a cut-off
follower cannot win an election, and once healed it cannot disrupt the leader it rejoins,
PreVote), and its claims are the ones that commit. A rule on gossip alone (formerly: the
live member of the lowest name, while gossip had a majority alive) trusts each node's view of
the others, and a view can lag: a node cut off past its death declaration, healed, still
held one member of the majority dead 12 s later while it saw the others alive again, so it
had "a majority" with itself the lowest live name, and it adopted the sessions of a live
node's connected clients (which that node then closed, DISCONNECT 0x8E); its claims commit,
as the majority's leader accepts them.

The leader's own gossip view can lag as well (the member cut off, healed, its first new
clients connecting before the leader hears that it refuted its death; or a stale death a
healed member's full state exchange spread). Hence the second condition: the leader adopts
the sessions of a gone member only once its Raft host has heard nothing from that node for
an election timeout (``MultiRaft.silent``: every node sends each peer a frame every
heartbeat interval, its groups quiesced or not). A member it hears from is alive and
reachable whatever gossip says, and its sessions are left to it. (The CheckQuorum flags of
``$sessions``' followers would not do: a quiesced group is not ticked, and its flags stay
as they were when it went quiet.)

The claims are fenced by their epoch like any other, and each is made only while the dead
member holds the client id: two nodes that both believe they should act (a leader deposed
that does not know it yet, and its successor) propose claims of the same epoch, only the
first applied wins and the other fails, so the will goes out from one node only. A dead node
that comes back applies these claims before it serves: the sessions leave its router
unpublished (replicated_sessions' ``resume``).

With several workers per node, worker 0 (the one that gossips) tells the others which members
are gone, the worker hosting ``$sessions`` tells them which of those this node adopts
(:meth:`Orphans.told`), and each worker adopts the client ids homed at it (``crc32 %
workers``), where its session directory records them (broker.workers.sessions).

A node declared dead that is in fact alive but cut off keeps its connections until it applies
the claim (then closes them, 5.0: DISCONNECT 0x8E). A will that falls due there meanwhile (its
client's connection drops) is not published at once: its will record names the epoch the
adopter's claim superseded, so it loses where it is applied, and the adopter alone publishes
that will: from the state it adopted, or, if it waited for this node's release, from the
release, which carries that will and those of the connections the claim closes
(broker.workers.will_fence). The adoption counts the will delay from when the dead
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
#: Gone members (node id -> loop seconds since when): gossip's, or those this node adopts.
Gone = dict[int, float]
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
        #: The gone members whose sessions the last sweep found none left of (None: sweep
        #: on the next tick), so that a member dead for long costs no pass over every owner.
        self._swept: frozenset[int] | None = None
        #: What the other workers last told (several workers: :meth:`told`) and what this one
        #: last told them, by kind ("gone": worker 0's gossip; "adopt": the ``$sessions``
        #: host's choice).
        self._told: dict[str, Gone] = {"gone": {}, "adopt": {}}
        self._said: dict[str, Gone] = {}
        #: Tells the node's other workers a kind and its members (set by the server with
        #: several workers).
        self.tell: Callable[[Any], None] | None = None

    def gone(self) -> Gone | None:
        """The members gossip has dead or left, and since when (None: no gossip here)."""
        node = self.sessions.node
        membership = node.membership
        if membership is None:
            return None
        behind = node.loop.time() - time.time()  # loop seconds minus wall seconds
        return {
            node_id_of(m.node): m.since / 1000 - behind
            for m in membership.core_members()
            if m.node != node.name and m.state in GONE
        }

    def adoptable(self, gone: Gone) -> Gone | None:
        """Of ``gone``, the members whose sessions this node adopts: none unless it leads
        ``$sessions``, and only those its Raft host has not heard from for an election
        timeout (module docstring). None: this worker does not host ``$sessions`` (the one
        that does tells)."""
        node = self.sessions.node
        group = next((g for g, key in node.group_keys.items() if key == SESSIONS), None)
        if group is None or group not in node.storages:
            return None
        host = node.host
        if host is None or not node.is_leader(group):
            return {}
        return {n: since for n, since in gone.items() if host.silent(n)}

    def told(self, message: Any) -> None:
        """Another worker's ``[kind, [[node id, since], ...]]`` (JSON; :attr:`_told`)."""
        kind, members = message
        self._told[str(kind)] = {int(n): float(t) for n, t in members}

    def _say(self, kind: str, members: Gone) -> None:
        """Tell the other workers ``members`` of ``kind`` if it changed, and again while it is
        not empty (a restarted worker learns it within a tick)."""
        if self.tell is not None and (members or self._said.get(kind) != members):
            self._said[kind] = members
            self.tell([kind, list(members.items())])

    def tick(self) -> None:
        """If this node adopts: claim the sessions gone members hold (homed here)."""
        sessions = self.sessions
        node = sessions.node
        gone = self.gone()
        if gone is None:
            gone = self._told["gone"]
        else:
            self._say("gone", gone)
        adopt = self.adoptable(gone)
        if adopt is None:
            adopt = self._told["adopt"]
        else:
            self._say("adopt", adopt)
        if not adopt or not sessions.serving or sessions.router is None:
            self._swept = None  # one that adopts later sweeps again
            return
        if self._swept == frozenset(adopt):
            return
        found = False
        for client_id, owner in list(sessions.owners.items()):
            died = adopt.get(owner.node)
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
        # A gone member that comes back is alive again (not in ``adopt``): the set changes.
        self._swept = None if found else frozenset(adopt)

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
