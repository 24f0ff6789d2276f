"""Sphinx configuration of the celery-redislock documentation site (``make docs``).

The guides are the Markdown files of this directory (MyST); the API
reference comes from the docstrings (autodoc), the settings reference from
``celery_redislock.integration.settings.SETTINGS`` (``_ext/redislock_docs.py``) and the
CLI page from the click commands (sphinx-click). The build never touches the
network: the intersphinx inventories are files under ``_inventories/``,
written by ``_inventories/make_inventories.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # the package of this checkout, not an installed one
sys.path.insert(0, str(HERE / "_ext"))

import celery_redislock  # noqa: E402

project = "celery-redislock"
author = "celery-redislock contributors"
copyright = "celery-redislock contributors"
release = celery_redislock.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx_click",
    "redislock_docs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "_inventories"]
templates_path: list[str] = []

# Every cross-reference must resolve (make docs runs with -n -W).
nitpicky = True
nitpick_ignore = [
    # A type variable of a signature.
    ("py:class", "celery_redislock.integration.locked.F"),
    # Internal machinery named by the type of a public attribute; documented
    # in the guides (worker.md, design.md), not part of the API.
    ("py:class", "celery_redislock.engine.heartbeat.Heartbeat"),
    ("py:class", "celery_redislock.worker.node.Node"),
    ("py:class", "celery_redislock.worker.node.IncarnationCell"),
    # redis-py documents its client as redis.Redis; a return annotation
    # resolves to where the class is defined.
    ("py:class", "redis.client.Redis"),
    # Not in the vendored Python inventory's py:class entries.
    ("py:class", "contextlib.AbstractContextManager"),
    ("py:class", "collections.abc.AsyncIterator"),
    # redis-py's inventory (vendored) has no redis.asyncio entries.
    ("py:class", "redis.asyncio.Redis"),
    ("py:class", "redis.asyncio.client.Redis"),
    # prometheus_client has no inventory among the vendored ones (the
    # prometheus extra's types, in docs/api.md's metrics section).
    ("py:class", "CollectorRegistry"),
    ("py:class", "prometheus_client.metrics_core.Metric"),
]

# Option names (--force) must stay as typed, not become dashes.
smartquotes = False

# -- MyST ---------------------------------------------------------------------

myst_enable_extensions = ["deflist", "colon_fence"]
# GitHub-style anchors for headings, so `page.md#some-heading` links work in
# the site as they do on the repository.
myst_heading_anchors = 4

# -- autodoc ------------------------------------------------------------------

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_default_options = {"members": True}
# The request aliases show as their own names ('~'), linked to api.md's entries.
autodoc_type_aliases = {
    "AnyRedis": "celery_redislock.store.connect.AnyRedis",
    "ResourceNames": "~celery_redislock.protocol.request.ResourceNames",
    "Limits": "~celery_redislock.protocol.request.Limits",
}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# -- intersphinx (vendored inventories: no network at build time) -------------

_INV = HERE / "_inventories"
intersphinx_mapping = {
    "python": ("https://docs.python.org/3", str(_INV / "python.inv")),
    "celery": ("https://docs.celeryq.dev/en/stable", str(_INV / "celery.inv")),
    "kombu": ("https://docs.celeryq.dev/projects/kombu/en/stable", str(_INV / "kombu.inv")),
    "redis": ("https://redis.readthedocs.io/en/stable", str(_INV / "redis.inv")),
}

# -- HTML ---------------------------------------------------------------------

html_theme = "furo"
html_title = f"celery-redislock {release}"
html_static_path = ["_static"]
html_css_files = ["redislock.css"]
html_theme_options = {
    # The build runs offline: no fonts or icons fetched from the network.
    "navigation_with_keys": True,
}
