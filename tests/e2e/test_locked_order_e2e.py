"""End-to-end: a real prefork worker refuses a task module with ``@locked``
placed above ``@app.task`` instead of running that task unlocked.

Outside a worker the mistake shows as a TypeError where the module is
imported (see ``tests/test_locked_mistakes.py``); in a worker it must stop
the start-up with the same message, before any task is consumed.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from .harness import Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_worker_refuses_to_start_with_locked_above_app_task(
    cluster: Callable[..., Cluster],
) -> None:
    c = cluster(app_module="e2e.proj_wrong_order")
    worker = c.start_worker("wrong-order", wait=False)
    ping = c.producer.send_task("e2e.ping", queue=worker.queue)
    # Either the worker exits (the fix) or it answers (it started and would
    # run e2e.wrong_order without its lock).
    wait_for(
        lambda: not worker.alive or ping.ready(),
        timeout=90,
        what="the worker to exit or answer",
        on_timeout=worker.tail,
    )
    if worker.alive:
        unlocked = c.send("wrong_order", "1").get(timeout=30)
        pytest.fail(
            "the worker started; e2e.wrong_order ran "
            + ("locked" if unlocked else "WITHOUT its lock")
            + f"\n{worker.tail()}"
        )
    assert worker.wait(10) != 0
    log = worker.text()
    assert "TypeError" in log and "@locked must be placed directly above the function" in log, (
        worker.tail()
    )
    assert "proj_wrong_order.py" in log, worker.tail()  # the traceback points at the module
