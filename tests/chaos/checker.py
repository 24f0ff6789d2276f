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
``over_limit``
    More sections of a limited resource than the largest limit among them
    (N + 1 with one limit) overlap at one moment, each measured as for
    ``overlap`` (first ``check()`` returned to second called), every one
    with both checks passed and released with ``lost == False``: Redis
    recorded more slots than the limit and no holder ever learned it.
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
import heapq
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
    #: Limited resources (one slot each) -> the limit asked for.
    l: dict[str, int] = field(default_factory=dict)  # noqa: E741

    @property
    def resources(self) -> list[str]:
        return self.x + self.s + list(self.l)

    def mode(self, res: str) -> str:
        """``x``, ``s`` or ``l`` (one slot of a limited resource)."""
        return "x" if res in self.x else "l" if res in self.l else "s"

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


class _Timed:
    """A run's clock (``t0``) and fault log, for the reports of :class:`Run`
    and :class:`CeleryRun`."""

    t0: float
    faults: list[dict[str, Any]]

    def rel(self, t: float | None) -> str:
        return "?" if t is None else f"+{t - self.t0:.3f}"

    def faults_between(self, lo: float, hi: float) -> list[str]:
        out = []
        for f in self.faults:
            if f["t1"] >= lo and f["t0"] <= hi:
                extra = {k: v for k, v in f.items() if k not in ("kind", "t0", "t1")}
                span = "" if f["t1"] == f["t0"] else f"..{self.rel(f['t1'])}"
                out.append(f"fault {self.rel(f['t0'])}{span} {f['kind']} {extra}")
        return out


