"""The node-to-node transport (broker.cluster.peers) over real TCP on 127.0.0.1.

Strangers and sinks are written here from the handshake's description (the module docstring),
independently of the transport's code, so the format on the wire is checked too. Every test
awaits events (a message, a connection, a log line, an EOF), never a fixed sleep, and ends with
no task left on the loop."""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from broker.cluster.peers import PeerTransport

SECRET = b"shared secret"
HOST = "127.0.0.1"
TIMEOUT = 5.0


class Node:
    """A transport and the messages it received, awaitable."""

    def __init__(self, name: str, seeds: list[tuple[str, int]] = (), **kw: Any) -> None:  # type: ignore[assignment]
        self.received: asyncio.Queue[tuple[str, int, bytes]] = asyncio.Queue()
        self.peers: list[tuple[str, tuple[str, int]]] = []
        kw.setdefault("secret", SECRET)
        self.t = PeerTransport(
            name,
            kw.pop("bind", (HOST, 0)),
            list(seeds),
            kw.pop("secret"),
            on_message=self.on_message,
            on_peer=lambda n, a: self.peers.append((n, a)),
            **kw,
        )

    def on_message(self, peer: str, kind: int, payload: memoryview) -> None:
        self.received.put_nowait((peer, kind, bytes(payload)))

    async def start(self) -> Node:
        await self.t.start()
        return self

    @property
    def address(self) -> tuple[str, int]:
        return self.t.address

    async def next(self) -> tuple[str, int, bytes]:
        return await asyncio.wait_for(self.received.get(), TIMEOUT)


