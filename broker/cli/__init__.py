"""The ``mqlog`` console script.

``mqlog serve -c config/broker.toml [-h/--host ADDR] [-p/--port N] [--http-port N]
[--data-dir DIR] [--workers N] [-v]`` runs the broker; command-line values take precedence over
the file and are checked exactly as the keys they override (an error names the flag). ``-h``
is the host, as in Mosquitto's clients; ``--help`` is the help. It says who can reach it (one
line: loopback by default while anonymous access has no password file; a warning when
anonymous access meets another address), logs one line per listener when ready and stops
cleanly on SIGTERM / SIGINT. ``mqlog --version`` prints the version. With ``workers`` > 1
this process is the supervisor of that many worker processes
(:mod:`broker.workers.supervisor`); each worker logs what it owns and serves, the supervisor
the listeners once all of them serve.

``mqlog spark-drain --broker URL [--stream S] --output DIR --checkpoint DIR [--once]`` drains
streams into Parquet partitioned by date with Spark, exactly once (:mod:`spark_sink.drain`;
PySpark is imported only by this command).

``mqlog passwd FILE USER [--password P] [-D]`` adds, changes or deletes (``-D``) a user in a
password file of scrypt hashes (like mosquitto_passwd). The password is prompted twice on a
terminal, else read as one line from stdin (scripts); ``--password`` is visible to other
local users in the process list, so prefer stdin.

``mqlog streams [--broker URL]`` and ``mqlog offsets [--broker URL]`` ask a running broker's
HTTP admin API (default ``http://127.0.0.1:8080``) and print tables: streams with their
partitions and high-water marks; each persistent session's and shared group's position and lag.
With ``--user NAME`` they (and ``spark-drain``) authenticate as that user of the broker's
password file, the password taken from ``$MQLOG_PASSWORD``.

No user error ends in a traceback: bad values, an unreachable broker, a missing optional
extra (``bench``, ``spark``: the message names the extra to install) are one line and a
non-zero exit.

``mqlog verify DATA_DIR [--repair]`` checks every segment, index and time index under a data
directory (read-only: safe against a running broker's files) and prints a table of what is
damaged; exit status 1 when something is. ``--repair`` (broker stopped) moves damaged segments
aside to ``<partition>/quarantine/`` (never deleted), keeps their intact batches and rebuilds
the indexes (:mod:`broker.commitlog.verify`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import importlib.metadata
import importlib.util
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from broker.auth import (
    AuthFileError,
    hash_password,
    read_password_file,
    valid_user_name,
    write_password_file,
)
from broker.cli import cluster as cluster_cli
from broker.cli.admin import (
    DEFAULT_BROKER,
    PASSWORD_ENV,
    BrokerUnreachable,
    cmd_offsets,
    cmd_streams,
    table,
)
from broker.commitlog import CommitLogError
from broker.commitlog.streams import check_format
from broker.commitlog.verify import findings, repair, verify_data_dir
from broker.config import FLAGS, Config, ConfigError, check_ports, is_loopback, load_config
from broker.server import ServeError, Server
from broker.workers.runtime import WorkerSpec
from broker.workers.supervisor import Supervisor, die_with_parent

log = logging.getLogger("mqlog")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys ``mqlog serve``'s flags set (:data:`broker.config.FLAGS`): they are
    checked exactly as the file's values are, and an error names the flag."""
    values = {
        "server.host": args.host,
        "server.port": args.port,
        "http.port": args.http_port,
        "commitlog.data_dir": args.data_dir,
        "router.workers": args.workers,
    }
    return {key: value for key, value in values.items() if value is not None}


