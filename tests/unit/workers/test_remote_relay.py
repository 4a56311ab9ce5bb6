"""The relay of remote reads between the workers of a node (broker.workers.remote_relay), with
the mesh and the node transport replaced by lists of what was sent: the owner sends a peer's
fetch on under an id of its own and passes back the answer from that node only, byte for
byte; a fetch that cannot leave is answered ``UNAVAILABLE`` at once; its own answers go to
its own fetch service; and a worker reads another's partition remotely or from its files as
the owner says."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from broker.cluster.fetch import (
    OK,
    UNAVAILABLE,
    FetchRequest,
    decode_answer,
    encode_answer,
    encode_request,
)
from broker.workers.mesh import PeerDown
from broker.workers.remote_fetches import FETCH, FETCHED
from broker.workers.remote_relay import RELAY_BIT, RELAY_FETCH, RELAYED, RemoteRelay

KEY = ("s", 1)
GROUP = 42
NODE_B, NODE_C = 7, 8


class Mesh:
    def __init__(self) -> None:
        self.handlers: dict[int, Any] = {}
        self.sent: list[tuple[int, int, bytes]] = []
        self.peers = {0: object(), 1: object()}

    def send(self, peer: int, kind: int, body: bytes) -> None:
        if peer not in self.peers:
            raise PeerDown(f"worker {peer}")
        self.sent.append((peer, kind, bytes(body)))


class Remote:
    """The parts of RemoteFetches the relay uses."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, bytes]] = []
        self.relayed = 0
        self.served: list[tuple[Any, ...]] = []
        self.dropped: list[int] = []

    def on_fetched(self, frm: int, body: memoryview) -> None:
        self.answers.append((frm, bytes(body)))

    def serve(self, g: int, key: Any, replicas: list[int], owner: int) -> Any:
        self.served.append((g, key, replicas, owner))
        return SimpleNamespace(group=g, watchers={"w"}, leader_hint=None)

    def drop(self, g: int) -> None:
        self.dropped.append(g)


def relay(index: int = 0, link_up: bool = True) -> tuple[RemoteRelay, Any, Any]:
    mesh = Mesh()
    node = SimpleNamespace(handlers={}, sent=[])

    def send(to: int, kind: int, body: bytes) -> bool:
        node.sent.append((to, kind, bytes(body)))
        return link_up

    node.send = send
    reader = SimpleNamespace(log=SimpleNamespace(close=lambda: setattr(reader, "closed", True)))
    partitions = SimpleNamespace(owned={}, remote={KEY: reader}, marks={KEY: (0, 5)})
    runtime = SimpleNamespace(
        mesh=mesh,
        index=index,
        actions={},
        partitions=partitions,
        make_partition=lambda key: SimpleNamespace(key=key, watchers=set()),
    )
    cluster = SimpleNamespace(
        every={GROUP: KEY},
        groups={},
        node=node,
        remote=Remote(),
        remote_parts={},
        router=SimpleNamespace(partitions={}),
    )
    return RemoteRelay(runtime, cluster), runtime, cluster  # type: ignore[arg-type]


def request(ident: int) -> bytes:
    return encode_request(FetchRequest(ident, GROUP, 10, 1 << 20, 0))


def test_the_owner_relays_a_fetch_and_passes_back_the_answer_of_that_node_only() -> None:
    _, runtime, cluster = relay(index=1)
    # The asking worker (0): the fetch leaves through the owner (worker 1).
    asker, asking_runtime, asking_cluster = relay(index=0)
    assert asker._relay(1, NODE_B, request(5))
    [(peer, kind, body)] = asking_runtime.mesh.sent
    assert (peer, kind) == (1, RELAY_FETCH)
    # The owner sends it on under its own id, the rest as it was.
    runtime.mesh.handlers[RELAY_FETCH](0, 0, memoryview(body))
    [(to, kind, sent)] = cluster.node.sent
    assert (to, kind) == (NODE_B, FETCH)
    ident = int.from_bytes(sent[:8], "little")
    assert ident & RELAY_BIT and sent[8:] == request(5)[8:]
    assert cluster.remote.relayed == 1
    answer = encode_answer(ident, GROUP, OK, NODE_B, 0, 12)
    cluster.node.handlers[FETCHED](NODE_C, memoryview(answer))  # another node: not passed
    assert runtime.mesh.sent == [] and cluster.remote.answers == []
    cluster.node.handlers[FETCHED](NODE_B, memoryview(answer))
    [(peer, kind, passed)] = runtime.mesh.sent
    assert (peer, kind) == (0, RELAYED)
    # The asker's fetch service gets it from NODE_B, under its own id, byte for byte.
    asking_runtime.mesh.handlers[RELAYED](1, 0, memoryview(passed))
    [(frm, got)] = asking_cluster.remote.answers
    assert frm == NODE_B and got == encode_answer(5, GROUP, OK, NODE_B, 0, 12)
    # Passed once: a second copy of the answer is nobody's.
    cluster.node.handlers[FETCHED](NODE_B, memoryview(answer))
    assert len(runtime.mesh.sent) == 1


def test_a_fetch_that_cannot_leave_is_answered_unavailable_at_once() -> None:
    owner, runtime, _ = relay(link_up=False)
    runtime.mesh.handlers[RELAY_FETCH](0, 0, memoryview(NODE_B.to_bytes(4, "little") + request(9)))
    [(peer, kind, passed)] = runtime.mesh.sent
    assert (peer, kind) == (0, RELAYED) and int.from_bytes(passed[:4], "little") == NODE_B
    answer = decode_answer(passed[4:])
    assert (answer.request, answer.group, answer.error) == (9, GROUP, UNAVAILABLE)
    assert owner.relayed == {}


def test_the_owners_own_answers_go_to_its_fetch_service() -> None:
    _, _, cluster = relay()
    answer = encode_answer(3, GROUP, OK, NODE_B, 0, 12)
    cluster.node.handlers[FETCHED](NODE_B, memoryview(answer))
    assert cluster.remote.answers == [(NODE_B, answer)]


def test_the_asker_cannot_relay_through_a_worker_that_is_down() -> None:
    asker, _, _ = relay()
    assert not asker._relay(3, NODE_B, request(1))  # no such peer up


def test_a_worker_reads_another_workers_partition_as_the_owner_says() -> None:
    worker, runtime, cluster = relay()
    # Told before it placed its own groups: followed once it has.
    worker.heard([1, [[*KEY, False, 0, 0, [NODE_B, NODE_C], NODE_B]]])
    assert cluster.remote.served == []
    worker._placed.set()
    worker.heard([1, [[*KEY, False, 0, 0, [NODE_B, NODE_C], NODE_B]]])
    assert cluster.remote.served == [(GROUP, KEY, [NODE_B, NODE_C], 1)]
    assert getattr(runtime.partitions.remote.get(KEY, object()), "closed", True)
    assert KEY not in runtime.partitions.marks  # the files here are not the group's
    assert worker.parts[KEY].leader_hint == NODE_B
    # Hosted here again: read from the owner's files from its marks, the watchers kept.
    cluster.router.partitions[KEY] = worker.parts[KEY]
    worker.heard([1, [[*KEY, True, 3, 40, [], None]]])
    assert cluster.remote.dropped == [GROUP] and KEY not in worker.parts
    assert runtime.partitions.marks[KEY] == (3, 40)
    assert cluster.router.partitions[KEY].watchers == {"w"}