class Warnings(logging.Handler):
    """The transport's WARNING lines, with an event to await the next one."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.event.set()

    async def until(self, done: Callable[[], bool]) -> None:
        async def wait() -> None:
            while not done():
                self.event.clear()
                await self.event.wait()

        await asyncio.wait_for(wait(), TIMEOUT)


@pytest.fixture(autouse=True, params=["asyncio", "uvloop"])
def loop_factory(request: pytest.FixtureRequest) -> None:
    """Every test runs on asyncio's loop and on uvloop's (the broker's)."""
    global LOOP_FACTORY
    LOOP_FACTORY = uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop


LOOP_FACTORY: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop


def run(test: Callable[[Warnings], Coroutine[Any, Any, None]]) -> Warnings:
    """Run ``test`` on a fresh loop with the transport's warnings captured; afterwards no
    task may be left but the test's own."""
    logger = logging.getLogger("broker.cluster.peers")

    async def main() -> Warnings:
        warnings = Warnings()
        logger.addHandler(warnings)
        try:
            await asyncio.wait_for(test(warnings), 2 * TIMEOUT)
        finally:
            logger.removeHandler(warnings)
        assert asyncio.all_tasks() == {asyncio.current_task()}
        return warnings

    with asyncio.Runner(loop_factory=LOOP_FACTORY) as runner:
        return runner.run(main())


async def wait(aw: Awaitable[Any]) -> Any:
    return await asyncio.wait_for(aw, TIMEOUT)


async def close(*nodes: Node) -> None:
    for n in nodes:
        await n.t.close()


# --- the handshake and framing as the module docstring states them ------------------------


def member(node: str, address: tuple[str, int]) -> bytes:
    host = address[0].encode()
    return (
        bytes([len(node)])
        + node.encode()
        + bytes([len(host)])
        + host
        + struct.pack(">H", address[1])
    )


def hello(
    node: str, address: tuple[str, int], nonce: bytes, worker: tuple[int, int] = (0, 1)
) -> bytes:
    return b"MQLR\x02" + nonce + member(node, address) + struct.pack(">HH", *worker)


def proof(secret: bytes, role: bytes, hello_bytes: bytes, reply: bytes) -> bytes:
    return hmac.new(secret, role + hello_bytes + reply, "sha256").digest()


async def read_hello(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readexactly(4 + 1 + 16 + 1)
    node = await reader.readexactly(head[-1])
    host_len = await reader.readexactly(1)
    rest = await reader.readexactly(host_len[0] + 2 + 4)  # port, worker, workers
    return head + node + host_len + rest


async def connect_as(
    node: str, to: tuple[str, int], secret: bytes = SECRET
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A hand-built connector: HELLO, check the acceptor's proof, send ours."""
    reader, writer = await asyncio.open_connection(*to)
    h = hello(node, (HOST, 1), secrets.token_bytes(16))
    writer.write(h)
    reply = await read_hello(reader)
    assert await reader.readexactly(32) == proof(secret, b"acceptor", h, reply)
    writer.write(proof(secret, b"connector", h, reply))
    return reader, writer


def frame(kind: int, payload: bytes) -> bytes:
    return struct.pack(">IB", len(payload), kind) + payload


# --- the tests ------------------------------------------------------------------------------


def test_three_nodes_exchange_messages_in_both_directions() -> None:
    async def test(_: Warnings) -> None:
        a = await Node("a").start()
        b = await Node("b", [a.address]).start()
        c = await Node("c", [a.address, b.address]).start()
        nodes = {"a": a, "b": b, "c": c}
        for x in nodes.values():
            for y in nodes:
                if y != x.t.node_id:
                    await wait(x.t.wait_connected(y))
        for x, y in [("a", "b"), ("b", "a"), ("a", "c"), ("c", "a"), ("b", "c"), ("c", "b")]:
            payload = f"{x} to {y}".encode() * 100
            assert nodes[x].t.send(y, 7, payload)
            assert await nodes[y].next() == (x, 7, payload)
        assert a.t.members == {"b": b.address, "c": c.address}
        assert sorted(c.peers) == [("a", a.address), ("b", b.address)]
        assert c.t.stats.frames_sent == 2 and c.t.stats.frames_received == 2
        assert c.t.stats.bytes_sent == 2 * (5 + 600)  # "c to a" and "c to b", 100 times
        assert a.t.stats.auth_failures == 0
        assert not a.t.send("nobody", 7, b"x")
        assert a.t.stats.dropped_unconnected == 1
        with pytest.raises(ValueError, match="kind 0"):
            a.t.send("b", 0, b"the transport's own kind")
        await close(a, b, c)
        await a.t.close()  # idempotent
        assert not a.t.connected("b")

    run(test)


def test_a_node_knowing_one_seed_reaches_every_node() -> None:
    async def test(_: Warnings) -> None:
        a = await Node("a").start()
        b = await Node("b", [a.address]).start()
        await wait(b.t.wait_connected("a"))
        c = await Node("c", [a.address]).start()  # knows only a
        await wait(c.t.wait_connected("b"))
        await wait(b.t.wait_connected("c"))
        assert c.t.send("b", 1, b"hello b")
        assert await b.next() == ("c", 1, b"hello b")
        assert b.t.send("c", 2, b"hello c")
        assert await c.next() == ("b", 2, b"hello c")
        assert c.t.members == {"a": a.address, "b": b.address}
        await close(a, b, c)

    run(test)


def test_a_wrong_secret_is_refused_on_both_sides_and_the_others_carry_on() -> None:
    async def test(warnings: Warnings) -> None:
        a = await Node("a").start()
        b = await Node("b", [a.address]).start()
        x = await Node("x", [a.address], secret=b"not the secret").start()
        await warnings.until(lambda: a.t.stats.auth_failures >= 1 and x.t.stats.auth_failures >= 1)
        assert any("'a' failed to prove the shared secret" in line for line in warnings.lines)
        assert any("closed during the handshake" in line for line in warnings.lines)
        await wait(a.t.wait_connected("b"))
        assert a.t.send("b", 3, b"still fine")
        assert await b.next() == ("a", 3, b"still fine")
        assert "x" not in a.t.members and not a.t.connected("x") and x.t.members == {}
        assert b.t.stats.auth_failures == 0
        await close(a, b, x)

    run(test)


def test_a_peer_with_another_worker_count_is_refused_on_both_sides() -> None:
    async def test(warnings: Warnings) -> None:
        a = await Node("a", worker=(0, 2)).start()
        b = await Node("b", [a.address], worker=(0, 2)).start()
        x = await Node("x", [a.address], worker=(0, 3)).start()
        await warnings.until(lambda: a.t.stats.incompatible >= 1 and x.t.stats.incompatible >= 1)
        # Both sides name both counts and the key to change.
        assert any(
            "node 'x' runs 3 worker(s) per node and this node 2" in line
            and "router.workers / --workers" in line
            for line in warnings.lines
        ), warnings.lines
        assert any(
            "node 'a' runs 2 worker(s) per node and this node 3" in line for line in warnings.lines
        )
        await wait(a.t.wait_connected("b"))
        assert a.t.send("b", 3, b"still fine")
        assert await b.next() == ("a", 3, b"still fine")
        assert not a.t.connected("x") and not x.t.connected("a")
        assert a.t.stats.auth_failures == 0 and b.t.stats.incompatible == 0
        await close(a, b, x)

    run(test)


def test_a_seed_that_is_another_worker_of_its_node_is_refused() -> None:
    async def test(warnings: Warnings) -> None:
        a1 = await Node("a", worker=(1, 2)).start()
        b0 = await Node("b", [a1.address], worker=(0, 2)).start()
        await warnings.until(lambda: b0.t.stats.incompatible >= 1)
        assert any(
            "node 'a' answered as its worker 1, expected worker 0" in line
            and "worker i uses raft_port + i" in line
            for line in warnings.lines
        ), warnings.lines
        assert not b0.t.connected("a")
        await close(a1, b0)

    run(test)


def test_strangers_are_disconnected_and_counted_once_per_address() -> None:
    async def test(warnings: Warnings) -> None:
        a = await Node("a", handshake_timeout=0.2).start()
        for garbage in (b"GET / HTTP/1.1\r\n\r\n", b"MQLR\x09" + bytes(40)):
            reader, writer = await asyncio.open_connection(*a.address)
            writer.write(garbage)
            assert await wait(reader.read()) == b""  # closed by a
            writer.close()
        reader, writer = await asyncio.open_connection(*a.address)  # silent: timed out
        assert await wait(reader.read()) == b""
        writer.close()
        reader, writer = await asyncio.open_connection(*a.address)
        writer.write(hello("a", (HOST, 1), secrets.token_bytes(16)))  # our own node id
        assert await wait(reader.read()) == b""  # no reply: refused at once
        writer.close()
        assert a.t.stats.auth_failures == 4
        assert len(warnings.lines) == 1 and "not a peer" in warnings.lines[0]
        assert a.t.members == {}
        await close(a)

    run(test)


def test_a_malformed_frame_closes_the_connection() -> None:
    async def test(_: Warnings) -> None:
        a = await Node("a").start()
        for bad in (struct.pack(">IB", (64 << 20) + 1, 5), frame(0, b"\x00\x05\x01")):
            reader, writer = await connect_as("s", a.address)
            writer.write(frame(9, b"first") + bad + frame(9, b"never delivered"))
            assert await a.next() == ("s", 9, b"first")
            assert await wait(reader.read()) == b""
            writer.close()
        assert a.t.stats.bad_frames == 2 and a.t.stats.frames_received == 2
        assert a.received.empty()
        await close(a)

    run(test)


def test_a_large_frame_arrives_whole_and_frames_split_anywhere_arrive() -> None:
    async def test(_: Warnings) -> None:
        a = await Node("a").start()
        _reader, writer = await connect_as("s", a.address)
        big = secrets.token_bytes(3 << 20)  # larger than the receive buffer
        stream = frame(1, b"x") + frame(2, big) + frame(3, b"") + frame(4, b"tail")
        for i in range(0, len(stream), 1 << 19):
            writer.write(stream[i : i + (1 << 19)])
            await writer.drain()
        assert [await a.next() for _ in range(4)] == [
            ("s", 1, b"x"), ("s", 2, big), ("s", 3, b""), ("s", 4, b"tail"),
        ]  # fmt: skip
        writer.write(frame(5, b"one")[:3])  # a header split in two writes
        await writer.drain()
        writer.write(frame(5, b"one")[3:])
        assert await a.next() == ("s", 5, b"one")
        writer.close()
        await close(a)

    run(test)


def test_a_peer_that_restarts_is_reconnected_to() -> None:
    async def test(_: Warnings) -> None:
        a = await Node("a").start()
        b = await Node("b", [a.address]).start()
        await wait(a.t.wait_connected("b"))
        await wait(b.t.wait_connected("a"))
        await b.t.close()
        b2 = await Node("b", bind=b.address).start()  # no seeds: it learns a when a redials
        await wait(b2.t.wait_connected("a"))
        assert a.t.connected("b")
        assert a.t.send("b", 1, b"welcome back")
        assert await b2.next() == ("a", 1, b"welcome back")
        assert b2.t.send("a", 2, b"thanks")
        assert await a.next() == ("b", 2, b"thanks")
        assert a.t.stats.connects == 2
        await close(a, b2)

    run(test)


def test_a_restarted_peer_told_of_a_member_before_it_listens_links_both_ways() -> None:
    """A worker restarting beside a running worker 0 hears worker 0's view (the members,
    ``broker.cluster.worker_view``) before its transport listens: the member is dialled once
    it does. Before, ``learn`` left a dialer registered without its task, so the restarted
    node never dialled that member again (not at formation's ``learn``, not when the member
    dialled in) and sent it nothing: seen as a group that elected no leader once a third
    node died."""

    async def test(_: Warnings) -> None:
        a = await Node("a", worker=(1, 2)).start()
        b = await Node("b", [a.address], worker=(1, 2)).start()
        await wait(b.t.wait_connected("a"))
        await b.t.close()
        b2 = Node("b", bind=b.address, worker=(1, 2))
        b2.t.learn("a", a.address)  # worker 0's view, before the transport listens
        await b2.start()
        b2.t.learn("a", a.address)  # formation's member list, once started
        await wait(b2.t.wait_connected("a"))
        await wait(a.t.wait_connected("b"))
        assert b2.t.send("a", 1, b"back") and await a.next() == ("b", 1, b"back")
        assert a.t.send("b", 2, b"welcome") and await b2.next() == ("a", 2, b"welcome")
        await close(a, b2)

    run(test)


def test_a_full_buffer_drops_while_the_reader_is_paused() -> None:
    async def test(_: Warnings) -> None:
        accepted: asyncio.Future[asyncio.StreamWriter] = asyncio.get_running_loop().create_future()

        async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            """A peer that completes the handshake as acceptor, then never reads."""
            h = await read_hello(reader)
            reply = hello("sink", (HOST, 1), secrets.token_bytes(16))
            writer.write(reply + proof(SECRET, b"acceptor", h, reply))
            assert await reader.readexactly(32) == proof(SECRET, b"connector", h, reply)
            accepted.set_result(writer)

        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        listener.bind((HOST, 0))
        server = await asyncio.start_server(sink, sock=listener, limit=4096)
        a = await Node("a", [listener.getsockname()], max_buffer=1 << 20).start()
        await wait(a.t.wait_connected("sink"))
        writer = await wait(accepted)
        payload = bytes(256 << 10)
        sent = 0
        while a.t.send("sink", 1, payload):
            sent += 1
            assert sent < 400, "the buffer never filled"
        assert a.t.stats.dropped_full == 1 and a.t.stats.frames_sent == sent
        assert not a.t.send("sink", 1, payload) and a.t.stats.dropped_full == 2
        await close(a)
        writer.close()
        server.close()
        await server.wait_closed()

    run(test)


def test_a_node_that_dials_itself_stops_without_an_alarm() -> None:
    async def test(warnings: Warnings) -> None:
        probe = socket.socket()
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
        probe.close()
        b = await Node("b").start()
        # Listening everywhere, it does not know 127.0.0.1 names itself.
        a = await Node("a", [(HOST, port), b.address], bind=("", port)).start()
        (dialling_itself,) = [
            t for t in asyncio.all_tasks() if t.get_name() == f"peer dial {(HOST, port)}"
        ]
        await asyncio.wait({dialling_itself}, timeout=TIMEOUT)
        assert dialling_itself.done()
        await wait(b.t.wait_connected("a"))
        assert a.t.stats.auth_failures == 0 and warnings.lines == []
        assert a.t.members == {"b": b.address} and b.t.members == {"a": (HOST, port)}
        await close(a, b)

    run(test)


def test_a_failing_callback_closes_only_its_connection(caplog: pytest.LogCaptureFixture) -> None:
    async def test(_: Warnings) -> None:
        class Buggy(Node):
            def on_message(self, peer: str, kind: int, payload: memoryview) -> None:
                if kind == 13:
                    raise RuntimeError("a bug in the consumer")
                super().on_message(peer, kind, payload)

        a = await Buggy("a").start()
        bad, bad_writer = await connect_as("s", a.address)
        _, good_writer = await connect_as("t", a.address)
        bad_writer.write(frame(13, b"boom") + frame(1, b"after the bug"))
        assert await wait(bad.read()) == b""
        good_writer.write(frame(1, b"unaffected"))
        assert await a.next() == ("t", 1, b"unaffected")
        assert a.received.empty()  # nothing after the failure on its connection
        bad_writer.close()
        good_writer.close()
        await close(a)

    run(test)
    assert "a bug in the consumer" in caplog.text