def _log_exposure(cfg: Config) -> None:
    """One line on who can reach the broker: loopback by default while anyone may log in
    (Mosquitto 2's rule); a warning naming the risk when anonymous access meets a
    non-loopback address."""
    server, auth, http = cfg.server, cfg.auth, cfg.http
    if not server.host_named and is_loopback(server.host):
        log.info(
            "anonymous access and no password file: listening on %s only (this machine); "
            "name an address with [server] host or --host to accept other machines",
            server.host,
        )
    elif auth.allow_anonymous and not is_loopback(server.host):
        log.warning(
            "MQTT on %s with anonymous access: anyone who can reach this address may publish "
            "and subscribe to every topic%s; set [auth] allow_anonymous = false and a "
            "password_file (mqlog passwd), or listen on 127.0.0.1",
            server.host,
            "" if auth.acl_file else " without a password",
        )
    if http.enabled and auth.allow_anonymous and not is_loopback(http.host):
        log.warning(
            "HTTP API on %s with anonymous access: anyone who can reach it may read every "
            'stream%s; set [auth] allow_anonymous = false, or [http] host = "127.0.0.1"',
            http.host,
            " their ACL allows" if auth.acl_file else "",
        )


async def _serve(cfg: Config, worker: WorkerSpec | None = None) -> None:
    server = Server(cfg, worker=worker)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A cluster's node serves once the cluster formed, which waits for the other nodes as
    # long as they take: SIGTERM / SIGINT stops it meanwhile too.
    starting = asyncio.ensure_future(server.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        log.info("stopping before serving")
        await server.stop()
        return
    try:
        listeners = starting.result()
    except OSError as e:
        await server.stop()
        raise ServeError(f"cannot listen: {e}") from None
    if worker is None:
        for listener in listeners:
            log.info("listening on %s", listener)
    else:
        owned = server.runtime.owned_keys() if server.runtime is not None else []
        log.info(
            "worker %d (pid %d): serving %s; owns %s",
            worker.index,
            os.getpid(),
            ", ".join(listeners),
            ", ".join(f"{s}/{p}" for s, p in owned) or "nothing",
        )
        worker.ready()
    await stop.wait()
    log.info("stopping: closing connections, persisting sessions, flushing logs")
    await server.stop()
    log.info("stopped")


def cmd_serve(args: argparse.Namespace) -> int:
    overrides = _overrides(args)
    cfg = load_config(args.config, overrides)
    check_ports(cfg, str(args.config), {key: FLAGS[key] for key in overrides})
    _log_exposure(cfg)
    count = cfg.worker_count()
    if count == 1:
        _run(_serve(cfg))
        return 0
    # Once, before the workers race to create it.
    check_format(cfg.commitlog.data_dir)
    return Supervisor(cfg, count, _run_worker).run()


def _run_worker(cfg: Config, worker: WorkerSpec) -> int:
    """The body of a forked worker process (see :class:`Supervisor`)."""
    die_with_parent()  # a SIGKILLed supervisor takes its workers along, as one process would
    try:
        _run(_serve(cfg, worker))
    except (ServeError, CommitLogError) as e:
        log.error("worker %d: %s", worker.index, e)
        return 2
    return 0


def _run(main: Any) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; fall back if absent
        asyncio.run(main)
    else:
        uvloop.run(main)


class MissingExtra(Exception):
    """A command needs an optional dependency that is not installed; the message names the
    extra that installs it."""


def _require(module: str, extra: str, command: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(
            f"needs {module}, which is not installed: pip install 'mqlog[{extra}]' "
            f"(in a source checkout: .venv/bin/pip install -e '.[{extra}]') to use `mqlog "
            f"{command}`"
        )


def cmd_spark_drain(args: argparse.Namespace) -> int:
    _require("pyspark", "spark", "spark-drain")
    from spark_sink.drain import run_cli  # lazy: only this command loads PySpark

    return run_cli(args)


class PasswdError(Exception):
    """`mqlog passwd` cannot do what was asked; the message says why."""


def _read_new_password(args: argparse.Namespace) -> str:
    if args.password is not None:
        password = str(args.password)
    elif sys.stdin.isatty():
        password = getpass.getpass("Password: ")
        if getpass.getpass("Reenter password: ") != password:
            raise PasswdError("passwords do not match")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        raise PasswdError("empty password")
    if len(password.encode()) > 65535:
        raise PasswdError("password longer than 65535 bytes (MQTT's limit)")
    return password


def cmd_passwd(args: argparse.Namespace) -> int:
    path = Path(args.file)
    user = args.user
    if not valid_user_name(user):
        raise PasswdError(f"invalid user name {user!r} (no ':' or white space, 1-256 chars)")
    users = read_password_file(path) if path.exists() else {}
    if args.delete:
        if user not in users:
            raise PasswdError(f"{path}: no user {user!r}")
        del users[user]
        write_password_file(path, users)
        print(f"{path}: deleted {user}", file=sys.stderr)
        return 0
    users[user] = hash_password(_read_new_password(args))
    write_password_file(path, users)
    return 0


class JsonFormatter(logging.Formatter):
    """One JSON object per line (orjson): ts (UTC), level, logger, msg, and exc if any."""

    converter = time.gmtime  # type: ignore[assignment]  # the stub types it loosely

    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(event).decode()


def _version() -> str:
    try:
        return importlib.metadata.version("mqlog")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was not installed
        return "unknown (not installed)"


def _configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mqlog", description="MQTT broker on a commit log")
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="DEBUG, INFO, WARNING, ERROR",
    )
    parser.add_argument("--version", action="version", version=f"mqlog {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "bench",
        add_help=False,
        help="mqlog vs Mosquitto side by side (bench/mqtt_bench.py; see --help)",
    )
    # -h names the host, as in Mosquitto's clients (mosquitto_sub -h HOST -p PORT); --help
    # stays, and `mqlog -h` is the top level's help.
    serve = sub.add_parser("serve", help="run the broker", add_help=False)
    serve.add_argument("--help", action="help", help="show this help message and exit")
    serve.add_argument("-c", "--config", default="config/broker.toml", help="TOML config file")
    serve.add_argument("-h", "--host", help="address of the MQTT listeners (overrides server.host)")
    serve.add_argument("-p", "--port", type=int, help="MQTT TCP port (overrides server.port)")
    serve.add_argument("--http-port", type=int, help="HTTP port (overrides http.port)")
    serve.add_argument("--data-dir", help="log directory (overrides commitlog.data_dir)")
    serve.add_argument("--workers", type=int, help="worker processes (overrides router.workers)")
    serve.add_argument(
        "-v", "--verbose", action="store_true", help="log at DEBUG (as --log-level DEBUG)"
    )
    serve.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text lines, or one JSON object per line",
    )
    serve.set_defaults(func=cmd_serve)
    passwd = sub.add_parser("passwd", help="add, change or delete a user in a password file")
    passwd.add_argument("file", help="password file (created if missing)")
    passwd.add_argument("user", help="user name")
    passwd.add_argument("-D", "--delete", action="store_true", help="delete the user")
    passwd.add_argument("--password", help="the password (else prompted, or read from stdin)")
    passwd.set_defaults(func=cmd_passwd)
    for name, func, text in (
        ("streams", cmd_streams, "list streams, partitions and high-water marks"),
        ("offsets", cmd_offsets, "each persistent session's position and lag"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument(
            "--broker",
            default=DEFAULT_BROKER,
            help=f"the broker's HTTP API (default {DEFAULT_BROKER})",
        )
        cmd.add_argument(
            "--user", help=f"a user of the password file (password in ${PASSWORD_ENV})"
        )
        cmd.set_defaults(func=func)
    cluster_cli.add_parser(sub)
    drain = sub.add_parser("spark-drain", help="drain streams into Parquet with Spark")
    drain.add_argument(
        "--broker", default=DEFAULT_BROKER, help=f"the broker's HTTP API (default {DEFAULT_BROKER})"
    )
    drain.add_argument(
        "--stream",
        action="append",
        help="a stream to drain (repeatable; default: every user stream)",
    )
    drain.add_argument("--output", required=True, help="Parquet output directory")
    drain.add_argument("--checkpoint", required=True, help="Spark checkpoint directory")
    drain.add_argument(
        "--once",
        action="store_true",
        help="drain what the broker holds now and exit (Trigger.AvailableNow)",
    )
    drain.add_argument(
        "--trigger-interval",
        default="10 seconds",
        help="micro-batch interval without --once (default: 10 seconds)",
    )
    drain.add_argument(
        "--max-records-per-trigger", type=int, help="at most this many records per micro-batch"
    )
    drain.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    drain.add_argument("--user", help=f"a user of the password file (password in ${PASSWORD_ENV})")
    drain.add_argument(
        "--spark-log",
        help="where Spark's own log (WARN and above) goes (default CHECKPOINT/spark-driver.log)",
    )
    drain.set_defaults(func=cmd_spark_drain)
    _add_verify_parser(sub)
    return parser


def cmd_verify(args: argparse.Namespace) -> int:
    """``mqlog verify DATA_DIR [--repair]``: a table of the damage found, one row each."""
    data_dir = Path(args.data_dir)
    if not data_dir.is_dir():
        print(f"mqlog verify: error: {data_dir} is not a directory", file=sys.stderr)
        return 2
    checked = verify_data_dir(data_dir)
    rows: list[list[Any]] = []
    damaged = []
    segments = 0
    for _directory, checks in checked:
        segments += len(checks)
        for check in checks:
            if check.damaged:
                damaged.append(check)
            for f in findings(check):
                d = f.damage
                where = [f"{d.position}..{d.end}", d.offsets()] if d is not None else ["", ""]
                rows.append([f.stream, f.partition, f.path.name, *where, f.problem])
    print(f"{segments} segments in {len(checked)} partitions checked under {data_dir}")
    if rows:
        headers = ["stream", "partition", "file", "bytes", "offsets", "problem"]
        print(table(headers, rows))
    else:
        print("no damage found")
    if args.repair:
        for check in damaged:
            for line in repair(check):
                print(f"{check.log_path.parent}: {line}")
    return 1 if rows else 0


def _add_verify_parser(sub: Any) -> None:
    verify = sub.add_parser("verify", help="check (and --repair) a data directory's segments")
    verify.add_argument("data_dir", metavar="DATA_DIR", help="the broker's commitlog.data_dir")
    verify.add_argument(
        "--repair",
        action="store_true",
        help="with the broker stopped: quarantine damaged segments' bytes, rebuild indexes",
    )
    verify.set_defaults(func=cmd_verify)


def cmd_bench(argv: list[str]) -> int:
    """``mqlog bench [...]``: bench/mqtt_bench.py (a source checkout's; not in the wheel).

    Imported only here: it needs numpy and matplotlib (the ``bench`` extra) and Mosquitto.
    """
    root = Path(__file__).resolve().parents[2]
    if not (root / "bench" / "mqtt_bench.py").is_file():
        print("mqlog bench: needs a source checkout (bench/mqtt_bench.py)", file=sys.stderr)
        return 2
    try:
        for module in ("numpy", "matplotlib"):
            _require(module, "bench", "bench")
    except MissingExtra as e:
        print(f"mqlog bench: error: {e}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    from bench.mqtt_bench import main as bench_main

    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own options: `mqlog bench --help`
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    level = "DEBUG" if getattr(args, "verbose", False) else args.log_level
    _configure_logging(level, getattr(args, "log_format", "text"))
    try:
        return int(args.func(args))
    except (ConfigError, CommitLogError, ServeError) as e:
        log.error("%s", e)
        return 2
    except (BrokerUnreachable, PasswdError, AuthFileError, MissingExtra) as e:
        print(f"mqlog {args.command}: error: {e}", file=sys.stderr)
        return 1
