"""`make demo` (examples/demo.py) tells its story end to end and exits 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_demo_runs_its_whole_story_and_exits_zero() -> None:
    proc = subprocess.run(
        [sys.executable, str(DEMO)],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    print(proc.stdout)
    print(proc.stderr, file=sys.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "all" in proc.stdout and "checks passed" in proc.stdout


def test_a_demo_that_checked_nothing_fails() -> None:
    """A worker that never started must not end in "all 0 checks passed"."""
    import importlib.util
    import tempfile

    spec = importlib.util.spec_from_file_location("redislock_demo", DEMO)
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    with tempfile.TemporaryDirectory() as workdir:
        story = demo.Demo(Path(workdir))
        assert story.finish() == 1
