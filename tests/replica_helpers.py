"""A real master and one replica of it (``--replicaof``), for tests and benchmarks.

:class:`Pair` starts both (diskless sync, so the replica is in sync within a
moment), reads either directly, and pauses the replica with SIGSTOP so that
the master's ``WAIT`` gets no acknowledgement (``resume_replica`` sends
SIGCONT; ``close`` always does).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from redis_server import LOOPBACK, RedisServer


class Pair:
    """A master and one replica of it."""

    def __init__(self, workdir: Path) -> None:
        fast_sync = ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
        self.master = RedisServer(workdir=workdir / "master", extra_args=fast_sync)
        self.master.start()
        self.replica = RedisServer(
            workdir=workdir / "replica",
            extra_args=[*fast_sync, "--replicaof", LOOPBACK, str(self.master.port)],
        )
        self.replica.start()
        self.m = self.master.client(socket_timeout=5)
        self.r = self.replica.client(socket_timeout=5)
        self.paused = False

    def in_sync(self) -> bool:
        info: dict[str, Any] = self.r.info("replication")
        if info.get("master_link_status") != "up":
            return False
        return int(self.m.info("replication").get("connected_slaves", 0)) == 1

    def pause_replica(self) -> None:
        assert self.replica.process is not None
        os.kill(self.replica.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume_replica(self) -> None:
        if self.paused and self.replica.process is not None:
            os.kill(self.replica.process.pid, signal.SIGCONT)
        self.paused = False

    def close(self) -> None:
        self.resume_replica()
        self.m.close()
        self.r.close()
        self.replica.close()
        self.master.close()
