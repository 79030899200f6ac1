"""The soak's invariants over what the run recorded: the workers' logs (every operation, what was
acknowledged, the violations they saw as they ran), the faults, the server's resident memory
samples and the audit export. Each invariant is ``held`` or broken, with its evidence, and an
invariant nothing exercised (no probe, no clear, no sample) is broken rather than held."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_OPS = ("store", "load", "lookup", "peer")
# data-plane audit events are batched (docs/audit.md, Durability of events): those acknowledged
# this long before a SIGKILL may be lost with the process, and are not counted missing
BATCHED = ("pin", "unpin")
BATCH_LOSS_WINDOW_S = 1.0


@dataclass
class Limits:
    p99_s: float
    rss_slope_mib_per_min: float | None
    rss_warmup_s: float
    rss_ceiling_mib: float | None = None


def load_logs(paths: list[Path]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in paths:
        with open(p) as f:
            for line in f:
                if line.strip():
                    out.append(json.loads(line))
    return out


def _inv(held: bool, **evidence: Any) -> dict[str, Any]:
    return {"held": bool(held), **evidence}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


# -- recovery and fault windows --------------------------------------------------------------
def recoveries(faults: list[dict[str, Any]], recs: list[dict[str, Any]], workers: int) -> None:
    """For each fault, written into its dict: seconds from its end to the first store begun after
    it that a worker was acknowledged (a store needs the capability, a data key and so the KEK,
    the registry and a tier), for the first worker and for every worker; when the last operation
    that failed ended (``errors_until_s``, before the next fault); and the errors and load
    reasons seen from its start to its recovery plus a second."""
    stored: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in recs:
        if r.get("op") == "store" and r.get("ok"):
            stored[r["w"]].append(r)
    for f_i, f in enumerate(faults):
        nxt = faults[f_i + 1]["start"] if f_i + 1 < len(faults) else math.inf
        firsts = []
        for w in range(workers):
            after = [r["t1"] for r in stored.get(w, []) if r["t0"] >= f["end"]]
            if after and min(after) < nxt:
                firsts.append(min(after) - f["end"])
        f["recovery_first_s"] = round(min(firsts), 3) if firsts else None
        f["recovery_all_s"] = round(max(firsts), 3) if len(firsts) == workers else None
        f["window_end"] = f["end"] + (f["recovery_all_s"] if f["recovery_all_s"] is not None else 10.0) + 1.0
        failed_after = [r["t1"] for r in recs if "t1" in r and not r.get("ok", True) and f["end"] <= r["t1"] < nxt]
        f["errors_until_s"] = round(max(failed_after) - f["end"], 3) if failed_after else 0.0
        errors: Counter[str] = Counter()
        reasons: Counter[str] = Counter()
        for r in recs:
            if "t1" not in r or r["t1"] < f["start"] or r["t0"] > f["window_end"]:
                continue
            if not r.get("ok", True):
                errors[r["err"]] += 1
            elif r.get("reason") and r["reason"] != "miss":
                reasons[r["reason"]] += 1
        f["errors"] = dict(errors.most_common())
        f["load_reasons"] = dict(reasons.most_common())


def in_fault_window(r: dict[str, Any], faults: list[dict[str, Any]]) -> bool:
    return any(r["t0"] <= f["window_end"] and r["t1"] >= f["start"] for f in faults)


# -- invariants ------------------------------------------------------------------------------
def _violations(recs: list[dict[str, Any]], *kinds: str) -> list[dict[str, Any]]:
    return [r for r in recs if r.get("op") == "violation" and r.get("kind") in kinds]


def readable_after_clear(recs: list[dict[str, Any]], scopes: dict[int, tuple[str, str]]) -> dict[str, Any]:
    """Over every worker's log: a load or lookup that found a prompt after a clear of its scope
    was acknowledged (to any worker), where no store of the prompt ran at or after the clear's start."""
    stores: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    clears: dict[str, list[tuple[float, float, str | None]]] = defaultdict(list)  # tenant -> (t0, t1, namespace or None)
    for r in recs:
        if r.get("op") == "store" and "prompt" in r and "t1" in r:
            stores[(r["prompt"][0], r["prompt"][1])].append((r["t0"], r["t1"]))
        ack = r.get("ack") if r.get("ok") else None
        if ack and ack["action"] == "clear":
            clears[ack["tenant"]].append((r["t0"], r["t1"], ack["namespace"] if ack["scope"] == "namespace" else None))
    checked, broken = 0, []
    for r in recs:
        if not r.get("ok") or r.get("op") not in ("load", "lookup", "peer") or "prompt" not in r:
            continue
        if r.get("op") == "peer" and r.get("scope") != "same":
            continue
        owner, idx = r["prompt"]
        tenant, namespace = scopes[owner]
        found = r.get("loaded", 0) or r.get("hit", 0)
        before = [s for s in stores[(owner, idx)] if s[0] < r["t1"]]
        gone = [c for c in clears[tenant] if (c[2] is None or c[2] == namespace) and c[1] < r["t0"]
                and all(s1 < c[0] for _s0, s1 in before)]
        if gone:
            checked += 1
            if found:
                broken.append({"worker": r["w"], "op": r["op"], "prompt": r["prompt"], "found_tokens": found,
                               "t0": r["t0"], "clear": gone[-1], "stores": before[-3:]})
    in_run = _violations(recs, "readable_after_clear")
    return _inv(not broken and not in_run and checked > 0, must_miss_reads_checked=checked,
                broken=broken[:10], broken_count=len(broken), seen_by_workers=in_run[:10])


