"""Loads the Lua scripts in ``lua/`` and runs them with EVALSHA.

Each script is ``_common.lua`` followed by the script's own file. redis-py's
:class:`redis.commands.core.Script` sends EVALSHA and, on NOSCRIPT (after a
Redis restart or SCRIPT FLUSH), loads the script and retries, so callers
never see a missing script.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import redis

#: Scripts shipped in ``celery_redislock/lua``, one per operation.
SCRIPT_NAMES = (
    "acquire",
    "release",
    "heartbeat",
    "cleanup_owner",
    "contenders",
    "node_start",
    "node_heartbeat",
    "node_evict",
    "node_stop",
)


@cache
def source(name: str) -> str:
    """Full source of script ``name``: the shared helpers, then the script."""
    lua = resources.files("celery_redislock") / "lua"
    common = (lua / "_common.lua").read_text(encoding="utf-8")
    own = (lua / f"{name}.lua").read_text(encoding="utf-8")
    return common + "\n" + own


class Scripts:
    """The scripts registered on one client; call ``scripts.run(name, keys, args)``."""

    def __init__(self, client: redis.Redis, names: tuple[str, ...] = SCRIPT_NAMES) -> None:
        self._scripts = {name: client.register_script(source(name)) for name in names}

    def run(self, name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        """Run script ``name`` (EVALSHA, loading it on NOSCRIPT); one round trip."""
        return self._scripts[name](keys=keys, args=args, client=client)
