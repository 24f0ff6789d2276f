"""``UniqueTask.apply_async`` from an asyncio web handler, through
``asyncio.to_thread`` (docs/howto.md): the send's Redis round trip and the
broker publish run in a worker thread, so the event loop serves other
requests meanwhile; concurrent requests for one key send one message.

A Starlette app driven in-process by httpx's ASGI transport, over the
test's real Redis (broker and locks).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from async_helpers import run, until
from celery_redislock import DuplicateTask, UniqueTask
from redis_server import RedisServer

httpx = pytest.importorskip("httpx")
starlette_apps = pytest.importorskip("starlette.applications")

from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402


def web_app(report: Any, strict: Any) -> Any:
    async def enqueue(request: Request) -> JSONResponse:
        user = int(request.path_params["user"])
        task = strict if request.query_params.get("strict") else report
        try:
            result = await asyncio.to_thread(task.apply_async, (user,))
        except DuplicateTask as dup:
            return JSONResponse({"running": dup.task_id}, status_code=409)
        return JSONResponse({"id": result.id})

    return starlette_apps.Starlette(routes=[Route("/reports/{user}", enqueue, methods=["POST"])])


def test_concurrent_handlers_send_one_message_per_key_without_blocking_the_loop(
    quick_apps: Callable[..., Celery], r: redis.Redis, redis_server: RedisServer
) -> None:
    app = quick_apps("uqa")

    @app.task(base=UniqueTask, unique_key="report:{user}", name="uqa.report")
    def report(user: int) -> int:
        return user

    @app.task(
        base=UniqueTask, unique_key="report:{user}", unique_on_duplicate="raise", name="uqa.strict"
    )
    def strict(user: int) -> int:
        return user

    report.apply_async((0,)).forget()  # the app's connections made: the stall hits the send

    async def main() -> None:
        transport = httpx.ASGITransport(app=web_app(report, strict))
        async with httpx.AsyncClient(transport=transport, base_url="http://web") as client:
            answers = await asyncio.gather(*(client.post("/reports/7") for _ in range(8)))
            assert {a.status_code for a in answers} == {200}
            assert len({a.json()["id"] for a in answers}) == 1
            dup = await client.post("/reports/7?strict=1")
            assert dup.status_code == 409 and dup.json()["running"] == answers[0].json()["id"]
            # Redis stalled: the send waits in its thread, the loop runs on
            assert redis_server.process is not None
            os.kill(redis_server.process.pid, signal.SIGSTOP)
            try:
                pending = asyncio.create_task(client.post("/reports/8"))
                ticks = 0

                async def tick() -> None:
                    nonlocal ticks
                    while True:
                        ticks += 1
                        await asyncio.sleep(0.01)

                ticker = asyncio.create_task(tick())
                await until(lambda: ticks >= 20, "the loop to run while the send waits")
                assert not pending.done()
                ticker.cancel()
            finally:
                os.kill(redis_server.process.pid, signal.SIGCONT)
            assert (await pending).status_code == 200

    run(main())
    # one message per key reached the broker: users 0, 7 and 8
    assert r.llen(app.conf.task_default_queue) == 3
