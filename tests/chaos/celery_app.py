"""The Celery app of the chaos run's Celery participants (``celery -A chaos.celery_app``).

:mod:`chaos.celery_runner` starts real ``celery worker -P prefork``
processes on this module through :class:`e2e.harness.Cluster`, which passes
the settings as environment variables (the ``E2E_*`` names of
:mod:`e2e.proj`, plus ``E2E_BODIES``, ``E2E_VISIBILITY`` and
``E2E_WAIT_TIMEOUT_S``). Every task body is a critical section on one
resource ``c:<res>`` that stamps what it did into a JSON-lines file of its
own process under ``E2E_BODIES`` (a plain file: it survives every fault the
run injects, the lock Redis's restarts included):

==========  ================================================================
``prerun``  a pool child took a message (``task_prerun``): id, task, retries,
            redispatch (the message carries a deferred grant), node, pid
``postrun`` the child is done with it (``task_postrun``): id, state
``begin``   the body started: id, retries, kind, mode (x/s), res, fence
``end``     the body ended: the same, plus lost (the lease was lost or
            ``check()`` failed) and retrying (the body calls ``self.retry()``)
``stall``   a deliberate stall of an adoption: id, res, where (``pre``:
            before the adoption, ``mid``: right after the engine's adopt (which
            updates the park record in the same script), until
==========  ================================================================

Tasks (``res`` names the resource, ``hold`` the seconds in the body):

* ``chaos.defer_x`` / ``chaos.defer_s``: ``@locked(on_busy="defer")``,
  exclusive / shared; ``retry=True`` makes the first run call
  ``self.retry()`` once (``countdown`` 0.1 s); ``stall_pre`` / ``stall_mid``
  (seconds) stall the first re-dispatched copy's adoption (the adoption
  lands near the grant deadline: ``redislock_defer_grant_ttl``);
* ``chaos.wait_x`` / ``chaos.wait_s``: ``@locked(on_busy="wait")``;
* ``chaos.unique``: ``UniqueTask`` (key ``u:<key>``) with
  ``@locked(on_busy="defer")``; :func:`define_unique` defines it on the
  runner's producer app too, so that ``apply_async`` takes the key there.

Every lock uses ``on_lost="ignore"``: a lost lease is stamped, not failed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from celery import Celery, signals

from celery_redislock import (
    Adoption,
    LockLost,
    LockManager,
    RedisLock,
    UniqueTask,
    current_lease,
    locked,
)
from e2e.settings import env_float, worker_settings

#: Seconds a wait-mode task waits for its lock before it fails with LockTimeout.
WAIT_TIMEOUT = env_float("E2E_WAIT_TIMEOUT_S") or 25.0
#: Countdown of the one retry of a ``retry=True`` task.
RETRY_COUNTDOWN = 0.1


def settings() -> dict[str, Any]:
    """The app's configuration from the environment (also the producer's)."""
    broker = os.environ.get("E2E_BROKER_URL", "redis://127.0.0.1:6379/0")
    visibility = env_float("E2E_VISIBILITY") or 30.0
    conf = worker_settings("chaosc", result_expires=3600)
    conf["broker_url"] = conf["result_backend"] = broker
    # A SIGKILLed worker's unacked messages come back after the visibility
    # timeout: keep it short, and sweep for them every second.
    conf["broker_transport_options"] = {
        "visibility_timeout": visibility,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
    return conf


app = Celery("chaosc")
app.conf.update(settings())
locks = RedisLock(app)


class Stamps:
    """This process's stamp file (re-opened after a fork), one JSON line per event."""

    def __init__(self) -> None:
        self._pid = 0
        self._file: Any = None
        self._lock = threading.Lock()

    def write(self, ev: str, **fields: Any) -> None:
        folder = os.environ.get("E2E_BODIES")
        if not folder:
            return
        with self._lock:
            if self._pid != os.getpid():
                path = os.path.join(folder, f"{os.getpid()}.jsonl")
                self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
                self._pid = os.getpid()
            rec = {"ev": ev, "pid": os.getpid(), "t": time.monotonic(), "w": time.time(), **fields}
            self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")


stamps = Stamps()


@app.task(name="e2e.ping", bind=True)
def ping(self: Any) -> dict[str, Any]:
    """Readiness probe of :class:`e2e.harness.Cluster`."""
    return {"pid": os.getpid(), "hostname": self.request.hostname}


def _body(task: Any, kind: str, mode: str, res: str, hold: float, retry: bool = False) -> str:
    lease = current_lease()
    request = task.request
    base = {
        "id": request.id,
        "retries": int(request.retries or 0),
        "kind": kind,
        "mode": mode,
        "res": res,
        "node": request.hostname,
        "fence": lease.fencing_token if lease is not None else None,
    }
    stamps.write("begin", **base)
    time.sleep(hold)
    lost = lease is None or lease.lost
    if lease is not None and not lost:
        try:
            lease.check()
        except LockLost:
            lost = True
    again = retry and base["retries"] == 0
    stamps.write("end", **base, lost=lost, retrying=again)
    if again:
        raise task.retry(countdown=RETRY_COUNTDOWN, max_retries=1)
    return str(request.id)


