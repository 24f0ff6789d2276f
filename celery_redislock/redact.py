"""Mask the secrets of a Redis URL before it is shown (errors, logs, CLI, status).

The package's only URL-masking code. It imports nothing from the package,
so :mod:`celery_redislock.exceptions` can use it too.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

#: What each secret is replaced with.
MASK = "***"
#: What :func:`redact_url` returns for a value it cannot read (not a string).
UNPARSABLE = "<unparsable url>"

# A ';' that starts another URL: kombu's `sentinel://a;sentinel://b` form.
_NEXT_URL_RE = re.compile(r";(?=\s*[A-Za-z][A-Za-z0-9+.-]*://)")
_SCHEME_RE = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.-]*://")
# The '?' that starts the query: the one followed by a `name=` parameter (a
# '?' inside an unencoded password is not).
_QUERY_RE = re.compile(r"\?(?=[A-Za-z0-9_.%-]*=)")
# A query parameter and its value, which runs to the next `&name=`/`;name=`
# (so an unencoded '&' in a password is masked too) or to the end.
_PARAM_RE = re.compile(r"([?&;])([A-Za-z0-9_.%-]*)=(.*?)(?=[&;][A-Za-z0-9_.%-]*=|\Z)", re.S)


def redact_url(url: str) -> str:
    """``url`` with every password replaced by ``***``; safe to log or print.

    What is masked:

    - the userinfo password of ``redis://``, ``rediss://``, ``unix://`` and
      ``sentinel://`` URLs (any ``scheme://`` in fact): ``user:pw@`` becomes
      ``user:***@`` and ``:pw@`` becomes ``:***@``. The userinfo runs to the
      *last* ``@`` before the query (the first ``?`` followed by ``name=``),
      so a password holding ``@``, ``:``, ``/``, ``#`` or a lone ``?``
      unencoded is masked whole; a percent-encoded one is masked as
      written. A username without a password (``user@host``) is kept: it is
      not a secret.
    - each part of kombu's ``;``-separated form
      (``sentinel://:pw@h1/0;sentinel://:pw2@h2``) and our multi-host form
      (``sentinel://:pw@h1:26379,h2/service/db``) alike.
    - the value of every query parameter whose name ends in ``password``
      (``password=``, ``sentinel_password=``, ``ssl_password=``; any case,
      percent-encoded names too), up to the next ``&name=`` / ``;name=``.

    Scheme, host, port, path (db, service name, socket path) and the other
    query parameters stay as written. Masking is idempotent, so an already
    masked URL (e.g. :attr:`LockManager.url`) comes back unchanged.

    Never raises and never returns a secret: text that is not a URL goes
    through the same rules, except that without a ``scheme://`` everything
    before the last ``@`` is masked (``pw@host`` -> ``***@host``); a value
    that is not a string (or that the rules cannot read) becomes
    ``<unparsable url>``.
    """
    if not isinstance(url, str):
        return UNPARSABLE
    try:
        return ";".join(_redact_one(part) for part in _NEXT_URL_RE.split(url))
    except Exception:  # defensive: masking must never be why an error is lost
        return UNPARSABLE


def _redact_one(url: str) -> str:
    scheme = _SCHEME_RE.match(url)
    head = url[: scheme.end()] if scheme else ""
    rest = url[len(head) :]
    query = _QUERY_RE.search(rest)
    at = rest.rfind("@", 0, query.start() if query else len(rest))
    if at >= 0:
        user, colon, _password = rest[:at].partition(":")
        if not scheme:  # not a URL: what precedes '@' may be a bare password
            rest = MASK + rest[at:]
        elif colon:
            rest = f"{user}:{MASK}{rest[at:]}"
    return head + _PARAM_RE.sub(_mask_param, rest)


def _mask_param(match: re.Match[str]) -> str:
    sep, name, _value = match.groups()
    if unquote(name).lower().endswith("password"):
        return f"{sep}{name}={MASK}"
    return match.group(0)
