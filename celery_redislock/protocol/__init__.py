"""The lock protocol without I/O: key names, options, requests, script calls, replies.

Holds: :mod:`.keys` (every key name and token format of a namespace, the
data-format version), :mod:`.options` (a manager's options, validated once),
:mod:`.request` (a validated request), :mod:`.calls` and :mod:`.defer_calls`
(each script's KEYS and ARGV, and the reading of its reply), :mod:`.causes` (the loss vocabulary)
and :mod:`.reports` (what cleanups and queries return).

May import: the shared modules at the package's top (``exceptions``,
``redact``, ``_validate``, ``_threads``) and nothing else of the package;
no Redis client, no Celery. A front-end on another transport (asyncio)
builds on this layer and adds transport only.
"""
