"""The ``mqlog`` console script.

``mqlog serve -c config/broker.toml [--port N] [--http-port N] [--data-dir DIR] [--workers N]``
runs the broker; command-line values take precedence over the file. It logs one line per
listener when ready and stops cleanly on SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
from pathlib import Path

from broker.commitlog import CommitLogError
from broker.config import Config, ConfigError, load_config

log = logging.getLogger("mqlog")


def _apply_overrides(cfg: Config, args: argparse.Namespace) -> Config:
    if args.port is not None:
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, port=args.port))
    if args.http_port is not None:
        cfg = dataclasses.replace(cfg, http=dataclasses.replace(cfg.http, port=args.http_port))
    if args.data_dir is not None:
        cfg = dataclasses.replace(
            cfg, commitlog=dataclasses.replace(cfg.commitlog, data_dir=Path(args.data_dir)))
    if args.workers is not None:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router,
                                                                  workers=args.workers))
    return cfg


async def _serve(cfg: Config) -> None:
    from broker.server import Server

    server = Server(cfg)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    for listener in await server.start():
        log.info("listening on %s", listener)
    await stop.wait()
    log.info("stopping: closing connections, persisting sessions, flushing logs")
    await server.stop()
    log.info("stopped")


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = _apply_overrides(load_config(args.config), args)
    if cfg.worker_count() != 1:
        raise ConfigError(
            f"{args.config}: router.workers = {cfg.router.workers}: this build runs one worker;"
            " set workers = 1"
        )
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; fall back if absent
        asyncio.run(_serve(cfg))
    else:
        uvloop.run(_serve(cfg))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mqlog", description="MQTT broker on a commit log")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the broker")
    serve.add_argument("-c", "--config", default="config/broker.toml", help="TOML config file")
    serve.add_argument("--port", type=int, help="MQTT TCP port (overrides server.port)")
    serve.add_argument("--http-port", type=int, help="HTTP port (overrides http.port)")
    serve.add_argument("--data-dir", help="log directory (overrides commitlog.data_dir)")
    serve.add_argument("--workers", type=int, help="worker processes (overrides router.workers)")
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except (ConfigError, CommitLogError) as e:
        log.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
