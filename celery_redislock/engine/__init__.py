"""The lock engine: :class:`~celery_redislock.engine.manager.LockManager` and its parts.

Holds the facade (:mod:`.manager`) and the parts :mod:`.parts` builds for
it, each owning its state: :mod:`.shared` (what every part shares), :mod:`.state` (what this
process holds and owes), :mod:`.liveness` (identity, heartbeat, deadline,
loss), :mod:`.release` (releases and deferred releases; the leases' host),
:mod:`.watcher` (the lost-owner watcher thread), :mod:`.cleanup` (dead
owners, reconcile, close), :mod:`.acquire` (the acquire loop), with
:mod:`.reentry` and :mod:`.outage`, and :mod:`.task_owner` (task-owned
grants). Also :mod:`.lease`, :mod:`.context` (what an integration tells an
acquire), :mod:`.identity`, :mod:`.heartbeat` and :mod:`.metrics` (the
metrics hook).

May import: :mod:`celery_redislock.store`, :mod:`celery_redislock.protocol`
and the shared top-level modules. Never Celery or kombu.
"""