def _deferred(mode: str, exclusive: tuple[str, ...], shared: tuple[str, ...]) -> Any:
    """The task ``chaos.defer_<mode>``: deferred when busy, on ``c:<res>``
    (exclusive: ``exclusive`` names it, shared: ``shared`` does)."""

    @app.task(name=f"chaos.defer_{mode}", bind=True, acks_late=True)
    @locked(*exclusive, shared=shared, on_busy="defer", on_lost="ignore")
    def deferred(
        self: Any, res: str, hold: float, retry: bool = False, stall_pre: float = 0.0,
        stall_mid: float = 0.0,
    ) -> str:  # fmt: skip
        return _body(self, "defer", mode, res, hold, retry)

    return deferred


#: Exclusive, deferred when busy.
defer_x = _deferred("x", ("c:{res}",), ())
#: Shared, deferred when busy.
defer_s = _deferred("s", (), ("c:{res}",))


@app.task(name="chaos.wait_x", bind=True, acks_late=True)
@locked("c:{res}", on_busy="wait", timeout=WAIT_TIMEOUT, on_lost="ignore")
def wait_x(self: Any, res: str, hold: float) -> str:
    """Exclusive, waits in its pool slot when busy."""
    return _body(self, "wait", "x", res, hold)


@app.task(name="chaos.wait_s", bind=True, acks_late=True)
@locked(shared=["c:{res}"], on_busy="wait", timeout=WAIT_TIMEOUT, on_lost="ignore")
def wait_s(self: Any, res: str, hold: float) -> str:
    """Shared, waits in its pool slot when busy."""
    return _body(self, "wait", "s", res, hold)


def define_unique(on: Celery) -> Any:
    """Define ``chaos.unique`` on ``on`` (the workers' app, or the producer's)."""

    @on.task(name="chaos.unique", bind=True, base=UniqueTask, unique_key="u:{key}", acks_late=True)
    @locked("c:{res}", on_busy="defer", on_lost="ignore")
    def unique(self: Any, key: str, res: str, hold: float) -> str:
        """One per key queued or running; exclusive, deferred when busy."""
        return _body(self, "unique", "x", res, hold)

    return unique


unique = define_unique(app)

# -- stamps of the pool slots, and the adoption stalls -------------------------

#: Task id -> seconds to stall after the engine's adopt (set at prerun).
_mid_stalls: dict[str, float] = {}


def _redispatched(task: Any) -> bool:
    request = getattr(task, "request", None)
    if request is None:
        return False
    if getattr(request, "redislock_defer", None) is not None:
        return True
    headers = getattr(request, "headers", None) or {}
    return isinstance(headers, dict) and headers.get("redislock_defer") is not None


def _first_time(task_id: str, where: str) -> bool:
    """One stall of each kind per task (an exclusive marker file)."""
    folder = os.environ.get("E2E_BODIES", "")
    try:
        fd = os.open(os.path.join(folder, f"stall-{where}-{task_id}"), os.O_CREAT | os.O_EXCL)
    except OSError:
        return False
    os.close(fd)
    return True


def _prerun(sender: Any = None, task_id: str = "", kwargs: Any = None, **_: Any) -> None:
    request = getattr(sender, "request", None)
    redispatch = _redispatched(sender)
    stamps.write(
        "prerun",
        id=task_id,
        task=getattr(sender, "name", None),
        retries=int(getattr(request, "retries", 0) or 0),
        redispatch=redispatch,
        node=getattr(request, "hostname", None),
        res=(kwargs or {}).get("res"),
    )
    if not redispatch or not kwargs:
        return
    pre = float(kwargs.get("stall_pre") or 0.0)
    mid = float(kwargs.get("stall_mid") or 0.0)
    if mid > 0 and _first_time(task_id, "mid"):
        _mid_stalls[task_id] = mid
    if pre > 0 and _first_time(task_id, "pre"):
        stamps.write("stall", id=task_id, res=kwargs.get("res"), where="pre",
                     until=time.monotonic() + pre)  # fmt: skip
        time.sleep(pre)


def _postrun(sender: Any = None, task_id: str = "", state: Any = None, **_: Any) -> None:
    stamps.write("postrun", id=task_id, state=str(state))


signals.task_prerun.connect(_prerun, weak=False)
signals.task_postrun.connect(_postrun, weak=False)

_engine_adopt = LockManager.adopt


def _adopt_then_stall(
    self: LockManager, task_id: str, attempt: int = 0, **options: Any
) -> Adoption:
    """``LockManager.adopt``, then (for a task whose prerun asked) a stall before
    the caller goes on: a deferred task's adoption is then stopped right after
    the engine's adopt (which updates the park record in the same script), as
    a paused child would be."""
    adoption = _engine_adopt(self, task_id, attempt, **options)
    stall = _mid_stalls.pop(task_id, 0.0)
    if stall and adoption.adopted:
        res = next((r[2:] for x in adoption.leases for r in x.resources if r.startswith("c:")), "")
        stamps.write("stall", id=task_id, res=res, where="mid", until=time.monotonic() + stall)
        time.sleep(stall)
    return adoption


LockManager.adopt = _adopt_then_stall  # type: ignore[method-assign]
