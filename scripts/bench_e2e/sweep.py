"""bench-e2e's bandwidth sweep: load or recompute over a link of a given speed.

    python -m scripts.bench_e2e.run --sweep-only [--sweep-gbps 0.01,0.02,0.05,1] [--sweep-lengths 1024,4096,8192]
    python -m scripts.bench_e2e.run --sweep ...    (after the systems: into e2e.json as well)

kvgate embedded with one tier, a Redis reached through a TCP proxy that holds Redis's answers (the
loads) to G GB/s (``tests/support/tcp_proxy.py``, all connections together; the stores, untimed,
go at full speed; the tier's deadlines raised so a slow load ends rather than fails). Per bandwidth
one engine (``load_policy: adaptive``), started cold: a warm-up, then per length and repetition a
stored miss and one hit per policy (``always``: always load, ``recompute``: always recompute,
``adaptive``), each naming its policy in the request (``kvgate_load_policy``), in an order that
changes with the repetition (each first in turn, and after different ones), then a flush. Every
hit follows a prefill of its prompt: the first the miss that stored it, each other one the same
prompt sent without a capability (``level``: no lookup, no store), since a hit right after a long
prefill loads slower than one after a short hit. The policies meet the same engine, link and machine
within seconds of each other, so neither one engine's speed against another's nor the machine's
drift over a run decides between them; adaptive learns from every load of the engine. Output (``analyze``): ``bandwidth_sweep``, a list of ``{gbps, length, always_load_ms, always_recompute_ms, adaptive_ms}``, each the median TTFT of the
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
    def gen(name: str, parts: list[list[int]], cap: str | None, n: int = main.out_tokens, policy: str | None = None,
            **tag: Any) -> dict[str, Any]:
        if policy:  # the request names it (kvgate_load_policy) and its row says so
            tag = {**tag, "policy": policy}
        req = {"parts": parts, "cap": cap, "salt": None, "tag": tag, **({"policy": policy} if policy else {})}
        return {"op": "gen", "name": name, "max_tokens": n, "reqs": [req]}

    out = [gen("warmup", [[128, 1]], None, 2, kind="warmup"), gen("warmup", [[min(cfg.lengths), 7]], None, 2, kind="warmup")]
    for length in cfg.lengths:
        for i in range(cfg.reps):
            parts = [[length, SEED + 1000 * length + i]]
            out += [gen(f"miss {length}/{i}", parts, TENANT, kind="miss", length=length, i=i)]
            k = i % len(cfg.policies)
            order = cfg.policies[k:] + cfg.policies[:k]  # each policy goes first in turn
            if k % 2:  # and follows more than one other: a hit's predecessor can change its time
                order = order[:1] + order[:0:-1]
            for k, policy in enumerate(order):
                if k:  # every hit follows a prefill of its length: a hit right after one loads slower
                    out.append(gen(f"level {length}/{i}", parts, None, 1, kind="level", length=length, i=i))
                out += [{"op": "settle"},
                        gen(f"hit {length}/{i} {policy}", parts, TENANT, policy=policy, kind="hit", length=length, i=i)]
            out.append({"op": "flush"})
    return out


def _one(gbps: float, cfg: SweepConfig, main: Any, model: Path, engine: dict[str, Any], work: Path) -> dict[str, Any]:
    """One engine: kvgate embedded, its Redis through a proxy of ``gbps``; every policy's hits."""
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
        extra = {"kvgate_settings": settings, "trace_path": str(trace), "model_name": "bench-llama", "load_policy": "adaptive"}
        plan = {"model": str(model), "engine": engine, "kv_transfer_config": _connector(extra), "caps": caps,
                "flush": {"redis_url": main.redis_url, "redis_prefix": redis_prefix}, "steps": steps(cfg, main)}
        t0 = time.monotonic()
        try:
            rows = run_engine(plan, work, engine_env({}, main), main.engine_timeout_s)
        finally:
            from scripts.bench_e2e.engine import _flush

            _flush(plan)
    events = [json.loads(x) for x in trace.read_text().splitlines()] if trace.exists() else []
    return {"gbps": gbps, "policies": cfg.policies, "rows": rows, "wall_s": round(time.monotonic() - t0, 1),
            "decisions": [e for e in events if e["event"] == "decision"],
            "loads": [e for e in events if e["event"] == "load"]}


