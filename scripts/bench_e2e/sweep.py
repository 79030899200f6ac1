"""bench-e2e's bandwidth sweep: load or recompute over a link of a given speed.

    python -m scripts.bench_e2e.run --sweep-only [--sweep-gbps 0.01,0.02,0.05,1] [--sweep-lengths 1024,4096,8192]
    python -m scripts.bench_e2e.run --sweep ...    (after the systems: into e2e.json as well)

kvgate embedded with one tier, a Redis reached through a TCP proxy that holds Redis's answers (the
loads) to G GB/s (``tests/support/tcp_proxy.py``, all connections together; the stores, untimed,
go at full speed; the tier's deadlines raised so a slow load ends rather than fails). Per bandwidth
and ``load_policy`` (``always``: always load, ``adaptive``) one engine, started cold: a warm-up, then
per length and repetition a stored miss, the timed hit and a flush. ``recompute`` (always
recompute) reads nothing over the link but the lookup, so it runs once, at the fastest bandwidth,
and its medians stand for every bandwidth (``always_recompute_gbps`` says where they were
measured). Output (``analyze``): ``bandwidth_sweep``, a list of ``{gbps, length, always_load_ms, always_recompute_ms, adaptive_ms}``, each the median TTFT of the
hits, with ``adaptive_loaded`` (the hits adaptive loaded, of its repetitions) and the ratio of
adaptive to the better of the other two. Alone (``--sweep-only``) it writes bench-results/e2e-sweep.json
(``--sweep-json``), its raw rows beside it and a Markdown table; with ``--sweep`` the list goes into
e2e.json and its table into e2e.md. Design notes: docs/architecture.md, section 5; docs/e2e.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from scripts.bench_e2e.model import SIZES, build_llama

__all__ = ["POLICIES", "QUICK", "SweepConfig", "add_args", "analyze", "config", "markdown", "run", "run_and_write"]

# load_policy -> the column of bandwidth_sweep
POLICIES = {"always": "always_load_ms", "recompute": "always_recompute_ms", "adaptive": "adaptive_ms"}
SEED = 5_150_000
TENANT = "acme"


@dataclass
class SweepConfig:
    gbps: list[float] = field(default_factory=lambda: [0.01, 0.02, 0.05, 1.0])
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 8192])
    reps: int = 3
    policies: list[str] = field(default_factory=lambda: list(POLICIES))


QUICK: dict[str, Any] = {"gbps": [0.005, 1.0], "lengths": [512], "reps": 2}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", action="store_true", help="also run the bandwidth sweep (load or recompute)")
    p.add_argument("--sweep-only", action="store_true", help="run the bandwidth sweep only")
    p.add_argument("--sweep-gbps", type=lambda s: [float(x) for x in s.split(",")], help="GB/s of the throttled link")
    p.add_argument("--sweep-lengths", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--sweep-reps", type=int)
    p.add_argument("--sweep-policies", type=lambda s: [x for x in s.split(",") if x], help=f"of {','.join(POLICIES)}")
    p.add_argument("--sweep-json", type=Path, help="with --sweep-only (default: bench-results/e2e-sweep.json)")


def config(a: argparse.Namespace) -> SweepConfig | None:
    """The sweep's configuration from the command line; None where it is not asked for."""
    if not (a.sweep or a.sweep_only):
        return None
    cfg = SweepConfig(**(QUICK if a.quick else {}))
    for name in ("gbps", "lengths", "reps", "policies"):
        value = getattr(a, "sweep_" + name)
        if value is not None:
            setattr(cfg, name, value)
    if [p for p in cfg.policies if p not in POLICIES] or cfg.reps < 1 or not cfg.gbps or min(cfg.gbps) <= 0:
        raise SystemExit(f"bandwidth sweep: policies of {', '.join(POLICIES)}, positive bandwidths, at least 1 repetition")
    return cfg


