"""The router's hooks on a cluster node of one worker (broker.router.hooks): the sessions
it loads, its wills, its shared groups, as ``$sessions`` says
(broker.workers.replicated_sessions)."""

from __future__ import annotations

from broker.mqtt.packets import Will
from broker.router.hooks import SingleWorker
from broker.workers.replicated_sessions import CLAIM_PREFIX, ClusterSessions


class ClusterHooks(SingleWorker):
    """The router's hooks on a cluster node (one worker): at start it loads only the
    sessions this node owns (or that no claim names: state written before the cluster);
    shared groups are held by one node (broker.workers.cluster_groups)."""

    def __init__(self, sessions: ClusterSessions) -> None:
        self.sessions = sessions
        self.group_peers = sessions.group_peers

    def session_ended(self, client_id: str) -> None:
        self.sessions.session_ended(client_id)

    def will_now(self, client_id: str, will: Will) -> bool:
        return self.sessions.will_now(client_id, will)

    def is_home(self, name: str) -> bool:
        if name.startswith((CLAIM_PREFIX, "$share/")):
            return False  # an ownership record; a group, held by the $sessions leader
        owner = self.sessions.owners.get(name)
        return owner is None or owner.node == self.sessions.node.id
