"""bench-e2e's ``published`` workload: many tenants behind one system prompt.

    python -m scripts.bench_e2e.run --published-only [--pub-tenants 16 --pub-prefix 4096 ...]

N tenants (16) send one shared P-token system prompt (4096) followed by their own questions,
Q rounds (2) of one batch (a request per tenant) each. Rows, each one engine of its own:
``isolation`` (kvgate embedded, tenants in no scope), ``published`` (kvgate embedded, every tenant
in one scope, the prompt published and its chunks recorded before the engine starts) and
``example`` (vLLM's ExampleConnector: one store for everyone, keyed by the whole prompt). Before
the timed rounds every row computes the system prompt once (kvgate: the publish answer's
capability in ``published``, a tenant of its own in ``isolation``); after them each tenant stores
a private prompt that its neighbour then sends (the cross-tenant check). Per row: TTFT median/p90,
prefill tokens computed (prompt - vLLM's cached tokens), requests/s (requests over the batches'
wall time) and the neighbour's tokens loaded on its private prompt. Design notes:
docs/architecture.md, section 5; docs/e2e.md, "Published prefixes"."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scripts.bench_e2e.model import SIZES, build_llama, prompt_ids
from scripts.bench_e2e.systems import ROOT, System, open_system, salts

__all__ = ["QUICK", "PubConfig", "add_args", "analyze", "config", "doc_section", "markdown", "run", "write_docs"]

LABELS = {"isolation": "kvgate, strict isolation", "published": "kvgate, published prefix",
          "example": "ExampleConnector (shares everything)"}
SCOPE = "bench"
WARM = "__publisher__"  # the capability that computes the system prompt before the timed rounds
PREFIX_SEED = 4_242_000
BEGIN, END = "<!-- bench-e2e-published:begin -->", "<!-- bench-e2e-published:end -->"


@dataclass
class PubConfig:
    tenants: int = 16
    prefix_tokens: int = 4096
    questions: int = 2
    question_tokens: int = 64
    private_tokens: int = 512  # each tenant's private document after the system prompt (the cross-tenant check)
    systems: list[str] = field(default_factory=lambda: list(LABELS))
    memory_bytes: int = 4 << 30  # the worker's memory tier (every tenant's copy of the prompt in isolation)
    kv_cache_gb: int = 4  # one round of every tenant's prompt in vLLM's KV cache

    @property
    def names(self) -> list[str]:
        return [f"tenant{t:02d}" for t in range(self.tenants)]


QUICK: dict[str, Any] = {"tenants": 4, "prefix_tokens": 512, "questions": 2, "question_tokens": 32, "private_tokens": 512,
                         "memory_bytes": 256 << 20, "kv_cache_gb": 1}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--published", action="store_true", help="also run the published-prefix workload")
    p.add_argument("--published-only", action="store_true", help="run the published-prefix workload only")
    p.add_argument("--pub-tenants", type=int)
    p.add_argument("--pub-prefix", type=int, dest="pub_prefix_tokens", help="tokens of the shared system prompt")
    p.add_argument("--pub-questions", type=int, help="rounds: questions per tenant")
    p.add_argument("--pub-question-tokens", type=int)
    p.add_argument("--pub-private-tokens", type=int, help="each tenant's private document (the cross-tenant check)")
    p.add_argument("--pub-systems", type=lambda s: [x for x in s.split(",") if x], help=f"of {','.join(LABELS)}")


def config(a: argparse.Namespace) -> PubConfig | None:
    """The workload's configuration from the command line; None where it is not asked for."""
    if not (a.published or a.published_only):
        return None
    cfg = PubConfig(**(QUICK if a.quick else {}))
    for name in ("tenants", "prefix_tokens", "questions", "question_tokens", "private_tokens", "systems"):
        value = getattr(a, "pub_" + name)
        if value is not None:
            setattr(cfg, name, value)
    unknown = [s for s in cfg.systems if s not in LABELS]
    if unknown or cfg.tenants < 2 or cfg.questions < 1 or cfg.prefix_tokens < 1:
        raise SystemExit(f"published workload: systems of {', '.join(LABELS)}, at least 2 tenants and 1 question")
    return cfg


