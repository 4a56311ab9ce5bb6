"""The supervisor of a multi-worker broker: one process that starts the workers, restarts
one that dies, and stops them all.

It holds what must be held once for the whole broker: the data directory's lock (the workers
inherit the descriptor, so the lock lives as long as any of them) and, for a listener asked
on port 0, the port picked for it (a bound, never listening SO_REUSEPORT socket keeps it
reserved while workers come and go). A port another process holds is found here, before
any worker starts, and reported in one line.

Workers are forked (the parent runs no event loop and no thread, so a fork is clean); each
tells the supervisor it serves by writing one byte to a pipe. A worker that fails before
that, at the first start, fails the whole start (its own message says why); one that dies
later is started again after a short, growing delay, its partitions recover from the log,
and its clients reconnect (SO_REUSEPORT hands new connections to the workers that listen).

SIGTERM / SIGINT: forwarded to every worker, which stops cleanly (DISCONNECTs, sessions
persisted, logs flushed); a worker still running after :data:`STOP_SECONDS` is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from broker.config import Config
from broker.server import ServeError, lock_data_dir
from broker.workers.runtime import WorkerSpec

log = logging.getLogger("broker.workers")

#: Seconds a worker has to stop after SIGTERM before it is killed.
STOP_SECONDS = 30.0
#: Seconds a worker has from its fork to serving (without ``[cluster]``: a cluster's worker
#: serves once the cluster formed, which waits for the other nodes as long as they take, as
#: a single-worker node does; each worker logs which members it is waiting for).
START_SECONDS = 60.0
#: Delay before restarting a dead worker; doubled for each death within RESTART_WINDOW of its
#: start, up to RESTART_MAX (a worker that crashes at once must not spin the machine).
RESTART_DELAY = 0.1
RESTART_MAX = 5.0
RESTART_WINDOW = 10.0
_SIGNALS = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
PR_SET_PDEATHSIG = 1  # linux/prctl.h


WorkerMain = Callable[[Config, WorkerSpec], int]
"""Runs one worker in the forked child until it is told to stop; returns the exit status."""


@dataclass
class _Worker:
    index: int
    pid: int = 0
    ready_fd: int = -1  # the read end of its ready pipe, until it said it serves
    started: float = 0.0
    quick_deaths: int = 0


class Supervisor:
    """Runs ``count`` workers of ``config`` (see the module docstring); :meth:`run` blocks."""

    def __init__(self, config: Config, count: int, main: WorkerMain) -> None:
        self.config = config
        self.count = count
        self.main = main
        self.workers = [_Worker(i) for i in range(count)]
        self._reserved: list[socket.socket] = []
        self._stopping = False

    def run(self) -> int:
        """Start the workers, keep them running until SIGTERM / SIGINT, stop them.

        Raises :class:`ServeError` when the broker cannot start (data directory in use, a
        port taken, a worker failing before it serves).
        """
        lock_fd = lock_data_dir(self.config.commitlog.data_dir)
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            self.config = self._claim_ports(self.config)
            for worker in self.workers:
                self._start(worker)
            if not self._wait_ready():
                return self._stop()  # SIGTERM / SIGINT while starting
            log.info("supervisor (pid %d): %d workers serving", os.getpid(), self.count)
            for listener in self.listeners():
                log.info("listening on %s", listener)
            while not self._stopping:
                self._step(signal.sigtimedwait(_SIGNALS, 1.0))
            return self._stop()
        except BaseException:
            self._stopping = True
            self._stop()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            for sock in self._reserved:
                sock.close()
            os.close(lock_fd)

    def listeners(self) -> list[str]:
        """The MQTT listeners the workers share, as URLs."""
        server = self.config.server
        out = [f"mqtt://{server.host}:{server.port}"]
        if server.tls_port:
            out.append(f"mqtts://{server.host}:{server.tls_port}")
        if server.ws_port:
            out.append(f"ws://{server.host}:{server.ws_port}/mqtt")
        return out

    # ------------------------------------------------------------ ports

    def _claim_ports(self, config: Config) -> Config:
        """Check every MQTT listener's port is free; pick and reserve one for port 0."""
        server = config.server
        port = self._claim(server.host, server.port)
        tls = self._claim(server.host, server.tls_port) if server.tls_port else 0
        ws = self._claim(server.host, server.ws_port) if server.ws_port else 0  # 0: off
        http = config.http
        if http.enabled and http.port:
            # Worker 0 alone serves it: a port in use is refused here rather than there,
            # after worker 1 serves and worker 0 waits for it to stop.
            self._claim(http.host, http.port)
        return replace(config, server=replace(server, port=port, tls_port=tls, ws_port=ws))

    def _claim(self, host: str, port: int) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        if port:
            # Without SO_REUSEPORT, as a second broker's probe would be: a port that anything
            # (another mqlog included) listens on is refused here, in one line.
            probe = socket.socket(family, socket.SOCK_STREAM)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                raise ServeError(f"cannot listen on {host}:{port}: {e.strerror}") from None
            finally:
                probe.close()
            return port
        keeper = socket.socket(family, socket.SOCK_STREAM)
        keeper.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        keeper.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        keeper.bind((host, 0))
        self._reserved.append(keeper)
        return int(keeper.getsockname()[1])

    # ------------------------------------------------------------ workers

    def _start(self, worker: _Worker) -> None:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            os.close(read_fd)
            status = 1
            try:
                signal.pthread_sigmask(signal.SIG_SETMASK, set())
                for sig in _SIGNALS:
                    signal.signal(sig, signal.SIG_DFL)
                for sock in self._reserved:
                    sock.close()
                status = self.main(self.config, WorkerSpec(worker.index, self.count, write_fd))
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else 1
            except BaseException:
                log.exception("worker %d failed", worker.index)
            finally:
                logging.shutdown()
                os._exit(status)
        os.close(write_fd)
        worker.pid = pid
        worker.ready_fd = read_fd
        worker.started = time.monotonic()
        log.info("worker %d: started, pid %d", worker.index, pid)

    def _wait_ready(self) -> bool:
        """Until every worker serves (True) or SIGTERM / SIGINT comes (False); a worker
        that ends first fails the start, as does one not serving within
        :data:`START_SECONDS` (no limit with ``[cluster]``)."""
        limit = None if self.config.cluster is not None else START_SECONDS
        deadline = time.monotonic() + (limit or 0.0)
        for worker in self.workers:
            while True:
                said = self._read_ready(worker, timeout=0.1)
                if said:
                    break
                if signal.sigtimedwait({signal.SIGTERM, signal.SIGINT}, 0) is not None:
                    self._stopping = True
                    return False
                pid, status = os.waitpid(worker.pid, 0 if said is None else os.WNOHANG)
                if pid:
                    worker.pid = 0
                    raise ServeError(
                        f"worker {worker.index} failed to start "
                        f"({_describe(status)}); see its message above"
                    )
                if limit is not None and time.monotonic() > deadline:
                    raise ServeError(f"worker {worker.index} did not start within {limit:.0f} s")
        return True

    def _read_ready(self, worker: _Worker, timeout: float) -> bool | None:
        """True once ``worker`` said it serves; False while it has not yet; None when its
        pipe closed without it (it is exiting)."""
        if worker.ready_fd < 0:
            return True
        readable, _, _ = select.select([worker.ready_fd], [], [], timeout)
        if not readable:
            return False
        said = os.read(worker.ready_fd, 1)
        os.close(worker.ready_fd)
        worker.ready_fd = -1
        return True if said == b"R" else None

    def _step(self, info: signal.struct_siginfo | None) -> None:
        if info is not None and info.si_signo in (signal.SIGTERM, signal.SIGINT):
            log.info("supervisor: stopping the workers")
            self._stopping = True
            return
        for worker in self.workers:
            if worker.ready_fd >= 0:
                self._read_ready(worker, timeout=0)
            if worker.pid == 0:
                self._restart(worker)
                continue
            pid, status = os.waitpid(worker.pid, os.WNOHANG)
            if pid:
                log.error(
                    "worker %d (pid %d) %s; restarting it", worker.index, pid, _describe(status)
                )
                worker.pid = 0
                if worker.ready_fd >= 0:
                    os.close(worker.ready_fd)
                    worker.ready_fd = -1
                if time.monotonic() - worker.started < RESTART_WINDOW:
                    worker.quick_deaths += 1
                else:
                    worker.quick_deaths = 0
                self._restart(worker)

    def _restart(self, worker: _Worker) -> None:
        delay = min(RESTART_DELAY * 2**worker.quick_deaths, RESTART_MAX)
        if time.monotonic() - worker.started < delay:
            return  # the next step (at most a second away) tries again
        self._start(worker)

    def _stop(self) -> int:
        """SIGTERM every worker, wait, kill what is left; 0 when all stopped cleanly."""
        running = {w.pid: w for w in self.workers if w.pid}
        for pid in running:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        status_all = 0
        while running and time.monotonic() < deadline:
            for pid in list(running):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    worker = running.pop(pid)
                    worker.pid = 0
                    if status:
                        log.error("worker %d %s while stopping", worker.index, _describe(status))
                        status_all = 1
            if running:
                time.sleep(0.05)
        for pid, worker in running.items():
            log.error(
                "worker %d (pid %d) did not stop in %.0f s; killing it",
                worker.index,
                pid,
                STOP_SECONDS,
            )
            _signal(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status_all = 1
        return status_all


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent (the supervisor) dies, so a
    supervisor killed with SIGKILL never leaves workers holding the port and the log."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() == 1:
        os._exit(1)  # the parent died before the request took effect


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(pid, sig)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"
