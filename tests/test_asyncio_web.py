"""The asyncio front-end in a web app: a Starlette endpoint served by a real
uvicorn server on loopback, its lock manager made in the app's lifespan.

A client that disconnects while its request waits for a lock takes its
request out of the queue (``cancel_on_disconnect``) and no grant is left
behind for it; a client that stays is served when the holder releases.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis

from async_helpers import run, until
from celery_redislock import LockManager
from celery_redislock.asyncio import AsyncLockManager, cancel_on_disconnect
from engine_helpers import assert_registry_truth, lock_holders, namespace_keys
from redis_server import LOOPBACK, free_port

httpx = pytest.importorskip("httpx")
starlette_apps = pytest.importorskip("starlette.applications")
uvicorn = pytest.importorskip("uvicorn")

from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

NS = "t"


def make_app(redis_url: str, entered: list[str], watch: bool) -> Any:
    """The app under test: PUT /reports/{day} edits under lock ``report:{day}``."""

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with AsyncLockManager(redis_url, NS, owner_ttl=5) as locks:
            app.state.locks = locks
            yield

    async def edit(request: Request) -> JSONResponse:
        day = request.path_params["day"]
        await request.body()
        locks: AsyncLockManager = request.app.state.locks
        if not watch:
            async with locks.lock(f"report:{day}", timeout=30) as lease:
                entered.append(lease.token)
                return JSONResponse({"fence": lease.fencing_token})
        async with cancel_on_disconnect(request.receive):
            async with locks.lock(f"report:{day}", timeout=30) as lease:
                entered.append(lease.token)
                return JSONResponse({"fence": lease.fencing_token})

    return starlette_apps.Starlette(
        routes=[Route("/reports/{day}", edit, methods=["PUT"])], lifespan=lifespan
    )


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """``app`` served by uvicorn on a free loopback port; its base URL."""
    port = free_port()
    config = uvicorn.Config(app, host=LOOPBACK, port=port, lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await until(lambda: server.started or task.done(), "uvicorn to start")
    assert not task.done(), task
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.should_exit = True
        await task


def request_state(r: redis.Redis) -> set[str]:
    """The namespace's request state and wake lists (a waiting request's keys)."""
    return {k for k in namespace_keys(r, NS) if ":req:" in k or ":wake:" in k}


def test_a_client_that_disconnects_while_waiting_leaves_the_queue_and_no_grant(
    redis_url: str, r: redis.Redis
) -> None:
    holder = LockManager(redis_url, NS, owner_ttl=5)
    entered: list[str] = []

    async def main() -> None:
        held = await asyncio.to_thread(holder.acquire, "report:1", timeout=5)
        async with serving(make_app(redis_url, entered, watch=True)) as base:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                gone = asyncio.create_task(client.put("/reports/1", content=b"x"))
                await until(lambda: r.zcard("{t}:q:report:1") == 1, "the request to queue")
                gone.cancel()  # the client goes away: httpx drops its connection
                with pytest.raises(asyncio.CancelledError):
                    await gone
                await until(lambda: r.zcard("{t}:q:report:1") == 0, "the request to leave")
                await until(lambda: not request_state(r), "its request state to go")
                stays = asyncio.create_task(client.put("/reports/1", content=b"y"))
                await until(lambda: r.zcard("{t}:q:report:1") == 1, "the next one to queue")
                await asyncio.to_thread(held.release)
                answer = await stays
                assert answer.status_code == 200
                assert answer.json()["fence"] > held.fencing_token
            assert len(entered) == 1  # the gone request never entered its block
        assert lock_holders(r) == {}

    try:
        run(main())
    finally:
        holder.close()
    assert_registry_truth(r)
