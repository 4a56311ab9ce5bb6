"""The worker mesh: real sockets between Mesh objects sharing one event loop."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop

from broker.workers.mesh import FIRST_USER_KIND, HEADER, Mesh, PeerDown, owner_of

ECHO = FIRST_USER_KIND
NOTE = FIRST_USER_KIND + 1
LATER = FIRST_USER_KIND + 2


def run(coro: Callable[[], Awaitable[Any]]) -> Any:
    return uvloop.run(asyncio.wait_for(coro(), 10))


class Worker:
    """A mesh with handlers that record what they were sent."""

    def __init__(self, data_dir: Path, worker: int, count: int) -> None:
        self.notes: list[tuple[int, bytes]] = []
        self.held: list[tuple[int, int]] = []
        self.ups: list[int] = []
        self.downs: list[int] = []
        self.mesh = Mesh(
            data_dir,
            worker,
            count,
            {
                ECHO: self.echo,
                NOTE: self.note,
                LATER: self.later,
            },
            on_peer_up=self.ups.append,
            on_peer_down=self.downs.append,
        )

    def echo(self, peer: int, request: int, body: memoryview) -> None:
        self.mesh.reply(peer, request, b"echo:" + bytes(body))

    def note(self, peer: int, request: int, body: memoryview) -> None:
        self.notes.append((peer, bytes(body)))

    def later(self, peer: int, request: int, body: memoryview) -> None:
        self.held.append((peer, request))  # answered by the test, after other frames


async def started(tmp: Path, count: int) -> list[Worker]:
    workers = [Worker(tmp, i, count) for i in range(count)]
    for w in workers:
        await w.mesh.start()
    for w in workers:
        await w.mesh.wait_connected(5)
    return workers


async def until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.005)


def test_every_pair_connects_and_requests_are_answered(tmp_path: Path) -> None:
    async def main() -> None:
        workers = await started(tmp_path, 3)
        for a, b in itertools.permutations(range(3), 2):
            reply = await workers[a].mesh.call(b, ECHO, f"{a}->{b}".encode())
            assert reply == f"echo:{a}->{b}".encode()
        assert sorted(workers[0].ups) == [1, 2]
        for w in workers:
            await w.mesh.close()

    run(main)


def test_notifications_arrive_in_order_in_one_write_per_iteration(tmp_path: Path) -> None:
    async def main() -> None:
        w0, w1 = await started(tmp_path, 2)
        proto = w1.mesh.peers[0]
        writes: list[bytes] = []

        class Counting:
            def __init__(self, real: Any) -> None:
                self.real = real

            def write(self, data: bytes) -> None:
                writes.append(data)
                self.real.write(data)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.real, name)

        proto.transport = Counting(proto.transport)
        for i in range(1000):
            w1.mesh.send(0, NOTE, str(i).encode())
        w1.mesh.broadcast(NOTE, b"all")
        await until(lambda: len(w0.notes) == 1001)
        assert w0.notes == [(1, str(i).encode()) for i in range(1000)] + [(1, b"all")]
        assert len(writes) == 1
        await w0.mesh.close()
        await w1.mesh.close()

    run(main)


def test_frames_split_at_every_byte_are_reassembled(tmp_path: Path) -> None:
    async def main() -> None:
        w0, w1 = await started(tmp_path, 2)
        proto = w0.mesh.peers[1]
        frame = HEADER.pack(HEADER.size - 4 + 5, NOTE, 0) + b"hello"
        stream = frame * 3
        for i in range(len(stream)):
            proto.data_received(stream[i : i + 1])
        assert w0.notes == [(1, b"hello")] * 3
        await w0.mesh.close()
        await w1.mesh.close()

    run(main)


def test_a_peer_that_goes_away_fails_its_requests_and_is_redialled(tmp_path: Path) -> None:
    async def main() -> None:
        w0, w1 = await started(tmp_path, 2)
        pending = w1.mesh.call(0, LATER, b"")
        await until(lambda: bool(w0.held))
        await w0.mesh.close()  # worker 0 "dies" before answering
        with pytest.raises(PeerDown):
            await pending
        await until(lambda: w1.downs == [0])
        with pytest.raises(PeerDown):
            w1.mesh.send(0, NOTE, b"lost")
        # Its replacement listens again; worker 1 dials it without being told.
        again = Worker(tmp_path, 0, 2)
        await again.mesh.start()
        await again.mesh.wait_connected(5)
        assert await w1.mesh.call(0, ECHO, b"back") == b"echo:back"
        assert w1.ups == [0, 0]
        await again.mesh.close()
        await w1.mesh.close()

    run(main)


def test_a_corrupt_length_drops_only_that_channel(tmp_path: Path) -> None:
    async def main() -> None:
        w0, w1 = await started(tmp_path, 2)
        w0.mesh.peers[1].data_received(HEADER.pack(0xFFFFFFFF, NOTE, 0))
        await until(lambda: w0.downs == [1])
        await w0.mesh.wait_connected(5)  # worker 1 dials again
        assert await w1.mesh.call(0, ECHO, b"x") == b"echo:x"
        await w0.mesh.close()
        await w1.mesh.close()

    run(main)


def test_two_brokers_on_different_data_dirs_do_not_meet(tmp_path: Path) -> None:
    async def main() -> None:
        a = await started(tmp_path / "a", 2)
        b = await started(tmp_path / "b", 2)
        assert await a[1].mesh.call(0, ECHO, b"a") == b"echo:a"
        assert await b[1].mesh.call(0, ECHO, b"b") == b"echo:b"
        with pytest.raises(OSError):
            await Worker(tmp_path / "a", 0, 2).mesh.start()  # the name is taken
        for w in a + b:
            await w.mesh.close()

    run(main)


def test_ownership_is_stable_and_spreads_a_streams_partitions() -> None:
    keys = [("telemetry", p) for p in range(8)]
    owners = [owner_of(k, 2) for k in keys]
    assert sorted(set(owners)) == [0, 1]
    assert owners.count(0) == owners.count(1) == 4
    assert owners == [owner_of(k, 2) for k in keys]
    assert all(owner_of(k, 1) == 0 for k in keys)
    assert {owner_of(k, 3) for k in keys} == {0, 1, 2}


def test_request_callbacks_get_the_reply_or_none_when_the_peer_goes(tmp_path: Path) -> None:
    async def main() -> None:
        w0, w1 = await started(tmp_path, 2)
        got: list[bytes | None] = []
        w1.mesh.request(0, ECHO, b"a", got.append)
        w1.mesh.request(0, LATER, b"", got.append)
        await until(lambda: bool(got) and bool(w0.held))
        assert got == [b"echo:a"]
        assert w1.mesh.pending_requests == 1
        await w0.mesh.close()  # worker 0 "dies" before answering the second
        await until(lambda: len(got) == 2)
        assert got == [b"echo:a", None]
        assert w1.mesh.pending_requests == 0
        with pytest.raises(PeerDown):
            w1.mesh.request(0, ECHO, b"lost", got.append)
        await w1.mesh.close()

    run(main)


@pytest.mark.parametrize("now", [True, False], ids=["flushed-now", "at-the-end"])
def test_frames_flushed_now_reach_a_peer_that_dies_right_after(tmp_path: Path, now: bool) -> None:
    """``flush_now`` writes the iteration's frames (the sends and what ``before_flush``
    builders queue) at once: a worker killed right after (its sockets aborted, as a kill
    leaves them) has still told its peer. Left to the end of the iteration, they die with it
    (what the server's links flush, after ``flush_now``, must not overtake)."""

    async def main() -> None:
        w0, w1 = await started(tmp_path, 2)
        w1.mesh.send(0, NOTE, b"sent")
        w1.mesh.before_flush(lambda: w1.mesh.send(0, NOTE, b"built"))
        if now:
            w1.mesh.flush_now()
        for proto in list(w1.mesh.peers.values()):
            assert proto.transport is not None
            proto.transport.abort()  # the kill: nothing more leaves
        await until(lambda: 1 in w0.downs)
        assert w0.notes == ([(1, b"sent"), (1, b"built")] if now else [])
        await w0.mesh.close()
        await w1.mesh.close()

    run(main)


def test_a_servers_links_are_written_after_its_frames_to_the_other_workers() -> None:
    """broker.server.Server._flush_links: the mesh's frames of the iteration first (see its
    docstring), then each pending link's output."""
    from types import SimpleNamespace

    from broker.server import Server

    order: list[str] = []
    mesh = SimpleNamespace(flush_now=lambda: order.append("mesh"))
    links = [SimpleNamespace(flush_output=lambda i=i: order.append(f"link{i}")) for i in range(2)]
    server = SimpleNamespace(runtime=SimpleNamespace(mesh=mesh), _flush_pending=links)
    server.flush_peers = lambda: Server.flush_peers(server)  # type: ignore[arg-type]
    Server._flush_links(server)  # type: ignore[arg-type]
    assert order == ["mesh", "link0", "link1"]
