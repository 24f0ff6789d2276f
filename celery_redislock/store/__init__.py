"""The Redis side: connections, the wire, the scripts, one channel for every call.

Holds: :mod:`.connect` (URLs to clients: standalone, Sentinel, Cluster,
TLS), :mod:`.wire` (commands sent straight on a held connection),
:mod:`.scripts` (the Lua scripts of ``celery_redislock/lua``, loaded and run
with one NOSCRIPT path), :mod:`.channel` (every round trip of a manager:
held connections, error mapping, the format and eviction gates) and
:mod:`.checks` (the server's eviction policy).

Knows nothing of lock rules. May import: :mod:`celery_redislock.protocol`
and the shared top-level modules; redis-py. No Celery, no kombu.
"""
