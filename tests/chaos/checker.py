"""Reads a run's timelines and reports invariant violations with a trace.

Inputs (all in the run's folder): ``run.json`` (config, ``t0``),
``faults.jsonl``, ``timelines/*.jsonl`` (:mod:`chaos.worker`) and
``audit.json`` (keys left in the lock namespace, the store's final state).
Every time is ``time.monotonic()``, one clock for every process of the
machine; traces show it as seconds since the run started (``+12.345``).

Each check is written to have no false positives (docs/chaos.md says why
each is sound); what cannot be proven from the timelines is not reported:

``overlap``
    Two sections on one resource, at least one exclusive, overlap in time
    (from the moment one's first ``check()`` returned to the moment its
    second was called), both ``check()`` calls of both passed, and both
    leases were released with ``lost == False``: Redis recorded two
    incompatible grants and neither holder ever learned it.
``stale_check``
    A lease's ``check()`` passed although a conflicting lease with a higher
    fence had already been granted and told so (its own first check
    returned before this check was called). Excused only within owner_ttl
    after a restart of the lock server or a forced cleanup of this owner
    that happened since this acquire began (state lost in a way no holder
    sees at once; the heartbeat and the local deadline tell it within
    owner_ttl). The holder would have written believing it held the lock.
``fence_backwards``
    A grant whose acquire began after another grant had returned got a
    fence that is not larger.
``stale_write_accepted``
    The store accepted a write whose fence passed but whose read was stale
    (a lost update let through by the fence rule), or a resource's counter
    differs from its number of accepted writes.
``waiter_stalled``
    An acquire timed out although, for longer than ``2 x owner_ttl + 1 s``
    within its wait, no other request touched any of its resources (no
    holder, no waiter, not even one that ended in an error) and no fault
    or error of any kind happened within owner_ttl before or during it.
``waiter_error``
    An acquire with a timeout (a waiter) raised an error although no
    restart of the lock server was under way (within 0.2 s before to 1 s
    after one): a killed connection or a stalled server (shorter than the
    clients' socket timeout) must not end a wait early.
``leftover_key``
    After every process exited and the final reconcile ran, a key of the
    lock namespace other than ``fence``/``seq``/``format``, or a key of a TTL'd kind
    (req, wake, contend, lost) without a TTL, is still there.
"""

from __future__ import annotations

import bisect
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Most violations of one kind given a full trace (the rest are counted).
MAX_TRACES = 5


@dataclass
class Op:
    """One acquire and what followed it, from one timeline."""

    op: str
    proc: str
    th: str
    x: list[str]
    s: list[str]
    timeout: float
    t_acq: float
    outcome: str = "open"  # granted | timeout | error | open
    t_end: float | None = None
    fence: int | None = None
    owner: str | None = None
    t_granted: float | None = None
    cb_ok: bool | None = None
    cb_tc: float | None = None
    cb_t: float | None = None
    ce_ok: bool | None = None
    ce_tc: float | None = None
    release: str | None = None  # released | release_error
    lost: bool | None = None
    t_rel: float | None = None
    store: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: The process's owner id when the acquire began (a lost owner is replaced
    #: during the acquire: ``owner`` is the one granted).
    acq_owner: str | None = None

    @property
    def resources(self) -> list[str]:
        return self.x + self.s

    def mode(self, res: str) -> str:
        return "x" if res in self.x else "s"

    @property
    def clean_section(self) -> bool:
        """Both checks passed and the lease was released not lost."""
        return bool(self.cb_ok and self.ce_ok and self.release == "released" and self.lost is False)


@dataclass
class Violation:
    kind: str
    summary: str
    trace: list[str]
    #: The operations involved (to drop a stale_check an overlap already shows).
    ops: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "summary": self.summary, "trace": self.trace, "ops": self.ops}

    def render(self) -> str:
        return "\n".join(
            [f"VIOLATION {self.kind}: {self.summary}", *("    " + t for t in self.trace)]
        )


@dataclass
class Report:
    stats: dict[str, Any]
    violations: list[Violation]


