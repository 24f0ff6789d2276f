"""A worker app whose tasks module puts ``@locked`` above ``@app.task``.

``celery -A e2e.proj_wrong_order worker`` must refuse to start: decorated in
this order, the task the worker registers would run unlocked.
"""

from __future__ import annotations

from typing import Any

from celery_redislock import current_lease, locked
from e2e.proj import app

__all__ = ["app", "wrong_order"]


@locked("res:{res}")  # wrong: must be under @app.task
@app.task(name="e2e.wrong_order")
def wrong_order(res: str) -> Any:
    """Returns whether it ran under a lease (it would not: that is the bug)."""
    return current_lease() is not None
