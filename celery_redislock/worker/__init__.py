"""Services of a worker that need no Celery: the node and the deferred-task dispatch.

Holds: :mod:`.node` (a worker incarnation's node record and heartbeat,
dead children's clean-up, fencing, shutdown) with :mod:`.succession` (the
node record's claim, the duplicate check, a same-name predecessor's
eviction) and :mod:`.clients` (the node's own managers, one per OS
thread), and :mod:`.defer` (park records and the dispatcher of
``on_busy="defer"``).
The Celery bootstep drives them; they are usable and testable without a
worker.

May import: :mod:`celery_redislock.engine` and the layers below it. No
Celery (kombu's JSON codec only, for the messages it keeps).
"""
