"""broker.net.handoff: descriptors between the workers of one broker, and nobody else's.

The channel accepts a descriptor only from a sibling worker (a process whose parent is the
supervisor, same uid), told by the kernel's credentials: a forked child of this test plays
the sibling (this process plays the supervisor), and this process itself, whose pid is the
receiver's, plays anyone else.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket

from broker.net.handoff import FdChannel, channel_name


def _send(supervisor: int, token: int, fd: int) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        out.sendmsg([token.to_bytes(8, "little")], rights, 0, channel_name(supervisor, 0))


def test_a_sibling_workers_descriptor_arrives_and_works() -> None:
    async def run() -> bytes:
        channel = FdChannel(asyncio.get_running_loop(), os.getpid(), 0)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the sibling: sends the pipe's write end, and goes
            try:
                _send(os.getppid(), 7, write)
            finally:
                os._exit(0)
        os.close(write)
        try:
            fd = await channel.take(7)
            assert fd is not None
            os.write(fd, b"through the handed descriptor")
            os.close(fd)
            assert channel.rejected == 0
            return os.read(read, 100)
        finally:
            os.waitpid(child, 0)
            os.close(read)
            channel.close()

    assert asyncio.run(run()) == b"through the handed descriptor"


def test_a_descriptor_from_anyone_else_is_dropped_and_counted() -> None:
    async def run() -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        channel = FdChannel(loop, os.getpid(), 0)
        read, write = os.pipe()
        try:
            _send(os.getpid(), 9, write)  # from the receiver's own process: no sibling
            os.close(write)
            for _ in range(100):
                if channel.rejected:
                    break
                await asyncio.sleep(0.01)
            # Dropped: its copy closed, so the pipe has no writer left (end of file).
            return channel.rejected, os.read(read, 10)
        finally:
            os.close(read)
            channel.close()

    assert asyncio.run(run()) == (1, b"")


def test_channel_names_differ_per_broker_and_worker() -> None:
    names = {channel_name(pid, w) for pid in (100, 101) for w in (0, 1)}
    assert len(names) == 4
    assert all(name.startswith(b"\0") for name in names)  # the abstract namespace