@dataclass
class Run:
    config: dict[str, Any]
    t0: float
    ops: list[Op]
    faults: list[dict[str, Any]]
    errors: list[tuple[float, str, str]]  # (t, proc, what)
    events: dict[str, int]
    kills: dict[str, float]
    audit: dict[str, Any]
    calm_s: float = 0.0

    def rel(self, t: float | None) -> str:
        return "?" if t is None else f"+{t - self.t0:.3f}"

    def fmt_op(self, o: Op) -> str:
        parts = [
            f"{o.op} [{o.proc}/{o.th}] x={o.x} s={o.s} timeout={o.timeout}: acq {self.rel(o.t_acq)}"
        ]
        if o.outcome == "granted":
            parts.append(f"granted {self.rel(o.t_granted)} fence={o.fence} owner={o.owner}")
            if o.cb_ok is not None:
                parts.append(f"check {'ok' if o.cb_ok else 'LOST'} {self.rel(o.cb_tc)}")
            for st in o.store:
                parts.append(
                    f"store {st['kind']} {st['res']} {'ok' if st['ok'] else 'REFUSED'} "
                    f"{self.rel(st['t'])}"
                )
            if o.ce_ok is not None:
                parts.append(f"check {'ok' if o.ce_ok else 'LOST'} {self.rel(o.ce_tc)}")
            if o.release:
                parts.append(f"{o.release} {self.rel(o.t_rel)} lost={o.lost}")
        elif o.outcome in ("timeout", "error"):
            parts.append(f"{o.outcome} {self.rel(o.t_end)}")
        if o.proc in self.kills and (o.t_end is None or o.t_end >= self.kills[o.proc]):
            parts.append(f"process killed {self.rel(self.kills[o.proc])}")
        parts += [f"error {e}" for e in o.errors]
        return "; ".join(parts)

    def faults_between(self, lo: float, hi: float) -> list[str]:
        out = []
        for f in self.faults:
            if f["t1"] >= lo and f["t0"] <= hi:
                extra = {k: v for k, v in f.items() if k not in ("kind", "t0", "t1")}
                span = "" if f["t1"] == f["t0"] else f"..{self.rel(f['t1'])}"
                out.append(f"fault {self.rel(f['t0'])}{span} {f['kind']} {extra}")
        return out


