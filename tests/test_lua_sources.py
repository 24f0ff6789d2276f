"""The Lua sources keep the conventions docs/design.md states for them.

- Every script opens with a header naming its KEYS, ARGV, atomic steps and
  reply (STYLE: the contract is read before the code).
- No argument given to ``redis.call`` is a Lua number: Redis formats each
  one with ``sprintf("%.14g")`` on every call, which cost more than the
  command itself (docs/design.md, "Redis cost"). A numeric literal or a
  ``tonumber(...)`` among the arguments is the mistake this catches;
  variables holding numbers are kept out by review and by ``int()``.

These read the files only; no Redis needed.
"""

from __future__ import annotations

import re
from importlib import resources

import pytest

from celery_redislock.store import scripts
from celery_redislock.store.scripts import SCRIPT_NAMES

LUA = resources.files("celery_redislock") / "lua"
FILES = ["_common", *SCRIPT_NAMES]


def _source(name: str) -> str:
    return (LUA / f"{name}.lua").read_text(encoding="utf-8")


def _code(text: str) -> str:
    """The source without comments and string literals (so they cannot match)."""
    text = re.sub(r"--[^\n]*", "", text)
    return re.sub(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", "''", text)


def _call_arguments(code: str) -> list[list[str]]:
    """The top-level arguments of every ``redis.call(...)`` in ``code``."""
    out = []
    for match in re.finditer(r"redis\.call\(", code):
        depth, args, current = 1, [], ""
        for ch in code[match.end() :]:
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth == 0:
                    args.append(current.strip())
                    break
            if ch == "," and depth == 1:
                args.append(current.strip())
                current = ""
            else:
                current += ch
        out.append(args)
    return out


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_script_opens_with_its_keys_argv_steps_and_reply(name: str) -> None:
    header = re.match(r"(?:--[^\n]*\n)+", _source(name))
    assert header, f"{name}.lua does not open with a comment"
    text = header.group(0)
    for part in ("KEYS", "ARGV", "Reply"):
        assert part in text, f"{name}.lua's header does not state {part}"
    assert re.search(r"[Aa]tomic steps|[Ss]teps", text), f"{name}.lua's header has no steps"


@pytest.mark.parametrize("name", FILES)
def test_no_lua_number_is_passed_to_redis_call(name: str) -> None:
    bad = [
        args
        for args in _call_arguments(_code(_source(name)))
        for arg in args[1:]
        if re.fullmatch(r"-?\d+(\.\d+)?", arg) or arg.startswith("tonumber(")
    ]
    assert bad == [], f"{name}.lua passes numbers to redis.call: {bad}"


def test_the_number_check_finds_what_it_looks_for() -> None:
    code = _code("redis.call('LTRIM', k, 0, 0)\nredis.call('PEXPIRE', k, tonumber(ARGV[1]))")
    calls = _call_arguments(code)
    assert calls == [["''", "k", "0", "0"], ["''", "k", "tonumber(ARGV[1])"]]


def _helpers() -> list[str]:
    """Names ``_common.lua`` defines at its top level."""
    return [name for name, _, _ in scripts.helper_units()]


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_each_script_defines_every_helper_it_uses_before_using_it(name: str) -> None:
    # scripts.source() includes only the helpers a script names; a helper
    # left out, or placed after its first use, would be a global at run
    # time ("Script attempted to access nonexistent global variable").
    # Checked with this file's own comment and string stripper.
    code = _code(scripts.source(name))
    for helper in _helpers():
        uses = [m.start() for m in re.finditer(rf"(?<![\w.]){helper}\b", code)]
        if not uses:
            continue
        definition = re.search(rf"^(?:local function {helper}\(|local {helper}\b)", code, re.M)
        assert definition is not None, f"{name}.lua uses {helper} but its source does not define it"
        assert definition.start() <= uses[0], f"{name}.lua uses {helper} before defining it"


def test_a_script_makes_only_the_closures_it_uses() -> None:
    # Every helper is a closure made on each call of the script: one that
    # uses none (the heartbeats run for every node each tick) gets none,
    # and acquire's fast path, before its '-- @helpers' line, gets only
    # what it calls.
    for name in ("heartbeat", "node_heartbeat", "node_start", "format"):
        assert "local function" not in _code(scripts.source(name)).split(_code(_source(name)))[0]
    acquire = scripts.source("acquire")
    fast = acquire[: acquire.index("local prefix = ARGV[5]")]
    defined = set(re.findall(r"^local function (\w+)", fast, re.M))
    assert defined == {"int", "owner_of", "name_of", "next_fence", "reg_buckets", "registry_add"}
    assert "wake_front" in acquire  # the rest still has every helper it uses


@pytest.mark.parametrize("name", FILES)
def test_no_long_string_or_comment_hides_a_name(name: str) -> None:
    # The helper scan (scripts.py) reads line comments and quoted strings
    # only; a Lua long bracket ([[...]], --[[...]]) would need more.
    assert not re.search(r"\[=*\[", _source(name)), f"{name}.lua has a long bracket"
