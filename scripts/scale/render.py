"""The scale run's Markdown tables from its JSON, and docs/runs.md's Scale section.

``python -m scripts.scale.render FILE.json`` prints the tables; ``--docs`` puts them between
``<!-- scale:begin -->`` and ``<!-- scale:end -->`` in docs/runs.md and copies the JSON to
docs/runs-data/scale.json. Ratios are of figures of the same run: a lookup's CPU time beside the
smallest size's, a clear's time per chunk above the clear of an empty namespace, a worker's
requests/s beside one worker alone, the audit writer's rows/s beside raw INSERTs of the same rows.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

__all__ = ["BEGIN", "END", "markdown", "write_docs"]

BEGIN, END = "<!-- scale:begin -->", "<!-- scale:end -->"
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _n(chunks: int) -> str:
    """10^k for a power of ten, else the number with separators."""
    k = len(str(chunks)) - 1
    return f"10^{k}" if chunks == 10**k and k >= 2 else f"{chunks:,}"


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _ratio(x: float | None, base: float | None) -> str:
    return "-" if x is None or not base else f"{x / base:.2f}"


def _lookup_rows(data: dict[str, Any]) -> list[str]:
    out = []
    for path, rows, cpu_key in (("embedded", data["embedded"]["lookup"], "cpu_ms"),
                                ("served", data.get("served", {}).get("lookup", []), "server_cpu_ms")):
        if not rows:
            continue
        base_cpu = _cpu(rows[0], cpu_key)
        for r in rows:
            cpu = _cpu(r, cpu_key)
            out.append(
                f"| {path} | {_n(r['chunks'])} | {_f(r['wall_ms']['p50'], 3)} | {_f(r['wall_ms']['p99'], 3)} | "
                f"{_f(cpu, 3)} | {_ratio(cpu, base_cpu)} | {r['rss_bytes'] / 2**20:,.0f} | "
                f"{_f(r['bytes_per_chunk'], 0)} |"
            )
    return out


def _cpu(row: dict[str, Any], key: str) -> float:
    value = row[key]
    return float(value["p50"] if isinstance(value, dict) else value)


def _clear_rows(data: dict[str, Any]) -> list[str]:
    out = []
    for tier, key in (("memory", "clear_memory"), ("redis", "clear_redis")):
        rows = data["embedded"].get(key) or []
        empty = next((r for r in rows if r["chunks"] == 0), None)
        for r in rows:
            if r["chunks"] == 0:
                continue
            per_chunk = None if empty is None else (r["namespace_ms"] - empty["namespace_ms"]) * 1e3 / r["chunks"]
            raw = r.get("raw_unlink_ms")
            out.append(
                f"| {tier} | {_n(r['chunks'])} | {_f(r['namespace_ms'])} | {_f(r['tenant_ms'])} | "
                f"{_f(empty['namespace_ms']) if empty else '-'} | {_f(per_chunk, 2)} | {_f(raw)} | {_ratio(r['namespace_ms'], raw)} |"
            )
    return out


def _worker_rows(data: dict[str, Any]) -> list[str]:
    rows = data.get("served", {}).get("workers", [])
    one = next((r["per_worker"] for r in rows if r["workers"] == 1), None)
    out = []
    for r in rows:
        lk, ld = r["lookup_ms"] or {}, r["load_ms"] or {}
        errors = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "0"
        out.append(
            f"| {r['workers']} | {r['requests_per_s']:,.0f} | {r['per_worker']:,.0f} | {_ratio(r['per_worker'], one)} | "
            f"{_ratio(r['requests_per_s'], one)} | {_f(lk.get('p50'))} / {_f(lk.get('p99'))} | "
            f"{_f(ld.get('p50'))} / {_f(ld.get('p99'))} | {_f(r['server_cpu_ms_per_request'], 3)} | {errors} |"
        )
    return out


def _audit_rows(data: dict[str, Any]) -> list[str]:
    a = data.get("audit")
    if not a:
        return []
    batch = a["batch_size"]
    names = [
        ("emitted", "`emit`, sustained", "raw_batch", f"raw INSERT, {batch} rows a transaction"),
        ("recorded_1", "`record`, 1 caller", "raw_row_1", "raw INSERT, 1 row a transaction"),
        ("recorded_16", "`record`, 16 callers", "raw_row_16", "raw INSERT, 1 row a transaction, 16 connections"),
    ]
    return [
        f"| {label} | {a[key]['rows_per_s']:,.0f} | {a[key]['seconds']:.0f} | {ceiling} | {a[ck]['rows_per_s']:,.0f} | "
        f"{_ratio(a[key]['rows_per_s'], a[ck]['rows_per_s'])} |"
        for key, label, ck, ceiling in names if key in a
    ]


def markdown(data: dict[str, Any]) -> str:
    """The four tables of a scale run (what it measured, its machine and command first)."""
    meta = data["meta"]
    cfg = meta["config"]
    lines = [
        f"Run {meta['date']} at {meta['commit']} with `{meta['command']}` on {meta['machine']}. "
        f"Envelopes of {cfg['envelope_bytes']} bytes; lookups of a stored {cfg['lookup_chunks']}-chunk prefix "
        f"(32K tokens), {cfg['lookup_reps']} timed per size (embedded) and {cfg['served_reps']} (served); "
        f"clears the median of {cfg['clear_reps']}; workers for {cfg['worker_seconds']:g} s per level, each "
        f"repeating a lookup and a load of {cfg['load_chunks']} chunks of {cfg['load_bytes'] // 1024} KiB; "
        f"audit for {cfg['audit_seconds']:g} s.",
        "",
        "Lookup and resident memory by chunks stored (memory tier). CPU: the calling thread's CPU time "
        "(embedded, p50) or the server's CPU time per lookup (served, mean); `vs first`: that CPU time "
        "beside the smallest size's; bytes/chunk: resident memory added per chunk stored.",
        "",
        "| path | chunks | lookup p50 ms | p99 ms | CPU ms | vs first | RSS MiB | bytes/chunk |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *_lookup_rows(data),
        "",
        "Clear time by chunks stored (the whole admin call: registry, epoch, audit, tiers). `empty`: a "
        "namespace clear of no chunks, the fixed part; us/chunk: the namespace clear above it, per chunk; "
        "raw UNLINK: redis-py deleting the same layout in pipelined batches.",
        "",
        "| tier | chunks | namespace clear ms | tenant clear ms | empty ms | us/chunk | raw UNLINK ms | vs raw |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *_clear_rows(data),
        "",
        "One `kvgate serve` (memory tier, Postgres registry and audit) under N worker processes at once. "
        "`vs 1`: requests/s per worker, and in all, beside one worker alone.",
        "",
        "| workers | requests/s | per worker | per worker vs 1 | all vs 1 | lookup p50 / p99 ms | load p50 / p99 ms | "
        "server CPU ms/request | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *_worker_rows(data),
        "",
        "Audit rows/s into Postgres, beside raw INSERTs of the same rows into a copy of the table without "
        "the chain, in the same database and run.",
        "",
        "| path | rows/s | seconds | ceiling | ceiling rows/s | fraction |",
        "| --- | --- | --- | --- | --- | --- |",
        *_audit_rows(data),
    ]
    return "\n".join(lines) + "\n"


def write_docs(data: dict[str, Any], runs_md: Path = DOCS / "runs.md", data_dir: Path = DOCS / "runs-data",
               source: Path | None = None) -> None:
    """Put ``markdown(data)`` between the markers of ``runs_md`` (SystemExit without them) and the
    JSON beside the other runs' data as ``scale.json``."""
    text = runs_md.read_text()
    pat = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    if not pat.search(text):
        raise SystemExit(f"{runs_md} has no {BEGIN} ... {END} markers to put the tables between")
    runs_md.write_text(pat.sub(lambda _: f"{BEGIN}\n{markdown(data)}{END}", text))
    data_dir.mkdir(parents=True, exist_ok=True)
    target = data_dir / "scale.json"
    if source is not None and source.resolve() != target.resolve():
        shutil.copyfile(source, target)
    elif source is None:
        target.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scripts.scale.render", description=__doc__)
    p.add_argument("json", type=Path)
    p.add_argument("--docs", action="store_true", help="write docs/runs.md's Scale section and docs/runs-data/scale.json")
    args = p.parse_args(argv)
    data = json.loads(args.json.read_text())
    if args.docs:
        write_docs(data, source=args.json)
    print(markdown(data), end="")


if __name__ == "__main__":
    main()