@dataclass
class Run(_Timed):
    config: dict[str, Any]
    t0: float
    ops: list[Op]
    faults: list[dict[str, Any]]
    errors: list[tuple[float, str, str]]  # (t, proc, what)
    events: dict[str, int]
    kills: dict[str, float]
    audit: dict[str, Any]
    calm_s: float = 0.0

    def fmt_op(self, o: Op) -> str:
        limited = f" l={o.l}" if o.l else ""
        parts = [
            f"{o.op} [{o.proc}/{o.th}] x={o.x} s={o.s}{limited} timeout={o.timeout}: "
            f"acq {self.rel(o.t_acq)}"
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
                ops[e["op"]].l = dict(e.get("l") or {})
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


def slot_sections(run: Run) -> dict[str, list[Op]]:
    """Limited resource -> its clean sections (both checks passed, released
    not lost), by the time their first check returned."""
    by_res: dict[str, list[Op]] = defaultdict(list)
    for o in run.ops:
        if o.clean_section and o.cb_t is not None and o.ce_tc is not None:
            for r in o.l:
                by_res[r].append(o)
    for secs in by_res.values():
        secs.sort(key=lambda o: o.cb_t or 0.0)
    return by_res


def most_at_once(secs: list[Op]) -> int:
    """Most of ``secs`` (sorted by ``cb_t``) inside their sections at one moment."""
    most = 0
    ends: list[float] = []  # a heap of the active sections' ends
    for o in secs:
        while ends and ends[0] <= (o.cb_t or 0.0):
            heapq.heappop(ends)
        heapq.heappush(ends, o.ce_tc or 0.0)
        most = max(most, len(ends))
    return most


def check_over_limit(run: Run) -> list[Violation]:
    """More clean sections of a limited resource at once than its limit.

    A section is measured as for ``overlap``: from when its first check()
    returned to when its second was called, both passed and its release did
    not find the lease lost. Each episode (a stretch during which the count
    stays above the limit) is reported once, with the sections of the moment
    the count first went above it. The limit is the largest any of those
    sections asked for (two limits for one resource may let the larger one
    hold: docs/design.md)."""
    out = []
    for res, secs in slot_sections(run).items():
        active: list[Op] = []
        over = False
        for o in secs:
            assert o.cb_t is not None
            active = [a for a in active if (a.ce_tc or 0.0) > o.cb_t]
            active.append(o)
            cap = max(a.l[res] for a in active)
            if len(active) <= cap:
                over = False
                continue
            if over:
                continue
            over = True
            lo = min(a.t_acq for a in active)
            hi = max(a.t_rel or 0.0 for a in active)
            out.append(
                Violation(
                    "over_limit",
                    f"{len(active)} sections held a slot of {res} (limit {cap}) at once from "
                    f"{run.rel(o.cb_t)} to {run.rel(min(a.ce_tc or 0.0 for a in active))}: "
                    f"{', '.join(a.op for a in active)}; every check passed, no lease lost",
                    [*(run.fmt_op(a) for a in active), *run.faults_between(lo - 1, hi + 1)],
                    tuple(a.op for a in active),
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
            owner = str(m).split("|", 1)[0]
            if ":q:" in k["key"]:
                owner = owner[1:]  # a queue entry: its mode letter, then the token
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
    check_over_limit,
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
        "slot_sections": sum(o.cb_ok is not None for o in ops if o.l),
        # An asyncio worker's coroutines are named A0, A1, ... (threads T0, ...).
        "asyncio_sections": sum(o.cb_ok is not None for o in ops if o.th.startswith("A")),
        "most_slots_at_once": {
            res: most_at_once(secs) for res, secs in sorted(slot_sections(run).items())
        },
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
    """Every check of a finished run (an engine run, or a Celery one: ``check_celery``)."""
    if json.loads((Path(folder) / "run.json").read_text()).get("celery"):
        return check_celery(folder)
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


# -- the Celery participants (chaos.celery_runner) ------------------------------
#
# Inputs: ``run.json`` (with ``"celery": true``), ``sent.jsonl`` (the
# producer), ``faults.jsonl`` (faults, worker starts and deaths),
# ``bodies/*.jsonl`` (every pool child's stamps, chaos.celery_app) and
# ``final.json`` (every sent task's state after the drain).
#
# ``never_ran``
#     A sent task's body (each attempt: a task that retries once has two)
#     never ran, or every run of it was cut short by a kill of its process.
# ``ran_twice``
#     A body ran more than once, beyond the at-least-once corner: a run
#     that a SIGKILL of its pool child, its worker's main process or its
#     whole worker hit while it ran or within ACK_SLACK after it ended
#     (acks_late redelivers that message) is counted (``at_least_once`` in
#     the numbers), not reported.
#     A task that failed with RedisUnavailable without running, while the
#     lock server restarted after its send (that attempt), is counted (``failed_lock_down``):
#     the documented outcome of a task that starts while the lock Redis is
#     unreachable.
# ``unexpected_run``
#     A body ran for a task that was never sent, or an attempt the task
#     never makes (a retry of a task that does not retry).
#     A task whose message the broker lost before any pool child got it (a
#     kill of a worker's main process between kombu's BRPOP and its unacked
#     bookkeeping: under way at the send or within BROKER_SLACK after it;
#     PENDING, never in a child) is counted (``broker_lost``): the Redis transport's own window,
#     before Celery or the locks see the message.
# ``left_pending``
#     After the drain (bounded), a sent task is not SUCCESS, FAILURE or
#     REVOKED (PENDING, DEFERRED, RETRY, STARTED...), unless ``broker_lost``.
# ``body_overlap`` / ``fence_order``
#     Two bodies on one resource, at least one exclusive, both ended with
#     their lease not lost: they overlapped in time, or the one with the
#     lower fence ran wholly after the other (it held its grant meanwhile).
#     Excused when a restart of the lock server happened during them or
#     within owner_ttl before (state lost that way is seen at the next
#     heartbeat).
# ``resource_idle``
#     A resource had no body running for longer than the idle bound (one
#     dispatch round trip plus slack: ``idle_bound``) while a task that
#     needs it waited (from its send, or its retry's countdown, to its
#     body's start), at least one pool slot was free or waiting for that
#     resource (not every live slot was busy with a body or a wait on
#     another resource), and no fault was settling (each fault plus the
#     time the documented recovery takes: see CELERY_SETTLE) and no
#     adoption of it was being stalled on purpose.
# ``unique_duplicate``
#     ``delay()`` of a UniqueTask sent a new task although an earlier task of
#     the same key was sent before the call and its body had not ended when
#     the call returned (the key must stay held while queued, parked and
#     running), with no fault since the earlier send.

#: Seconds after a body's end in which a SIGKILL may still lose its ack.
ACK_SLACK = 1.0
#: Countdown of a retry=True task's retry (chaos.celery_app.RETRY_COUNTDOWN).
RETRY_COUNTDOWN = 0.1
CELERY_FINAL = ("SUCCESS", "FAILURE", "REVOKED")
KILLS = ("kill_child", "kill_main", "kill_worker")


@dataclass
class Body:
    """One run of a task body, from its pool child's stamps."""

    id: str
    retries: int
    kind: str
    mode: str
    res: str
    node: str
    pid: int
    fence: int | None
    t0: float
    t1: float | None = None
    lost: bool | None = None
    retrying: bool = False
    #: When a kill hit this run (None: none did).
    killed: float | None = None

    @property
    def clean(self) -> bool:
        return self.t1 is not None and self.lost is False and self.killed is None


@dataclass
class Sent:
    id: str
    kind: str
    res: str
    mode: str
    t0: float
    t1: float
    retry: bool = False
    key: str | None = None


@dataclass
class SlotUse:
    """A pool child busy with one message, from prerun to postrun."""

    id: str
    task: str
    pid: int
    node: str
    res: str | None
    t0: float
    t1: float | None = None


@dataclass
class CeleryRun(_Timed):
    config: dict[str, Any]
    t0: float
    sent: dict[str, Sent]
    delays: list[dict[str, Any]]
    bodies: list[Body]
    slots: list[SlotUse]
    stalls: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    workers: list[dict[str, Any]]
    final: dict[str, Any]

    @property
    def t_end(self) -> float:
        return float(self.final.get("t_end") or max([self.t0, *(b.t0 for b in self.bodies)]))

    def fmt_sent(self, s: Sent) -> str:
        state = self.final.get("states", {}).get(s.id, "?")
        extra = " retry" if s.retry else ""
        extra += f" key={s.key}" if s.key else ""
        return (f"{s.id} {s.kind}{extra} {s.mode} {s.res}: sent {self.rel(s.t0)}..{self.rel(s.t1)}"
                f", final state {state}")  # fmt: skip

    def fmt_body(self, b: Body) -> str:
        end = (f"end {self.rel(b.t1)} lost={b.lost}" + (" retrying" if b.retrying else "")
               if b.t1 is not None else "no end")  # fmt: skip
        killed = f", killed {self.rel(b.killed)}" if b.killed is not None else ""
        return (f"  body {b.id} attempt {b.retries} ({b.kind} {b.mode} {b.res}) pid {b.pid} "
                f"{b.node} fence={b.fence}: begin {self.rel(b.t0)}, {end}{killed}")  # fmt: skip


def _lines(path: Path) -> list[dict[str, Any]]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by SIGKILL
    return out


def _kill_hits(faults: list[dict[str, Any]], b: Body) -> float | None:
    end = (b.t1 if b.t1 is not None else float("inf")) + ACK_SLACK
    for f in faults:
        if f["kind"] not in KILLS or not b.t0 <= f["t0"] <= end:
            continue
        if (f["kind"] == "kill_child" and f.get("pid") == b.pid) or (
            f["kind"] != "kill_child" and f.get("node") == b.node
        ):
            return float(f["t0"])
    return None


def load_celery(folder: Path) -> CeleryRun:
    meta = json.loads((folder / "run.json").read_text())
    sent: dict[str, Sent] = {}
    delays = []
    for e in _lines(folder / "sent.jsonl"):
        delays.append(e)
        if e.get("error") or e.get("dup_of") or not e.get("id"):
            continue
        sent[e["id"]] = Sent(e["id"], e["kind"], e["res"], e["mode"], e["t0"], e["t1"],
                             e["kind"] == "retry", e.get("key"))  # fmt: skip
    everything = [f for f in _lines(folder / "faults.jsonl")]
    faults = sorted((f for f in everything if f["kind"] not in ("worker_up", "worker_down", "load")),
                    key=lambda f: f["t0"])  # fmt: skip
    workers = sorted((f for f in everything if f["kind"] in ("worker_up", "worker_down")),
                     key=lambda f: f["t0"])  # fmt: skip
    bodies: list[Body] = []
    slots: list[SlotUse] = []
    stalls: list[dict[str, Any]] = []
    for path in sorted((folder / "bodies").glob("*.jsonl")):
        open_bodies: dict[tuple[str, int], Body] = {}
        open_slot: SlotUse | None = None
        node = ""
        for e in _lines(path):
            ev = e["ev"]
            if ev == "prerun":
                node = e.get("node") or node
                if open_slot is not None and open_slot.t1 is None:
                    open_slot.t1 = e["t"]
                open_slot = SlotUse(e["id"], e.get("task") or "", e["pid"], node, e.get("res"),
                                    e["t"])  # fmt: skip
                slots.append(open_slot)
            elif ev == "postrun":
                if open_slot is not None and open_slot.id == e["id"]:
                    open_slot.t1 = e["t"]
            elif ev == "begin":
                b = Body(e["id"], e["retries"], e["kind"], e["mode"], e["res"], e["node"],
                         e["pid"], e.get("fence"), e["t"])  # fmt: skip
                bodies.append(b)
                open_bodies[(b.id, b.retries)] = b
            elif ev == "end":
                ob = open_bodies.pop((e["id"], e["retries"]), None)
                if ob is not None:
                    ob.t1, ob.lost, ob.retrying = e["t"], e["lost"], bool(e.get("retrying"))
            elif ev == "stall":
                stalls.append(e)
    for b in bodies:
        b.killed = _kill_hits(faults, b)
    final_path = folder / "final.json"
    final = json.loads(final_path.read_text()) if final_path.exists() else {}
    return CeleryRun(meta["config"], meta["t0"], sent, delays, bodies, slots, stalls, faults,
                     workers, final)  # fmt: skip


def _runs(run: CeleryRun) -> dict[tuple[str, int], list[Body]]:
    runs: dict[tuple[str, int], list[Body]] = defaultdict(list)
    for b in run.bodies:
        runs[(b.id, b.retries)].append(b)
    for lst in runs.values():
        lst.sort(key=lambda b: b.t0)
    return runs


def _attempts(s: Sent) -> tuple[int, ...]:
    return (0, 1) if s.retry else (0,)


def _extra_runs(rs: list[Body]) -> tuple[list[Body], int]:
    """The runs of one attempt that completed (an ``end`` stamp), and how many
    runs (ended or not) no kill explains: a kill of the run's process while
    it ran or within ACK_SLACK after it ended may make its message come back."""
    done = [b for b in rs if b.t1 is not None]
    return done, sum(b.killed is None for b in rs)


def failed_lock_down(run: CeleryRun, s: Sent) -> bool:
    """Whether ``s`` failed with RedisUnavailable, the body of its last
    attempt never run, while the lock server restarted after its send: the
    documented outcome of a task (or a retry of one) that starts while the
    lock Redis is unreachable (it ends in a state that says why). The
    attempts before the last one are still checked."""
    last = max(_attempts(s))
    return (
        run.final.get("states", {}).get(s.id) == "FAILURE"
        and run.final.get("errors", {}).get(s.id) == "RedisUnavailable"
        and not any(b.id == s.id and b.retries == last for b in run.bodies)
        and any(f["kind"] == "lock_restart" and f["t1"] >= s.t0 for f in run.faults)
    )


#: Seconds after a send in which a SIGKILL of a worker's main process may
#: still catch its message between the broker's BRPOP and kombu's unacked
#: bookkeeping (see :func:`broker_lost`).
BROKER_SLACK = 1.0


def broker_lost(run: CeleryRun, s: Sent) -> bool:
    """Whether the broker lost ``s``'s message before any pool child got it.

    kombu's Redis transport takes a message off its queue (BRPOP) and only
    then records it as unacked (its visibility-timeout restore reads that
    record): a worker's main process SIGKILLed in between loses the message
    for good, before Celery or this library sees it. So does a main process
    SIGKILLed just before the send: Redis serves a blocked BRPOP of a dead
    client until it sees the connection closed, and writes the message into
    a socket no one reads. Counted (``broker_lost``), not reported, when the
    task never reached a pool child (no prerun, no body), has no result at
    all (PENDING), and a kill of a worker's main process (or its whole
    worker) was under way at its send (the fault's start is stamped before
    the SIGKILL goes out, its end once the process is reaped) or came
    within BROKER_SLACK after it.

    The same holds for the message of a retry (``self.retry()``): a task left
    RETRY whose last body ended sending its retry, with no pool child busy
    with it after that, and such a kill under way at that send or within
    BROKER_SLACK after it.
    """
    state = run.final.get("states", {}).get(s.id, "PENDING")
    if state == "PENDING":
        lo, hi, since = s.t0, s.t1, None
    elif state == "RETRY":
        ends = [b.t1 for b in run.bodies if b.id == s.id and b.retrying and b.t1 is not None]
        if not ends:
            return False
        lo = hi = since = max(ends)
    else:
        return False
    return (
        not any(u.id == s.id and (since is None or u.t0 > since) for u in run.slots)
        and not any(b.id == s.id and (since is None or b.t0 > since) for b in run.bodies)
        and any(
            f["kind"] in ("kill_main", "kill_worker")
            and f["t1"] >= lo
            and f["t0"] <= hi + BROKER_SLACK
            for f in run.faults
        )
    )


def _counted_apart(run: CeleryRun, s: Sent) -> bool:
    """A task whose missing run is a documented outcome, counted apart."""
    return failed_lock_down(run, s) or broker_lost(run, s)


def check_exactly_once(run: CeleryRun) -> list[Violation]:
    runs = _runs(run)
    out = []
    for s in run.sent.values():
        # The attempt that failed with the lock server down, or whose
        # message the broker lost: it has no run to check (the others do).
        excused = failed_lock_down(run, s) or broker_lost(run, s)
        for a in _attempts(s):
            rs = runs.get((s.id, a), [])
            if excused and not rs:
                continue
            done, unexplained = _extra_runs(rs)
            if not done:
                what = "never ran" if not rs else f"started {len(rs)} time(s), never ended"
                hi = max([s.t1, *(b.t0 for b in rs)]) + 1
                out.append(Violation(
                    "never_ran",
                    f"{s.id} ({s.kind} on {s.res}) attempt {a}: the body {what}",
                    [run.fmt_sent(s), *(run.fmt_body(b) for b in rs),
                     *run.faults_between(s.t0 - 1, hi)[:8]],
                    (s.id,),
                ))  # fmt: skip
            elif unexplained > 1:
                lo, hi = rs[0].t0, max(b.t1 or b.t0 for b in rs)
                out.append(Violation(
                    "ran_twice",
                    f"{s.id} ({s.kind} on {s.res}) attempt {a}: the body ran {len(rs)} times "
                    f"({unexplained} not explained by a kill)",
                    [run.fmt_sent(s), *(run.fmt_body(b) for b in rs),
                     *run.faults_between(lo - 1, hi + 1)[:8]],
                    (s.id,),
                ))  # fmt: skip
    for (tid, a), rs in sorted(runs.items()):
        s = run.sent.get(tid)
        if s is None or a not in _attempts(s):
            out.append(Violation(
                "unexpected_run",
                f"a body ran for {tid} attempt {a}, which "
                + ("was never sent" if s is None else "this task never makes"),
                [*([run.fmt_sent(s)] if s else []), *(run.fmt_body(b) for b in rs)],
                (tid,),
            ))  # fmt: skip
    return out


def at_least_once_corners(run: CeleryRun) -> int:
    """Attempts whose body started more than once, every extra start explained
    by a kill (cut mid-body, or its ack lost): the at-least-once corner."""
    n = 0
    for (tid, a), rs in _runs(run).items():
        s = run.sent.get(tid)
        done, unexplained = _extra_runs(rs)
        if s is not None and a in _attempts(s) and len(rs) > 1 and done and unexplained <= 1:
            n += 1
    return n


def check_left_pending(run: CeleryRun) -> list[Violation]:
    states = run.final.get("states", {})
    bound = run.config.get("drain")
    took = run.final.get("drain_s")
    out = []
    for s in run.sent.values():
        state = states.get(s.id, "PENDING")
        if state in CELERY_FINAL or broker_lost(run, s):
            continue
        out.append(Violation(
            "left_pending",
            f"{s.id} ({s.kind} on {s.res}) is {state} after the drain "
            f"({took if took is None else round(took, 1)} s, bound {bound} s)",
            [run.fmt_sent(s), *(run.fmt_body(b) for b in run.bodies if b.id == s.id)],
            (s.id,),
        ))  # fmt: skip
    return out


def _restart_excuse(run: CeleryRun, lo: float, hi: float) -> bool:
    ttl = float(run.config["owner_ttl"])
    return any(
        f["kind"] == "lock_restart" and f["t0"] <= hi and f["t1"] + ttl >= lo for f in run.faults
    )


def _bodies_violation(
    run: CeleryRun, kind: str, a: Body, b: Body, lo: float, hi: float, msg: str
) -> Violation:
    """A ``kind`` violation by bodies ``a`` and ``b``, traced with the faults of ``lo - 1..hi``."""
    trace = [run.fmt_body(a), run.fmt_body(b), *run.faults_between(lo - 1, hi)[:8]]
    return Violation(kind, msg, trace, (a.id, b.id))


def check_exclusion(run: CeleryRun) -> list[Violation]:
    by_res: dict[str, list[Body]] = defaultdict(list)
    for b in run.bodies:
        if b.clean:
            by_res[b.res].append(b)
    out = []
    for res, bs in sorted(by_res.items()):
        bs.sort(key=lambda b: b.t0)
        for i, a in enumerate(bs):
            for b in bs[i + 1 :]:
                if a.mode != "x" and b.mode != "x":
                    continue
                assert a.t1 is not None and b.t1 is not None
                lo, hi = min(a.t0, b.t0), max(a.t1, b.t1)
                if b.t0 < a.t1:
                    if _restart_excuse(run, lo, min(a.t1, b.t1)):
                        continue
                    out.append(_bodies_violation(
                        run, "body_overlap", a, b, lo, hi,
                        f"{a.id} ({a.mode}) and {b.id} ({b.mode}) ran bodies on {res} at once "
                        f"from {run.rel(b.t0)} to {run.rel(min(a.t1, b.t1))}; neither lease lost",
                    ))  # fmt: skip
                elif (
                    a.fence is not None
                    and b.fence is not None
                    and a.fence > b.fence
                    and not _restart_excuse(run, lo, hi)
                ):
                    out.append(_bodies_violation(
                        run, "fence_order", a, b, lo, hi,
                        f"{b.id} (fence {b.fence}) ran on {res} after {a.id} (fence {a.fence}) "
                        f"had run: {b.id} held its grant across {a.id}'s body; neither lease lost",
                    ))  # fmt: skip
    return out


def celery_settle(run: CeleryRun, kind: str) -> float:
    """Seconds after a fault in which the documented recovery may keep a
    resource idle: the node frees a dead child's locks within a tick, a dead
    owner's liveness runs out after owner_ttl, a grant in transit to a dead
    or stopped process is handed on after the grant TTL, and a dead main
    process's unacked messages come back after the visibility timeout."""
    c = run.config
    hb, ttl, g = float(c["heartbeat"]), float(c["owner_ttl"]), float(c["grant_ttl"])
    ticks = 2 * hb
    if kind in ("kill_main", "kill_worker"):
        return max(float(c["visibility"]) + 1.0, g + ttl) + ticks
    if kind in ("kill_child", "lock_restart"):
        return g + ttl + ticks
    if kind == "stop_child":
        return g + ticks
    return ticks


IdleEvent = tuple[float, str, int, str]  # (time, what, +1/-1, tag)


def _idle_events(
    run: CeleryRun, res: str, runs: dict[tuple[str, int], list[Body]]
) -> list[IdleEvent]:
    """+1/-1 events of: tasks waiting for ``res`` (``wait``), bodies on it
    (``busy``), pool slots busy with a body or a wait elsewhere
    (``elsewhere``), live slots (``slots``), faults settling and stalled
    adoptions (``blackout``)."""
    c = run.config
    end_of_run = run.t_end
    ev: list[IdleEvent] = []

    def add(lo: float, hi: float, what: str, tag: str) -> None:
        if hi > lo:
            ev.append((lo, what, 1, tag))
            ev.append((hi, what, -1, tag))

    for s in run.sent.values():
        if s.res != res or _counted_apart(run, s):
            continue
        for a in _attempts(s):
            start = s.t1
            if a == 1:
                prev = [b.t1 for b in runs.get((s.id, 0), []) if b.retrying and b.t1 is not None]
                if not prev:
                    continue
                start = min(prev) + RETRY_COUNTDOWN
            began = runs.get((s.id, a))
            add(start, began[0].t0 if began else end_of_run, "wait", s.id)
    for b in run.bodies:
        hi = b.t1 if b.t1 is not None else (b.killed if b.killed is not None else end_of_run)
        add(b.t0, hi, "busy" if b.res == res else "elsewhere", b.id)
    starts = defaultdict(list)
    for b in run.bodies:
        starts[(b.id, b.pid)].append(b.t0)
    for u in run.slots:
        if u.task.startswith("chaos.wait_") and u.res != res:
            began = [t for t in starts[(u.id, u.pid)] if t >= u.t0]
            add(u.t0, min(began) if began else (u.t1 or end_of_run), "elsewhere", u.id)
    for f in run.faults:
        add(f["t0"], f["t1"] + celery_settle(run, f["kind"]), "blackout", f["kind"])
    for st in run.stalls:
        if st.get("res") == res:
            add(st["t"], st["until"] + 2 * float(c["heartbeat"]), "blackout", "stall")
    for w in run.workers:
        up = w["kind"] == "worker_up"
        ev.append(
            (w["t0"], "slots", int(w.get("slots") or c["concurrency"]) * (1 if up else -1), "")
        )
    ev.sort(key=lambda e: (e[0], e[2]))  # ends before starts at one instant
    return ev


def _is_idle(count: Counter[str]) -> bool:
    return (
        count["wait"] > 0
        and count["busy"] == 0
        and count["blackout"] == 0
        and count["elsewhere"] < count["slots"]
    )


def _idle_stretches(ev: list[IdleEvent], end: float) -> list[tuple[float, float, set[str]]]:
    """Maximal stretches in which ``_is_idle`` holds, with the tasks that waited."""
    count: Counter[str] = Counter()
    waiting: set[str] = set()
    seen: set[str] = set()
    at: float | None = None
    out = []
    for t, what, d, tag in ev:
        was = _is_idle(count)
        if what == "wait":
            if d > 0:
                waiting.add(tag)
                seen.add(tag)
            else:
                waiting.discard(tag)
        count[what] += d
        now = _is_idle(count)
        if now and not was:
            at, seen = t, set(waiting)
        elif was and not now and at is not None:
            out.append((at, t, seen))
            at = None
    if at is not None:
        out.append((at, end, seen))
    return out


def check_idle(run: CeleryRun) -> list[Violation]:
    bound = float(run.config["idle_bound"])
    runs = _runs(run)
    out = []
    for res in sorted({s.res for s in run.sent.values()}):
        for lo, hi, waiting in _idle_stretches(_idle_events(run, res, runs), run.t_end):
            if hi - lo > bound:
                out.append(_idle_violation(run, res, lo, hi, bound, waiting))
    return out


def _idle_violation(
    run: CeleryRun, res: str, lo: float, hi: float, bound: float, waiting: set[str]
) -> Violation:
    before = [b for b in run.bodies if b.res == res and b.t0 <= lo]
    after = [b for b in run.bodies if b.res == res and b.t0 >= hi]
    trace = [run.fmt_sent(run.sent[i]) for i in sorted(waiting)[:4] if i in run.sent]
    if before:
        trace.append("last body before:" + run.fmt_body(max(before, key=lambda b: b.t0))[1:])
    if after:
        trace.append("next body after:" + run.fmt_body(min(after, key=lambda b: b.t0))[1:])
    trace += run.faults_between(lo - 5, hi)[:6]
    return Violation(
        "resource_idle",
        f"{res} ran no body for {hi - lo:.2f}s (> {bound:.2f}s) from {run.rel(lo)} to "
        f"{run.rel(hi)} while {len(waiting)} task(s) waited for it and a pool slot was free "
        "or waiting for it",
        trace,
        tuple(sorted(waiting)),
    )


def _longest_idle(run: CeleryRun) -> float:
    runs = _runs(run)
    return max(
        (
            hi - lo
            for res in {s.res for s in run.sent.values()}
            for lo, hi, _ in _idle_stretches(_idle_events(run, res, runs), run.t_end)
        ),
        default=0.0,
    )


def check_unique_duplicate(run: CeleryRun) -> list[Violation]:
    runs = _runs(run)
    by_key: dict[str, list[Sent]] = defaultdict(list)
    for s in run.sent.values():
        if s.kind == "unique" and s.key:
            by_key[s.key].append(s)
    out = []
    for key, ss in sorted(by_key.items()):
        ss.sort(key=lambda s: s.t0)
        for i, first in enumerate(ss):
            ended = [b.t1 for b in runs.get((first.id, 0), []) if b.t1 is not None]
            end1 = max(ended) if ended else run.t_end
            for second in ss[i + 1 :]:
                if not (first.t1 < second.t0 and second.t1 < end1):
                    continue
                if any(f["t0"] <= second.t1 and f["t1"] >= first.t0 for f in run.faults):
                    continue
                out.append(Violation(
                    "unique_duplicate",
                    f"delay() of key {key} at {run.rel(second.t0)} sent {second.id} although "
                    f"{first.id} (sent {run.rel(first.t1)}) had not ended its body "
                    f"({run.rel(end1) if ended else 'never'})",
                    [run.fmt_sent(first), run.fmt_sent(second),
                     *(run.fmt_body(b) for b in runs.get((first.id, 0), []))],
                    (first.id, second.id),
                ))  # fmt: skip
    return out


CELERY_CHECKS = (
    check_exactly_once,
    check_left_pending,
    check_exclusion,
    check_idle,
    check_unique_duplicate,
)


def celery_stats(run: CeleryRun, violations: list[Violation]) -> dict[str, Any]:
    states = run.final.get("states", {})
    return {
        "seed": run.config.get("seed"),
        "duration_s": run.config.get("duration"),
        "participants": list(run.config.get("participants", [])),
        "sent": len(run.sent),
        "sent_by_kind": dict(Counter(s.kind for s in run.sent.values())),
        "unique_duplicate_delays": sum(bool(d.get("dup_of")) for d in run.delays),
        "send_errors": sum(bool(d.get("error")) for d in run.delays),
        "held_back_s": round(sum(float(d.get("held_back_s") or 0.0) for d in run.delays), 1),
        "bodies": len(run.bodies),
        "bodies_killed": sum(b.killed is not None for b in run.bodies),
        "bodies_lost": sum(bool(b.lost) for b in run.bodies),
        "at_least_once": at_least_once_corners(run),
        "failed_lock_down": sum(failed_lock_down(run, s) for s in run.sent.values()),
        "broker_lost": sum(broker_lost(run, s) for s in run.sent.values()),
        "states": dict(Counter(states.get(i, "PENDING") for i in run.sent)),
        "drained": run.final.get("drained"),
        "drain_s": round(float(run.final.get("drain_s") or 0.0), 1),
        "faults": dict(Counter(f["kind"] for f in run.faults)),
        "stalls": len(run.stalls),
        "idle_longest_s": round(_longest_idle(run), 2),
        "violations": dict(Counter(v.kind for v in violations)),
    }


def check_celery(folder: str | Path) -> Report:
    run = load_celery(Path(folder))
    violations: list[Violation] = []
    for fn in CELERY_CHECKS:
        violations += fn(run)
    return Report(celery_stats(run, violations), violations)
