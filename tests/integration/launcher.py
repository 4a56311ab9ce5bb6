"""A fork server for the brokers the integration tests start: ``mqlog serve`` without the
interpreter start and the imports each time.

A broker process spent most of its start importing (``python -X importtime -c "import
broker.cli"``: 1-4 s of a 2-5 s start on the 2-core CI machine, pyarrow and aiohttp the
largest), and the suite starts some hundreds. The launcher imports the broker once, then for
each request forks a child that runs ``broker.cli.main(argv)`` exactly as ``python -m
broker.cli`` would (its output appended to a log file, the given environment and working
directory, stdin from /dev/null) and exits with its return code. The broker forks its own
workers the same way after the same imports (broker.workers.supervisor), so nothing a test
sees differs from a process started by ``subprocess``.

The launcher is the children's parent: it reaps them and answers for their exit status.
Requests and answers are JSON lines on its stdin and stdout:
``["spawn", argv, out, err, stdin, env, cwd]`` -> pid (see :func:`_child`),
``["poll", pid]`` -> return code or null, ``["wait", pid, timeout]`` -> return code or null
when ``timeout`` passed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import broker.cli

ROOT = Path(__file__).resolve().parents[2]


def _child(
    argv: list[str], out: str, err: str | None, stdin: str | None, env: dict[str, str], cwd: str
) -> None:
    """In the forked child: become ``mqlog <argv>`` with stdout appended to ``out``, stderr
    to ``err`` (None: ``out`` too), stdin read from ``stdin`` (None: /dev/null); never
    returns."""
    code = 1
    try:
        for fd, path in ((1, out), (2, err or out)):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        source = os.open(stdin or os.devnull, os.O_RDONLY)
        os.dup2(source, 0)
        os.close(source)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own streams
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [str(ROOT / "broker" / "cli" / "__main__.py"), *argv]  # as with -m
        code = broker.cli.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve() -> None:
    """The launcher's loop (``python -m tests.integration.launcher``)."""
    requests = sys.stdin
    answers = sys.stdout
    status: dict[int, int] = {}

    def reap(pid: int, block: bool) -> int | None:
        if pid in status:
            return status[pid]
        try:
            done, st = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return status.get(pid, -1)
        if done == 0:
            return None
        status[pid] = os.waitstatus_to_exitcode(st)
        return status[pid]

    for line in requests:
        request = json.loads(line)
        answer: Any
        if request[0] == "spawn":
            pid = os.fork()
            if pid == 0:
                _child(*request[1:])
            answer = pid
        elif request[0] == "poll":
            answer = reap(request[1], block=False)
        else:  # wait
            _, pid, timeout = request
            deadline = time.monotonic() + timeout
            answer = reap(pid, block=False)
            while answer is None and time.monotonic() < deadline:
                time.sleep(0.01)
                answer = reap(pid, block=False)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


class Launcher:
    """The test side: one launcher process per pytest process, started on first use."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.launcher"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lock = threading.Lock()

    def ask(self, *request: Any) -> Any:
        with self._lock:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the broker launcher exited ({self._proc.poll()})")
        return json.loads(line)

    def spawn(self, argv: list[str], log_path: Path, env: dict[str, str]) -> LaunchedProcess:
        log_path.touch()  # there when the caller reads it, before the child opened it
        pid = self.ask("spawn", argv, str(log_path), None, None, env, str(ROOT))
        return LaunchedProcess(self, int(pid))

    def run(
        self,
        argv: list[str],
        *,
        input: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 30,
    ) -> subprocess.CompletedProcess[str]:
        """``subprocess.run([python, -m, broker.cli, *argv], input=input, env=env,
        capture_output=True, text=True, timeout=timeout)``, forked from here."""
        with tempfile.TemporaryDirectory(prefix="mqlog-run-") as tmp:
            out, err, stdin = (Path(tmp) / name for name in ("out", "err", "in"))
            stdin.write_text(input or "")
            pid = self.ask(
                "spawn", argv, str(out), str(err), str(stdin), env or dict(os.environ), str(ROOT)
            )
            proc = LaunchedProcess(self, int(pid))
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
            text = [p.read_text() if p.exists() else "" for p in (out, err)]
            return subprocess.CompletedProcess(["mqlog", *argv], code, *text)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(10)


class LaunchedProcess:
    """The part of :class:`subprocess.Popen` the broker fixtures use, for a launched
    broker."""

    def __init__(self, launcher: Launcher, pid: int) -> None:
        self.launcher = launcher
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.launcher.ask("poll", self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.launcher.ask(
                "wait", self.pid, 1e9 if timeout is None else timeout
            )
        if self.returncode is None:
            raise subprocess.TimeoutExpired(["mqlog"], timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_launcher: Launcher | None = None


def launcher() -> Launcher:
    """This pytest process's launcher (started on first use, ended with the process)."""
    global _launcher
    if _launcher is None or _launcher._proc.poll() is not None:
        _launcher = Launcher()
    return _launcher


if __name__ == "__main__":
    _serve()