def run(cfg: SweepConfig, main: Any, work: Path) -> dict[str, Any]:
    """Every bandwidth in an engine of its own, all the policies in each; the raw rows (``analyze``
    makes the list)."""
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
        key = f"{gbps:g} GB/s"
        sub = work / f"sweep-{gbps:g}"
        sub.mkdir(parents=True, exist_ok=True)
        print(f"[bench-e2e] sweep {key}: starting (load {_load()})", flush=True)
        try:
            runs.append(_one(gbps, cfg, main, model, engine, sub))
        except Exception as exc:
            print(f"[bench-e2e] sweep {key}: FAILED: {exc}", flush=True)
            failed[key] = str(exc)[-2000:]
            continue
        print(f"[bench-e2e] sweep {key}: {len(runs[-1]['rows'])} requests in {runs[-1]['wall_s']} s", flush=True)
    return {"config": asdict(cfg), "kv_bytes_per_token": size.kv_bytes_of(main.dtype),
            "runs": runs, "failed": failed}


def analyze(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """``bandwidth_sweep``: per bandwidth and length the median hit TTFT of each policy (its hits
    in that bandwidth's engine)."""
    cfg = raw["config"]

    def hits(run_: dict[str, Any], length: int, policy: str) -> list[dict[str, Any]]:
        return [r for r in run_["rows"] if (r.get("tag") or {}).get("kind") == "hit" and r["tag"]["length"] == length
                and r["tag"].get("policy") == policy]

    def median_ms(rows: list[dict[str, Any]]) -> float | None:
        ttft = [r["ttft_s"] * 1e3 for r in rows if r.get("ttft_s") is not None]
        return round(statistics.median(ttft), 1) if ttft else None

    out = []
    for gbps in cfg["gbps"]:
        run_ = next((r for r in raw["runs"] if r["gbps"] == gbps), None)
        if run_ is None:
            continue
        detail = _detail(run_)
        for length in cfg["lengths"]:
            row: dict[str, Any] = {"gbps": gbps, "length": length}
            for policy, column in POLICIES.items():
                got = hits(run_, length, policy)
                if not got:
                    continue
                row[column] = median_ms(got)
                if policy == "adaptive":
                    row["adaptive_loaded"] = sum(1 for r in got if r.get("cached", 0) > 0)
                    row["adaptive_reps"] = len(got)
            best: list[float] = [v for c in ("always_load_ms", "always_recompute_ms") if (v := row.get(c))]
            if best and row.get("adaptive_ms"):
                row["adaptive_vs_best"] = round(row["adaptive_ms"] / min(best), 3)
            row["hits"] = [d for d in detail if d["length"] == length]
            out.append(row)
    return out


def _detail(run_: dict[str, Any]) -> list[dict[str, Any]]:
    """Every hit of one engine in the order it ran: its policy, the one before it in its
    repetition, its TTFT, the decision (tokens, reason, estimates) and the load the workers
    measured (time, lead). The n-th decision is the n-th hit's: a miss looks up nothing to decide."""
    rows = [r for r in run_["rows"] if (r.get("tag") or {}).get("kind") == "hit"]
    decisions = run_.get("decisions") or []
    loads: dict[str, list[dict[str, Any]]] = {}
    for e in run_.get("loads") or []:
        loads.setdefault(str(e.get("req")), []).append(e)
    out: list[dict[str, Any]] = []
    before: dict[tuple[int, int], str] = {}
    for i, r in enumerate(rows):
        tag = r["tag"]
        d = decisions[i] if len(decisions) == len(rows) else {}
        mine = loads.get(str(d.get("req")), [])
        rep = (tag["length"], tag["i"])
        out.append({
            "length": tag["length"], "i": tag["i"], "policy": tag.get("policy"), "after": before.get(rep),
            "ttft_ms": None if r.get("ttft_s") is None else round(r["ttft_s"] * 1e3, 1), "cached": r.get("cached"),
            **{k: d.get(k) for k in ("tokens", "reason", "est_ttft_ms", "est_load_ms", "est_lead_ms", "est_recompute_ms")},
            "load_ms": round(sum(e.get("ms", 0.0) for e in mine), 1) if mine else None,
            "lead_ms": round(sum(e.get("lead_ms", e.get("ms", 0.0)) for e in mine), 1) if mine else None,
        })
        before[rep] = tag.get("policy")
    return out


def run_and_write(
    cfg: SweepConfig, main: Any, workdir: Path | None, json_path: Path | None = None, docs: bool = False,
) -> list[dict[str, Any]]:
    """The sweep alone: run it, write its JSON (``bandwidth_sweep``), raw rows and table; ``docs``:
    its list and meta into docs/e2e.json too, beside the systems' figures of their own run."""
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
    if docs:
        e2e = ROOT / "docs" / "e2e.json"
        doc = json.loads(e2e.read_text()) if e2e.exists() else {"meta": {}}
        doc["bandwidth_sweep"] = rows
        doc["meta"]["bandwidth_sweep"] = meta
        e2e.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote bandwidth_sweep into {e2e}")
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