def _fingerprint(main: Any) -> str:
    """The model fingerprint's digest as the connector derives it on a CPU engine (the scheduler's
    ``KVModel`` of the model name it is given and vLLM's CPU cache geometry)."""
    import torch

    from gateway.types import KVModel
    from kernels.layouts import KVGeometry, KVLayout

    size = SIZES[main.size]
    geometry = KVGeometry(size.layers, size.kv_heads, size.head_size, getattr(torch, main.dtype), main.block_size, KVLayout.CPU)
    return KVModel("bench-llama", geometry).fingerprint_digest


async def _setup(settings: dict[str, Any], tenants: list[str], prefix: list[int] | None, fingerprint: str) -> dict[str, Any]:
    """Tenants and their capabilities; with ``prefix`` first a scope of them all, the prefix
    published into it and its chunks recorded (the warm-up's report), its capability as WARM."""
    from gateway.config import Settings
    from gateway.services import dbschema
    from gateway.services.prefixes import chain_from_digest
    from gateway.services.runtime import open_runtime
    from scripts.bench_e2e.systems import CAP_TTL, OPS

    Path(settings["state_dir"]).mkdir(parents=True, exist_ok=True, mode=0o700)
    await asyncio.to_thread(dbschema.upgrade, Settings(**settings).db_url)
    rt = await open_runtime(Settings(**settings))
    try:
        caps: dict[str, str] = {}
        info: dict[str, Any] = {}
        for t in tenants:
            await rt.admin.create_tenant(t)
        if prefix is None:  # the system prompt is computed once by a tenant of its own
            await rt.admin.create_tenant("publisher")
            caps[WARM] = await rt.access.mint("publisher", "default", OPS, CAP_TTL)
        else:
            await rt.prefixes.create_scope(SCOPE, members=tenants)
            pub = await rt.prefixes.publish(SCOPE, "bench-llama", prefix, ttl=CAP_TTL)
            raw = b"".join(t.to_bytes(4, "little") for t in prefix)
            hashes = chain_from_digest(fingerprint, raw, settings["chunk_tokens"])
            await rt.prefixes.warm(pub.capability, pub.publication.id, fingerprint, hashes)
            caps[WARM] = pub.capability
            info = {"prefix_id": pub.publication.id, "digest": pub.publication.digest, "whole_chunks": pub.whole_chunks}
        for t in tenants:  # minted after the scope: a member's capability lists it
            caps[t] = await rt.access.mint(t, "default", OPS, CAP_TTL)
        return {"caps": caps, "info": info}
    finally:
        await rt.aclose()


def _kvgate(key: str, work: Path, cfg: PubConfig, main: Any, prefix: list[int]) -> tuple[System, dict[str, Any]]:
    """As ``kvgate-embedded`` (memory and Redis tiers: the scheduler's lookups see the worker's
    stores through Redis), with the scope and publication of ``published`` made first."""
    from scripts.bench_e2e.systems import _connector

    redis_prefix = f"kvgate-e2e-pub-{secrets.token_hex(4)}:"
    settings = {"state_dir": str(work / "state"), "tiers": ["memory", "redis"], "redis_url": main.redis_url,
                "redis_prefix": redis_prefix, "chunk_tokens": main.chunk_tokens, "memory_bytes": cfg.memory_bytes,
                "capability_max_ttl_s": 3600}
    got = asyncio.run(_setup(settings, cfg.names, prefix if key == "published" else None, _fingerprint(main)))
    trace = work / "trace.jsonl"
    extra = {"kvgate_settings": settings, "trace_path": str(trace), "model_name": "bench-llama"}
    flush = {"redis_url": main.redis_url, "redis_prefix": redis_prefix}  # System.close removes the keys
    return System("kvgate-embedded", _connector(extra), got["caps"], flush=flush, trace=trace), got["info"]


def _req(parts: list[list[int]], cap: str | None, salt: str | None, **tag: Any) -> dict[str, Any]:
    return {"parts": parts, "cap": cap, "salt": salt, "tag": tag}


