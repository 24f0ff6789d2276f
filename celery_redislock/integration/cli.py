"""``celery -A proj redislock ...``: see and free locks during an incident.

Registered as a Celery sub-command through the ``celery.commands`` entry
point (pyproject.toml), and runnable without an app as
``python -m celery_redislock --url redis://... --namespace ns ...``.

Commands (each takes ``--json`` for machine-readable output)::

    status                 owners alive/dead, registered locks, eviction policy, fence
    locks [RESOURCE...]    who holds what (walks the owner registries; no SCAN)
    owners                 the active-owners set: liveness, registry size, node
    waiters RESOURCE       the wait queue of one resource, in serving order
    release --owner ID     free every lock of one owner (dead; live only with --force)
    release --resource R   free R by cleaning up its holders' owners
    reconcile              free the locks of every dead owner now (what beat does)
    format [--switch]      the namespace's data-format version; switch it after a drain

Connection: ``--url`` / ``--namespace`` (on the group or any command, or
``REDISLOCK_URL`` / ``REDISLOCK_NAMESPACE``) override the app's settings
``redislock_url`` (default: the broker URL when it is Redis) and
``redislock_namespace`` (default ``redislock``).

Every command but ``format`` first checks (one round trip) that the
namespace was ever used and holds data of this release's format; if not it
exits 1 saying so (a mistyped ``--namespace`` is never shown as an empty,
healthy namespace).

Exit codes: 0 done; 1 refused (a live owner without ``--force``), an owner
or namespace that does not exist, a namespace of another data format, partial
cleanup, Redis unavailable, or permission denied (the Redis user's ACL lacks
a command or key: the message names it; a refused read is never shown as
"nobody waits" or a DEAD owner); 2 usage error; an unconfirmed prompt aborts
with 1 and frees nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import click
import redis

from ..engine.manager import DEFAULT_OWNER_TTL, LockManager
from ..exceptions import ConfigurationError, LockError
from ..ops.inspector import Holder, Inspector, LockInfo, OwnerInfo, ReleasePlan, redact_url
from ..protocol.keys import FORMAT_VERSION, UNVERSIONED_FORMAT, text
from ..protocol.reports import CleanupReport
from .settings import default_url, load_config, reveal

log = logging.getLogger("celery_redislock.cli")

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_NAMESPACE = "redislock"

ERR_NO_URL = (
    "no Redis URL for the locks: pass -A proj (`celery -A proj redislock ...` reads "
    "the app's redislock_url, else its Redis broker URL) or --url redis://host:port/db "
    "(or sentinel://host:26379[,host2:26379]/service_name[/db], or "
    "redis+cluster://host:6379[,host2:6379]/ for Redis Cluster)"
)
ERR_UNUSED = (
    "namespace {ns!r} at {url} has never been used: no format key, no fencing counter, "
    "no owners (or Redis lost its data since). The workers use another one: check "
    "--namespace / redislock_namespace / REDISLOCK_NAMESPACE and --url"
)


# ---------------------------------------------------------------- settings


def resolve_connection(app: Any, url: str | None, namespace: str | None) -> tuple[str, str, float]:
    """The (url, namespace, owner_ttl) to use: overrides, else the app's settings.

    ``--url``/``--namespace`` win; otherwise :func:`celery_redislock.integration.settings.load_config`
    reads ``app.conf`` (``redislock_url``, falling back to a Redis broker URL;
    ``redislock_namespace``, default ``redislock``). Without an app (the
    standalone entry) ``url`` is required.

    Raises:
        click.UsageError: no usable URL, or a refused url/namespace setting.
    """
    if namespace == "":
        raise click.UsageError(
            "--namespace is empty: give the namespace's name (1-64 of [A-Za-z0-9_.-]), "
            "or leave the option out to use redislock_namespace (default 'redislock')"
        )
    conf = getattr(app, "conf", None) if app is not None else None
    if conf is None:
        if not url:
            raise click.UsageError(ERR_NO_URL)
        return url, namespace or DEFAULT_NAMESPACE, DEFAULT_OWNER_TTL
    overrides: dict[str, Any] = {}
    if url:
        overrides["redislock_url"] = url
    if namespace is not None:
        overrides["redislock_namespace"] = namespace
    view = _ConfView(conf, overrides)
    try:
        cfg = load_config(view)
    except ConfigurationError as exc:
        if exc.setting == "redislock_url":
            raise click.UsageError(
                f"{exc}; or pass -A proj (an app with redislock_url or a Redis broker) "
                "or --url redis://host:port/db"
            ) from exc
        if exc.setting == "redislock_namespace":
            raise click.UsageError(f"{exc} (or pass --namespace)") from exc
        # Another setting is refused: an incident tool still runs, on defaults.
        click.echo(f"warning: {exc}; using the default owner TTL", err=True)
        final_url = (
            url
            or reveal(view.get("redislock_url"))
            or default_url(view.get("broker_url"), view.get("broker_transport_options"))
        )
        if not final_url:
            raise click.UsageError(ERR_NO_URL) from exc
        return (
            final_url,
            namespace or view.get("redislock_namespace") or DEFAULT_NAMESPACE,
            (DEFAULT_OWNER_TTL),
        )
    return cfg.url, cfg.namespace, cfg.owner_ttl


class _ConfView(Mapping[str, Any]):
    """``app.conf`` under ``overrides``, read-only; reading never raises."""

    def __init__(self, conf: Any, overrides: dict[str, Any]) -> None:
        self._conf = conf
        self._overrides = overrides

    def __getitem__(self, key: str) -> Any:
        if key in self._overrides:
            return self._overrides[key]
        try:
            value = self._conf.get(key)
        except Exception:  # a lazy settings object that fails to load: unset
            value = None
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


# ---------------------------------------------------------------- plumbing


def _connection_options(f: F) -> F:
    f = click.option(
        "--namespace",
        "namespace",
        default=None,
        help="Lock namespace (default: redislock_namespace, else 'redislock').",
    )(f)
    f = click.option(
        "--url",
        "url",
        default=None,
        help="Redis URL of the locks (default: redislock_url, else a Redis broker URL).",
    )(f)
    return f


def _command_options(f: F) -> F:
    f = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(f)
    return _connection_options(f)


def _state(ctx: click.Context) -> dict[str, Any]:
    state: dict[str, Any] = ctx.meta.setdefault("celery_redislock.cli", {})
    return state


def _manager(ctx: click.Context, url: str | None, namespace: str | None) -> LockManager:
    state = _state(ctx)
    app = state.get("app")
    url = url or state.get("url")
    namespace = namespace if namespace is not None else state.get("namespace")
    try:
        final_url, ns, owner_ttl = resolve_connection(app, url, namespace)
        mgr = LockManager(
            final_url, ns, owner_ttl=owner_ttl, heartbeat=False, name="cli", eviction_check="ignore"
        )
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc
    except LockError as exc:  # a cluster client connects when made: RedisUnavailable
        raise click.ClickException(str(exc)) from exc
    ctx.call_on_close(mgr.close)
    return mgr


def _inspector(ctx: click.Context, url: str | None, namespace: str | None) -> Inspector:
    """An inspector of a namespace that is in use and of this release's data format.

    One round trip first (:meth:`Inspector.usage`): a namespace nothing ever
    used, or one of another data format, ends the command with exit 1.
    """
    mgr = _manager(ctx, url, namespace)
    insp = Inspector(mgr)

    def check() -> None:
        if not insp.usage().used:
            raise click.ClickException(ERR_UNUSED.format(ns=mgr.namespace, url=mgr.url))

    _guard(check)
    return insp


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = ["  ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip()]
    for row in rows:
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
    return "\n".join(lines)


def _life(alive: bool, ttl: float | None) -> str:
    if not alive:
        return "DEAD"
    return f"alive {ttl:.1f}s" if ttl is not None else "alive (no ttl)"


def _guard(fn: Callable[[], None]) -> None:
    """Run ``fn``; turn library errors into a one-line CLI error (exit 1)."""
    try:
        fn()
    except LockError as exc:
        raise click.ClickException(str(exc)) from exc
    except redis.RedisError as exc:  # e.g. NOPERM from an ACL user without the namespace
        raise click.ClickException(f"Redis refused a command: {exc}") from exc


class _Refused(click.ClickException):
    exit_code = 1


# ---------------------------------------------------------------- group


@click.group(name="redislock")
@click.option(
    "--url",
    envvar="REDISLOCK_URL",
    default=None,
    help="Redis URL of the locks (default: redislock_url, else a Redis broker URL).",
)
@click.option(
    "--namespace",
    envvar="REDISLOCK_NAMESPACE",
    default=None,
    help="Lock namespace (default: redislock_namespace, else 'redislock').",
)
@click.pass_context
def redislock(ctx: click.Context, url: str | None, namespace: str | None, **_: Any) -> None:
    """Inspect and free celery-redislock locks (for operators in an incident).

    Read-only: status, locks, owners, waiters. Freeing: release (names what
    it frees, asks, refuses a live owner without --force) and reconcile
    (frees only dead owners). Nothing here SCANs the keyspace.
    """
    state = _state(ctx)
    state["app"] = getattr(ctx.obj, "app", None)
    state["url"] = url
    state["namespace"] = namespace


# ---------------------------------------------------------------- status


@redislock.command()
@_command_options
@click.pass_context
def status(ctx: click.Context, url: str | None, namespace: str | None, as_json: bool) -> None:
    """Summary: owners alive/dead, registered locks, eviction policy, fence.

    The `limited` row counts the limited resources held or waited for, the
    slots their holders take and the requests queued for one.
    """
    insp = _inspector(ctx, url, namespace)

    def run() -> None:
        st = insp.status()
        if as_json:
            _emit_json(st.as_dict())
            return
        rows = [
            ("namespace", st.namespace),
            ("redis", f"{st.url} (version {st.redis_version or '?'})"),
            (
                "format",
                f"{st.format_version if st.format_version is not None else '-'} "
                f"(this release: {st.release_format})",
            ),
            ("eviction", st.eviction_note),
            ("fence", str(st.fence) if st.fence is not None else "- (nothing acquired yet)"),
            (
                "owners",
                f"{st.owners} ({st.alive_owners} alive, {st.dead_owners} dead; "
                f"{st.holding_owners} holding locks, {st.waiting_only_owners} only waiting)",
            ),
            (
                "locks",
                f"{st.registered_locks} registered ({st.dead_owner_locks} by dead owners)",
            ),
            (
                "waiting",
                f"{st.waiting_requests} request(s) queued"
                + (
                    f"; most for {st.busiest_resource} ({st.busiest_waiting}): "
                    f"`redislock waiters {st.busiest_resource}`"
                    if st.busiest_resource is not None
                    else ""
                ),
            ),
            (
                "limited",
                f"{st.limited_resources} resource(s), {st.limited_slots} slot(s) held, "
                f"{st.limited_waiting} request(s) queued",
            ),
        ]
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            click.echo(f"{k.ljust(width)}  {v}")
        for w in st.warnings:
            click.echo(f"WARNING: {w}")

    _guard(run)


# ---------------------------------------------------------------- locks


def _slot_mode(info: LockInfo, h: Holder) -> str:
    """MODE of a holder: a slot of a limited resource shows the slots held
    and the limit (``limited 3/5``; ``limited 4/3 (limits 3,5)`` while the
    holders asked for different limits)."""
    if info.slots is None or h.limit is None:
        return h.mode
    mixed = f" (limits {','.join(map(str, info.limits))})" if len(info.limits) > 1 else ""
    return f"{h.mode} {info.slots}{mixed}"


def _holder_rows(infos: Sequence[LockInfo]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for info in infos:
        if info.odd_type:
            rows.append((info.resource, f"? ({info.odd_type} key)", "-", "-", "-", "-", "-", "-"))
            continue
        if not info.holders:
            rows.append((info.resource, "free", "-", "-", str(info.waiting), "-", "-", "-"))
            continue
        for h in info.holders:
            task = f"{h.task_name or '?'}[{h.task_id or '?'}]" if h.task_name or h.task_id else "-"
            rows.append(
                (
                    h.resource,
                    _slot_mode(info, h),
                    h.owner_id,
                    _life(h.alive, h.ttl),
                    str(info.waiting),
                    task,
                    h.node or "-",
                    h.description or "-",
                )
            )
    return rows


@redislock.command()
@click.argument("resources", nargs=-1)
@_command_options
@click.pass_context
def locks(
    ctx: click.Context,
    resources: tuple[str, ...],
    url: str | None,
    namespace: str | None,
    as_json: bool,
) -> None:
    """Who holds what: every registered lock, or the RESOURCES named.

    Walks the active-owners set and each owner's registry (SSCAN), never the
    keyspace. A lock whose owner is DEAD is freed by the next acquirer, by
    `reconcile`, or by `release --owner`. A slot of a limited resource
    shows as `limited 3/5` (slots held / the limit of the most recent
    grant; every limit its holders asked for while they differ).
    """
    insp = _inspector(ctx, url, namespace)

    def run() -> None:
        infos = insp.locks(list(resources) or None)
        if as_json:
            _emit_json([i.as_dict() for i in infos])
            return
        if not infos:
            click.echo("no locks held")
            return
        click.echo(
            _table(
                (
                    "RESOURCE",
                    "MODE",
                    "OWNER",
                    "OWNER STATE",
                    "WAITING",
                    "TASK",
                    "NODE",
                    "OWNER INFO",
                ),
                _holder_rows(infos),
            )
        )

    _guard(run)


# ---------------------------------------------------------------- owners


def _node(o: OwnerInfo) -> str:
    if not o.node:
        return "-"
    return f"{o.node} (evicted)" if o.tombstoned else o.node


@redislock.command()
@click.option(
    "--node",
    "nodes",
    multiple=True,
    help="Label the owners of this Celery node (e.g. celery@host; repeatable).",
)
@_command_options
@click.pass_context
def owners(
    ctx: click.Context,
    nodes: tuple[str, ...],
    url: str | None,
    namespace: str | None,
    as_json: bool,
) -> None:
    """The active-owners set: each owner's liveness, registry size and node.

    Dead owners come first. NODE is shown for the owners of each --node
    (read from its node record and incarnation group; "(evicted)" when a
    successor tombstoned that incarnation).
    """
    insp = _inspector(ctx, url, namespace)

    def run() -> None:
        infos = insp.owners(nodes=nodes)
        if as_json:
            _emit_json([o.as_dict() for o in infos])
            return
        if not infos:
            click.echo("no owners")
            return
        rows = [
            (
                o.owner_id,
                _life(o.alive, o.ttl),
                str(o.locks),
                _node(o),
                str(o.pid) if o.pid is not None else "-",
                o.host or "-",
            )
            for o in infos
        ]
        click.echo(_table(("OWNER", "STATE", "LOCKS", "NODE", "PID", "HOST"), rows))

    _guard(run)


# ---------------------------------------------------------------- waiters


@redislock.command()
@click.argument("resource", required=False)
@click.option(
    "--limit",
    type=click.IntRange(1, 100000),
    default=None,
    help="Most entries shown: queue entries of RESOURCE (default 1000), or "
    "resources without one (default 100).",
)
@_command_options
@click.pass_context
def waiters(
    ctx: click.Context,
    resource: str | None,
    limit: int | None,
    url: str | None,
    namespace: str | None,
    as_json: bool,
) -> None:
    """The wait queue of RESOURCE, in the order it will be served.

    Without RESOURCE: every resource somebody waits for, longest queue first.
    A request for a slot of a limited resource shows the limit it asked for.
    """
    insp = _inspector(ctx, url, namespace)
    if resource is None:
        _guard(lambda: _queue_lengths(insp, limit or 100, as_json))
        return

    def run() -> None:
        ws = insp.waiters(resource, limit=limit or 1000)
        if as_json:
            _emit_json([w.as_dict() for w in ws])
            return
        if not ws:
            click.echo(f"nobody waits for {resource}")
            return
        rows = [
            (
                str(w.position),
                w.mode
                + (f" (limit {w.limit})" if w.limit is not None else "")
                + (" (nested)" if w.nested else ""),
                w.owner_id,
                _life(w.alive, w.ttl),
                w.state,
                f"{w.task_name or '?'} {w.task_id}" if w.task_id else "-",
                w.token,
            )
            for w in ws
        ]
        click.echo(
            _table(("POS", "MODE", "OWNER", "OWNER STATE", "REQUEST", "TASK", "TOKEN"), rows)
        )

    _guard(run)


def _queue_lengths(insp: Inspector, limit: int, as_json: bool) -> None:
    """``waiters`` without a resource: the longest ``limit`` queues."""
    queues = insp.queue_lengths()
    shown = queues[:limit]
    if as_json:
        _emit_json([q.as_dict() for q in shown])
        return
    if not queues:
        click.echo("nobody waits")
        return
    click.echo(_table(("RESOURCE", "WAITING"), [(q.resource, str(q.waiting)) for q in shown]))
    if len(queues) > limit:
        click.echo(f"... and {len(queues) - limit} more resource(s) with waiters (--limit)")


# ---------------------------------------------------------------- release


def _describe_owner(o: OwnerInfo) -> str:
    bits = [_life(o.alive, o.ttl)]
    if o.node:
        bits.append(f"node {o.node}")
    if o.pid is not None:
        bits.append(f"pid {o.pid}")
    if o.host:
        bits.append(f"host {o.host}")
    return ", ".join(bits)


def _plan_text(plan: ReleasePlan, force: bool, *, dry_run: bool = False) -> str:
    lines = []
    total = sum(len(v) for v in plan.resources.values())
    verb = "would free" if dry_run else "will free"
    lines.append(
        f"This {verb} {total} lock(s) of {len(plan.owners)} owner(s) (every lock each owner holds):"
    )
    for o in plan.owners:
        names = plan.resources.get(o.owner_id, ())
        needs = " [LIVE: needs --force]" if o.alive and not force else ""
        lines.append(f"  owner {o.owner_id} ({_describe_owner(o)}): {len(names)} lock(s){needs}")
        for name in names:
            lines.append(f"    {name}")
    for h in plan.kept:
        lines.append(
            f"  left alone: {h.owner_id} holds {h.resource} ({h.mode}, "
            f"{_life(h.alive, h.ttl)}); --force would free it"
        )
    if force and plan.live_owners:
        lines.append(
            "WARNING: --force frees the locks of LIVE owners. If one of them is still "
            "running, it keeps working until its next heartbeat finds its liveness gone, "
            "and meanwhile another process may take the same locks. Only the fencing "
            "tokens, if your store checks them, stop its late writes."
        )
    elif dry_run and plan.live_owners:
        lines.append(
            f"{len(plan.live_owners)} owner(s) above are LIVE: without --force, release "
            "refuses them (and frees nothing); with --force it frees them too"
        )
    return "\n".join(lines)


def _refuse_live(live: Sequence[OwnerInfo] | Sequence[Holder], what: str) -> _Refused:
    who = "; ".join(
        f"{x.owner_id} ({_life(x.alive, x.ttl)}"
        + (f", {x.description}" if x.description else "")
        + ")"
        for x in live
    )
    return _Refused(
        f"refusing to free {what}: owner(s) still alive: {who}. A live owner's locks "
        "are in use: freeing them lets another process in while it still runs. If you "
        "are sure it is gone or wedged, re-run with --force (it fences itself at its next "
        "heartbeat; fencing tokens guard the store)."
    )


def _report_dict(r: CleanupReport) -> dict[str, Any]:
    return {
        "owner_id": r.owner_id,
        "status": r.status,
        "released": r.released,
        "skipped": [list(x) for x in r.skipped],
        "errors": [list(x) for x in r.errors],
        "remaining": r.remaining,
    }


@redislock.command()
@click.option("--owner", "owner_ids", multiple=True, help="Owner id to free (repeatable).")
@click.option("--resource", "resource", default=None, help="Free the holders of this resource.")
@click.option(
    "-f",
    "--force",
    is_flag=True,
    help="Also free LIVE owners (dangerous: they may still be writing).",
)
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Only show what would be freed, live owners included (marked): never refuses.",
)
@_command_options
@click.pass_context
def release(
    ctx: click.Context,
    owner_ids: tuple[str, ...],
    resource: str | None,
    force: bool,
    yes: bool,
    dry_run: bool,
    url: str | None,
    namespace: str | None,
    as_json: bool,
) -> None:
    """Free locks: every lock of --owner ID, or the holders of --resource NAME.

    Freeing is per owner (its whole registry), so --resource frees every
    lock of each owner holding NAME; the list is printed before asking.
    Dead owners (liveness key gone) are always safe to free. A live owner
    is refused unless --force: its liveness key is then deleted too, so that
    if it still runs its next heartbeat finds itself dead and marks its
    leases lost. --dry-run prints the whole plan, live owners marked as
    needing --force, and frees nothing. An --owner Redis knows nothing of
    is an error (exit 1).
    """
    if bool(owner_ids) == bool(resource):
        raise click.UsageError("give either --owner ID (one or more) or --resource NAME")
    for o in owner_ids:
        if not o or "|" in o:
            hint = f" (a holder token: its owner is {o.split('|', 1)[0]!r})" if "|" in o else ""
            raise click.UsageError(f"not an owner id: {o!r}{hint}")
    insp = _inspector(ctx, url, namespace)
    out = (lambda s: click.echo(s, err=True)) if as_json else click.echo

    def run() -> None:
        if owner_ids:
            plan: ReleasePlan | None = _owners_plan(insp, owner_ids, force, dry_run)
        else:
            assert resource is not None
            plan = _resource_plan(insp, resource, force, dry_run, as_json, out)
        if plan is not None:
            _free(insp, plan, force, yes, dry_run, as_json, out)

    _guard(run)


def _owners_plan(
    insp: Inspector, owner_ids: tuple[str, ...], force: bool, dry_run: bool
) -> ReleasePlan:
    """``release --owner``: the plan of those owners; refuses live ones
    unless --force (or a dry run) and owners Redis knows nothing of."""
    plans = [insp.plan_owner(o) for o in dict.fromkeys(owner_ids)]
    missing = [m for p in plans for m in p.missing]
    if missing:
        raise click.ClickException(
            f"no such owner in namespace {insp.keys.namespace!r}: "
            f"{', '.join(missing)} (no liveness key, no registered lock, not in the "
            "active-owners set; `redislock owners` lists the owners)"
        )
    plan = ReleasePlan(
        owners=tuple(o for p in plans for o in p.owners),
        resources={k: v for p in plans for k, v in p.resources.items()},
    )
    live = list(plan.live_owners)
    if live and not force and not dry_run:
        raise _refuse_live(live, "the locks of a live owner")
    return plan


def _resource_plan(
    insp: Inspector,
    resource: str,
    force: bool,
    dry_run: bool,
    as_json: bool,
    out: Callable[[str], None],
) -> ReleasePlan | None:
    """``release --resource``: the plan of its holders (None: nothing held,
    already reported); refuses live holders unless --force or a dry run."""
    # A dry run plans every holder (the live ones marked): it never refuses.
    plan = insp.plan_resource(resource, force=force or dry_run)
    if not plan.owners and not plan.kept:
        _finish(
            as_json, out, plan, [], f"{resource} has no holders: nothing to free", dry_run=dry_run
        )
        return None
    if not plan.owners:
        raise _refuse_live(plan.kept, resource)
    if plan.live_owners and not force and not dry_run:
        raise _refuse_live(plan.live_owners, resource)
    return plan


def _free(
    insp: Inspector,
    plan: ReleasePlan,
    force: bool,
    yes: bool,
    dry_run: bool,
    as_json: bool,
    out: Callable[[str], None],
) -> None:
    """Print the plan, ask, free each owner of it (one cleanup each), report."""
    if not any(plan.resources.values()) and not plan.live_owners:
        _finish(
            as_json, out, plan, [], "nothing to free: the owner(s) hold no locks", dry_run=dry_run
        )
        return
    out(_plan_text(plan, force, dry_run=dry_run))
    if dry_run:
        _finish(as_json, out, plan, [], "dry run: nothing freed", dry_run=True, force=force)
        return
    if not yes:
        click.confirm("Free these locks?", abort=True, err=True)
    reports = []
    for o in plan.owners:
        rep = insp.manager.cleanup_owner(o.owner_id, force=force, reason="operator")
        log.info(
            "cli.release owner=%s force=%s status=%s released=%d",
            o.owner_id,
            force,
            rep.status,
            rep.released,
        )
        reports.append(rep)
    _finish(as_json, out, plan, reports, None)


def _finish(
    as_json: bool,
    out: Callable[[str], None],
    plan: ReleasePlan,
    reports: Sequence[CleanupReport],
    message: str | None,
    *,
    dry_run: bool = False,
    force: bool = False,
) -> None:
    bad = [r for r in reports if r.status != "cleaned"]
    if as_json:
        _emit_json(
            {
                "dry_run": dry_run,
                "needs_force": [] if force else [o.owner_id for o in plan.live_owners],
                "plan": plan.as_dict(),
                "results": [_report_dict(r) for r in reports],
                "released": sum(r.released for r in reports),
                "ok": not bad,
            }
        )
    else:
        if message:
            out(message)
        for r in reports:
            line = f"owner {r.owner_id}: {r.status}, {r.released} grant(s) released"
            if r.status == "alive":
                line += " (became alive? nothing freed; re-run to see its state)"
            out(line)
            for key, kind in r.skipped:
                out(f"  kept {key}: unexpected type {kind} (inspect it by hand)")
            for key, msg in r.errors:
                out(f"  failed {key}: {msg} (re-run to retry)")
    if bad:
        raise click.exceptions.Exit(1)


# ---------------------------------------------------------------- reconcile


@redislock.command()
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--dry-run", is_flag=True, help="Only list the dead owners and their locks.")
@click.option("--batch-size", type=click.IntRange(1, 10000), default=500, show_default=True)
@_command_options
@click.pass_context
def reconcile(
    ctx: click.Context,
    yes: bool,
    dry_run: bool,
    batch_size: int,
    url: str | None,
    namespace: str | None,
    as_json: bool,
) -> None:
    """Free the locks of every dead owner now (what the beat task does).

    Only owners whose liveness key is gone are touched, so this is safe
    while workers run. Lists the dead owners first and asks unless --yes;
    an owner that dies meanwhile is freed too.
    """
    insp = _inspector(ctx, url, namespace)
    out = (lambda s: click.echo(s, err=True)) if as_json else click.echo

    def run() -> None:
        dead = [o for o in insp.owners() if not o.alive]
        regs = insp.registries([o.owner_id for o in dead]) if dead else {}
        plan = ReleasePlan(
            owners=tuple(dead),
            resources={o: tuple(insp.resource_of(k) for k in keys) for o, keys in regs.items()},
        )
        if not dead:
            out("no dead owners: nothing to reconcile")
        else:
            out(_plan_text(plan, force=False))
        if dry_run:
            if as_json:
                _emit_json({"dry_run": True, "plan": plan.as_dict()})
            return
        if dead and not yes:
            click.confirm("Free the locks of these dead owners?", abort=True, err=True)
        report = insp.manager.reconcile(batch_size=batch_size)
        if as_json:
            data = report.as_dict()
            data["dry_run"] = False
            data["results"] = [_report_dict(r) for r in report.reports]
            _emit_json(data)
        else:
            out(
                f"reconcile: {report.owners_seen} owner(s) seen, {report.alive} alive, "
                f"{report.cleaned} cleaned, {report.partial} partial, "
                f"{report.released} grant(s) released, {len(report.errors)} error(s)"
            )
            for owner, err in report.errors.items():
                out(f"  owner {owner}: {err} (retried on the next pass)")
            for r in report.reports:
                for key, kind in r.skipped:
                    out(f"  kept {key} of {r.owner_id}: unexpected type {kind}")
        if report.partial or report.errors:
            raise click.exceptions.Exit(1)

    _guard(run)


# ---------------------------------------------------------------- format


@redislock.command(name="format")
@click.option(
    "--switch",
    is_flag=True,
    help="Record this release's format (only once no owner of the old one is left).",
)
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@_command_options
@click.pass_context
def format_(
    ctx: click.Context,
    switch: bool,
    yes: bool,
    url: str | None,
    namespace: str | None,
    as_json: bool,
) -> None:
    """The namespace's data-format version; --switch moves it to this release's.

    Workers, beat and the CLI refuse a namespace whose lock data has another
    format than theirs. After draining every process of the old release
    (its workers stopped, its `redislock reconcile` run: the active-owners
    set is empty), --switch records this release's format so that its
    workers may start. It refuses while any owner is left.
    """
    mgr = _manager(ctx, url, namespace)

    def run() -> None:
        info, found, unversioned = _format_info(mgr)
        if not switch:
            if as_json:
                _emit_json(info)
                return
            _print_format(mgr, found, unversioned)
            return
        _switch_format(mgr, found, unversioned, info["owners"], yes)

    _guard(run)


def _format_info(mgr: LockManager) -> tuple[dict[str, Any], str | None, bool]:
    """What ``redislock format`` reports (one round trip), the stored format
    (``UNVERSIONED_FORMAT`` for data from before versioning, None if never
    used) and whether it is unversioned."""
    pipe = mgr.client.pipeline(transaction=False)
    pipe.get(mgr.keys.format)
    pipe.exists(mgr.keys.fence)
    pipe.scard(mgr.keys.owners)
    stored, fenced, owners = pipe.execute()
    found = text(stored) if stored is not None else None
    unversioned = found is None and bool(fenced)
    if unversioned:
        found = str(UNVERSIONED_FORMAT)
    info = {
        "namespace": mgr.namespace,
        "format": int(found) if found is not None and found.isdigit() else found,
        "unversioned": unversioned,
        "release_format": FORMAT_VERSION,
        "owners": int(owners),
    }
    return info, found, unversioned


def _print_format(mgr: LockManager, found: str | None, unversioned: bool) -> None:
    """``redislock format`` without --switch, as text."""
    shown = "- (never used)" if found is None else found
    if unversioned:
        shown += " (data from before format versioning)"
    click.echo(f"namespace       {mgr.namespace}")
    click.echo(f"format          {shown}")
    click.echo(f"this release    {FORMAT_VERSION}")
    if found is not None and found != str(FORMAT_VERSION):
        click.echo(
            "MISMATCH: this release refuses the namespace; see `redislock format "
            "--help` and docs/operations.md, 'Upgrading across a data-format change'"
        )


def _switch_format(
    mgr: LockManager, found: str | None, unversioned: bool, owners: int, yes: bool
) -> None:
    """``redislock format --switch``: refuses while ``owners`` are left, asks
    unless ``yes``, then records this release's format."""
    if found == str(FORMAT_VERSION) and not unversioned:
        click.echo(f"namespace {mgr.namespace!r} already has format {FORMAT_VERSION}")
        return
    if owners:
        raise _Refused(
            f"refusing to switch namespace {mgr.namespace!r} from format {found} to "
            f"{FORMAT_VERSION}: {owners} owner(s) of the old release are left. Stop "
            "its workers (warm shutdown frees their locks), run its `redislock reconcile` "
            "for the dead ones, wait until `redislock owners` (old release) lists none, "
            "then retry; or use a new namespace"
        )
    if not yes:
        click.confirm(
            f"Switch namespace {mgr.namespace!r} from format {found or '-'} to "
            f"{FORMAT_VERSION}? Workers of the old release will refuse it afterwards",
            abort=True,
            err=True,
        )
    mgr.client.set(mgr.keys.format, str(FORMAT_VERSION))
    log.info("cli.format-switch namespace=%s from=%s to=%d", mgr.namespace, found, FORMAT_VERSION)
    click.echo(f"namespace {mgr.namespace!r} now has format {FORMAT_VERSION}")


#: Help of --url / --namespace for the standalone entry, which has no app
#: settings to default from.
_STANDALONE_HELP = {
    "url": "Redis URL of the locks (required here; or set REDISLOCK_URL).",
    "namespace": "Lock namespace (default: 'redislock'; or set REDISLOCK_NAMESPACE).",
}


def _standalone_help(group: click.Group) -> None:
    """Describe --url/--namespace without the app-only defaults."""
    for cmd in [group, *group.commands.values()]:
        for param in cmd.params:
            if isinstance(param, click.Option) and param.name in _STANDALONE_HELP:
                param.help = _STANDALONE_HELP[param.name]


def main(argv: Sequence[str] | None = None) -> None:
    """Standalone entry (``python -m celery_redislock``): no Celery app needed."""
    _standalone_help(redislock)
    redislock.main(
        args=list(argv) if argv is not None else None, prog_name="python -m celery_redislock"
    )


__all__ = ["main", "redact_url", "redislock", "resolve_connection"]
