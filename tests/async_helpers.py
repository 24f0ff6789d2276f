"""Helpers of the asyncio front-end's tests: run a coroutine, wait on a condition.

Plain ``asyncio.run`` (no plugin). The waits poll a condition, never sleep
for a fixed time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from engine_helpers import met

_T = TypeVar("_T")


def run(coro: Coroutine[Any, Any, _T], timeout: float = 60.0) -> _T:
    """Run ``coro`` on a new event loop, failing after ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(cond: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    """Yield to the loop until ``cond()`` is truthy (a condition, not a sleep)."""
    deadline = time.monotonic() + timeout
    while (value := met(cond(), deadline, timeout, what)) is None:
        await asyncio.sleep(0.002)
    return value


async def until_async(cond: Callable[[], Awaitable[Any]], what: str, timeout: float = 10.0) -> Any:
    """:func:`until` for a condition that is a coroutine."""
    deadline = time.monotonic() + timeout
    while (value := met(await cond(), deadline, timeout, what)) is None:
        await asyncio.sleep(0.002)
    return value
