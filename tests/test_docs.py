"""The documentation's promises: its code examples run, its links resolve.

- Every fenced ``python`` block of README.md and docs/*.md runs here against
  the session's real redis-server (``redis://localhost:6379/0`` and
  ``redis://127.0.0.1:6379/0`` in an example become the test server's URL).
  An example that defines a Celery app has its settings validated
  (``RedisLock(app).config``) and its tasks named in :data:`CALLS` run
  through Celery's in-process worker. A fragment that cannot run says so
  with ``<!-- example: no-run (why) -->`` on the line before its fence (an
  HTML comment: invisible on the repository and package index pages);
  :data:`EXPECTED_NO_RUN` counts them, so opting an example out is a
  visible change to this file.
- The README's links are absolute (they also work on the package index
  page), start with the repository URL of pyproject.toml and name files
  that exist.
- The intersphinx inventories committed under docs/_inventories are what
  their script writes, and the docs build's internal link checker catches
  a missing page and a missing anchor.
"""

from __future__ import annotations

import gc
import re
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery._state import _set_current_app, get_current_app
from celery.bin.base import CLIContext
from celery.contrib.testing.worker import start_worker

from celery_redislock import LockManager, RedisLock
from engine_helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Examples opted out with the no-run marker (README.md and docs/*.md).
EXPECTED_NO_RUN = 1
#: At least this many examples run (a guard against a broken extractor).
MIN_EXAMPLES = 6

#: Tasks an example defines that the test runs through a worker: args.
CALLS: dict[str, tuple[Any, ...]] = {"sync": (1, 7), "fetch_repos": ("github", "acme")}

FENCE_RE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")
NO_RUN_RE = re.compile(r"<!--\s*example:\s*no-run\b")
LOCAL_URL_RE = re.compile(r"redis://(?:localhost|127\.0\.0\.1):6379/0")


@dataclass(frozen=True)
class Example:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    no_run: bool

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def extract_examples(path: Path) -> list[Example]:
    """The fenced ``python`` blocks of one Markdown file, dedented."""
    lines = path.read_text(encoding="utf-8").splitlines()
    examples: list[Example] = []
    i = 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            close = FENCE_RE.match(lines[j])
            if (
                close
                and close["fence"][0] == fence[0]
                and len(close["fence"]) >= len(fence)
                and not close["info"].strip()
            ):
                break
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        if info.split()[:1] in (["python"], ["py"]):
            before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            examples.append(
                Example(
                    path,
                    i + 1,
                    textwrap.dedent("\n".join(body)) + "\n",
                    bool(NO_RUN_RE.search(before)),
                )
            )
        i = j + 1
    return examples


ALL_EXAMPLES = [ex for path in DOC_FILES for ex in extract_examples(path)]


def test_examples_are_found_and_few_opt_out() -> None:
    runnable = [ex for ex in ALL_EXAMPLES if not ex.no_run]
    opted_out = [ex.id for ex in ALL_EXAMPLES if ex.no_run]
    assert len(opted_out) == EXPECTED_NO_RUN, (
        f"examples marked no-run: {opted_out}; update EXPECTED_NO_RUN only for a "
        "fragment that truly cannot run"
    )
    assert len(runnable) >= MIN_EXAMPLES, [ex.id for ex in ALL_EXAMPLES]


def test_extractor_reads_fences_markers_and_indented_blocks(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "text\n\n```python\na = 1\n```\n\n<!-- example: no-run (needs a cluster) -->\n"
        "```python\nb = 2\n```\n\n- item:\n\n  ```python\n  c = 3\n  ```\n\n"
        "```sh\necho no\n```\n\n````markdown\n```python\nnot an example\n```\n````\n"
    )
    found = extract_examples(doc)
    assert [(ex.line, ex.code, ex.no_run) for ex in found] == [
        (3, "a = 1\n", False),
        (8, "b = 2\n", True),
        (14, "c = 3\n", False),
    ]


@pytest.fixture
def restore_current_app() -> Iterator[None]:
    previous = get_current_app()
    yield
    _set_current_app(previous)


@pytest.mark.parametrize(
    "example", [ex for ex in ALL_EXAMPLES if not ex.no_run], ids=lambda ex: ex.id
)
def test_example_runs(example: Example, redis_url: str, restore_current_app: None) -> None:
    code = LOCAL_URL_RE.sub(redis_url, example.code)
    ns: dict[str, Any] = {"__name__": f"doc_example_{example.line}"}
    try:
        exec(compile(code, example.id, "exec"), ns)
        apps = [v for v in ns.values() if isinstance(v, Celery)]
        for locks in [v for v in ns.values() if isinstance(v, RedisLock)]:
            locks.config  # noqa: B018 - the example's settings are valid
        for app in apps:
            _run_tasks(app, ns, redis_url)
    finally:
        for value in ns.values():
            if isinstance(value, (RedisLock, LockManager)):
                value.close()
        gc.collect()
        for app in [v for v in ns.values() if isinstance(v, Celery)]:
            consumer = getattr(app.backend, "result_consumer", None)
            if consumer is not None:
                consumer.stop()
            app.close()


def _run_tasks(app: Celery, ns: dict[str, Any], redis_url: str) -> None:
    """Run the example's tasks named in CALLS through an in-process worker."""
    tasks = {name: ns[name] for name in CALLS if name in ns and hasattr(ns[name], "delay")}
    if not tasks:
        return
    app.conf.update(
        result_backend=redis_url,
        broker_connection_retry_on_startup=False,
        redislock_heartbeat_interval=0.25,
    )
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False):
        for name, task in tasks.items():
            result = task.delay(*CALLS[name])
            result.get(timeout=30)
            assert result.successful(), (name, result.state)


# -- links ---------------------------------------------------------------------


def _project_urls() -> dict[str, str]:
    """pyproject.toml's [project.urls] (tomllib is 3.11+; the table is flat)."""
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("\n[project.urls]\n", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([A-Za-z][\w-]*) = "([^"]+)"$', table, re.M))


PROJECT_URLS = _project_urls()
REPO_URL = PROJECT_URLS["Repository"]
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_links_are_absolute_and_name_files_of_the_repository() -> None:
    links = LINK_RE.findall((ROOT / "README.md").read_text())
    assert links
    into_repo = 0
    for link in links:
        assert link.startswith("https://"), f"{link}: relative links break on the package index"
        if not link.startswith(REPO_URL):
            continue
        rest = link[len(REPO_URL) :].split("#")[0]
        m = re.fullmatch(r"/(?:blob|tree)/main/(.+)", rest)
        assert m, f"{link}: expected {REPO_URL}/blob/main/<file> or /tree/main/<dir>"
        assert (ROOT / m[1]).exists(), f"{link}: no {m[1]} in the repository"
        into_repo += 1
    assert into_repo >= 5
    assert {"Repository", "Documentation", "Changelog"} <= set(PROJECT_URLS)
    for url in PROJECT_URLS.values():
        assert url.startswith(REPO_URL), url


# -- the docs build's own machinery ------------------------------------------

sys.path.insert(0, str(ROOT / "docs" / "_ext"))
sys.path.insert(0, str(ROOT / "docs" / "_inventories"))


def test_committed_inventories_are_what_the_script_writes(tmp_path: Path) -> None:
    import make_inventories

    make_inventories.main(tmp_path)
    for name in make_inventories.INVENTORIES:
        assert (tmp_path / name).read_bytes() == (
            ROOT / "docs" / "_inventories" / name
        ).read_bytes(), f"re-run docs/_inventories/make_inventories.py ({name} is stale)"


def test_link_checker_reports_missing_pages_and_anchors(tmp_path: Path) -> None:
    from redislock_docs import broken_links

    (tmp_path / "sub").mkdir()
    (tmp_path / "index.html").write_text(
        '<a href="sub/page.html#here">ok</a>\n'
        '<a href="sub/page.html#gone">no anchor</a>\n'
        '<a href="missing.html">no page</a>\n'
        '<a href="#top">self</a><h1 id="top">t</h1>\n'
        '<a href="https://example.org/x.html#y">external</a>\n'
        '<img src="_static/logo.png">\n'
    )
    (tmp_path / "sub" / "page.html").write_text(
        '<p id="here">x</p><a href="../index.html#top">back</a><a href="../../out.html">out</a>'
    )
    found = sorted((page, link) for page, _, link, _ in broken_links(tmp_path))
    assert found == [
        ("index.html", "_static/logo.png"),
        ("index.html", "missing.html"),
        ("index.html", "sub/page.html#gone"),
        ("sub/page.html", "../../out.html"),
    ]


def test_api_reference_documents_every_public_name() -> None:
    """A name added to ``celery_redislock.__all__`` gets its entry in docs/api.md."""
    import celery_redislock

    api = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in celery_redislock.__all__ if f"celery_redislock.{n}\n" not in api]
    assert not missing, f"add to docs/api.md: {missing}"


# -- command samples -------------------------------------------------------------


STATUS_SAMPLE_RE = re.compile(
    r"^\$ celery -A proj redislock status\n(?P<rows>(?:[a-z]+ +\S.*\n)+)", re.MULTILINE
)


def _shape(line: str) -> str:
    return re.sub(r"\d+", "N", " ".join(line.split()))


def test_status_samples_are_what_the_command_prints(redis_url: str) -> None:
    """Every ``redislock status`` sample in the docs has the rows the command
    prints, in order and of the same shape (numbers aside), and its format
    row is this release's, word for word."""
    from click.testing import CliRunner

    from celery_redislock import FORMAT_VERSION
    from celery_redislock.integration.cli import redislock

    samples = [
        (path.name, m["rows"].splitlines())
        for path in DOC_FILES
        for m in STATUS_SAMPLE_RE.finditer(path.read_text(encoding="utf-8"))
    ]
    assert samples, "no `redislock status` sample found"
    app = Celery("docstatus", set_as_current=False)
    app.conf.redislock_url = redis_url
    holder, waiter = LockManager(redis_url, "redislock"), LockManager(redis_url, "redislock")
    lease = holder.acquire("repo:1", timeout=5)
    queued = threading.Thread(target=lambda: waiter.acquire("repo:1", timeout=30).release())
    queued.start()  # the sample has a waiter behind the holder

    def status() -> Any:
        return CliRunner().invoke(
            redislock, ["status"], obj=CLIContext(app=app, no_color=True, workdir=None)
        )

    try:
        result = wait_until(
            lambda: (lambda res: res if "1 request(s) queued" in res.output else None)(status()),
            what="the waiter queued",
        )
    finally:
        lease.release()
        queued.join(30)
        holder.close()
        waiter.close()
        app.close()
    assert result.exit_code == 0, result.output
    printed = [ln for ln in result.output.splitlines() if ln.strip()]
    format_row = next(ln for ln in printed if ln.startswith("format "))
    assert (
        " ".join(format_row.split()) == f"format {FORMAT_VERSION} (this release: {FORMAT_VERSION})"
    )
    for name, rows in samples:
        assert [_shape(x) for x in rows] == [_shape(x) for x in printed[: len(rows)]], name
        assert format_row in rows, (name, format_row, rows)


def test_the_docs_name_this_release_s_data_format() -> None:
    from celery_redislock import FORMAT_VERSION

    said = [
        (path.name, int(n))
        for path in DOC_FILES
        for n in re.findall(
            r"(?:this release|this celery-redislock)\s+uses\s+format\s+(\d+)",
            path.read_text(encoding="utf-8"),
        )
    ]
    assert len(said) >= 2, said
    assert all(n == FORMAT_VERSION for _, n in said), said
