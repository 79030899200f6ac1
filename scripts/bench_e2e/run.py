"""``make bench-e2e``: time to first token on a real CPU vLLM engine, kvgate beside the peers.

    python -m scripts.bench_e2e.run [--quick] [--lengths 1024,4096,8192] [--reps 5] [--systems ...]

Builds the random-weight Llama (model.py), then for each system (systems.py) starts one engine
process (engine.py; LMCache's in its own environment, after a preflight) with the same flags and
thread count, drives it through the same steps, stops it by process id, and writes
``bench-results/e2e.json``, the PNG and the Markdown table (report.py; ``--docs`` also refreshes
docs/e2e.md, docs/e2e.json, docs/img/e2e_ttft.png and the README section between its markers).
Steps per system: a warm-up; per prompt length and repetition, tenant A misses and stores, the
store settles, A hits, at the isolation length tenant B sends A's prompt, then the store is
flushed; the multi-tenant workload (``--published``: then published.py's workload; alone with
``--published-only``). A system that cannot run is not dropped silently: its reason
(``systems.NotRun``, or a preflight that saw no hit) goes to ``meta.not_run``, one that fails mid-run
to ``meta.failed``, and the report gives each a row. ``--interleave`` starts every system's engine at
once and takes their requests in turns instead (interleave.py), so no system meets a different
machine than another. Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from scripts.bench_e2e import published
from scripts.bench_e2e.model import SIZES, build_llama
from scripts.bench_e2e.systems import ROOT, NotRun, System, describe, open_system, salts, start_process, stop_process

ISO_A, ISO_B = "acme", "globex"


@dataclass
class Config:
    size: str = "full"
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 8192, 16384])  # the model's max is 16,640
    reps: int = 5
    iso_length: int = 4096
    # greedy tokens per request: a decode figure is a rate over all but the first, and over seven
    # steps (a quarter second) it spread by a third with no store beside it; a store yields to
    # decode steps, so it spans whatever the decode lasts, up to its bound (store_finish_s)
    out_tokens: int = 32
    tenants: int = 4
    context: int = 2048
    questions: int = 4
    question_tokens: int = 64
    systems: list[str] = field(default_factory=lambda: [
        "none", "kvgate-embedded", "kvgate-remote", "kvgate-remote-uds", "kvgate-remote-shm", "example", "lmcache"])
    chunk_tokens: int = 256
    block_size: int = 32
    dtype: str = "float32"
    memory_bytes: int = 3 << 30
    # kvgate-remote-shm: each tenant's region in MiB; None: room for the longest prompt's envelopes
    # (``region_mb``), as an operator sizes it for the prompts its engines take
    shm_mb: int | None = None
    kv_cache_gb: int = 3
    redis_url: str = "redis://127.0.0.1:6379/0"
    # every system's engine up at once, their requests in turns (interleave.py), a gap between
    # turns for the engine that ran to go idle
    interleave: bool = False
    interleave_gap_s: float = 2.0
    # before each miss, the same prompt without a capability in the same engine: no lookup and no
    # store, so the pair times what the connector adds to a miss free of the machine's drift
    paired_miss: bool = False
    engine_timeout_s: int = 1500
    # LMCache's environment (vLLM + LMCache; systems.py): the option, the variable, or the default place
    lmcache_python: str = field(default_factory=lambda: os.environ.get(
        "KVGATE_E2E_LMCACHE_PYTHON", str(ROOT / ".venv-lmcache-vllm" / "bin" / "python")))

    @property
    def mt_tenants(self) -> list[str]:
        return [f"tenant{t}" for t in range(self.tenants)]


QUICK: dict[str, Any] = {"size": "tiny", "lengths": [256, 512], "reps": 2, "iso_length": 512, "tenants": 2,
                         "context": 256, "questions": 2, "memory_bytes": 256 << 20, "kv_cache_gb": 1}


def _seed(length: int, i: int) -> int:
    return length * 1000 + i


def _req(parts: list[list[int]], who: str | None, salt: dict[str, str], **tag: Any) -> dict[str, Any]:
    return {"parts": parts, "cap": who, "salt": salt[who] if who else None, "tag": tag}


def steps(cfg: Config, key: str, salt: dict[str, str]) -> list[dict[str, Any]]:
    def gen(name: str, reqs: list[dict[str, Any]], n: int = cfg.out_tokens) -> dict[str, Any]:
        return {"op": "gen", "name": name, "max_tokens": n, "reqs": reqs}

    out = [gen("warmup", [_req([[128, 1]], None, salt, kind="warmup")], 2),
           gen("warmup", [_req([[min(cfg.lengths), 7]], None, salt, kind="warmup")], 2)]
    for length in cfg.lengths:
        for i in range(cfg.reps):
            parts = [[length, _seed(length, i)]]
            if key == "none":
                out.append(gen(f"base {length}/{i}", [_req(parts, ISO_A, salt, kind="base", length=length, i=i)]))
                continue
            miss = gen(f"miss {length}/{i}", [_req(parts, ISO_A, salt, kind="miss", length=length, i=i)])
            if cfg.paired_miss and key.startswith("kvgate"):
                # each side of a pair starts with no store of the connector's running, and the
                # order alternates, so neither an earlier store nor going first favours one side;
                # only kvgate skips a request without a capability (another connector would store
                # the first of the pair, and the second would be its hit)
                capless = gen(f"capless {length}/{i}", [_req(parts, None, salt, kind="capless", length=length, i=i)])
                first, second = (capless, miss) if i % 2 == 0 else (miss, capless)
                out.extend([{"op": "settle"}, first, {"op": "settle"}, second])
            else:
                out.append(miss)
            out.append({"op": "settle"})  # the miss's store has ended: the hit measures a load
            out.append(gen(f"hit {length}/{i}", [_req(parts, ISO_A, salt, kind="hit", length=length, i=i)]))
            if length == cfg.iso_length:
                out.append(gen(f"b_on_a {length}/{i}", [_req(parts, ISO_B, salt, kind="b_on_a", length=length, i=i)]))
            out.append({"op": "flush"})
    for q in range(cfg.questions):
        reqs = [
            _req([[cfg.context, 7000 + t], [cfg.question_tokens, 8000 + 100 * t + q]], tenant if key != "none" else None,
                 salt, kind="mt", tenant=tenant, q=q)
            for t, tenant in enumerate(cfg.mt_tenants)
        ]
        out.append(gen(f"mt round {q}", reqs))
    return out


def engine_env(extra: dict[str, str], cfg: Config) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL="WARNING",
        VLLM_CPU_KVCACHE_SPACE=str(cfg.kv_cache_gb),
        # every system on all cores: without a connector vLLM would keep one back (and run on one thread here)
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(extra)
    return env


def run_engine(plan: dict[str, Any], work: Path, env: dict[str, str], timeout_s: int,
               python: str = sys.executable) -> list[dict[str, Any]]:
    work.mkdir(parents=True, exist_ok=True)
    plan_path, out_path, log_path = work / "plan.json", work / "results.jsonl", work / "engine.log"
    plan_path.write_text(json.dumps(plan))
    proc = start_process([python, "-m", "scripts.bench_e2e.engine", str(plan_path), str(out_path)], env, log_path)
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        rc = -1
    finally:
        stop_process(proc)  # its process group: vLLM's engine core and workers too
    rows = [json.loads(x) for x in out_path.read_text().splitlines()] if out_path.exists() else []
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"engine exited with {rc} after {len(rows)} requests; log {log_path}:\n{tail}")
    return rows


ANSI = re.compile(r"\x1b\[[0-9;]*m")
# vLLM's and LMCache's log prefixes, then what is left of an error: the exception line and
# LMCache's "System will operate in degraded mode (recompute)"
LOG_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?((ERROR|WARNING|INFO) \S+ \S+ \[[^]]*\] )?(\[[^]]*\] )?")
ERROR_LINE = re.compile(r"^(\w+(Error|Exception): .*|.*degraded mode.*)$")


def _log_errors(log: str, limit: int = 4) -> list[str]:
    """The distinct exception lines of an engine log (and LMCache's degraded-mode line), in order."""
    seen: list[str] = []
    for line in ANSI.sub("", log).splitlines():
        line = LOG_PREFIX.sub("", line.strip()).strip(" .")[:300]
        if ERROR_LINE.match(line) and line not in seen:
            seen.append(line)
    return seen[:limit]


def preflight(system: System, cfg: Config, plan: dict[str, Any], work: Path) -> None:
    """Before the full plan: the same prompt twice (two chunks); the second must load something.

    A connector can start and yet never hit: LMCache 0.5.6 on a CPU engine logs that it cannot
    build its KV connector and runs on in "degraded mode (recompute)". Such a system is not run
    (``NotRun``, with its versions and the engine log's error lines), rather than reported as one
    that misses every time.
    """
    length = min(2 * cfg.chunk_tokens, max(cfg.lengths))
    req = {"parts": [[length, 999_000 + length]], "cap": None, "salt": None, "tag": {"kind": "preflight"}}
    steps = [{"op": "gen", "name": f"preflight {n}", "max_tokens": cfg.out_tokens, "reqs": [req]} for n in ("miss", "hit")]
    sub = work / "preflight"
    try:
        rows = run_engine({**plan, "steps": steps}, sub, engine_env(system.env, cfg), cfg.engine_timeout_s, system.python)
    except RuntimeError as exc:
        raise NotRun(f"{_versions(system)}: the engine did not run: {' / '.join(_log_errors(str(exc))) or str(exc)[-500:]}") from exc
    if len(rows) == 2 and rows[1]["cached"] > 0:
        return
    errors = _log_errors((sub / "engine.log").read_text(errors="replace"))
    raise NotRun(f"{_versions(system)}: the engine starts but never loads KV (the second request of the same "
                 f"{length}-token prompt had 0 cached tokens); engine log: {' / '.join(errors) or '(no error lines)'}")


def run_system(
    key: str, name: str, open_: Callable[[], System], plan: dict[str, Any], cfg: Config, work: Path,
    failed: dict[str, str], not_run: dict[str, str],
) -> tuple[System, dict[str, Any]] | None:
    """One system's engine lifetime: ``open_`` it, run ``plan`` (its model, engine and steps; the
    system's connector, capabilities and flush are added) after the system's preflight, close it.
    Gives the system and its rows, the connector's loads and stores, the wall time and the load
    averages; None where it was not run (the reason in ``not_run[key]``) or failed (``failed[key]``)."""
    t0 = time.monotonic()
    load_before = _load()
    print(f"[bench-e2e] {name}: starting (load {load_before})", flush=True)
    try:
        system = open_()
        try:
            plan = {**plan, "kv_transfer_config": system.ktc, "caps": system.caps, "flush": system.flush}
            if system.preflight:
                preflight(system, cfg, plan, work)
            rows = run_engine(plan, work, engine_env(system.env, cfg), cfg.engine_timeout_s, system.python)
        finally:
            system.close()
    except NotRun as exc:
        print(f"[bench-e2e] {name}: not run: {exc}", flush=True)
        not_run[key] = str(exc)
        return None
    except Exception as exc:
        print(f"[bench-e2e] {name}: FAILED: {exc}", flush=True)
        failed[key] = str(exc)[-2000:]
        return None
    trace = [json.loads(x) for x in system.trace.read_text().splitlines()] if system.trace and system.trace.exists() else []
    out = {"rows": rows, "trace": [e for e in trace if e["event"] in ("load", "store")],
           "wall_s": round(time.monotonic() - t0, 1), "load_before": load_before, "load_after": _load()}
    print(f"[bench-e2e] {name}: {len(rows)} requests in {out['wall_s']} s", flush=True)
    return system, out


def _versions(system: System) -> str:
    return ", ".join(f"{k} {v}" for k, v in system.versions.items()) or system.label


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _commit() -> str | None:
    """The checkout's commit, ``+dirty`` where tracked files differ from it."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "") if head else None
    except (OSError, subprocess.SubprocessError):
        return None


def _machine() -> dict[str, Any]:
    import platform

    import torch
    import vllm

    info = _cpuinfo()
    cpu = info.get("model name") or platform.processor()
    mem = next((int(ln.split()[1]) // (1 << 20) for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), None)
    return {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "commit": _commit(), "cpus": os.cpu_count(), "cpu_model": cpu, "cpu": _cpu_id(info), "mem_gib": mem,
            "ceilings": _ceilings(), "omp_env": _omp_env(), "loadavg_start": _load(), "uptime_start": _uptime(),
            "note": ("the load averages count this run's own engines (with --interleave every one is up at once); "
                     "what the idle ones used during a turn is interleave.others_cpu_s")}


_FLAGS = ("aes", "vaes", "vpclmulqdq", "avx2", "avx512f")


def _cpuinfo() -> dict[str, str]:
    """/proc/cpuinfo's fields, as its first CPU gives them."""
    info: dict[str, str] = {}
    for ln in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = ln.partition(":")
        info.setdefault(key.strip(), value.strip())
    return info


def _cpu_id(info: dict[str, str] | None = None) -> dict[str, Any]:
    """Which CPU ran the run (hosts of one name differ: family and model tell a generation) and
    whether it has the instructions AES-GCM runs on."""
    info = _cpuinfo() if info is None else info
    flags = set(info.get("flags", "").split())
    return {"family": info.get("cpu family"), "model": info.get("model"), "flags": [f for f in _FLAGS if f in flags]}


def _omp_env() -> dict[str, str]:
    """The OpenMP settings every engine inherits from this process (how its threads wait between
    parallel regions moves what cores a load's threads find)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("OMP_", "GOMP_", "KMP_"))}


def _ceilings() -> dict[str, float]:
    """This host's AES-256-GCM (cryptography) and memory copy on the bytes of a 4K-token hit, one
    core, measured before any engine starts: a kvgate hit authenticates and decrypts every byte a
    plaintext connector only copies, so its distance to one moves with the first."""
    from gateway.bench.ceilings import aes_ceiling, memcpy_ceiling

    total, segment = 192 << 20, 2 << 20  # the 4K-token hit of the full model, in envelope segments
    seal, open_ = aes_ceiling(total, segment, 1, 5)
    return {"aes_gcm_open_gbps": round(open_, 2), "aes_gcm_seal_gbps": round(seal, 2),
            "memcpy_gbps": round(memcpy_ceiling(total, segment, 1, 5), 2)}


def region_mb(longest: int, chunk_tokens: int, kv_bytes_per_token: int) -> int:
    """A shared-memory region that holds every envelope of a ``longest``-token load: its chunks'
    KV (a partial last chunk is stored whole), and 64 KiB a chunk for its header, tags and the
    region's 64-byte alignment. A smaller region sends what does not fit through the socket."""
    chunks = -(-longest // chunk_tokens)
    return -(-(chunks * (chunk_tokens * kv_bytes_per_token + (64 << 10))) // (1 << 20))


def run(cfg: Config, work: Path) -> dict[str, Any]:
    size = SIZES[cfg.size]
    if cfg.shm_mb is None:
        kvb = size.kv_bytes_of(cfg.dtype)
        cfg = replace(cfg, shm_mb=region_mb(max(cfg.lengths), cfg.chunk_tokens, kvb))
    model = build_llama(work / f"model-{cfg.size}", size)
    max_len = max(max(cfg.lengths), cfg.context + cfg.question_tokens) + cfg.out_tokens + 64
    if max_len > size.max_len:
        raise SystemExit(f"prompt length {max_len} exceeds the model's {size.max_len}")
    engine = {
        "block_size": cfg.block_size, "dtype": cfg.dtype, "max_model_len": max_len, "max_num_seqs": max(8, cfg.tenants),
        # a whole prompt (and a whole multi-tenant round) in one prefill step, for every system alike
        "max_num_batched_tokens": max(max_len, cfg.tenants * (cfg.context + cfg.question_tokens + cfg.out_tokens)),
    }
    tenants = [ISO_A, ISO_B, *cfg.mt_tenants]
    salt = salts(tenants)
    machine = _machine()
    runs: dict[str, Any] = {}
    failed: dict[str, str] = {}
    not_run: dict[str, str] = {}

    def meta() -> dict[str, Any]:
        kvb = size.kv_bytes_of(cfg.dtype)
        return {**machine, "loadavg_end": _load(), "uptime_end": _uptime(), "config": asdict(cfg), "engine": engine,
                "model": {"size": cfg.size, **asdict(size), "params": size.params(), "kv_bytes_per_token": kvb}}

    if cfg.interleave:
        runs, meta_interleave = _interleaved(cfg, work, model, engine, tenants, salt, failed, not_run)
        return {"meta": {**meta(), "failed": failed, "not_run": not_run, "interleave": meta_interleave}, "runs": runs}
    for key in cfg.systems:
        sys_work = work / key
        plan = {"model": str(model), "engine": engine, "steps": steps(cfg, key, salt)}
        ran = run_system(key, key, lambda: open_system(key, sys_work, tenants, asdict(cfg)), plan, cfg, sys_work,
                         failed, not_run)
        if ran is None:
            continue
        system, out = ran
        runs[key] = {**describe(system), **out}
        # what ran so far, in the shape of e2e-raw.json (``--from-raw`` reports it)
        (work / "raw-partial.json").write_text(json.dumps({"meta": {**meta(), "failed": failed, "not_run": not_run}, "runs": runs}))
    return {"meta": {**meta(), "failed": failed, "not_run": not_run}, "runs": runs}


def _interleaved(
    cfg: Config, work: Path, model: Path, engine: dict[str, Any], tenants: list[str], salt: dict[str, str],
    failed: dict[str, str], not_run: dict[str, str],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--interleave``: every system open and its engine up at once, turns taken in lockstep
    (interleave.py). A system that cannot open is not run or failed, as in a sequential run."""
    from scripts.bench_e2e import interleave

    opened: list[tuple[str, System, dict[str, Any], dict[str, str]]] = []
    runs: dict[str, Any] = {}
    try:
        for key in cfg.systems:
            sys_work = work / key
            try:
                system = open_system(key, sys_work, tenants, asdict(cfg))
            except NotRun as exc:
                print(f"[bench-e2e] {key}: not run: {exc}", flush=True)
                not_run[key] = str(exc)
                continue
            except Exception as exc:
                print(f"[bench-e2e] {key}: FAILED: {exc}", flush=True)
                failed[key] = str(exc)[-2000:]
                continue
            plan = {"model": str(model), "engine": engine, "steps": steps(cfg, key, salt),
                    "kv_transfer_config": system.ktc, "caps": system.caps, "flush": system.flush}
            opened.append((key, system, plan, engine_env(system.env, cfg)))
            if system.preflight:
                try:
                    preflight(system, cfg, plan, sys_work)
                except NotRun as exc:
                    not_run[key] = str(exc)
                    opened.pop()
                    system.close()
        print(f"[bench-e2e] interleaved: {', '.join(k for k, *_ in opened)} (load {_load()})", flush=True)
        out, bad, meta = interleave.run(opened, work, cfg.engine_timeout_s, cfg.interleave_gap_s)
        failed.update(bad)
        for key, system, _plan, _env in opened:
            if key in out:
                runs[key] = {**describe(system), **out[key]}
    finally:
        for _key, system, _plan, _env in opened:
            system.close()
    return runs, meta


_SAME = ("size", "lengths", "reps", "iso_length", "tenants", "context", "questions", "chunk_tokens", "dtype", "out_tokens")


def merge_raw(raws: list[dict[str, Any]]) -> dict[str, Any]:
    """One raw run from several of the same benchmark (``_SAME`` equal): the first one's machine
    and engine, every system's run (a later one replaces an earlier one of the same system), the
    systems in the first one's order then the others'. ``SystemExit`` where they differ."""
    first = raws[0]
    cfg = first["meta"]["config"]
    if len(raws) > 1 and any(r["meta"]["config"].get("interleave") for r in raws):
        raise SystemExit("an interleaved run's systems ran side by side: it cannot be merged with another run")
    meta = {**first["meta"], "failed": dict(first["meta"].get("failed", {})), "not_run": dict(first["meta"].get("not_run", {}))}
    runs = dict(first["runs"])
    for other in raws[1:]:
        theirs = other["meta"]["config"]
        differ = [k for k in _SAME if theirs.get(k) != cfg.get(k)]
        if differ:
            raise SystemExit(f"the runs differ in {', '.join(differ)}: they cannot be reported together")
        for key, run_ in other["runs"].items():
            runs[key] = {**run_, "merged_from_run_at": other["meta"].get("started_at") or other["meta"].get("uptime_end")}
            meta["failed"].pop(key, None)
            meta["not_run"].pop(key, None)
        meta["failed"].update({k: v for k, v in other["meta"].get("failed", {}).items() if k not in runs})
        meta["not_run"].update({k: v for k, v in other["meta"].get("not_run", {}).items() if k not in runs})
    order = [*cfg.get("systems", first["runs"]), *(k for r in raws[1:] for k in r["meta"]["config"].get("systems", r["runs"]))]
    meta["config"] = {**cfg, "systems": list(dict.fromkeys(order))}
    if len(raws) > 1:
        meta["merged_runs"] = len(raws)
    pub = [r["published"] for r in raws if r.get("published")]  # the last run's published workload
    return {"meta": meta, "runs": runs, **({"published": pub[-1]} if pub else {})}


def parse(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="bench-e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, short prompts (develops the harness)")
    p.add_argument("--size", choices=sorted(SIZES))
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--reps", type=int)
    p.add_argument("--iso-length", type=int)
    p.add_argument("--systems", type=lambda s: s.split(","))
    p.add_argument("--tenants", type=int)
    p.add_argument("--context", type=int)
    p.add_argument("--questions", type=int)
    p.add_argument("--chunk-tokens", type=int)
    p.add_argument("--out-tokens", type=int, help="greedy tokens per request (the decode rate is timed over all but the first)")
    p.add_argument("--redis-url")
    p.add_argument("--paired-miss", action="store_true", default=None,
                   help="before each miss the same prompt without a capability, in the same engine (miss_vs_capless)")
    p.add_argument("--interleave", action="store_true", default=None,
                   help="every system's engine up at once, their requests taken in turns (interleave.py)")
    p.add_argument("--shm-mb", type=int, help="kvgate-remote-shm's region per tenant (MiB; default: the longest prompt's envelopes)")
    p.add_argument("--kv-cache-gb", type=int, help="each engine's KV cache space (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--memory-mb", type=int, help="kvgate's memory tier, embedded and in kvgate serve (MiB)")
    p.add_argument("--lmcache-vllm-python", dest="lmcache_python",
                   help="python of an environment with vLLM and LMCache (default: $KVGATE_E2E_LMCACHE_PYTHON or .venv-lmcache-vllm)")
    p.add_argument("--json", type=Path, help="default: bench-results/e2e.json (--published-only: e2e-published.json)")
    p.add_argument("--docs", action="store_true", help="also refresh docs/e2e.*, docs/img/e2e_ttft.png and the README table")
    p.add_argument("--from-raw", type=Path, nargs="+",
                   help="no engines: analyze and report an earlier run's e2e-raw.json; several: their systems merged "
                        "(runs of the same model, lengths and repetitions; a later file's system replaces an earlier one's)")
    from scripts.bench_e2e import pd as pd_workload  # the P/D workload's options

    pd_workload.add_args(p)
    p.add_argument("--workdir", type=Path, help="keep engine logs, plans and traces here (default: a temporary directory)")
    from scripts.bench_e2e import sweep

    sweep.add_args(p)
    published.add_args(p)
    a = p.parse_args(argv)
    cfg = Config(**(QUICK if a.quick else {}))
    for name in ("size", "lengths", "reps", "iso_length", "systems", "tenants", "context", "questions", "chunk_tokens", "out_tokens", "redis_url", "lmcache_python", "paired_miss", "interleave", "kv_cache_gb", "shm_mb"):
        if getattr(a, name) is not None:
            setattr(cfg, name, getattr(a, name))
    if a.memory_mb is not None:
        cfg.memory_bytes = a.memory_mb << 20
    if cfg.iso_length not in cfg.lengths:
        cfg.iso_length = cfg.lengths[len(cfg.lengths) // 2]
    if a.published_only:
        cfg.systems = []
    a.json = a.json or ROOT / "bench-results" / ("e2e-published.json" if a.published_only else "e2e.json")
    a.pub = published.config(a)
    return cfg, a


def main(argv: list[str] | None = None) -> None:
    from scripts.bench_e2e.analyze import analyze
    from scripts.bench_e2e.report import write_all

    cfg, a = parse(argv)
    from scripts.bench_e2e import sweep

    sweep_cfg = sweep.config(a)
    if sweep_cfg is not None and a.sweep_only:  # the bandwidth sweep alone: bench-results/e2e-sweep.*
        sweep.run_and_write(sweep_cfg, cfg, a.workdir, a.sweep_json, docs=a.docs)
        return
    from scripts.bench_e2e import pd as pd_workload

    pd = pd_workload.config(a)
    if pd is not None and a.pd_only:  # the P/D workload alone: it writes bench-results/e2e-pd.{json,md}
        pd_workload.run_and_write(pd, a.workdir)
        return
    t0 = time.monotonic()
    if a.from_raw:
        raw = merge_raw([json.loads(p.read_text()) for p in a.from_raw])
    else:
        with tempfile.TemporaryDirectory(prefix="kvgate-e2e-") as tmp:
            raw = run(cfg, a.workdir or Path(tmp))
            if sweep_cfg is not None:  # --sweep: the bandwidth sweep (sweep.py), after the systems
                raw["sweep"] = sweep.run(sweep_cfg, cfg, a.workdir or Path(tmp))
            if a.pub is not None:  # the published-prefix workload (published.py), after the systems
                raw["published"] = published.run(a.pub, cfg, a.workdir or Path(tmp))
        raw["meta"]["total_wall_s"] = round(time.monotonic() - t0, 1)
    if pd is not None:  # --pd: after the systems, with files of its own
        pd_workload.run_and_write(pd, a.workdir)
    result = analyze(raw)
    if raw.get("sweep"):
        result["bandwidth_sweep"] = sweep.analyze(raw["sweep"])
    write_all(result, raw, a.json, docs=a.docs, published_only=a.published_only)


if __name__ == "__main__":
    main()