def steps(cfg: SweepConfig, main: Any) -> list[dict[str, Any]]:
    def gen(name: str, parts: list[list[int]], cap: str | None, n: int = main.out_tokens, **tag: Any) -> dict[str, Any]:
        return {"op": "gen", "name": name, "max_tokens": n, "reqs": [{"parts": parts, "cap": cap, "salt": None, "tag": tag}]}

    out = [gen("warmup", [[128, 1]], None, 2, kind="warmup"), gen("warmup", [[min(cfg.lengths), 7]], None, 2, kind="warmup")]
    for length in cfg.lengths:
        for i in range(cfg.reps):
            parts = [[length, SEED + 1000 * length + i]]
            out += [gen(f"miss {length}/{i}", parts, TENANT, kind="miss", length=length, i=i), {"op": "settle"},
                    gen(f"hit {length}/{i}", parts, TENANT, kind="hit", length=length, i=i), {"op": "flush"}]
    return out


def _one(policy: str, gbps: float, cfg: SweepConfig, main: Any, model: Path, engine: dict[str, Any], work: Path) -> dict[str, Any]:
    """One engine: kvgate embedded, its Redis through a proxy of ``gbps``, ``load_policy``."""
    from scripts.bench_e2e.run import engine_env, run_engine
    from scripts.bench_e2e.systems import CAP_TTL, _connector, _embedded_caps
    from tests.support.tcp_proxy import tcp_proxy

    target = urlsplit(main.redis_url)
    redis_prefix = f"kvgate-e2e-sweep-{secrets.token_hex(4)}:"
    with tcp_proxy(target.hostname or "127.0.0.1", target.port or 6379, rate_bps=gbps * 1e9) as proxy:
        settings = {"state_dir": str(work / "state"), "tiers": ["redis"], "redis_url": proxy.url_for("redis") + (target.path or "/0"),
                    "redis_prefix": redis_prefix, "chunk_tokens": main.chunk_tokens, "capability_max_ttl_s": CAP_TTL,
                    # a load over a slow link takes seconds: it is timed, not cut at the tier's deadline
                    "tier_read_timeout_s": 60.0, "tier_write_timeout_s": 60.0}
        proxy.rate_bps = None  # the set-up is not timed
        caps = asyncio.run(_embedded_caps(settings, [TENANT]))
        proxy.rate_bps = gbps * 1e9
        proxy.throttle_up = False  # the stores before each hit are not timed: only the loads cross the slow link
        trace = work / "trace.jsonl"
        extra = {"kvgate_settings": settings, "trace_path": str(trace), "model_name": "bench-llama", "load_policy": policy}
        plan = {"model": str(model), "engine": engine, "kv_transfer_config": _connector(extra), "caps": caps,
                "flush": {"redis_url": main.redis_url, "redis_prefix": redis_prefix}, "steps": steps(cfg, main)}
        t0 = time.monotonic()
        try:
            rows = run_engine(plan, work, engine_env({}, main), main.engine_timeout_s)
        finally:
            from scripts.bench_e2e.engine import _flush

            _flush(plan)
    events = [json.loads(x) for x in trace.read_text().splitlines()] if trace.exists() else []
    return {"policy": policy, "gbps": gbps, "rows": rows, "wall_s": round(time.monotonic() - t0, 1),
            "decisions": [e for e in events if e["event"] == "decision"],
            "loads": [e for e in events if e["event"] == "load"]}


def run(cfg: SweepConfig, main: Any, work: Path) -> dict[str, Any]:
    """Every (bandwidth, policy) in an engine of its own, ``recompute`` at the fastest bandwidth
    only; the raw rows (``analyze`` makes the list)."""
    from scripts.bench_e2e.run import _load

    size = SIZES[main.size]
    model = build_llama(work / f"model-{main.size}", size)
    max_len = max(cfg.lengths) + main.out_tokens + 64
    if max_len > size.max_len:
        raise SystemExit(f"prompt length {max_len} exceeds the model's {size.max_len}")
    engine = {"block_size": main.block_size, "dtype": main.dtype, "max_model_len": max_len, "max_num_seqs": 8,
              "max_num_batched_tokens": max_len}
    runs: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    for gbps in cfg.gbps:
        for policy in cfg.policies:
            if policy == "recompute" and gbps != max(cfg.gbps):
                continue
            key = f"{policy}@{gbps:g}"
            sub = work / f"sweep-{policy}-{gbps:g}"
            sub.mkdir(parents=True, exist_ok=True)
            print(f"[bench-e2e] sweep {key}: starting (load {_load()})", flush=True)
            try:
                runs.append(_one(policy, gbps, cfg, main, model, engine, sub))
            except Exception as exc:
                print(f"[bench-e2e] sweep {key}: FAILED: {exc}", flush=True)
                failed[key] = str(exc)[-2000:]
                continue
            print(f"[bench-e2e] sweep {key}: {len(runs[-1]['rows'])} requests in {runs[-1]['wall_s']} s", flush=True)
    return {"config": asdict(cfg), "kv_bytes_per_token": size.kv_bytes_per_token(4 if main.dtype == "float32" else 2),
            "runs": runs, "failed": failed}


