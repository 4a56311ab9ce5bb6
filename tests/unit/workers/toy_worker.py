"""A stand-in worker for the supervisor tests: answers each TCP connection with its index and
pid on the shared SO_REUSEPORT port. Run as ``python toy_worker.py DATA_DIR PORT COUNT [fail]``."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from broker.config import Config
from broker.server import ServeError
from broker.workers.runtime import WorkerSpec
from broker.workers.supervisor import Supervisor, die_with_parent


def main(config: Config, spec: WorkerSpec) -> int:
    die_with_parent()  # as the real workers: nothing outlives a killed test
    if sys.argv[4:] == ["fail"] and spec.index == 1:
        print("worker 1: cannot start: told to fail", file=sys.stderr)
        return 3
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((config.server.host, config.server.port))
    sock.listen(64)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"worker {spec.index} listening on {config.server.port}", file=sys.stderr, flush=True)
    spec.ready()
    while True:
        conn, _ = sock.accept()
        conn.sendall(f"{spec.index} {os.getpid()}\n".encode())
        conn.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = Config()
    cfg = dataclasses.replace(
        cfg,
        server=dataclasses.replace(cfg.server, host="127.0.0.1", port=int(sys.argv[2])),
        commitlog=dataclasses.replace(cfg.commitlog, data_dir=Path(sys.argv[1])),
    )
    try:
        sys.exit(Supervisor(cfg, int(sys.argv[3]), main).run())
    except ServeError as e:
        print(f"mqlog: {e}", file=sys.stderr)
        sys.exit(2)
