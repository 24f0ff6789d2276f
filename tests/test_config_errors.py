"""A refused ``redislock_*`` setting: one line in every process, no traceback.

Real subprocesses of a project whose ``redislock_owner_ttl`` is refused: a
producer (imports the app and sends nothing) reports the line and goes on;
``celery worker`` and ``celery beat`` report it and refuse to start (exit
status 78, EX_CONFIG: beat must not run without its reconcile entry); the
``redislock`` CLI reports it and still runs on defaults.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis

from celery_redislock import FORMAT_VERSION

#: EX_CONFIG (sysexits.h), celery_redislock.integration.app.EX_CONFIG
EX_CONFIG = 78

LINE = (
    "celery_redislock: invalid setting redislock_owner_ttl: must be a number of seconds, not 'soon'"
)


@pytest.fixture
def project(tmp_path: Path, redis_url: str) -> Path:
    (tmp_path / "badproj.py").write_text(
        textwrap.dedent(
            f"""
            from celery import Celery
            from celery_redislock import RedisLock

            app = Celery("badproj", broker={redis_url!r})
            app.conf.redislock_owner_ttl = "soon"
            app.conf.redislock_namespace = "bad"
            RedisLock(app)
            """
        )
    )
    return tmp_path


def run(project: Path, *argv: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("REDISLOCK_URL", None)
    env["PYTHONPATH"] = os.pathsep.join([str(project), str(Path.cwd())])
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=project,
        env=env,
    )


def lines_naming_the_setting(proc: subprocess.CompletedProcess[str]) -> list[str]:
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    return [ln for ln in out.splitlines() if "redislock_owner_ttl" in ln]


def test_producer_reports_the_setting_in_one_line_and_goes_on(project: Path) -> None:
    proc = run(project, "-c", "import badproj; print('sent', badproj.app.conf.broker_url)")
    assert proc.returncode == 0 and "sent" in proc.stdout, proc.stderr
    assert lines_naming_the_setting(proc) == [LINE]


def test_beat_refuses_to_start(project: Path) -> None:
    proc = run(project, "-m", "celery", "-A", "badproj", "beat", "-s", str(project / "s"))
    assert proc.returncode == EX_CONFIG, (proc.stdout, proc.stderr)
    found = lines_naming_the_setting(proc)
    assert found and all(LINE in ln for ln in found), found
    assert "refuses to start" in found[-1]


def test_worker_refuses_to_start(project: Path) -> None:
    proc = run(project, "-m", "celery", "-A", "badproj", "worker", "-P", "solo")
    assert proc.returncode == EX_CONFIG, (proc.stdout, proc.stderr)
    found = lines_naming_the_setting(proc)
    assert found and all(LINE in ln for ln in found), found
    assert "refuses to start" in found[-1]


def test_cli_reports_the_setting_in_one_line_and_runs_on_defaults(
    project: Path, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set("{bad}:format", str(FORMAT_VERSION))  # a namespace in use
    client.close()
    proc = run(project, "-m", "celery", "-A", "badproj", "redislock", "owners")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    found = lines_naming_the_setting(proc)
    assert found[0] == LINE, found
    assert found[1:] == [
        "warning: redislock_owner_ttl: must be a number of seconds, not 'soon'; "
        "using the default owner TTL"
    ]


def test_worker_refuses_a_wait_timeout_above_the_socket_timeout_in_one_line(
    tmp_path: Path, redis_url: str
) -> None:
    # Valid on its own (0.001..60), refused only against the client's socket
    # timeout, when the worker makes its manager: the same one line and 78.
    (tmp_path / "waitproj.py").write_text(
        textwrap.dedent(
            f"""
            from celery import Celery
            from celery_redislock import RedisLock

            app = Celery("waitproj", broker={redis_url!r})
            app.conf.redislock_url = {redis_url + "?socket_timeout=1"!r}
            app.conf.redislock_wait_replicas = 1
            app.conf.redislock_wait_timeout = 2.0
            RedisLock(app)
            """
        )
    )
    proc = run(tmp_path, "-m", "celery", "-A", "waitproj", "worker", "-P", "solo")
    out = proc.stdout + proc.stderr
    assert proc.returncode == EX_CONFIG, out
    assert "Traceback" not in out, out
    found = [ln for ln in out.splitlines() if "redislock_wait_timeout" in ln]
    assert found and "refuses to start" in found[-1], out
    assert "celery_redislock: invalid setting redislock_wait_timeout: must be within" in found[-1]