def analyze(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """``bandwidth_sweep``: per bandwidth and length the median hit TTFT of each policy. A policy
    run at one bandwidth only (``recompute``) gives its medians to every bandwidth."""
    cfg = raw["config"]

    def hits(run_: dict[str, Any], length: int) -> list[dict[str, Any]]:
        return [r for r in run_["rows"] if (r.get("tag") or {}).get("kind") == "hit" and r["tag"]["length"] == length]

    def median_ms(rows: list[dict[str, Any]]) -> float | None:
        ttft = [r["ttft_s"] * 1e3 for r in rows if r.get("ttft_s") is not None]
        return round(statistics.median(ttft), 1) if ttft else None

    out = []
    for gbps in cfg["gbps"]:
        for length in cfg["lengths"]:
            row: dict[str, Any] = {"gbps": gbps, "length": length}
            for policy, column in POLICIES.items():
                runs = [r for r in raw["runs"] if r["policy"] == policy]
                run_ = next((r for r in runs if r["gbps"] == gbps), runs[0] if len(runs) == 1 else None)
                if run_ is None:
                    continue
                got = hits(run_, length)
                row[column] = median_ms(got)
                if run_["gbps"] != gbps:
                    row[column.replace("_ms", "_gbps")] = run_["gbps"]
                if policy == "adaptive":
                    row["adaptive_loaded"] = sum(1 for r in got if r.get("cached", 0) > 0)
                    row["adaptive_reps"] = len(got)
            best: list[float] = [v for c in ("always_load_ms", "always_recompute_ms") if (v := row.get(c))]
            if best and row.get("adaptive_ms"):
                row["adaptive_vs_best"] = round(row["adaptive_ms"] / min(best), 3)
            out.append(row)
    return out


def run_and_write(cfg: SweepConfig, main: Any, workdir: Path | None, json_path: Path | None = None) -> list[dict[str, Any]]:
    """The sweep alone: run it, write its JSON (``bandwidth_sweep``), raw rows and table."""
    from scripts.bench_e2e.run import _machine
    from scripts.bench_e2e.systems import ROOT

    t0 = time.monotonic()
    machine = _machine()
    with tempfile.TemporaryDirectory(prefix="kvgate-e2e-sweep-") as tmp:
        raw = run(cfg, main, workdir or Path(tmp))
    rows = analyze(raw)
    path = json_path or ROOT / "bench-results" / "e2e-sweep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {**machine, "config": asdict(main), "sweep": raw["config"], "kv_bytes_per_token": raw["kv_bytes_per_token"],
            "failed": raw["failed"], "total_wall_s": round(time.monotonic() - t0, 1)}
    path.write_text(json.dumps({"meta": meta, "bandwidth_sweep": rows}, indent=1) + "\n")
    path.with_name(f"{path.stem}-raw.json").write_text(json.dumps(raw) + "\n")
    md = markdown(rows)
    path.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {path}, {path.with_suffix('.md')}")
    if raw["failed"]:
        raise SystemExit(f"bandwidth sweep: {len(raw['failed'])} engine runs failed: {', '.join(raw['failed'])}")
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = ["### Bandwidth sweep (load or recompute)", "",
             "TTFT of a hit (median, ms) with kvgate's only tier behind a link of the given speed.", "",
             "| GB/s | tokens | always load | always recompute | adaptive | adaptive / better | adaptive loaded |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def f(v: Any) -> str:
        return "n/a" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    for r in rows:
        loaded = f"{r['adaptive_loaded']}/{r['adaptive_reps']}" if "adaptive_reps" in r else "n/a"
        lines.append(f"| {f(r['gbps'])} | {r['length']} | {f(r.get('always_load_ms'))} | {f(r.get('always_recompute_ms'))} | "
                     f"{f(r.get('adaptive_ms'))} | {f(r.get('adaptive_vs_best'))} | {loaded} |")
    return "\n".join(lines) + "\n"
