"""``mqlog cluster leave``: drain this node and stop it (issue 21 item 4).

The node hands its leaderships to the other replicas (each held there against the balancers
for five minutes, ``broker.cluster.leadership``), tells its clients to use another server
(MQTT 5 DISCONNECT 0x9C [MQTT-3.14.2-1]; 3.1.1: closed) and waits until they claimed their
sessions elsewhere (at most :data:`LEAVE_CLAIM_SECONDS`), announces that it is leaving
(gossip), and waits while the leaders move its replicas to the other members
(``broker.cluster.reshape``; those placement keeps here, with too few other members, stay,
and are not waited for), handing away any leadership the others' balancers gave back before
they heard it leaves (from the drain on it declines them, but may still win an election);
then the members hear its goodbye (left, not dead), and it stops as on SIGTERM. Started
again, it is placed again: its replicas come back.

**Several workers per node.** Each worker leads and follows the groups of the partitions it
owns and holds its own clients, so each step runs in every worker, and worker 0 (which serves
the HTTP API and gossips) runs them in order over the workers' mesh (the runtime's ``call``:
:meth:`Leaving.step`), each step on every worker before the next: hand the leaderships away
and stop accepting; send the clients away and wait for their sessions to be claimed; then,
once worker 0 announced the leave and told the others (``broker.cluster.worker_view``, so
that each plans without this node), wait for the replicas to move. The supervisor is stopped
last (SIGTERM), which stops every worker as on a node's SIGTERM, exit status 0.

Called only from the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import TYPE_CHECKING, Any, Protocol

from broker.mqtt.reason_codes import ReasonCode
from broker.workers.mesh import PeerDown

if TYPE_CHECKING:
    from broker.net.transport import MQTTProtocol
    from broker.workers.replicated import ClusterService
    from broker.workers.runtime import WorkerRuntime, WorkerSpec

log = logging.getLogger("broker.server")

#: Seconds to hand the leaderships over, then to say goodbye.
LEAVE_DRAIN_SECONDS = 10.0
LEAVE_GOODBYE_SECONDS = 3.0
#: Seconds its clients have to reconnect elsewhere and claim their sessions before its
#: replicas move (the claimant waits 3 s for a release at most).
LEAVE_CLAIM_SECONDS = 3.0
#: The runtime action that runs one step in a worker (:meth:`Leaving.step`).
ACTION = "leave"


class LeavingServer(Protocol):
    """What a leave needs of its worker (``broker.server.Server``)."""

    cluster: ClusterService | None
    runtime: WorkerRuntime | None
    worker: WorkerSpec | None
    links: set[MQTTProtocol]

    def stop_accepting(self) -> None: ...


class Leaving:
    """One worker's part of a leave (the module docstring); :meth:`leave` on worker 0 (or
    the only worker) runs the whole of it."""

    def __init__(self, server: LeavingServer) -> None:
        self.server = server
        #: Group -> the node last asked to lead it (``Leadership.drain``, ``vacate``).
        self.asked: dict[int, int] = {}
        if server.runtime is not None:
            server.runtime.actions[ACTION] = self.step

    async def leave(self, timeout: float) -> dict[str, Any]:
        """Drain the node, waiting up to ``timeout`` s for its replicas to move, and stop it
        (answered first); what was handed over. Raises ValueError on a single node."""
        server = self.server
        if server.cluster is None:
            raise ValueError("a single node: no [cluster] section")
        node = server.cluster.node
        log.info("cluster: leaving: handing this node's leaderships to the other replicas")
        await self._everywhere("drain")
        # The clients go next, while this node still holds its replicas of $sessions: the
        # nodes they reconnect to claim their sessions, which this node releases as it
        # applies the claims; only then are its replicas moved away.
        await self._everywhere("clients")
        if node.membership is not None:
            node.membership.announce(leaving=True)
        if node.reshape.tell is not None:
            node.reshape.tell()  # before the other workers wait: they plan without it
        log.info("cluster: leaving: waiting for the leaders to move this node's replicas")
        parts = await self._everywhere("vacate", timeout)
        if node.membership is not None:
            await node.membership.leave(LEAVE_GOODBYE_SECONDS)
        # The answer leaves first; then the same path as SIGTERM (broker.cli's serve): the
        # supervisor's, which stops every worker.
        pid = os.getppid() if server.worker is not None else os.getpid()
        asyncio.get_running_loop().call_later(0.5, os.kill, pid, signal.SIGTERM)
        answer: dict[str, Any] = {
            "node": node.name,
            "moved": {},
            "still_leading": [],
            "replicas_kept": [],
            "replicas_unmoved": [],
        }
        for part in parts:
            answer["moved"].update(part["moved"])
            for key in ("still_leading", "replicas_kept", "replicas_unmoved"):
                answer[key] += part[key]
        log.info(
            "cluster: left: %d leaderships handed over, %d not; %d replicas not moved in "
            "time, %d kept here (too few other members)",
            len(answer["moved"]),
            len(answer["still_leading"]),
            len(answer["replicas_unmoved"]),
            len(answer["replicas_kept"]),
        )
        return answer

    async def _everywhere(self, name: str, argument: float = 0.0) -> list[dict[str, Any]]:
        """Step ``name`` in every worker at once (this one alone without a runtime); their
        results, a worker that is down left out."""
        runtime = self.server.runtime
        if runtime is None:
            return [await self.step([name, argument])]
        calls = [runtime.call(w, ACTION, [name, argument]) for w in range(runtime.count)]
        parts = []
        for w, result in enumerate(await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(result, PeerDown) or result is None:
                log.warning("cluster: leave: worker %d did not take step %s", w, name)
            elif isinstance(result, BaseException):
                raise result
            else:
                parts.append(result)
        return parts

    async def step(self, argument: list[Any]) -> dict[str, Any]:
        """One step of the leave in this worker (the runtime's action): ``[name, timeout]``."""
        name, timeout = argument
        cluster = self.server.cluster
        assert cluster is not None
        if name == "drain":
            self.server.stop_accepting()  # no new client: they go to the other nodes
            await cluster.leadership.drain(LEAVE_DRAIN_SECONDS, self.asked)
            return {}
        if name == "clients":
            links = self.server.links
            clients = {link.client_id for link in links if link.client_id}
            for link in list(links):
                link.close(ReasonCode.USE_ANOTHER_SERVER, "this node is leaving the cluster")
            await self._claimed_elsewhere(clients, LEAVE_CLAIM_SECONDS)
            return {}
        return await self._vacate(float(timeout))

    async def _vacate(self, timeout: float) -> dict[str, Any]:
        """Wait for this worker's replicas to move (``Leadership.vacate``); what it did."""
        cluster = self.server.cluster
        assert cluster is not None
        node = cluster.node
        kept, unmoved = await cluster.leadership.vacate(timeout, self.asked)
        still = [g for g in node.storages if node.is_leader(g)]
        return {
            "moved": {
                node.label(g): node.names.get(to, str(to))
                for g, to in self.asked.items()
                if g not in still
            },
            "still_leading": [node.label(g) for g in still],
            "replicas_kept": [node.label(g) for g in kept],
            "replicas_unmoved": [node.label(g) for g in unmoved],
        }

    async def _claimed_elsewhere(self, clients: set[str], timeout: float) -> None:
        """Until no session of ``clients`` is held by this node any more (claimed by the nodes
        they reconnected to), or ``timeout`` s (a client that does not come back)."""
        cluster = self.server.cluster
        assert cluster is not None
        sessions, me = cluster.sessions, cluster.node.id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            owners = sessions.owners
            if not any((o := owners.get(c)) is not None and o.node == me for c in clients):
                return
            await asyncio.sleep(0.05)
