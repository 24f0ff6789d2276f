"""Benchmarks for celery-redislock (not part of the test suite).

Run them all, against a throw-away redis-server they start themselves::

    make bench            # or: .venv/bin/python -m benchmarks.run

- :mod:`benchmarks.peers`: handoff latency, contended throughput, fairness
  and exclusion violations of celery-redislock, redis-py's ``Lock`` and
  python-redis-lock, with N contending processes on one Redis.
- :mod:`benchmarks.cost`: Redis commands used by acquire+release,
  ``cleanup_owner`` and ``reconcile`` with a small and a large keyspace.
- :mod:`benchmarks.fleet` (also alone: ``python -m benchmarks.fleet``): a
  fleet's Redis cost simulated on one machine (idle heartbeats of 1,000
  nodes, reconcile, 150 workers starting at once, one worker's cleanup),
  each at two sizes, and the nodes one Redis core carries.
- :mod:`benchmarks.memory` (run alone: ``python -m benchmarks.memory``):
  Redis bytes per held lock, owner and queued waiter, against the peers.
- :mod:`benchmarks.limited` (run alone: ``make bench-limited``): limited
  resources (at most N holders) against dramatiq's ``ConcurrentRateLimiter``
  and redis-limiters' ``SyncSemaphore``: throughput, waits, fairness, peak
  holders, recovery after a killed holder.
- :mod:`benchmarks.celery_e2e` (run alone: ``make bench-celery``): real
  prefork workers contending for a few locks (waits, stalls, exact counts)
  and the tasks/s cost of ``@locked``; writes ``benchmarks/results-celery.md``.

Results are printed as markdown and written to ``benchmarks/results.md``;
``docs/benchmarks.md`` explains how to read them.
"""
