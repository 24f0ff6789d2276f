"""A web request whose client went away stops waiting for its lock.

ASGI servers (uvicorn, hypercorn) do not cancel a request's handler when
its client disconnects: they only answer the handler's next ``receive()``
with ``http.disconnect``. A handler waiting for a lock would wait on for a
client that is gone, and take the lock when its turn came.
:func:`cancel_on_disconnect` watches ``receive()`` for that message and
cancels the handler's task, which leaves the queue like any cancelled
acquire. Plain ASGI: Starlette, FastAPI and any other ASGI framework pass
their request's ``receive``; nothing here imports a framework.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

__all__ = ["cancel_on_disconnect"]

#: An ASGI ``receive`` callable.
Receive = Callable[[], Awaitable[Mapping[str, Any]]]


@asynccontextmanager
async def cancel_on_disconnect(receive: Receive) -> AsyncIterator[None]:
    """Cancel the current task if the HTTP client disconnects inside the block.

    ``receive``: the request's ASGI ``receive`` (Starlette's and FastAPI's
    ``request.receive``). Enter the block once the request body is read
    (``await request.body()``, ``request.json()``; a GET has none): the
    watcher reads every message ``receive()`` gives until the block ends.
    On ``http.disconnect`` the task is cancelled: an acquire waiting in the
    block leaves the queue and holds nothing, a lease held in it is released
    by its ``async with``, and ``asyncio.CancelledError`` leaves the block
    (the response would go to nobody).
    """
    task = asyncio.current_task()
    assert task is not None, "cancel_on_disconnect runs inside an asyncio task"

    async def watch() -> None:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    watcher.add_done_callback(_retrieved)
    try:
        yield
    finally:
        watcher.cancel()


def _retrieved(watcher: asyncio.Future[None]) -> None:
    """Read the watcher's outcome: a ``receive()`` that failed (the server
    closing) ends the watch, never as an unretrieved task exception."""
    if not watcher.cancelled():
        watcher.exception()
