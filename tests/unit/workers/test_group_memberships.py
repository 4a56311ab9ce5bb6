"""A shared group's home matches each member's frames to the membership they are about
(broker.router.shared, broker.workers.groups): routers over real logs, one holding the group
(worker 0) and members' workers 1 and 2, whose JOIN and LEAVE frames the test hands to the
home in the order it chooses, as two workers' (or nodes') links may deliver them.

- A session moving between workers (or nodes) joins from the new one and leaves from the old
  one: the late LEAVE of the old membership must not end the new one (before, a leave was
  matched by client id only, and the member got nothing).
- The same membership joining twice (a node relays a member's JOIN to the new home and the
  member joins it again when told the home moved) is one membership: what was handed to it
  is not handed to another member too [MQTT-4.8.2] (before, the second JOIN gave it out
  again, a duplicate on a planned hand-over).
"""

from __future__ import annotations

from pathlib import Path

import orjson

from broker.router.hooks import SingleWorker
from broker.workers.groups import MeshGroupPeers
from tests.unit.router.conftest import Harness

GROUP = "$share/g/t/+"
FIRST_KIND = 100


class _Mesh:
    """The frames a worker sends: (to worker, kind, body)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, bytes]] = []

    def send(self, worker: int, kind: int, body: bytes) -> None:
        self.sent.append((worker, kind, body))


class _Worker(SingleWorker):
    """Worker ``index`` of a broker whose shared groups are held by worker 0."""

    def __init__(self, index: int) -> None:
        self.mesh = _Mesh()
        self.group_peers = MeshGroupPeers(index, lambda group: 0, FIRST_KIND)
        self.group_peers.mesh = self.mesh  # type: ignore[assignment]


def _worker(path: Path, index: int) -> Harness:
    h = Harness(path)
    h.hooks = _Worker(index)
    h.restart()
    h.hooks.group_peers.router = h.router  # type: ignore[union-attr]
    return h


class Lab:
    """The home (worker 0) and the members' workers 1 and 2."""

    def __init__(self, tmp_path: Path) -> None:
        self.home = _worker(tmp_path / "w0", 0)
        self.workers = {i: _worker(tmp_path / f"w{i}", i) for i in (1, 2)}
        _, self.publisher = self.home.connect("pub")
        self.published = 0

    def frames(self, worker: int, name: str) -> list[bytes]:
        """The frames of kind ``name`` (JOIN, LEAVE) ``worker`` sent the home, taken."""
        mesh: _Mesh = self.workers[worker].hooks.mesh  # type: ignore[attr-defined]
        kind = getattr(self.workers[worker].hooks.group_peers, name)
        taken = [body for to, k, body in mesh.sent if k == kind and to == 0]
        mesh.sent = [f for f in mesh.sent if f[1] != kind]
        return taken

    def to_home(self, worker: int, name: str, body: bytes) -> None:
        peers = self.home.hooks.group_peers
        assert peers is not None
        kind = getattr(peers, name)
        peers.handlers()[kind](worker, 0, memoryview(body))  # type: ignore[attr-defined]
        self.home.run()

    def publish(self, n: int) -> None:
        for _ in range(n):
            self.published += 1
            self.home.publish(self.publisher, "t/x", b"%d" % self.published, 1, self.published)
        self.home.run()

    def delivered(self) -> list[tuple[int, int]]:
        """The DELIVER frames the home sent: (to worker, offset), taken."""
        mesh: _Mesh = self.home.hooks.mesh  # type: ignore[attr-defined]
        kind = self.home.hooks.group_peers.DELIVER  # type: ignore[union-attr]
        # The offset is the body's last but one field (then the QoS), whatever else it holds.
        out = [(to, orjson.loads(body)[-2]) for to, k, body in mesh.sent if k == kind]
        mesh.sent = [f for f in mesh.sent if f[1] != kind]
        return out


def test_a_late_leave_from_the_old_worker_keeps_the_new_membership(tmp_path: Path) -> None:
    lab = Lab(tmp_path)
    w1, w2 = lab.workers[1], lab.workers[2]
    link, s = w1.connect("m")
    w1.subscribe(s, GROUP, 1)
    w1.drop(s, link)  # the client went away from worker 1 ...
    _, s2 = w2.connect("m")
    w2.subscribe(s2, GROUP, 1)  # ... and came back on worker 2
    [join1] = lab.frames(1, "JOIN")
    leaves1 = lab.frames(1, "LEAVE")
    [join2] = lab.frames(2, "JOIN")
    assert leaves1
    # Worker 2's JOIN overtakes worker 1's LEAVE (two links to the home).
    lab.to_home(1, "JOIN", join1)
    lab.to_home(2, "JOIN", join2)
    for leave in leaves1:
        lab.to_home(1, "LEAVE", leave)
    lab.publish(4)
    assert [to for to, _ in lab.delivered()] == [2, 2, 2, 2]


