"""End-to-end as the least-privilege lock user of docs/operations.md.

A real ``celery worker -P prefork`` whose ``redislock_url`` is a Redis user
holding exactly the documented ACL (its namespace's keys, the listed
commands; the broker keeps the default user): contending tasks, a SIGKILLed
pool child freed by the node heartbeat, the operator CLI, and a warm
shutdown that releases everything all work, and nothing is refused. The
same worker answers ``celery inspect conf`` and ``celery report`` without
the lock user's password (Celery masks only the settings it knows).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable

import pytest

import acl_helpers
from redis_server import RedisServer

from .harness import CELERY, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PASSWORD = "Lock-Pw-3f9a"


def _celery(c: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CELERY, "-A", c.app_module, *args],
        env=c.env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_worker_runs_as_the_least_privilege_user_and_never_prints_its_password(
    cluster: Callable[..., Cluster], redis_server: RedisServer, redis_url: str
) -> None:
    admin = redis_server.client()
    namespace = "e2eacl"
    try:
        acl_helpers.create_lock_user(admin, [namespace], user="e2e-locks", password=PASSWORD)
    finally:
        admin.close()
    lock_url = acl_helpers.user_url(
        acl_helpers.admin_url(redis_url), user="e2e-locks", password=PASSWORD
    )
    c = cluster(
        namespace=namespace,
        lock_url=lock_url,
        lock_admin_url=acl_helpers.admin_url(redis_url),
        owner_ttl=60,
        heartbeat=1,
    )
    w = c.start_worker("acl", concurrency=2)

    # contention and hand-off
    results = [c.send("write", str(i % 2), 0.005) for i in range(8)]
    results += [c.send("read", "0", 0.01) for _ in range(2)]
    for res in results:
        res.get(timeout=120)
    assert c.data.lrange("e2e:violations", 0, -1) == []

    # a SIGKILLed child: the node heartbeat frees its lock (cleanup, HDEL)
    held = c.send("hold", "k1", "acl1", 1)
    info = c.wait_held("acl1")
    os.kill(info["pid"], signal.SIGKILL)
    c.wait_freed(info["owner"], "res:k1", "the dead child's lock to be freed")
    assert held.get(timeout=90)["attempt"] == 2

    # the operator CLI, as the same user
    for args in (["status"], ["locks"], ["owners"], ["waiters", "res:k1"]):
        done = _celery(c, "redislock", *args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)

    # celery inspect conf (asks the running worker) and celery report
    conf = _celery(c, "inspect", "conf", "-d", w.nodename, "--json")
    assert conf.returncode == 0, conf.stderr
    assert "redislock_url" in conf.stdout and "e2e-locks:***@" in conf.stdout
    report = _celery(c, "report")
    assert report.returncode == 0, report.stderr
    assert "redislock_url" in report.stdout and "e2e-locks:***@" in report.stdout
    for shown in (conf.stdout, conf.stderr, report.stdout, report.stderr):
        assert PASSWORD not in shown

    w.send_signal(signal.SIGTERM)
    assert w.wait(60) == 0, w.tail()
    assert c.namespace_keys("lock") == [] and c.namespace_keys("held") == []
    log = w.text()
    for refused in ("permission denied", "no permissions", "noperm", "node.halt-error"):
        assert refused not in log.lower(), w.tail()
    assert PASSWORD not in log
