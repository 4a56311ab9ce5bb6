"""Fixtures that run the real broker process (``mqlog serve``) for black-box tests.

Each test gets its own broker on a free port with its own data directory; the process is
stopped (SIGTERM, then SIGKILL if it hangs) when the test ends. The processes are forked by
a launcher that imported the broker once (tests.integration.launcher): a start took 2-5 s on
the CI machine, most of it the interpreter's imports; 0.3-0.8 s so.

Every test using a broker runs twice: with one worker and with two worker processes
(``--workers 2``: the supervisor and two routers sharing the port). ``MQLOG_TEST_WORKERS``
(e.g. ``1``, as ``make test-fast`` sets it) narrows that down; the tests of test_workers.py,
which are about several workers, always start two.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench import ports
from tests.integration.launcher import LaunchedProcess, launcher

ROOT = Path(__file__).resolve().parents[2]
READY = "listening on mqtt://"
WORKERS = [int(n) for n in os.environ.get("MQLOG_TEST_WORKERS", "1,2").split(",")]
#: Brokers are forked by the launcher (tests.integration.launcher: no interpreter start and
#: imports for each); ``MQLOG_TEST_LAUNCHER=0`` starts each as ``python -m broker.cli``.
LAUNCHER = os.environ.get("MQLOG_TEST_LAUNCHER", "1") != "0"


def run_mqlog(
    *args: str, input: str | None = None, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """``mqlog *args`` run to its end (forked by the launcher, see :data:`LAUNCHER`), its
    output captured as text."""
    if LAUNCHER:
        return launcher().run(list(args), input=input, env=env, timeout=timeout)
    return subprocess.run(
        [sys.executable, "-m", "broker.cli", *args],
        cwd=ROOT,
        input=input,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class BrokerProcess:
    """A broker child process; restartable on the same port and data directory."""

    def __init__(
        self,
        tmp: Path,
        config: str = "",
        fsync: str = "interval",
        server: str = "",
        workers: int = 1,
    ) -> None:
        self.workers = workers
        self.host = "127.0.0.1"
        self.port = free_port()
        self.http_port = free_port()  # [http] admin API; its own port so brokers never clash
        tmp.mkdir(parents=True, exist_ok=True)
        self.data_dir = tmp / "data"
        self.config_path = tmp / "broker.toml"
        self.config_path.write_text(
            f'[server]\nhost = "127.0.0.1"\nport = {self.port}\n{server}'
            f'[commitlog]\ndata_dir = "{self.data_dir}"\nfsync = "{fsync}"\n'
            f'[http]\nhost = "127.0.0.1"\nport = {self.http_port}\n' + config
        )
        self.log_path = tmp / "broker.log"
        self.proc: subprocess.Popen[bytes] | LaunchedProcess | None = None
        #: "listening on mqtt://" lines in the log so far: one per start that got ready.
        self.readies = 0

    def start(self, timeout: float = 20.0) -> None:
        argv = ["serve", "-c", str(self.config_path), "--workers", str(self.workers)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if LAUNCHER:
            self.proc = launcher().spawn(argv, self.log_path, env)
        else:
            log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "broker.cli", *argv],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            if text.count(READY) > self.readies:  # this start's line (the log is appended)
                self.readies = text.count(READY)
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.02)
        raise RuntimeError(f"broker not ready after {timeout}s:\n{self.log_path.read_text()}")

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait: the clean shutdown path."""
        proc = self.proc
        if proc is None:
            return 0
        returncode = proc.poll()
        if returncode is not None:
            return returncode
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"broker did not stop on SIGTERM:\n{self.log()}") from None

    def kill(self) -> None:
        """SIGKILL: the crash path (the workers die with their supervisor)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            self._wait_unlocked()

    def _wait_unlocked(self, timeout: float = 10.0) -> None:
        """Until no process of this broker holds its data directory (workers killed with
        their supervisor exit a moment after it)."""
        path = self.data_dir / ".lock"
        if not path.exists():
            return
        deadline = time.monotonic() + timeout
        with open(path, "rb") as f:
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{path} still locked {timeout}s after the kill"
                        ) from None
                    time.sleep(0.01)
                    continue
                fcntl.flock(f, fcntl.LOCK_UN)
                return

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def restart(self) -> None:
        self.stop()
        self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


#: Under pytest-xdist (``pytest -n 2``) process ``gwN`` takes its ports in turn from its own
#: block below Linux's ephemeral range (32768-60999): never a port the kernel hands a client
#: socket, nor one another process chose and has not bound yet.
XDIST_PORT_BASE = 20000
XDIST_PORT_BLOCK = 3000
XDIST_PORT_BLOCKS = 4  # 20000-31999
_xdist_given = 0


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on now, and not given lately by this process
    (under xdist: not within its last ``XDIST_PORT_BLOCK`` ports; else never)."""
    global _xdist_given
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else -1
    if not 0 <= index < XDIST_PORT_BLOCKS:
        return ports.free_port()
    first = XDIST_PORT_BASE + index * XDIST_PORT_BLOCK
    for _ in range(XDIST_PORT_BLOCK):
        port = first + _xdist_given % XDIST_PORT_BLOCK
        _xdist_given += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (a broker still running, or another program)
        return port
    raise RuntimeError(f"no free port in {first}-{first + XDIST_PORT_BLOCK - 1} ({worker})")


BrokerFactory = Callable[..., BrokerProcess]


@pytest.fixture(params=WORKERS, ids=[f"w{n}" for n in WORKERS])
def workers(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(scope="module", params=WORKERS, ids=[f"w{n}" for n in WORKERS])
def module_workers(request: pytest.FixtureRequest) -> int:
    """``workers`` for a broker shared by the tests of a module."""
    return int(request.param)


@pytest.fixture
def broker_factory(tmp_path: Path, workers: int) -> Iterator[BrokerFactory]:
    """``broker_factory(config="extra toml", fsync="always", start=True, server="...")``;
    ``server`` adds keys to the [server] section (which holds host and port already)."""
    started: list[BrokerProcess] = []

    def make(
        config: str = "", fsync: str = "interval", start: bool = True, server: str = ""
    ) -> BrokerProcess:
        b = BrokerProcess(tmp_path / f"b{len(started)}", config, fsync, server, workers)
        started.append(b)
        if start:
            b.start()
        return b

    yield make
    for b in started:
        try:
            b.stop()
        except RuntimeError:
            b.kill()
            raise


@pytest.fixture
def broker(broker_factory: BrokerFactory) -> BrokerProcess:
    return broker_factory()


def _worker_count(item: pytest.Item) -> int | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    n = callspec.params.get("module_workers", callspec.params.get("workers"))
    return None if n is None else int(n)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The Spark tests first (a stable sort: the order is otherwise kept): their file is the
    longest by far (JVM starts). Run on two processes a file to each in turn
    (``pytest -n 2 --dist loadfile --no-loadscope-reorder``), the other process runs the
    rest meanwhile instead of leaving Spark alone at the end.

    A test marked ``only_workers(n)`` keeps its ``[wn]`` variant only (all of them when
    ``MQLOG_TEST_WORKERS`` leaves ``n`` out); the mark's reason says why the other count
    adds nothing."""
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("only_workers")
        n = _worker_count(item)
        if mark is not None and n is not None and mark.args[0] in WORKERS and n != mark.args[0]:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    items.sort(key=lambda item: item.get_closest_marker("spark") is None)