def integrity(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Loads whose envelope failed authentication: none may, since nothing in the soak tampers
    with a tier. A store that races a clear of its scope is refused whole by the server
    (``namespace-changed``: docs/server.md), so it stores nothing a load could fail on. Held only
    where loads found chunks to authenticate."""
    failures = _violations(recs, "integrity_failure")
    checked = sum(1 for r in recs if r.get("op") in ("load", "peer") and r.get("ok") and r.get("loaded"))
    return _inv(not failures and checked > 0, loads_with_hits_checked=checked, failure_count=len(failures),
                failures=failures[:10])


def audit_complete(recs: list[dict[str, Any]], rows: list[dict[str, Any]], kills: list[float]) -> dict[str, Any]:
    """Every action acknowledged to a worker (or to the soak itself) has its row in the export."""
    mints = {r["details"].get("cap_id") for r in rows if r["action"] == "capability.mint"}
    rotations = {(r["target"].get("tenant"), r["details"].get("version")) for r in rows if r["action"] == "key.rotate"}
    clear_rows: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        if r["action"] in ("clear.requested", "clear.completed"):
            clear_rows[str(r["details"].get("job_id"))].add(r["action"])
    by_tenant = {(r["action"], r["target"].get("tenant")) for r in rows}
    batched = Counter((r["action"], r["target"].get("tenant"), r["target"].get("namespace")) for r in rows if r["action"] in BATCHED)
    acked: Counter[str] = Counter()
    missing: list[dict[str, Any]] = []
    want_batched: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in recs:
        ack = r.get("ack")
        if not ack or (r.get("op") != "ack" and not r.get("ok")):
            continue
        action = ack["action"]
        acked[action] += 1
        when = r.get("t1", r.get("t"))
        if action == "capability.mint":
            ok = ack["cap_id"] in mints
        elif action == "key.rotate":
            ok = (ack["tenant"], ack["version"]) in rotations
        elif action == "clear":
            ok = clear_rows.get(ack["job_id"]) == {"clear.requested", "clear.completed"}
        elif action in ("tenant.create", "tenant.disable"):
            ok = (action, ack["tenant"]) in by_tenant
        elif action in BATCHED:
            want_batched[(action, ack["tenant"], ack["namespace"])].append(float(when))
            continue
        else:
            ok = False
        if not ok:
            missing.append({"worker": r.get("w"), "ack": ack, "t": when})
    excused = 0
    for key, times in want_batched.items():
        short = len(times) - batched.get(key, 0)
        if short > 0:
            near_kill = sum(1 for t in times if any(0 <= k - t <= BATCH_LOSS_WINDOW_S for k in kills))
            excused += min(short, near_kill)
            if short > near_kill:
                missing.append({"ack": {"action": key[0], "tenant": key[1], "namespace": key[2]},
                                "acknowledged": len(times), "rows": batched.get(key, 0)})
    return _inv(not missing and sum(acked.values()) > 0, acknowledged=dict(acked), missing=missing[:20],
                missing_count=len(missing), batched_lost_near_sigkill=excused, rows=len(rows))


def rss_trend(
    samples: list[tuple[float, int, int]], warmup_s: float, limit: float | None, ceiling_mib: float | None = None,
) -> dict[str, Any]:
    """The least-squares slope of the server's resident memory over time, pooled over its
    processes (one intercept per process: a restart starts afresh), after ``warmup_s`` of each,
    at most ``limit`` MiB/min; and every sample at most ``ceiling_mib``. A run too short for a
    process to level off judges the ceiling only (``limit`` None) and reports the slope."""
    by_pid: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for t, pid, kib in samples:
        by_pid[pid].append((t, kib))
    sxx = sxy = 0.0
    segments = []
    used = 0
    for pid, pts in by_pid.items():
        t_first = pts[0][0]
        kept = [(t, k / 1024.0) for t, k in pts if t - t_first >= warmup_s]
        segments.append({"pid": pid, "samples": len(pts), "after_warmup": len(kept),
                         "first_mib": round(pts[0][1] / 1024, 1), "last_mib": round(pts[-1][1] / 1024, 1),
                         "max_mib": round(max(k for _t, k in pts) / 1024, 1), "seconds": round(pts[-1][0] - t_first, 1)})
        if len(kept) < 5:
            continue
        mt = sum(t for t, _ in kept) / len(kept)
        my = sum(y for _, y in kept) / len(kept)
        sxx += sum((t - mt) ** 2 for t, _ in kept)
        sxy += sum((t - mt) * (y - my) for t, y in kept)
        used += len(kept)
    peak = max((k / 1024.0 for _t, _pid, k in samples), default=0.0)
    under = ceiling_mib is None or (bool(samples) and peak <= ceiling_mib)
    if sxx <= 0:
        if limit is None and samples:
            return _inv(under, why="too few samples after warm-up for a slope", max_mib=round(peak, 1),
                        ceiling_mib=ceiling_mib, segments=segments)
        return _inv(False, why="too few samples after warm-up", segments=segments)
    slope = sxy / sxx * 60.0
    return _inv((limit is None or slope <= limit) and under, slope_mib_per_min=round(slope, 3), limit_mib_per_min=limit,
                max_mib=round(peak, 1), ceiling_mib=ceiling_mib, samples=used, warmup_s=warmup_s, segments=segments)


def p99_outside_faults(recs: list[dict[str, Any]], faults: list[dict[str, Any]], bound: float) -> dict[str, Any]:
    lat: dict[str, list[float]] = {"lookup": [], "load": []}
    excluded = 0
    for r in recs:
        op = r.get("op")
        if op == "peer":
            op = r.get("kind")
        if op not in lat or "t1" not in r:
            continue
        if in_fault_window(r, faults):
            excluded += 1
            continue
        lat[op].append(r["t1"] - r["t0"])
    out: dict[str, Any] = {"bound_s": bound, "excluded_in_fault_windows": excluded}
    held = True
    for op, values in lat.items():
        p99 = percentile(values, 0.99)
        out[op] = {"n": len(values), "p50_s": _r(percentile(values, 0.5)), "p99_s": _r(p99), "max_s": _r(max(values, default=None))}
        held = held and p99 is not None and p99 <= bound
    return _inv(held, **out)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def evaluate(recs: list[dict[str, Any]], faults: list[dict[str, Any]], scopes: dict[int, tuple[str, str]],
             rss: list[tuple[float, int, int]], audit: dict[str, Any], exits: list[dict[str, Any]],
             worker_exits: dict[int, int | None], limits: Limits) -> dict[str, Any]:
    workers = len(scopes)
    recoveries(faults, recs, workers)
    ops = [r for r in recs if r.get("op") in ("store", "load", "lookup", "peer", "pin", "unpin", "clear_namespace",
                                              "clear_tenant", "rotate", "revoke")]
    peer = [r for r in ops if r["op"] == "peer" and r.get("ok")]
    cross_t = sum(1 for r in peer if r.get("scope") == "other_tenant")
    cross_n = sum(1 for r in peer if r.get("scope") == "other_namespace")
    same_hits = sum(1 for r in peer if r.get("scope") == "same" and (r.get("loaded") or r.get("hit")))
    loads_hit = sum(1 for r in ops if r["op"] in ("load", "peer") and r.get("ok") and r.get("loaded"))
    revocations = sum(1 for r in ops if r.get("ok") and ("old_capability" in r))
    crashes = [r for r in ops if str(r.get("err", "")).startswith("crash:")]
    outside = Counter(r["err"] for r in ops if not r.get("ok") and not in_fault_window(r, faults))
    sigterms = [e for e in exits if e["signal"] == "SIGTERM"]
    inv = {
        "no_wrong_bytes": _inv(not _violations(recs, "wrong_bytes") and loads_hit > 0, loads_with_hits_checked=loads_hit,
                               violations=_violations(recs, "wrong_bytes")[:10]),
        "no_cross_tenant_read": _inv(not _violations(recs, "cross_tenant_read") and cross_t > 0, probes=cross_t,
                                     violations=_violations(recs, "cross_tenant_read")[:10],
                                     positive_control_same_scope_hits=same_hits),
        "no_cross_namespace_read": _inv(not _violations(recs, "cross_namespace_read") and cross_n > 0, probes=cross_n,
                                        violations=_violations(recs, "cross_namespace_read")[:10]),
        "nothing_readable_after_clear": readable_after_clear(recs, scopes),
        "capabilities_revoked": _inv(not _violations(recs, "capability_not_revoked") and revocations > 0,
                                     checks=revocations, violations=_violations(recs, "capability_not_revoked")[:10]),
        "no_integrity_failures": integrity(recs),
        "audit_acknowledged_actions_logged": audit["complete"],
        "audit_chain_verifies_and_extends_checkpoints": audit["verified"],
        "rss_no_upward_trend": rss_trend(rss, limits.rss_warmup_s, limits.rss_slope_mib_per_min, limits.rss_ceiling_mib),
        "p99_bounded_outside_faults": p99_outside_faults(recs, faults, limits.p99_s),
        "recovered_after_every_fault": _inv(all(f["recovery_all_s"] is not None for f in faults) and bool(faults),
                                            faults=[{"kind": f["kind"], "recovery_first_s": f["recovery_first_s"],
                                                     "recovery_all_s": f["recovery_all_s"]} for f in faults]),
        "sigterm_exits_0": _inv(bool(sigterms) and all(e["exit_code"] == 0 and not e["forced"] for e in sigterms),
                                exits=exits),
        "workers_ran_clean": _inv(not crashes and all(c == 0 for c in worker_exits.values()),
                                  crashes=[{k: r.get(k) for k in ("w", "op", "err", "msg", "trace")} for r in crashes[:5]],
                                  exit_codes=worker_exits),
    }
    totals = Counter(r["op"] for r in ops)
    failed = Counter(r["op"] for r in ops if not r.get("ok"))
    return {"invariants": inv, "operations": {op: {"done": totals[op], "failed": failed[op]} for op in sorted(totals)},
            "errors_outside_fault_windows": dict(outside.most_common()), "faults": faults}
