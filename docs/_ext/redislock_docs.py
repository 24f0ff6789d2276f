"""Sphinx extension of the celery-redislock docs.

Public names resolve where they are documented
-----------------------------------------------
The API reference documents the public classes under the package
(``celery_redislock.LockManager``), while type hints and docstrings name them
where they are defined (``celery_redislock.engine.manager.LockManager``) or bare
(``LockManager`` inside ``celery_redislock.inspect``). A reference that
does not resolve otherwise and whose last part is a name of
``celery_redislock.__all__`` (defined in the module it names, when it names
one) resolves to the documented ``celery_redislock.<name>``.

The settings reference
----------------------

``{redislock-settings}`` (a directive without arguments) renders every entry
of :data:`celery_redislock.integration.settings.SETTINGS` (name, type, default, meaning),
so the reference is generated from the table the code validates against and
never retyped. Each setting is a cross-reference target of the ``std``
domain's ``setting`` type: ``{setting}`redislock_owner_ttl``` in Markdown,
``:setting:`redislock_owner_ttl``` in reStructuredText. Celery's own settings
(``:setting:`task_acks_late```) and signals (``:signal:`beat_init```) resolve
to Celery's documentation through intersphinx.

The README inside the site
--------------------------
The README's links are absolute (they must work on the package index page
too). Where a page includes part of it (``usage.md``), :func:`local_links`
turns each link to a guide of ``docs/`` into a link to that page of the
site, so a reader stays in the documentation they are reading.

Internal links
--------------
After an HTML build, :func:`check_internal_links` reads every page of the
output and warns (an error under ``-W``) about each relative ``href`` or
``src`` whose file is missing, or whose ``#fragment`` names no ``id`` in the
target page. External links are not checked (the build runs offline).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import make_id

import celery_redislock
from celery_redislock.integration.settings import SETTINGS


def _public_name(target: str) -> str | None:
    """``celery_redislock.<name>`` for a reference to a public object, else None."""
    module, _, name = target.rpartition(".")
    if name not in celery_redislock.__all__:
        return None
    obj = getattr(celery_redislock, name)
    if module and module != "celery_redislock" and getattr(obj, "__module__", None) != module:
        return None
    return f"celery_redislock.{name}"


def resolve_public_names(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> nodes.Element | None:
    """The ``missing-reference`` hook: see the module docstring."""
    if node.get("refdomain") != "py":
        return None
    public = _public_name(node["reftarget"])
    if public is None or public == node["reftarget"]:
        return None
    py: Any = env.get_domain("py")
    return py.resolve_xref(  # type: ignore[no-any-return]
        env, node["refdoc"], app.builder, node["reftype"], public, node, contnode
    )


class SettingsDirective(SphinxDirective):
    """A definition list of every ``redislock_*`` setting, from ``SETTINGS``."""

    has_content = False
    required_arguments = 0

    def run(self) -> list[nodes.Node]:
        std: Any = self.env.get_domain("std")
        items = nodes.definition_list(classes=["redislock-settings"])
        for setting in SETTINGS:
            node_id = make_id(self.env, self.state.document, "setting", setting.name)
            term = nodes.term("", "", ids=[node_id])
            term += nodes.literal(setting.name, setting.name)
            self.state.document.note_explicit_target(term)
            std.note_object("setting", setting.name, node_id, location=term)

            body = nodes.definition()
            fields = nodes.field_list()
            for label, value in (("Type", setting.type), ("Default", setting.default)):
                field = nodes.field()
                field += nodes.field_name(label, label)
                field += nodes.field_body("", nodes.paragraph(value, value))
                fields += field
            body += nodes.paragraph(setting.doc, setting.doc)
            body += fields
            items += nodes.definition_list_item("", term, body)
        return [items]


class _Page(HTMLParser):
    """The ids and the (tag, attribute, value, line) links of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[str, int]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name") and (name == "id" or tag == "a"):
                self.ids.add(value)
            elif name in ("href", "src") and tag != "link" or (tag == "link" and name == "href"):
                self.links.append((value, self.getpos()[0]))


def _internal(link: str) -> bool:
    parts = urlsplit(link)
    return not parts.scheme and not parts.netloc and not link.startswith("//")


def broken_links(root: Path) -> Iterator[tuple[str, int, str, str]]:
    """(page, line, link, why) for each relative link under ``root`` that does not resolve."""
    pages: dict[str, _Page] = {}
    for path in sorted(root.rglob("*.html")):
        page = _Page()
        page.feed(path.read_text(encoding="utf-8"))
        page.close()
        pages[path.relative_to(root).as_posix()] = page
    for name, page in pages.items():
        for link, line in page.links:
            if not _internal(link):
                continue
            parts = urlsplit(link)
            target = name
            if parts.path:
                target = posixpath.normpath(
                    posixpath.join(posixpath.dirname(name), unquote(parts.path))
                )
                if target.startswith("../"):
                    yield name, line, link, "points outside the site"
                    continue
                if (root / target).is_dir():
                    target = posixpath.join(target, "index.html")
                if not (root / target).is_file():
                    yield name, line, link, f"no file {target}"
                    continue
            fragment = unquote(parts.fragment)
            if fragment and target.endswith(".html") and fragment not in pages[target].ids:
                yield name, line, link, f"no id {fragment!r} in {target}"


def check_internal_links(app: Sphinx, exc: Exception | None) -> None:
    """The ``build-finished`` hook: warn about every broken internal link."""
    if exc is not None or app.builder.format != "html":
        return
    log = logging.getLogger(__name__)
    for page, line, link, why in broken_links(Path(app.outdir)):
        log.warning(
            "broken internal link %r: %s",
            link,
            why,
            location=f"{page}:{line}",
            type="redislock",
            subtype="link",
        )


#: The prefix of the README's links to files of the repository's docs/.
DOCS_URL = "https://github.com/celery-redislock/celery-redislock/blob/main/docs/"


def local_links(app: Sphinx, relative_path: Path, parent_docname: str, content: list[str]) -> None:
    """``include-read``: an included README's links to ``docs/X.md`` become ``X.md``."""
    if relative_path.name == "README.md":
        content[0] = content[0].replace(f"]({DOCS_URL}", "](")


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_object_type("setting", "setting", objname="setting", indextemplate="pair: %s; setting")
    # Celery's signals, so that :signal:`worker_process_init` links to Celery's docs.
    app.add_crossref_type("signal", "signal", indextemplate="pair: %s; signal")
    app.add_directive("redislock-settings", SettingsDirective)
    app.connect("missing-reference", resolve_public_names)
    app.connect("include-read", local_links)
    app.connect("build-finished", check_internal_links)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
