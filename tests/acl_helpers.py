"""The least-privilege ACL of docs/operations.md, as the tests use it.

The ACL is read from the documentation, never copied: :func:`documented_acl`
parses the one ``ACL SETUSER`` line of the *Least-privilege ACL* section, and
:func:`create_lock_user` creates that user on a test redis-server, with the
key pattern of the namespaces a test uses. So the suites that run as this
user (``REDISLOCK_TEST_ACL=1``, ``make test-acl``) fail as soon as the code
needs a permission the documentation does not grant.

This module imports nothing from celery_redislock.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis

DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
#: Environment variable: when "1", the ``redis_url`` fixture carries the
#: restricted user's credentials (see tests/conftest.py).
ENV_VAR = "REDISLOCK_TEST_ACL"
#: The restricted user the tests create, and its password.
USER = "redislock-test"
PASSWORD = "lock-user-pw"
#: Namespaces the suites that run as the restricted user lock in (typo-ns:
#: the CLI tests' never-used namespace, which the user may read).
TEST_NAMESPACES = ("t", "redislock", "other", "typo-ns")

_SECTION_RE = re.compile(r"^### Least-privilege ACL\n(.*?)(?=^#{1,3} )", re.M | re.S)
_LINE_RE = re.compile(r"^ACL SETUSER (\S+) (.*)$", re.M)


@dataclass(frozen=True)
class DocumentedAcl:
    """The documented rules, split: commands (lower case), key patterns, the rest."""

    user: str
    commands: frozenset[str]
    key_patterns: tuple[str, ...]
    flags: tuple[str, ...]

    def rules(self, namespaces: Iterable[str], *, select: bool = False) -> list[str]:
        """The rules for ``namespaces`` (``~{ns}:*`` each), plus SELECT if asked."""
        out: list[str] = []
        for flag in self.flags:
            if flag == "resetkeys":
                out.append(flag)
                out.extend(f"~{{{ns}}}:*" for ns in namespaces)
            else:
                out.append(flag)
        out.extend(f"+{c}" for c in sorted(self.commands))
        if select:
            out.append("+select")
        return out


def documented_acl(doc: Path = DOC) -> DocumentedAcl:
    """Parse the ``ACL SETUSER`` line of docs/operations.md."""
    section = _SECTION_RE.search(doc.read_text(encoding="utf-8"))
    if section is None:
        raise AssertionError(f"{doc} has no '### Least-privilege ACL' section")
    lines = _LINE_RE.findall(section.group(1))
    if len(lines) != 1:
        raise AssertionError(f"expected one ACL SETUSER line in the section, found {len(lines)}")
    user, rest = lines[0]
    commands: set[str] = set()
    keys: list[str] = []
    flags: list[str] = []
    for token in rest.split():
        if token.startswith("+") and not token.startswith("+@"):
            commands.add(token[1:].lower())
        elif token.startswith("~"):
            keys.append(token)
        elif token.startswith(">"):
            continue  # the password
        else:
            flags.append(token)
    return DocumentedAcl(user, frozenset(commands), tuple(keys), tuple(flags))


def create_lock_user(
    admin: redis.Redis,
    namespaces: Iterable[str] = TEST_NAMESPACES,
    *,
    user: str = USER,
    password: str = PASSWORD,
    select: bool = False,
    drop: Iterable[str] = (),
) -> None:
    """(Re)create ``user`` with the documented ACL for ``namespaces``.

    ``drop``: commands to leave out (to test a user lacking one permission).
    """
    rules = documented_acl().rules(list(namespaces), select=select)
    dropped = {f"+{c.lower()}" for c in drop}
    rules = [r for r in rules if r not in dropped]
    admin.execute_command("ACL", "SETUSER", user, "reset", f">{password}", *rules)


def user_directive(
    namespaces: Iterable[str] = TEST_NAMESPACES,
    *,
    user: str = USER,
    password: str = PASSWORD,
    select: bool = False,
) -> list[str]:
    """redis-server arguments declaring the user (``--user NAME RULES...``).

    A user declared at start-up is there again after a restart, unlike one
    made with ACL SETUSER.
    """
    rules = documented_acl().rules(list(namespaces), select=select)
    return ["--user", user, f">{password}", *rules]


def user_url(url: str, *, user: str = USER, password: str = PASSWORD, db: int | None = None) -> str:
    """``url`` (``redis://host:port/db``) with the user's credentials (and another db)."""
    scheme, rest = url.split("://", 1)
    if db is not None:
        rest = rest.rsplit("/", 1)[0] + f"/{db}"
    return f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{rest}"


def admin_url(url: str) -> str:
    """``url`` without its user and password: the test server's default user.

    The engine may run as the least-privilege user; a test's own reads and
    its data keys outside the namespace use this.
    """
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{rest.rsplit('@', 1)[-1]}"
