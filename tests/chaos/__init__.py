"""Randomized fault-injection run of the lock engine (``make chaos``).

Worker processes (:mod:`chaos.worker`), each with several threads, acquire
random sets of resources in random modes through
:class:`celery_redislock.LockManager` on a real redis-server, and do fenced
read-modify-writes on a separate store server (:mod:`chaos.store`) that
refuses stale fencing tokens. Meanwhile :mod:`chaos.runner` injects faults
(:mod:`chaos.faults`). Every process appends a JSON-lines timeline; after
the run :mod:`chaos.checker` reads them and reports invariant violations
with a short trace. ``python -m chaos --help`` lists the options;
docs/chaos.md explains what is checked and why each check is sound.

The engine run imports celery_redislock only in the worker processes and in
the fault injector, never Celery. The Celery participants
(:mod:`chaos.celery_runner`, app :mod:`chaos.celery_app`) run real prefork
workers through :mod:`e2e.harness`; :mod:`chaos.checker` reads their
stamps too (``check_celery``).
"""