def test_a_stale_join_overtaking_a_newer_one_ends_with_its_own_leave(tmp_path: Path) -> None:
    """The client on worker 1, then on worker 2 for a moment, then on worker 1 again (a new
    session there): worker 2's JOIN and LEAVE both arrive after worker 1's new JOIN. The
    membership left is worker 2's, the one on worker 1 stays (and gets the records)."""
    lab = Lab(tmp_path)
    w1, w2 = lab.workers[1], lab.workers[2]
    link, s = w1.connect("m")
    w1.subscribe(s, GROUP, 1)
    w1.drop(s, link)
    link2, s2 = w2.connect("m")
    w2.subscribe(s2, GROUP, 1)
    w2.drop(s2, link2)
    _, s3 = w1.connect("m")
    w1.subscribe(s3, GROUP, 1)
    first, again = lab.frames(1, "JOIN")
    leaves1 = lab.frames(1, "LEAVE")
    [join2] = lab.frames(2, "JOIN")
    leaves2 = lab.frames(2, "LEAVE")
    lab.to_home(1, "JOIN", first)
    for leave in leaves1:
        lab.to_home(1, "LEAVE", leave)
    lab.to_home(1, "JOIN", again)
    lab.to_home(2, "JOIN", join2)
    for leave in leaves2:
        lab.to_home(2, "LEAVE", leave)
    lab.publish(3)
    assert [to for to, _ in lab.delivered()] == [1, 1, 1]


def test_the_same_membership_joining_twice_gets_nothing_twice(tmp_path: Path) -> None:
    """Members on workers 1 and 2 hold records unacknowledged; worker 1's member's JOIN
    reaches the home a second time (relayed by its node as the home moved, then sent again
    as its worker was told to join the new home): nothing it holds goes to worker 2 too."""
    lab = Lab(tmp_path)
    for i, w in lab.workers.items():
        _, s = w.connect(f"m{i}")
        w.subscribe(s, GROUP, 1)
    [join1] = lab.frames(1, "JOIN")
    [join2] = lab.frames(2, "JOIN")
    lab.to_home(1, "JOIN", join1)
    lab.to_home(2, "JOIN", join2)
    lab.publish(6)
    first = lab.delivered()
    assert sorted(to for to, _ in first) == [1, 1, 1, 2, 2, 2]
    lab.to_home(1, "JOIN", join1)  # the same JOIN again
    lab.publish(2)
    offsets = [offset for _, offset in first + lab.delivered()]
    assert sorted(offsets) == sorted(set(offsets)), f"delivered twice: {offsets}"
    assert len(offsets) == 8


def test_frames_read_before_the_router_loaded_its_groups_wait_for_it() -> None:
    """A restarted home's peers rejoin its groups as soon as the mesh is up, before its
    router has loaded them from ``$sessions``: a JOIN handled then made a new group at the
    partitions' ends, stored over the one in the log (the records its dead predecessor had
    handed out past its last stored positions never went out again: 316 of one three-worker
    churn run's), and a LEAVE's records given back were dropped (no group yet). The frames
    wait for the load, in the order they came."""
    calls: list[tuple[str, str, int]] = []

    class Router:
        def remote_join(self, worker: int, full: str, client_id: str, *rest: object) -> None:
            calls.append(("join", client_id, worker))

        def remote_leave(self, worker: int, full: str, client_id: str, *rest: object) -> None:
            calls.append(("leave", client_id, worker))

    peers = MeshGroupPeers(0, lambda group: 0, FIRST_KIND)
    peers.router = Router()  # type: ignore[assignment]
    handlers = peers.handlers()
    join = orjson.dumps([GROUP, "m", 7, 1, None, 4, 10, None])
    leave = orjson.dumps([GROUP, "m", 7, [["default", 0, 5]]])
    peers.hold()
    handlers[peers.JOIN](1, 0, memoryview(join))
    handlers[peers.LEAVE](2, 0, memoryview(leave))
    assert calls == []
    peers.loaded()
    assert calls == [("join", "m", 1), ("leave", "m", 2)]
    handlers[peers.JOIN](2, 0, memoryview(join))  # loaded: handled at once
    assert calls[-1] == ("join", "m", 2)