def load(folder: Path) -> Run:
    meta = json.loads((folder / "run.json").read_text())
    faults: list[dict[str, Any]] = []
    fpath = folder / "faults.jsonl"
    if fpath.exists():
        faults = [json.loads(line) for line in fpath.read_text().splitlines() if line.strip()]
    calm = sum(f["t1"] - f["t0"] for f in faults if f["kind"] == "calm")
    faults = [f for f in faults if f["kind"] != "calm"]  # a calm is the absence of faults
    faults.sort(key=lambda f: f["t0"])
    kills = {
        f["target"]: f["t0"]
        for f in faults
        if f["kind"] in ("kill_worker", "drain_kill", "end_kill")
    }
    ops: dict[str, Op] = {}
    errors: list[tuple[float, str, str]] = []
    events: Counter[str] = Counter()
    for path in sorted((folder / "timelines").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a line cut short by SIGKILL
            ev = e["ev"]
            events[ev] += 1
            if ev == "acq":
                ops[e["op"]] = Op(e["op"], e["p"], e["th"], e["x"], e["s"], e["timeout"], e["t"])
                ops[e["op"]].acq_owner = e.get("owner")
                continue
            if ev in ("reconcile_error",):
                errors.append((e["t"], e["p"], f"{ev} {e.get('err')}"))
            o = ops.get(e.get("op", ""))
            if o is None:
                continue
            o.t_end = e["t"]
            if ev == "granted":
                o.outcome, o.fence, o.owner, o.t_granted = "granted", e["fence"], e["owner"], e["t"]
            elif ev == "timeout":
                o.outcome = "timeout"
            elif ev == "acq_error":
                o.outcome = "error"
                o.errors.append(e["err"])
                errors.append((e["t"], e["p"], f"acq_error {e['err']}"))
            elif ev == "cs_begin":
                o.cb_ok, o.cb_tc, o.cb_t = e["ok"], e["tc"], e["t"]
            elif ev == "cs_end":
                o.ce_ok, o.ce_tc = e["ok"], e["tc"]
            elif ev == "store":
                o.store.append(e)
            elif ev == "store_error":
                o.errors.append(e["err"])
                errors.append((e["t"], e["p"], f"store_error {e['err']}"))
            elif ev in ("released", "release_error"):
                o.release, o.lost, o.t_rel = ev, e["lost"], e["t"]
                if ev == "release_error":
                    o.errors.append(e["err"])
                    errors.append((e["t"], e["p"], f"release_error {e['err']}"))
    for o in ops.values():
        killed = kills.get(o.proc)
        # Whatever a killed process held or waited for, it did so until killed.
        if killed is not None and o.release is None and o.outcome in ("open", "granted"):
            o.t_end = killed
    audit_path = folder / "audit.json"
    audit = json.loads(audit_path.read_text()) if audit_path.exists() else {}
    return Run(meta["config"], meta["t0"], list(ops.values()), faults, sorted(errors),
               dict(events), kills, audit, calm)  # fmt: skip


def _conflict(a: Op, b: Op, res: str) -> bool:
    return a.mode(res) == "x" or b.mode(res) == "x"


def check_overlap(run: Run) -> list[Violation]:
    by_res: dict[str, list[Op]] = defaultdict(list)
    for o in run.ops:
        if o.clean_section:
            for r in o.resources:
                by_res[r].append(o)
    found: dict[tuple[str, str], tuple[str, Op, Op]] = {}
    for res, secs in by_res.items():
        secs.sort(key=lambda o: o.cb_t or 0.0)
        active: list[Op] = []
        for o in secs:
            assert o.cb_t is not None
            active = [a for a in active if (a.ce_tc or 0.0) > o.cb_t]
            for a in active:
                if _conflict(a, o, res) and min(a.ce_tc or 0, o.ce_tc or 0) > o.cb_t:
                    found.setdefault((a.op, o.op), (res, a, o))
            active.append(o)
    out = []
    for res, a, b in found.values():
        lo, hi = min(a.t_acq, b.t_acq), max(a.t_rel or 0, b.t_rel or 0)
        out.append(
            Violation(
                "overlap",
                f"{a.op} ({a.mode(res)}) and {b.op} ({b.mode(res)}) both held {res} "
                f"from {run.rel(max(a.cb_t or 0, b.cb_t or 0))} to "
                f"{run.rel(min(a.ce_tc or 0, b.ce_tc or 0))}; every check passed, neither "
                "lease lost",
                [run.fmt_op(a), run.fmt_op(b), *run.faults_between(lo - 1, hi + 1)],
                (a.op, b.op),
            )
        )
    return out


def _excused(run: Run, o: Op, tc: float) -> bool:
    """Whether a check at ``tc`` may pass though superseded: the lock state was
    lost in a way no holder sees at once (a lock-server restart, or a forced
    cleanup of this owner) after this acquire began and at most owner_ttl
    before ``tc``. Its next heartbeat (every owner_ttl / 3) finds its liveness
    gone, and its local deadline (last successful refresh + owner_ttl) bounds
    the wait even when heartbeats fail, so a check later than that is stale."""
    ttl = float(run.config["owner_ttl"])
    for f in run.faults:
        if f["t1"] < o.t_acq or f["t0"] > tc or tc > f["t1"] + ttl:
            continue
        if f["kind"] == "redis_restart":
            return True
        if f["kind"] == "force_cleanup" and f.get("owner") in (o.owner, o.acq_owner):
            return True
    return False


def check_stale_check(run: Run) -> list[Violation]:
    granted = [o for o in run.ops if o.fence is not None and o.cb_ok]
    by_res: dict[str, list[Op]] = defaultdict(list)
    for o in granted:
        for r in o.resources:
            by_res[r].append(o)
    for secs in by_res.values():
        secs.sort(key=lambda o: o.fence or 0)
    out = []
    seen: set[str] = set()
    for res, secs in by_res.items():
        fences = [o.fence or 0 for o in secs]
        for L in secs:
            if L.op in seen:
                continue
            checks = [(L.cb_tc, "first")]
            if L.ce_ok:
                checks.append((L.ce_tc, "second"))
            horizon = max(t or 0.0 for t, _ in checks)
            j = bisect.bisect_right(fences, L.fence or 0)
            hit = None
            while j < len(secs) and hit is None:
                M = secs[j]
                j += 1
                if M.t_acq > horizon:
                    # M and every higher fence were granted after M's acquire began,
                    # so after L's last check: none can have been told before it.
                    break
                if (M.t_granted or 0) > horizon:
                    continue  # returned after L's last check (a paused grantee)
                if M.op == L.op or not _conflict(L, M, res) or M.cb_t is None:
                    continue
                for tc, which in checks:
                    if tc is not None and M.cb_t < tc and not _excused(run, L, tc):
                        hit = (M, tc, which)
                        break
            if hit is None:
                continue
            M, tc, which = hit
            seen.add(L.op)
            out.append(
                Violation(
                    "stale_check",
                    f"{L.op}'s {which} check() passed at {run.rel(tc)} although {M.op} "
                    f"(fence {M.fence} > {L.fence}) held {res} ({M.mode(res)}) since "
                    f"{run.rel(M.cb_t)}",
                    [run.fmt_op(L), run.fmt_op(M), *run.faults_between(L.t_acq - 1, tc + 0.5)],
                    (L.op, M.op),
                )
            )
    return out


def check_fence_backwards(run: Run) -> list[Violation]:
    grants = sorted((o for o in run.ops if o.fence is not None), key=lambda o: o.t_granted or 0)
    starts = sorted((o for o in run.ops if o.fence is not None), key=lambda o: o.t_acq)
    out = []
    best: Op | None = None
    i = 0
    for g in starts:
        while i < len(grants) and (grants[i].t_granted or 0) < g.t_acq:
            h = grants[i]
            if best is None or (h.fence or 0) > (best.fence or 0):
                best = h
            i += 1
        if best is not None and (best.fence or 0) >= (g.fence or 0):
            out.append(
                Violation(
                    "fence_backwards",
                    f"{g.op} began at {run.rel(g.t_acq)}, after {best.op} was granted fence "
                    f"{best.fence} at {run.rel(best.t_granted)}, but got fence {g.fence}",
                    [
                        run.fmt_op(best),
                        run.fmt_op(g),
                        *run.faults_between(best.t_granted or 0, g.t_granted or 0),
                    ],
                )  # fmt: skip
            )
    return out


def check_store(run: Run) -> list[Violation]:
    out = []
    by_op = {o.op: o for o in run.ops}
    for raw in run.audit.get("anomalies", []):
        a = json.loads(raw)
        o = by_op.get(a["op"])
        out.append(
            Violation(
                "stale_write_accepted",
                f"store accepted {a['op']}'s write of {a['res']} with fence {a['fence']}, "
                f"but it had read {a['expected']} and the value was {a['found']} (lost update)",
                [run.fmt_op(o)] if o else [],
            )
        )
    for res, h in sorted(run.audit.get("store", {}).items()):
        if h and int(h.get("v", 0)) != int(h.get("writes", 0)):
            out.append(
                Violation(
                    "stale_write_accepted",
                    f"store counter of {res} is {h.get('v')} after {h.get('writes')} accepted "
                    "writes (updates were lost)",
                    [],
                )
            )
    return out


def check_waiter_stalled(run: Run) -> list[Violation]:
    ttl = float(run.config["owner_ttl"])
    need = 2 * ttl + 1.0
    # Busy intervals per resource: every request touching it, from acquire to end.
    by_res: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for o in run.ops:
        end = o.t_end if o.t_end is not None else float("inf")
        if o.outcome == "open" and o.proc not in run.kills:
            end = float("inf")
        for r in o.resources:
            by_res[r].append((o.t_acq, end, o.op))
    for lst in by_res.values():
        lst.sort()
    starts = {r: [b[0] for b in lst] for r, lst in by_res.items()}
    longest = max((b[1] - b[0] for lst in by_res.values() for b in lst if b[1] != float("inf")),
                  default=0.0)  # fmt: skip
    # Fault windows: each fault and each error, plus owner_ttl to settle.
    blackout = [(f["t0"], f["t1"] + ttl, f["kind"]) for f in run.faults]
    blackout += [(t, t + ttl, what) for t, _p, what in run.errors]
    out = []
    for w in run.ops:
        if w.outcome != "timeout" or w.t_end is None or w.t_end - w.t_acq < need:
            continue
        blocks: list[tuple[float, float, str]] = []
        for r in w.resources:
            lst = by_res[r]
            hi = bisect.bisect_right(starts[r], w.t_end)
            lo = bisect.bisect_left(starts[r], w.t_acq - longest)
            for b in lst[lo:hi]:
                if b[2] != w.op and b[1] > w.t_acq:
                    blocks.append(b)
            for b in lst[:lo]:
                if b[1] == float("inf"):
                    blocks.append(b)
        blocks += [b for b in blackout if b[1] > w.t_acq and b[0] < w.t_end]
        blocks.sort()
        cursor, gap, gap_at, prev = w.t_acq, 0.0, w.t_acq, None
        last_before = None
        for b in blocks + [(w.t_end, w.t_end, "end")]:
            if b[0] - cursor > gap:
                gap, gap_at, last_before = b[0] - cursor, cursor, prev
            if b[1] > cursor:
                cursor, prev = b[1], b
        if gap <= need:
            continue
        trace = [run.fmt_op(w)]
        if last_before is not None:
            trace.append(f"last request or fault before the free window: {last_before[2]} "
                         f"{run.rel(last_before[0])}..{run.rel(last_before[1])}")  # fmt: skip
        trace += run.faults_between(w.t_acq - ttl, w.t_end)
        out.append(
            Violation(
                "waiter_stalled",
                f"{w.op} timed out at {run.rel(w.t_end)} although {w.resources} were free "
                f"(no holder, no other request, no fault) from {run.rel(gap_at)} for "
                f"{gap:.2f}s (> 2 x owner_ttl + 1 = {need:.1f}s)",
                trace,
            )
        )
    return out


def check_waiter_error(run: Run) -> list[Violation]:
    """Waiters that raised although the lock server never went away."""
    restarts = [(f["t0"] - 0.2, f["t1"] + 1.0) for f in run.faults if f["kind"] == "redis_restart"]
    out = []
    for o in run.ops:
        if o.outcome != "error" or not o.timeout or o.t_end is None:
            continue
        if any(lo <= o.t_end and o.t_acq <= hi for lo, hi in restarts):
            continue
        out.append(
            Violation(
                "waiter_error",
                f"{o.op} (timeout {o.timeout}) raised at {run.rel(o.t_end)} though the lock "
                f"server kept running: {o.errors[0] if o.errors else '?'}",
                [run.fmt_op(o), *run.faults_between(o.t_acq - 0.5, o.t_end)],
                (o.op,),
            )
        )
    return out


def check_leftover(run: Run) -> list[Violation]:
    bad = [k for k in run.audit.get("keys", []) if not k.get("allowed")]
    if not bad:
        return []
    lines = [
        f"{k['key']} type={k['type']} pttl={k['pttl']} members={k.get('members')}" for k in bad
    ]
    # Who left them: the last requests of the owners named in queue entries
    # (``<mode><owner>|<request id>``) or registries, on the same resource.
    owners: dict[str, set[str]] = defaultdict(set)
    for k in bad:
        res = k["key"].split(":", 2)[-1] if ":q:" in k["key"] else None
        members = k.get("members") or []
        for m in members if isinstance(members, list) else list(members):
            owner = str(m).split("|", 1)[0].lstrip("xs")
            owners[owner].add(res or "")
    procs: dict[str, set[str]] = defaultdict(set)  # process -> resources
    for o in run.ops:
        for who in (o.acq_owner, o.owner):
            if who in owners:
                procs[o.proc] |= owners[who]
    suspects = [
        o
        for o in run.ops
        if o.proc in procs
        and (o.outcome in ("open", "error") or (o.outcome == "granted" and o.release is None))
        and (procs[o.proc] & (set(o.resources) | {""}))
    ]
    lines += ["left by " + run.fmt_op(o) for o in suspects[:10]]
    return [
        Violation(
            "leftover_key",
            f"{len(bad)} key(s) left in the lock namespace after every process exited and "
            "reconcile ran",
            lines[:20] + ([f"... and {len(lines) - 20} more"] if len(lines) > 20 else []),
        )
    ]


CHECKS = (
    check_overlap,
    check_stale_check,
    check_fence_backwards,
    check_store,
    check_waiter_stalled,
    check_waiter_error,
    check_leftover,
)


def _error_kind(what: str) -> str:
    """``acq_error RedisUnavailable('redis://...', 'Connection closed by server.')``
    -> ``acq_error RedisUnavailable: Connection closed by server.``"""
    event, _, err = what.partition(" ")
    name = err.split("(", 1)[0]
    detail = err.rsplit(", ", 1)[-1].strip("')\"") if ", " in err else err[len(name) :].strip("()'")
    detail = re.sub(r"\d+\.\d+\.\d+\.\d+:\d+", "<addr>", detail)
    return f"{event} {name}: {detail}"


def stats_of(run: Run, violations: list[Violation]) -> dict[str, Any]:
    ops = run.ops
    store_events = [st for o in ops for st in o.store]
    return {
        "seed": run.config.get("seed"),
        "duration_s": run.config.get("duration"),
        "processes_started": len({o.proc for o in ops} | set(run.kills)),
        "acquires": len(ops),
        "granted": sum(o.outcome == "granted" for o in ops),
        "timeouts": sum(o.outcome == "timeout" for o in ops),
        "acquire_errors": sum(o.outcome == "error" for o in ops),
        "sections": sum(o.cb_ok is not None for o in ops),
        "sections_check_lost": sum(o.cb_ok is False or o.ce_ok is False for o in ops),
        "released_lost": sum(bool(o.release and o.lost) for o in ops),
        "release_errors": sum(o.release == "release_error" for o in ops),
        "store_writes_accepted": sum(st["kind"] == "write" and st["ok"] for st in store_events),
        "store_refused": sum(not st["ok"] for st in store_events),
        "reconciles": run.events.get("reconcile", 0),
        "errors": dict(Counter(_error_kind(what) for _t, _p, what in run.errors)),
        "faults": dict(Counter(f["kind"] for f in run.faults)),
        "calm_s": round(run.calm_s, 1),
        "violations": dict(Counter(v.kind for v in violations)),
    }


def check(folder: str | Path) -> Report:
    run = load(Path(folder))
    violations: list[Violation] = []
    for fn in CHECKS:
        violations += fn(run)
    # An overlap is also a stale check of each side: report it once.
    overlaps = {frozenset(v.ops) for v in violations if v.kind == "overlap"}
    violations = [
        v for v in violations if not (v.kind == "stale_check" and frozenset(v.ops) in overlaps)
    ]
    return Report(stats_of(run, violations), violations)


def render(report: Report, limit: int = MAX_TRACES) -> str:
    """Violations, at most ``limit`` traces per kind, then a count of the rest."""
    lines: list[str] = []
    shown: Counter[str] = Counter()
    for v in report.violations:
        shown[v.kind] += 1
        if shown[v.kind] <= limit:
            lines.append(v.render())
    for kind, n in shown.items():
        if n > limit:
            lines.append(f"... {n - limit} more {kind} violation(s) (summary.json lists all)")
    return "\n".join(lines)