def steps(cfg: PubConfig, main: Any, key: str, salt: dict[str, str]) -> list[dict[str, Any]]:
    """Engine warm-up, the system prompt once, Q timed rounds, the cross-tenant check."""
    kvgate = key != "example"
    prefix = [cfg.prefix_tokens, PREFIX_SEED]

    def question(t: int, q: int) -> list[list[int]]:
        return [prefix, [cfg.question_tokens, PREFIX_SEED + 1 + 100 * t + q]]

    def gen(name: str, reqs: list[dict[str, Any]], n: int = main.out_tokens) -> dict[str, Any]:
        return {"op": "gen", "name": name, "max_tokens": n, "reqs": reqs}

    out = [gen("warmup", [_req([[128, 1]], None, None, kind="warmup")], 2),
           gen("system prompt", [_req([prefix], WARM if kvgate else None, None, kind="prefix")]), {"op": "settle"}]
    names = cfg.names
    for q in range(cfg.questions):
        reqs = [_req(question(t, q), name if kvgate else None, salt[name], kind="pub", tenant=name, q=q)
                for t, name in enumerate(names)]
        out += [gen(f"published round {q}", reqs), {"op": "settle"}]
    # each tenant stores a private document after the system prompt; its neighbour then sends it
    # (what it loads beyond the system prompt's whole chunks is the owner's), and the owner itself
    # (the positive control: the private chunks are there to be found)
    def private(t: int) -> list[list[int]]:
        return [prefix, [cfg.private_tokens, PREFIX_SEED + 50_000 + t]]

    def cap(name: str) -> str | None:
        return name if kvgate else None

    n = len(names)
    out += [gen("private", [_req(private(t), cap(x), salt[x], kind="private", tenant=x) for t, x in enumerate(names)]),
            {"op": "settle"},
            gen("cross-tenant", [_req(private((t + 1) % n), cap(x), salt[x], kind="cross", tenant=x, owner=names[(t + 1) % n])
                                 for t, x in enumerate(names)]),
            gen("own", [_req(private(t), cap(x), salt[x], kind="own", tenant=x) for t, x in enumerate(names)])]
    return out


def run(cfg: PubConfig, main: Any, work: Path) -> dict[str, Any]:
    """Every row in an engine of its own; the raw rows (``analyze`` makes the figures)."""
    from scripts.bench_e2e.run import run_system

    size = SIZES[main.size]
    model = build_llama(work / f"model-{main.size}", size)
    max_len = cfg.prefix_tokens + max(cfg.question_tokens, cfg.private_tokens) + main.out_tokens + 64
    if max_len > size.max_len:
        raise SystemExit(f"prompt length {max_len} exceeds the model's {size.max_len}")
    engine = {"block_size": main.block_size, "dtype": main.dtype, "max_model_len": max_len,
              "max_num_seqs": max(8, cfg.tenants), "max_num_batched_tokens": cfg.tenants * max_len}  # a round in one step
    prefix = prompt_ids(cfg.prefix_tokens, PREFIX_SEED)
    salt = salts([*cfg.names, "publisher"])
    env_cfg = type(main)(**{**asdict(main), "kv_cache_gb": cfg.kv_cache_gb})
    runs: dict[str, Any] = {}
    failed: dict[str, str] = {}
    not_run: dict[str, str] = {}
    for key in cfg.systems:
        sys_work = work / f"published-{key}"
        sys_work.mkdir(parents=True, exist_ok=True)
        info: dict[str, Any] = {}

        def open_() -> System:
            if key == "example":
                return open_system("example", sys_work, cfg.names, asdict(main))
            system, got = _kvgate(key, sys_work, cfg, main, prefix)
            info.update(got)
            return system

        plan = {"model": str(model), "engine": engine, "steps": steps(cfg, main, key, salt)}
        ran = run_system(key, f"published/{key}", open_, plan, env_cfg, sys_work, failed, not_run)
        if ran is not None:
            runs[key] = {"label": LABELS[key], "publication": info, **ran[1]}
    return {"config": asdict(cfg), "engine": engine, "runs": runs, "failed": failed, "not_run": not_run}


def _q(xs: list[float], q: float) -> float:
    from scripts.bench_e2e.analyze import quantile

    return quantile(xs, q)


