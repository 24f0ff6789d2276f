"""Property tests (hypothesis): resource names and request shapes.

Names: any accepted name becomes exactly ``{ns}:lock:<name>``, inside the
namespace's hash tag; any refused one raises InvalidResource and writes
nothing. Shapes: random exclusive/shared requests from two managers are
granted exactly when a pure-Python reader/writer model says so, and after
every release Redis keeps no lock, queue, request or wake key.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from celery_redislock import InvalidResource, Lease, LockManager, LockTimeout
from celery_redislock.protocol.keys import MAX_RESOURCE_BYTES
from engine_helpers import (
    Managers,
    all_keys,
    assert_registry_truth,
    kinds,
    lock_holders,
    registries,
)

SETTINGS = settings(
    max_examples=75,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: Characters that could matter in a key: hash tags, separators, globs, unicode.
TRICKY = "{}:|*?[]\\/.-_ é€😀 \u200b"


def is_valid(name: str) -> bool:
    return (
        0 < len(name.encode("utf-8", "surrogatepass")) <= MAX_RESOURCE_BYTES
        and not any(ord(c) < 0x20 or ord(c) == 0x7F for c in name)
        and not any(0xD800 <= ord(c) <= 0xDFFF for c in name)
    )


def hash_tag(key: str) -> str:
    """The part of a key Redis Cluster hashes (the first non-empty {...})."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


valid_names = st.one_of(
    st.text(alphabet=st.sampled_from(TRICKY + "abc09"), min_size=1, max_size=40),
    st.text(min_size=1, max_size=60),
    st.just("x" * MAX_RESOURCE_BYTES),
    st.just("😀" * (MAX_RESOURCE_BYTES // 4)),
).filter(is_valid)

any_text = st.one_of(
    st.text(alphabet=st.sampled_from(TRICKY + "\x00\n\t\x7f\x1b"), max_size=20),
    st.text(st.characters(codec=None), max_size=30),  # includes lone surrogates
    st.text(min_size=MAX_RESOURCE_BYTES - 2, max_size=MAX_RESOURCE_BYTES + 2),
)

invalid_names = st.one_of(
    st.just(""),
    st.text(min_size=MAX_RESOURCE_BYTES + 1, max_size=MAX_RESOURCE_BYTES + 20),
    st.tuples(
        st.text(max_size=5), st.sampled_from("\x00\x01\n\r\t\x1b\x7f"), st.text(max_size=5)
    ).map("".join),
    st.integers(),
    st.binary(min_size=1, max_size=5),
    st.none(),
    st.floats(allow_nan=False),
).filter(lambda n: not (isinstance(n, str) and is_valid(n)))


# -- names -------------------------------------------------------------------


@SETTINGS
@given(name=valid_names, mode=st.sampled_from(["exclusive", "shared"]))
def test_valid_names_round_trip_as_a_lock_key_inside_the_namespace(
    managers: Managers, r: redis.Redis, name: str, mode: str
) -> None:
    r.flushall()
    mgr = managers()
    key = mgr.keys.lock(name)
    assert key == "{t}:lock:" + name and mgr.keys.resource_of(key) == name
    with mgr.lock(timeout=0, **{mode: [name]}) as lease:
        assert lease.resources == (name,)
        assert lock_holders(r) == {key: {lease.token: {"exclusive": "x", "shared": "s"}[mode]}}
        assert registries(r) == {mgr.owner_id: {key}}
    keys = all_keys(r)
    assert keys and all(k.startswith("{t}:") and hash_tag(k) == "t" for k in keys)
    assert lock_holders(r) == {}
    mgr.close()


@SETTINGS
@given(name=any_text)
def test_no_name_ever_produces_a_key_outside_the_namespace(
    managers: Managers, r: redis.Redis, name: str
) -> None:
    r.flushall()
    mgr = managers()
    try:
        lease = mgr.acquire(exclusive=[name], timeout=0)
    except InvalidResource:
        assert not is_valid(name)
        assert all_keys(r) == set()
    else:
        assert is_valid(name)
        keys = all_keys(r)
        assert "{t}:lock:" + name in keys
        assert all(k.startswith("{t}:") and hash_tag(k) == "t" for k in keys)
        lease.release()
    mgr.close()


@SETTINGS
@given(name=invalid_names, mode=st.sampled_from(["exclusive", "shared"]))
def test_invalid_names_raise_invalid_resource_and_write_nothing(
    r: redis.Redis, managers: Managers, name: Any, mode: str
) -> None:
    r.flushall()
    mgr = managers()
    with pytest.raises(InvalidResource):
        mgr.acquire(timeout=0, **{mode: [name]})
    with pytest.raises(InvalidResource):  # also next to a valid name
        mgr.acquire(timeout=0, **{mode: ["ok", name]})
    assert all_keys(r) == set()
    mgr.close()


# -- request shapes ------------------------------------------------------------

RESOURCES = ["r0", "r1", "r2", "r3"]

shapes = st.dictionaries(
    st.sampled_from(RESOURCES), st.sampled_from(["x", "s"]), min_size=1, max_size=4
)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.integers(0, 1), shapes),
        st.tuples(st.just("release"), st.integers(0, 7), st.just({})),
    ),
    min_size=1,
    max_size=12,
)


def model_grants(held: list[tuple[Lease, dict[str, str]]], want: dict[str, str]) -> bool:
    """Reader/writer compatibility: a resource may have one 'x' or many 's'."""
    for _, modes in held:
        for res, mode in want.items():
            other = modes.get(res)
            if other is not None and "x" in (mode, other):
                return False
    return True


def take(got: list[Any], mgr: LockManager, exclusive: list[str], shared: list[str]) -> None:
    try:
        got.append(mgr.acquire(exclusive=exclusive, shared=shared, timeout=0))
    except BaseException as exc:
        got.append(exc)


@SETTINGS
@given(plan=steps)
def test_grants_match_a_reader_writer_model_and_release_leaves_no_lock_keys(
    managers: Managers, r: redis.Redis, plan: list[tuple[str, int, dict[str, str]]]
) -> None:
    assume(any(op == "acquire" for op, _, _ in plan))
    r.flushall()
    mgrs = [managers(), managers()]
    held: list[tuple[Lease, dict[str, str]]] = []

    for op, who, want in plan:
        if op == "acquire":
            exclusive = [res for res, m in want.items() if m == "x"]
            shared = [res for res, m in want.items() if m == "s"]
            expect = model_grants(held, want)
            # Each acquire from a thread of its own: one thread would
            # re-enter the leases it holds (reentrancy has tests of its own).
            got: list[Lease | BaseException] = []
            t = threading.Thread(target=take, args=(got, mgrs[who], exclusive, shared))
            t.start()
            t.join(30)
            try:
                if isinstance(got[0], BaseException):
                    raise got[0]
                lease = got[0]
            except LockTimeout:
                assert not expect, f"refused {want} while holding {[m for _, m in held]}"
            else:
                assert expect, f"granted {want} while holding {[m for _, m in held]}"
                held.append((lease, want))
        elif held:
            lease, _ = held.pop(who % len(held))
            lease.release()

        # Redis records exactly the model's grants, and registries agree
        expected: dict[str, dict[str, str]] = {}
        for lease, modes in held:
            for res, mode in modes.items():
                expected.setdefault("{t}:lock:" + res, {})[lease.token] = mode
        assert lock_holders(r) == expected
        assert_registry_truth(r)

    for lease, _ in held:
        lease.release()
    assert kinds(all_keys(r)) <= {"fence", "born", "format", "owners", "alive"}
    for mgr in mgrs:
        mgr.close()
