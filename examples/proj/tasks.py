"""Tasks of the example project.

``sync`` holds ``repo:<repo_id>`` alone and ``remote:<remote_id>`` shared: two
syncs of one repository never overlap, while syncs of different repositories
from the same remote run side by side. ``report`` only reads the remote.
``fetch`` takes one of two slots of ``api:<partner>``: at most two at once.

Every task appends what it did to the Redis list ``proj:events`` (JSON), so
the demo can narrate the timeline; a real project would not need this.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

from celery_redislock import Lease, UniqueTask, current_lease, locked

from .celery import app

EVENTS = "proj:events"

_client: redis.Redis | None = None
_client_pid = 0


def _redis() -> redis.Redis:
    """A client for the example's own keys (one per process)."""
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        _client = redis.Redis.from_url(app.conf.broker_url, decode_responses=True)
        _client_pid = os.getpid()
    return _client


def _event(task: Any, event: str, lease: Lease | None = None, **fields: Any) -> dict[str, Any]:
    lease = lease or current_lease()
    record = {
        "t": time.time(),
        "event": event,
        "task": task.name.rsplit(".", 1)[-1],
        "id": task.request.id,
        "label": task.request.kwargs.get("label") or task.request.id[:8],
        "pid": os.getpid(),
        "fence": lease.fencing_token if lease is not None else None,
        "owner": lease.owner_id if lease is not None else None,
        **fields,
    }
    _redis().rpush(EVENTS, json.dumps(record))
    return record


@app.task(bind=True, acks_late=True)
@locked("repo:{repo_id}", shared=["remote:{remote_id}"], timeout=60, on_busy="wait")
def sync(self: Any, repo_id: int, remote_id: str, seconds: float = 1.0, label: str = "") -> str:
    """Synchronise one repository from a remote (holds repo exclusive, remote shared)."""
    _event(self, "start", resources=[f"repo:{repo_id}", f"remote:{remote_id}"])
    time.sleep(seconds)
    _event(self, "end")
    return f"repo {repo_id} synced from {remote_id}"


@app.task(bind=True, acks_late=True)
@locked(shared=["remote:{remote_id}"], timeout=60)
def report(self: Any, remote_id: str, seconds: float = 0.5, label: str = "") -> str:
    """Read-only pass over a remote: shares the remote with every sync."""
    _event(self, "start", resources=[f"remote:{remote_id}"])
    time.sleep(seconds)
    _event(self, "end")
    return f"report on {remote_id}"


@app.task(bind=True, acks_late=True)
@locked("repo:{repo_id}", timeout=60)
def migrate(self: Any, repo_id: int, label: str = "", crash_first: bool = True) -> str:
    """A long migration of one repository.

    In the demo its first delivery is killed: it waits (holding the lock)
    for up to a minute, for a signal that never comes. A redelivered run
    (acks_late + reject_on_worker_lost) finishes at once.
    """
    attempt = _redis().incr(f"proj:attempts:{self.request.id}")
    _event(self, "start", resources=[f"repo:{repo_id}"], attempt=attempt)
    if crash_first and attempt == 1:
        time.sleep(60)  # holding repo:<id>; the demo kills this process meanwhile
    _event(self, "end", attempt=attempt)
    return f"repo {repo_id} migrated (attempt {attempt})"


@app.task(bind=True, base=UniqueTask, unique_key="reindex:{repo_id}", acks_late=True)
def reindex(self: Any, repo_id: int, seconds: float = 60.0, label: str = "") -> str:
    """Rebuild one repository's search index: one queued or running per repository.

    A second ``reindex.delay(repo_id)`` while one is queued or running
    returns that task's handle instead of sending a duplicate. Its key,
    ``unique:reindex:<repo_id>``, is a lock: it dies with the worker process
    running the task, so a killed worker never leaves it stuck.
    """
    key = f"unique:reindex:{repo_id}"
    _event(self, "start", lease=self.unique_lease, resources=[key])
    time.sleep(seconds)
    _event(self, "end")
    return f"repo {repo_id} reindexed"


@app.task(bind=True, acks_late=True)
@locked("repo:{repo_id}", on_busy="defer")
def build(self: Any, repo_id: int, seconds: float = 0.4, label: str = "") -> str:
    """Build one repository; when the repository is busy the task is deferred.

    It keeps its place in repo:<repo_id>'s queue but gives its pool slot
    back (its result shows state DEFERRED), and is dispatched again, under
    the same task id, when the lock is handed to it.
    """
    _event(self, "start", resources=[f"repo:{repo_id}"])
    time.sleep(seconds)
    _event(self, "end")
    return f"repo {repo_id} built"


@app.task(bind=True, acks_late=True)
@locked(limited={"api:{partner}": 2}, timeout=60)
def fetch(self: Any, partner: str, seconds: float = 0.4, label: str = "") -> str:
    """Call a partner's API: at most two calls to one partner at a time,
    across every worker (a limited resource, one of 2 slots)."""
    _event(self, "start", resources=[f"api:{partner}"])
    time.sleep(seconds)
    _event(self, "end")
    return f"fetched from {partner}"