def analyze(raw: dict[str, Any], chunk_tokens: int) -> dict[str, Any]:
    """Per row: the timed rounds' TTFT, prefill tokens, requests/s, and the cross-tenant round."""
    cfg = raw["config"]
    shared = cfg["prefix_tokens"] // chunk_tokens * chunk_tokens  # what a scope may serve: whole chunks
    base = {(r["tag"]["tenant"], r["tag"]["q"]): r["tokens"]
            for r in raw["runs"].get("isolation", {}).get("rows", []) if r["tag"].get("kind") == "pub"}
    rows = []
    for key, run_ in raw["runs"].items():
        timed = [r for r in run_["rows"] if r["tag"].get("kind") == "pub"]
        cross = [r for r in run_["rows"] if r["tag"].get("kind") == "cross"]
        own = [r["cached"] for r in run_["rows"] if r["tag"].get("kind") == "own"]
        if not timed:
            continue
        ttft = [float(r["ttft_s"]) * 1e3 for r in timed]
        walls = {(r["tag"]["q"], r["batch_wall_s"]) for r in timed}  # one wall time a round
        wall = sum(w for _, w in walls)
        # a kvgate tenant holds the system prompt's whole chunks itself (its own copy, or the scope's);
        # ExampleConnector matches whole prompts only, so any hit on a neighbour's prompt is the neighbour's
        allowed = 0 if key == "example" else shared
        first = [r["cached"] for r in timed if r["tag"]["q"] == 0]
        same = [r["tokens"] == base[(r["tag"]["tenant"], r["tag"]["q"])] for r in timed if (r["tag"]["tenant"], r["tag"]["q"]) in base]
        rows.append({
            "system": key, "label": run_["label"], "requests": len(timed),
            "ttft_ms": {"median": round(statistics.median(ttft), 1), "p90": round(_q(ttft, 0.9), 1)},
            "prompt_tokens": sum(r["prompt_tokens"] for r in timed),
            "cached_tokens": sum(r["cached"] for r in timed),
            "prefill_tokens": sum(r["prompt_tokens"] - r["cached"] for r in timed),
            "req_per_s": round(len(timed) / wall, 3) if wall > 0 else None, "wall_s": round(wall, 2),
            "first_request_cached": {"min": min(first), "max": max(first)} if first else None,
            "cross_tenant": {
                "requests": len(cross),
                "hits": sum(1 for r in cross if r["cached"] > allowed),
                "private_tokens": sum(max(0, r["cached"] - allowed) for r in cross),
                "cached_median": statistics.median([r["cached"] for r in cross]) if cross else None,
                "own_cached_median": statistics.median(own) if own else None,  # the positive control
            },
            "identical_to_isolation": f"{sum(same)}/{len(same)}" if same and key != "isolation" else None,
            "publication": run_.get("publication") or None,
        })
    by = {r["system"]: r for r in rows}
    targets: dict[str, Any] = {}
    if "isolation" in by and "published" in by and by["published"]["prefill_tokens"]:
        targets["prefill_isolation_over_published"] = round(by["isolation"]["prefill_tokens"] / by["published"]["prefill_tokens"], 2)
    if "published" in by and "example" in by and by["example"]["req_per_s"]:
        targets["req_per_s_published_over_example"] = round((by["published"]["req_per_s"] or 0) / by["example"]["req_per_s"], 2)
    return {"config": cfg, "engine": raw["engine"], "shared_tokens": shared, "rows": rows, "targets": targets,
            "failed": raw.get("failed", {}), "not_run": raw.get("not_run", {})}


def _f(x: Any, nd: int = 0) -> str:
    return "-" if x is None else f"{x:,.{nd}f}" if isinstance(x, float | int) else str(x)


