"""Write the intersphinx inventories the docs build uses, without the network.

``make docs`` must build offline, so the docs cannot download the
``objects.inv`` of Python, Celery, kombu and redis-py at build time. This
script writes small inventories instead, holding only the objects these docs
reference, each with the URL it has in that project's published
documentation (known URLs, written down here by hand from those sites; the
anchors are the ones Sphinx generates there: ``#<dotted.name>`` for Python
objects, ``#std-setting-<name>`` / ``#std-signal-<name>`` for Celery's
settings and signals). A reference not listed here fails the nitpicky build
("reference target not found"): add it below with its URL and re-run

    .venv/bin/python docs/_inventories/make_inventories.py

which rewrites ``docs/_inventories/*.inv`` (committed). The output is
deterministic; ``tests/test_docs.py`` checks the committed files match.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (name, domain:role, path relative to the project's docs root, anchor or "$"
# for the name itself). Base URLs are in docs/conf.py (intersphinx_mapping).
Entry = tuple[str, str, str]

PYTHON: list[Entry] = [
    ("str", "py:class", "library/stdtypes.html#str"),
    ("str.format", "py:method", "library/stdtypes.html#str.format"),
    ("int", "py:class", "library/functions.html#int"),
    ("float", "py:class", "library/functions.html#float"),
    ("bool", "py:class", "library/functions.html#bool"),
    ("bytes", "py:class", "library/stdtypes.html#bytes"),
    ("dict", "py:class", "library/stdtypes.html#dict"),
    ("list", "py:class", "library/stdtypes.html#list"),
    ("tuple", "py:class", "library/stdtypes.html#tuple"),
    ("frozenset", "py:class", "library/stdtypes.html#frozenset"),
    ("object", "py:class", "library/functions.html#object"),
    ("None", "py:data", "library/constants.html#None"),
    ("Exception", "py:exception", "library/exceptions.html#Exception"),
    ("ValueError", "py:exception", "library/exceptions.html#ValueError"),
    ("TypeError", "py:exception", "library/exceptions.html#TypeError"),
    ("KeyError", "py:exception", "library/exceptions.html#KeyError"),
    ("SystemExit", "py:exception", "library/exceptions.html#SystemExit"),
    (
        "collections.abc.Callable",
        "py:class",
        "library/collections.abc.html#collections.abc.Callable",
    ),
    (
        "collections.abc.Iterable",
        "py:class",
        "library/collections.abc.html#collections.abc.Iterable",
    ),
    (
        "collections.abc.Iterator",
        "py:class",
        "library/collections.abc.html#collections.abc.Iterator",
    ),
    ("collections.abc.Mapping", "py:class", "library/collections.abc.html#collections.abc.Mapping"),
    (
        "collections.abc.Sequence",
        "py:class",
        "library/collections.abc.html#collections.abc.Sequence",
    ),
    ("typing.Any", "py:data", "library/typing.html#typing.Any"),
    ("time.monotonic", "py:function", "library/time.html#time.monotonic"),
    ("time.time", "py:function", "library/time.html#time.time"),
    ("os.fork", "py:function", "library/os.html#os.fork"),
    ("os.EX_CONFIG", "py:data", "library/os.html#os.EX_CONFIG"),
    ("threading.Event", "py:class", "library/threading.html#threading.Event"),
    ("logging", "py:module", "library/logging.html#module-logging"),
]

CELERY: list[Entry] = [
    ("celery.Celery", "py:class", "reference/celery.html#celery.Celery"),
    ("celery.app.task.Task", "py:class", "reference/celery.app.task.html#celery.app.task.Task"),
    (
        "celery.app.task.Task.retry",
        "py:method",
        "reference/celery.app.task.html#celery.app.task.Task.retry",
    ),
    *[
        (name, "std:setting", f"userguide/configuration.html#std-setting-{name}")
        for name in (
            "broker_url",
            "broker_transport_options",
            "result_backend",
            "task_acks_late",
            "task_reject_on_worker_lost",
            "task_time_limit",
            "task_soft_time_limit",
            "worker_prefetch_multiplier",
            "beat_schedule",
        )
    ],
    *[
        (name, "std:signal", f"userguide/signals.html#std-signal-{name}")
        for name in ("worker_process_init", "worker_shutting_down", "beat_init")
    ],
]

KOMBU: list[Entry] = [
    (
        "kombu.transport.redis",
        "py:module",
        "reference/kombu.transport.redis.html#module-kombu.transport.redis",
    ),
    (
        "kombu.transport.redis.Transport",
        "py:class",
        "reference/kombu.transport.redis.html#kombu.transport.redis.Transport",
    ),
]

REDIS: list[Entry] = [
    ("redis.Redis", "py:class", "connections.html#redis.Redis"),
    ("redis.Redis.from_url", "py:method", "connections.html#redis.Redis.from_url"),
    ("redis.cluster.RedisCluster", "py:class", "connections.html#redis.cluster.RedisCluster"),
    ("redis.sentinel.Sentinel", "py:class", "connections.html#redis.sentinel.Sentinel"),
    ("redis.lock.Lock", "py:class", "lock.html#redis.lock.Lock"),
    (
        "redis.exceptions.NoPermissionError",
        "py:exception",
        "exceptions.html#redis.exceptions.NoPermissionError",
    ),
]

#: file name -> (project, version, entries)
INVENTORIES: dict[str, tuple[str, str, list[Entry]]] = {
    "python.inv": ("Python", "3", PYTHON),
    "celery.inv": ("Celery", "5", CELERY),
    "kombu.inv": ("Kombu", "5", KOMBU),
    "redis.inv": ("redis-py", "5", REDIS),
}


def render(project: str, version: str, entries: list[Entry]) -> bytes:
    """One inventory in Sphinx's format version 2 (zlib-compressed body)."""
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {project}\n"
        f"# Version: {version}\n"
        "# The remainder of this file is compressed using zlib.\n"
    ).encode()
    lines = []
    for name, role, uri in sorted(entries):
        priority = "1" if role.startswith("py:") else "-1"
        lines.append(f"{name} {role} {priority} {uri} -\n")
    return header + zlib.compress("".join(lines).encode(), 9)


def main(out: Path = HERE) -> None:
    for filename, (project, version, entries) in INVENTORIES.items():
        (out / filename).write_bytes(render(project, version, entries))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
