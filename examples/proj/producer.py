"""Send contending tasks to the example project.

Run from ``examples/`` while a worker runs: ``python -m proj.producer``.
Three syncs of repository 1 queue behind each other (first come, first
served); a sync of repository 2 and a report share the remote with them.
"""

from __future__ import annotations

import time
from typing import Any

from .tasks import report, sync


def send_contention(gap: float = 0.3) -> list[Any]:
    """Send the contention scenario; ``gap`` seconds between the repo:1 syncs."""
    results = []
    for i in range(1, 4):
        results.append(
            sync.apply_async(args=(1, "origin"), kwargs={"seconds": 1.0, "label": f"sync-1.{i}"})
        )
        if i == 1:
            results.append(
                sync.apply_async(args=(2, "origin"), kwargs={"seconds": 1.0, "label": "sync-2"})
            )
            results.append(
                report.apply_async(args=("origin",), kwargs={"seconds": 1.0, "label": "report"})
            )
        time.sleep(gap)  # make the arrival order of the repo:1 syncs unambiguous
    return results


if __name__ == "__main__":
    for result in send_contention():
        print(result.get(timeout=120))
