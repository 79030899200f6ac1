"""The soak's outputs: ``report.json`` (everything ``checks`` found, the run's settings and the
fault schedule as it happened) and ``summary.md`` (the verdict, one line per invariant with its
key evidence, one per fault with its recovery and the errors the workers saw)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_KEY_EVIDENCE = {
    "no_wrong_bytes": ("loads_with_hits_checked",),
    "no_cross_tenant_read": ("probes", "positive_control_same_scope_hits"),
    "no_cross_namespace_read": ("probes",),
    "nothing_readable_after_clear": ("must_miss_reads_checked", "broken_count"),
    "capabilities_revoked": ("checks",),
    "no_integrity_failures": ("loads_with_hits_checked", "failure_count"),
    "audit_acknowledged_actions_logged": ("acknowledged", "missing_count", "batched_lost_near_sigkill", "rows"),
    "audit_chain_verifies_and_extends_checkpoints": ("rows", "checkpoints", "output"),
    "rss_no_upward_trend": ("slope_mib_per_min", "limit_mib_per_min", "max_mib", "ceiling_mib", "samples", "why"),
    "p99_bounded_outside_faults": ("bound_s", "lookup", "load"),
    "sigterm_exits_0": ("exits",),
}


def _brief(name: str, inv: dict[str, Any]) -> str:
    keys = _KEY_EVIDENCE.get(name, ())
    parts = []
    for k in keys:
        if k in inv:
            v = inv[k]
            if isinstance(v, dict) and {"p99_s", "n"} <= set(v):
                v = f"p99 {v['p99_s']} s over {v['n']}"
            elif isinstance(v, str):
                v = v.strip().splitlines()[-1][:120] if v.strip() else ""
            parts.append(f"{k}: {v}")
    if name == "recovered_after_every_fault":
        parts.append(f"{sum(f['recovery_all_s'] is not None for f in inv['faults'])}/{len(inv['faults'])} faults")
    for k in ("violations", "broken", "missing", "crashes", "failures"):
        if inv.get(k):
            parts.append(f"{k}: {json.dumps(inv[k][:2])[:300]}")
    return "; ".join(str(p) for p in parts).replace("|", "/")


def markdown(report: dict[str, Any]) -> str:
    res = report["results"]
    cfg = report["config"]
    ok = report["passed"]
    lines = [
        f"# Soak: {'PASSED' if ok else 'FAILED'}",
        "",
        f"{cfg['duration_s']:.0f} s, {cfg['workers']} workers in {cfg['tenants']} tenants, tiers {cfg['tiers']}, "
        f"{len(res['faults'])} faults; seed {cfg['seed']}; started {report['started']}.",
        "",
        "| invariant | held | evidence |",
        "| --- | --- | --- |",
    ]
    for name, inv in res["invariants"].items():
        lines.append(f"| {name} | {'yes' if inv['held'] else '**NO**'} | {_brief(name, inv)} |")
    lines += ["", "| fault | at (s) | held (s) | recovery, first worker (s) | recovery, every worker (s) | errors until (s) | errors seen | load reasons |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f in res["faults"]:
        errs = ", ".join(f"{k} {v}" for k, v in f["errors"].items()) or "none"
        reasons = ", ".join(f"{k} {v}" for k, v in f["load_reasons"].items()) or "none"
        lines.append(f"| {f['kind']} | {f['at']:.0f} | {f['end'] - f['start']:.1f} | {f['recovery_first_s']} | "
                     f"{f['recovery_all_s']} | {f['errors_until_s']} | {errs} | {reasons} |")
    lines += ["", "| operation | done | failed |", "| --- | --- | --- |"]
    for op, n in res["operations"].items():
        lines.append(f"| {op} | {n['done']} | {n['failed']} |")
    outside = ", ".join(f"{k} {v}" for k, v in res["errors_outside_fault_windows"].items()) or "none"
    lines += ["", f"Errors outside the fault windows: {outside}.", ""]
    return "\n".join(lines)


def write(out: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / "report.json", out / "summary.md"
    j.write_text(json.dumps(report, indent=2, default=str) + "\n")
    m.write_text(markdown(report))
    return j, m