def markdown(pub: dict[str, Any]) -> str:
    c = pub["config"]
    lines = [
        f"Published prefixes ({c['tenants']} tenants, one {c['prefix_tokens']}-token system prompt computed once before "
        f"the timed part, {c['questions']} rounds of one {c['question_tokens']}-token question per tenant, each round one "
        f"batch; cross-tenant: each tenant sends its neighbour's private prompt, the system prompt and a "
        f"{c['private_tokens']}-token document, and a hit is a load of the neighbour's part, beyond the "
        f"{pub['shared_tokens']} tokens of the system prompt's whole chunks for kvgate; the owner's own "
        f"request is the control):", "",
        "| system | TTFT median ms | p90 ms | prefill tokens computed | cached tokens | requests/s | first request cached (min-max) | cross-tenant hits / private tokens (owner's cached) | outputs = isolation |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in pub["rows"]:
        fr, x = r["first_request_cached"], r["cross_tenant"]
        lines.append(
            f"| {r['label']} | {_f(r['ttft_ms']['median'])} | {_f(r['ttft_ms']['p90'])} | {_f(r['prefill_tokens'])} | "
            f"{_f(r['cached_tokens'])} | {_f(r['req_per_s'], 2)} | {fr['min'] if fr else '-'}-{fr['max'] if fr else '-'} | "
            f"{x['hits']}/{x['requests']} / {_f(x['private_tokens'])} ({_f(x['own_cached_median'])}) | "
            f"{r['identical_to_isolation'] or '-'} |")
    for kind in ("not_run", "failed"):
        for key, why in (pub.get(kind) or {}).items():
            reason = (why.strip().splitlines() or [""])[0][:300].replace("|", "\\|")
            lines.append(f"| {LABELS.get(key, key)} | {kind.replace('_', ' ')}: {reason} | - | - | - | - | - | - | - |")
    t = pub.get("targets") or {}
    if t:
        lines += ["", "Prefill tokens, strict isolation over published: "
                  f"{_f(t.get('prefill_isolation_over_published'), 2)}x; requests/s, published over ExampleConnector: "
                  f"{_f(t.get('req_per_s_published_over_example'), 2)}x."]
    return "\n".join(lines) + "\n"


DOC = """## Published prefixes

`make bench-e2e-published E2E_ARGS=--docs` refreshes this section and `docs/e2e-published.json`
(`scripts/bench_e2e/published.py`; `--published` runs it after the TTFT systems). {tenants} tenants
send one shared {prefix}-token system prompt, then their own questions, on the same model and
engine flags as above, in three rows of one engine each: kvgate with strict isolation (the tenants
in no scope), kvgate with the prompt published into a scope of all of them (published and its
chunks recorded before the engine starts; the run's first request computes and stores it with the
publish answer's capability) and vLLM's ExampleConnector. Every row computes the system prompt
once before the timed rounds, and a round's stores end before the next round starts (untimed).
Prefill tokens computed are the prompt tokens less vLLM's cached tokens; requests/s are the timed
requests over their batches' wall time. Then each tenant stores a private prompt (the system
prompt and a document of its own) and its neighbour sends it: kvgate may serve the neighbour the
system prompt's whole chunks, never the document (the owner's own request is the control that it
is cached). ExampleConnector keys its store by the whole prompt (block-aligned, less the last
token): it shares an identical prompt across tenants, but a prefix only with a prompt less than a
block longer, so with questions of a block or more it reuses nothing of the system prompt.
`--pub-tenants`, `--pub-prefix`, `--pub-questions`, `--pub-question-tokens`,
`--pub-private-tokens` and `--pub-systems` change the workload; `--quick` runs 4 tenants and a
512-token prompt on the tiny model. The kvgate rows use the memory and Redis tiers as
`kvgate-embedded` does; in the isolation row they hold every tenant's copy of the prompt (16 x 4K
tokens: about 3 GiB of this model's KV).

"""


def doc_section(pub: dict[str, Any] | None) -> str:
    """docs/e2e.md's section, between its markers: how to run it, and the last run's table."""
    c = pub["config"] if pub else asdict(PubConfig())
    body = DOC.format(tenants=c["tenants"], prefix=c["prefix_tokens"])
    body += markdown(pub) if pub else "No figures here: the command above writes them.\n"
    return f"{BEGIN}\n{body}{END}\n"


def write_docs(pub: dict[str, Any] | None, doc: Path = ROOT / "docs" / "e2e.md", json_path: Path | None = None) -> None:
    """Put the section into docs/e2e.md (replacing the one there, else at the end); with
    ``json_path`` the workload's figures go there too."""
    text = doc.read_text() if doc.exists() else ""
    pat = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END) + "\n?", re.DOTALL)
    section = doc_section(pub)
    text = pat.sub(lambda _: section, text) if pat.search(text) else text.rstrip("\n") + "\n\n" + section
    doc.write_text(text)
    if json_path is not None and pub is not None:
        json_path.write_text(json.dumps(pub, indent=1) + "\n")
