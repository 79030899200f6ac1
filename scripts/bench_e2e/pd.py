"""bench-e2e's ``pd`` workload: prefill/decode disaggregation as a client sees it through the proxy.

    python -m scripts.bench_e2e.pd [--quick] [--pd-lengths 1024,4096] [--pd-reps 3] [--pd-systems ...]
    python -m scripts.bench_e2e.run --pd-only [--quick]        # the same, through bench-e2e; docs/e2e.md

Rows: ``single`` (one engine, no connector, the client on its socket), ``pd-kvgate-embedded`` (a
kv_producer and a kv_consumer engine with kvgate embedded, memory + Redis tiers), ``pd-kvgate-uds``
(the same in remote mode through a ``kvgate serve --uds`` on this host) and ``pd-example`` (vLLM's
ExampleConnector both ways: plaintext files, the baseline). Engines serve vLLM's OpenAI API on Unix
sockets, a P/D row's two on cores of their own (``--pd-shared-cores``: all); P/D rows go through ``gateway.vllm.disagg`` on a socket of its own, the client acting as the
authenticating gateway (``x-tenant-id``; kvgate's engines run the tenant middleware, trusting the
proxy's socket). Per row: TTFT (request sent to first streamed token) per prompt length, decode
tokens/s, requests/s at a concurrency, outputs against ``single``'s, and the tokens tenant B's consumer
loads when B sends A's prompt with A's receipt straight to the decode engine (kvgate: must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from scripts.bench_e2e.model import SIZES, build_llama, prompt_ids
from scripts.bench_e2e.systems import (
    ROOT,
    NotRun,
    _embedded,
    _kvgate,
    _remote,
    free_port,
    start_process,
    start_serve,
    stop_process,
    wait_up,
)

__all__ = ["LABELS", "PdConfig", "add_args", "analyze", "config", "markdown", "run", "run_and_write"]

LABELS = {"single": "one engine, no connector", "pd-kvgate-embedded": "P/D, kvgate embedded (Redis)",
          "pd-kvgate-uds": "P/D, kvgate remote (Unix socket)", "pd-example": "P/D, ExampleConnector (plaintext)"}
TENANT_A, TENANT_B = "acme", "globex"
HEADER = "x-tenant-id"


@dataclass
class PdConfig:
    size: str = "full"
    lengths: list[int] = field(default_factory=lambda: [1024, 4096])
    reps: int = 3
    out_tokens: int = 32
    requests: int = 8  # the throughput phase: this many requests, `concurrency` at a time
    concurrency: int = 2
    systems: list[str] = field(default_factory=lambda: list(LABELS))
    chunk_tokens: int = 256
    block_size: int = 32
    memory_bytes: int = 1 << 30
    kv_cache_gb: int = 2
    redis_url: str = "redis://127.0.0.1:6379/0"
    start_timeout_s: int = 600
    # a P/D row's producer on the first half of the CPUs, its consumer on the rest (as P/D is deployed;
    # on shared cores each engine's forward waits at its barriers for cores the other's processes hold)
    split_cores: bool = True


QUICK: dict[str, Any] = {"size": "tiny", "lengths": [256, 512], "reps": 2, "out_tokens": 8, "requests": 4,
                         "memory_bytes": 256 << 20, "kv_cache_gb": 1}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pd", action="store_true", help="also run the P/D workload")
    p.add_argument("--pd-only", action="store_true", help="run the P/D workload only")
    p.add_argument("--pd-lengths", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--pd-reps", type=int)
    p.add_argument("--pd-systems", type=lambda s: [x for x in s.split(",") if x], help=f"of {','.join(LABELS)}")
    p.add_argument("--pd-shared-cores", action="store_true", help="a P/D row's two engines on every CPU, not a half each")


def config(a: argparse.Namespace) -> PdConfig | None:
    if not (getattr(a, "pd", False) or getattr(a, "pd_only", False)):
        return None
    cfg = PdConfig(**(QUICK if a.quick else {}))
    for name in ("lengths", "reps", "systems"):
        if getattr(a, "pd_" + name) is not None:
            setattr(cfg, name, getattr(a, "pd_" + name))
    cfg.split_cores = not getattr(a, "pd_shared_cores", False)
    if any(s not in LABELS for s in cfg.systems) or "single" not in cfg.systems:
        raise SystemExit(f"P/D workload: systems of {', '.join(LABELS)}, single among them (the outputs' reference)")
    return cfg


# -- processes ---------------------------------------------------------------------------------

def _uds_client(path: Path, timeout: float = 600.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(path)), base_url="http://bench", timeout=timeout)


def _wait_up(path: Path, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    wait_up(proc, "http://bench/health", log, timeout_s, uds=path, interval_s=1.0)


def _start(cmd: list[str], env: dict[str, str], log: Path, procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    proc = start_process(cmd, env, log)
    procs.append(proc)
    return proc


def _engine_env(cfg: PdConfig, extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gb),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.update(extra)
    return env


def _placement(cfg: PdConfig) -> tuple[dict[str, str], dict[str, str]]:
    """The producer's and the consumer's OpenMP cores (``VLLM_CPU_OMP_THREADS_BIND``): a half of
    this process's CPUs each, or both unset (every CPU) with ``split_cores`` off or a single CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if not cfg.split_cores or len(cpus) < 2:
        return {}, {}
    half = len(cpus) // 2
    return ({"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[:half]))},
            {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[half:]))})


def _engine_cmd(model: Path, sock: Path, cfg: PdConfig, max_len: int, ktc: dict[str, Any] | None, middleware: bool) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--uds", str(sock),
           "--served-model-name", "bench", "--enforce-eager", "--block-size", str(cfg.block_size), "--dtype", "float32",
           "--max-model-len", str(max_len), "--max-num-batched-tokens", str(max_len * cfg.concurrency),
           "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0"]
    if middleware:
        cmd += ["--middleware", "gateway.vllm.middleware.KvgateMiddleware"]
    if ktc is not None:
        cmd += ["--kv-transfer-config", json.dumps(ktc)]
    return cmd


@dataclass
class Stack:
    """What a row runs on: the client's socket (the proxy's, or the single engine's), the decode
    engine's socket (the receipt check), and its processes."""

    entry: Path
    decode: Path | None
    procs: list[subprocess.Popen[bytes]]
    closers: list[Any]
    ktc: dict[str, Any] | None = None

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc)
        for c in self.closers:
            c.close()


def _with_role(ktc: dict[str, Any], role: str) -> dict[str, Any]:
    return {**ktc, "kv_role": role}


def _open(key: str, cfg: PdConfig, model: Path, work: Path, max_len: int) -> Stack:
    work.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    closers: list[Any] = []
    if key == "single":
        sock = work / "engine.sock"
        proc = _start(_engine_cmd(model, sock, cfg, max_len, None, False), _engine_env(cfg, {}), work / "engine.log", procs)
        stack = Stack(sock, None, procs, closers)
        try:
            _wait_up(sock, proc, work / "engine.log", cfg.start_timeout_s)
        except BaseException:
            stack.close()
            raise
        return stack
    main = {"chunk_tokens": cfg.chunk_tokens, "memory_bytes": cfg.memory_bytes, "redis_url": cfg.redis_url}
    middleware_env: dict[str, str] = {}
    engine_extra: dict[str, str] = {}
    if key == "pd-example":
        store = work / "example-store"
        store.mkdir(exist_ok=True)
        ktc: dict[str, Any] = {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    else:
        tenants = [TENANT_A, TENANT_B]
        (work / "kvgate").mkdir(exist_ok=True)
        if key == "pd-kvgate-uds":
            system = _remote(work / "kvgate", tenants, main, uds=True)
            closers.append(system)
            url = system.ktc["kv_connector_extra_config"]["remote_url"]  # type: ignore[index]
            state = work / "kvgate" / "state"
            engine_extra = dict(system.env)
            ktc = system.ktc  # type: ignore[assignment]
        else:
            system = _embedded(work / "kvgate", tenants, main)
            closers.append(system)
            ktc = system.ktc  # type: ignore[assignment]
            state = Path(ktc["kv_connector_extra_config"]["kvgate_settings"]["state_dir"])
            # the middleware mints through a server of the connectors' own state (their database and KEK)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            serve_env = {**os.environ, "PYTHONPATH": str(ROOT), "KVGATE_STATE_DIR": str(state), "KVGATE_TIERS": '["memory"]',
                         "KVGATE_LOG_LEVEL": "warning", "KVGATE_CAPABILITY_MAX_TTL_S": "3600"}
            procs.append(start_serve(port, serve_env, work / "serve.log", timeout_s=120))
        token_env = {**os.environ, "PYTHONPATH": str(ROOT), "KVGATE_STATE_DIR": str(state)}
        operator = _kvgate(["token", "mint", "--tenant", "platform", "--roles", "kv.operator", "--ttl", "3600"], token_env)
        middleware_env = {
            "KVGATE_VLLM_ISSUER": url + "/dev-issuer", "KVGATE_VLLM_GATEWAY_URL": url,
            "KVGATE_VLLM_SALT_SECRET": os.urandom(32).hex(), "KVGATE_VLLM_TENANT_HEADER": HEADER,
            "KVGATE_VLLM_TRUSTED_PEERS": "unix", "KVGATE_VLLM_SERVICE_TOKEN": operator,
            "KVGATE_VLLM_AUDIT_DATABASE_URL": f"sqlite+aiosqlite:///{work / 'middleware-audit.db'}",
            "KVGATE_VLLM_AUDIT_SPOOL_DIR": str(work / "audit-spool"), "KVGATE_VLLM_CAPABILITY_TTL": "3600",
        }
        _migrate_audit(middleware_env["KVGATE_VLLM_AUDIT_DATABASE_URL"])
    pre, dec, proxy = work / "prefill.sock", work / "decode.sock", work / "proxy.sock"
    kvgate = key != "pd-example"
    env = _engine_env(cfg, {**engine_extra, **middleware_env})
    bind_pre, bind_dec = _placement(cfg)
    stack = Stack(proxy, dec, procs, closers, ktc)
    try:
        p1 = _start(_engine_cmd(model, pre, cfg, max_len, _with_role(ktc, "kv_producer"), kvgate), {**env, **bind_pre},
                    work / "prefill.log", procs)
        p2 = _start(_engine_cmd(model, dec, cfg, max_len, _with_role(ktc, "kv_consumer"), kvgate), {**env, **bind_dec},
                    work / "decode.log", procs)
        _wait_up(pre, p1, work / "prefill.log", cfg.start_timeout_s)
        _wait_up(dec, p2, work / "decode.log", cfg.start_timeout_s)
        args = [sys.executable, "-m", "gateway.vllm.disagg", "--prefill", f"unix:{pre}", "--decode", f"unix:{dec}", "--uds", str(proxy)]
        if kvgate:
            args += ["--tenant-header", HEADER, "--trusted-peers", "unix"]
        px = _start(args, {**os.environ, **middleware_env, "PYTHONPATH": str(ROOT)}, work / "proxy.log", procs)
        deadline = time.monotonic() + 60
        while not proxy.exists():
            if px.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the P/D proxy did not start:\n" + (work / "proxy.log").read_text()[-3000:])
            time.sleep(0.2)
        return stack
    except BaseException:
        stack.close()
        raise


def _migrate_audit(url: str) -> None:
    """The middleware's audit table (its refusals; the engines' own database has one too)."""
    from audit.db import create_audit_engine, create_audit_schema

    async def make() -> None:
        engine = create_audit_engine(url)
        try:
            await create_audit_schema(engine)
        finally:
            await engine.dispose()

    asyncio.run(make())


# -- the client --------------------------------------------------------------------------------

async def _complete(c: httpx.AsyncClient, ids: list[int], tenant: str | None, cfg: PdConfig,
                    kv: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed completion: TTFT, decode tokens/s, the text, the consumer's cached tokens."""
    body: dict[str, Any] = {"model": "bench", "prompt": ids, "max_tokens": cfg.out_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if kv is not None:
        body["kv_transfer_params"] = kv
    headers = {HEADER: tenant} if tenant else {}
    t0 = time.perf_counter()
    first = last = None
    text, usage, n = [], None, 0
    async with c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if doc.get("usage"):
                usage = doc["usage"]
            for ch in doc.get("choices") or []:
                if ch.get("text"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n += 1
                    text.append(ch["text"])
    assert first is not None and last is not None, "no token streamed"
    cached = int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    decode_tps = (n - 1) / (last - first) if n > 1 and last > first else None
    return {"ttft_s": first - t0, "decode_tps": decode_tps, "text": "".join(text), "cached": cached, "chunks": n}


async def _prefill_receipt(stack: Stack, ids: list[int], tenant: str) -> tuple[dict[str, Any] | None, float]:
    """What the proxy would hand the decode engine after tenant's prefill (its kv_transfer_params),
    and the seconds the prefill leg took."""
    async with _uds_client(stack.entry.parent / "prefill.sock") as c:
        t0 = time.perf_counter()
        r = await c.post("/v1/completions", headers={HEADER: tenant},
                         json={"model": "bench", "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": False,
                               "kv_transfer_params": {"do_remote_decode": True}})
        r.raise_for_status()
        took = time.perf_counter() - t0
        params = r.json().get("kv_transfer_params")
        return (params if isinstance(params, dict) else None), took


async def _drive(key: str, stack: Stack, cfg: PdConfig) -> dict[str, Any]:
    tenant = TENANT_A if key != "single" else None
    rows: list[dict[str, Any]] = []
    async with _uds_client(stack.entry) as c:
        for who in ((TENANT_A, TENANT_B) if tenant else (None,)):  # warm-up: each engine's first request of a tenant
            await _complete(c, prompt_ids(64, 1), who, cfg)
        for length in cfg.lengths:
            for i in range(cfg.reps):
                got = await _complete(c, prompt_ids(length, length * 1000 + i), tenant, cfg)
                rows.append({"length": length, "i": i, **got})
        # requests/s: distinct prompts, `concurrency` in flight, tenants alternating
        length = cfg.lengths[0]
        sem = asyncio.Semaphore(cfg.concurrency)

        async def one(j: int) -> dict[str, Any]:
            async with sem:
                who = (TENANT_A if j % 2 == 0 else TENANT_B) if tenant else None
                return await _complete(c, prompt_ids(length, 900_000 + j), who, cfg)

        t0 = time.perf_counter()
        burst = await asyncio.gather(*(one(j) for j in range(cfg.requests)))
        wall = time.perf_counter() - t0
    out: dict[str, Any] = {"rows": rows, "burst": {"requests": cfg.requests, "concurrency": cfg.concurrency,
                                                   "length": length, "wall_s": wall, "texts": [b["text"] for b in burst],
                                                   "decode_tps": [b["decode_tps"] for b in burst]}}
    if key != "single" and stack.decode is not None:
        # tenant B sends A's prompt straight to the consumer with A's receipt (ExampleConnector: no
        # receipt, it loads whatever the prompt's files hold)
        length = cfg.lengths[-1]
        ids = prompt_ids(length, 777_000)
        params, prefill_s = await _prefill_receipt(stack, ids, TENANT_A) if key != "pd-example" else (None, None)
        kv = {k: v for k, v in (params or {}).items() if k == "kvgate_receipt"} or None
        if key == "pd-example":
            async with _uds_client(stack.entry) as c:
                await _complete(c, ids, None, cfg)  # A's request through the proxy stores the prompt's files
        async with _uds_client(stack.decode) as c:
            got = await _complete(c, ids, TENANT_B if key != "pd-example" else None, cfg, kv)
        out["b_on_a"] = {"length": length, "cached": got["cached"], "text": got["text"], "had_receipt": kv is not None,
                         "prefill_leg_s": prefill_s, "consumer_ttft_s": got["ttft_s"]}
    return out


def run(cfg: PdConfig, work: Path) -> dict[str, Any]:
    size = SIZES[cfg.size]
    model = build_llama(work / f"model-{cfg.size}", size)
    max_len = max(cfg.lengths) + cfg.out_tokens + 64
    runs: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for key in cfg.systems:
        t0 = time.monotonic()
        print(f"[bench-e2e] pd/{key}: starting (load {os.getloadavg()[0]:.2f})", flush=True)
        try:
            stack = _open(key, cfg, model, work / key, max_len)
            try:
                got = asyncio.run(_drive(key, stack, cfg))
            finally:
                stack.close()
        except NotRun as exc:
            failed[key] = f"not run: {exc}"
            continue
        except Exception as exc:
            print(f"[bench-e2e] pd/{key}: FAILED: {exc}", flush=True)
            failed[key] = str(exc)[-2000:]
            continue
        runs[key] = {"label": LABELS[key], "kv_transfer_config": stack.ktc, **got, "wall_s": round(time.monotonic() - t0, 1)}
        print(f"[bench-e2e] pd/{key}: done in {runs[key]['wall_s']} s", flush=True)
    return {"config": asdict(cfg), "runs": runs, "failed": failed, "loadavg_end": list(os.getloadavg())}


# -- figures -----------------------------------------------------------------------------------

def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def analyze(raw: dict[str, Any]) -> dict[str, Any]:
    cfg, runs = raw["config"], raw["runs"]
    ref = runs.get("single")
    out: dict[str, Any] = {"config": cfg, "failed": raw.get("failed", {}), "systems": {}}
    for key, r in runs.items():
        ttft = {str(n): _median([x["ttft_s"] for x in r["rows"] if x["length"] == n]) for n in cfg["lengths"]}
        tps = [x["decode_tps"] for x in r["rows"] if x["decode_tps"]]
        same = None
        if ref is not None:
            mine = {(x["length"], x["i"]): x["text"] for x in r["rows"]}
            theirs = {(x["length"], x["i"]): x["text"] for x in ref["rows"]}
            same = mine == theirs and r["burst"]["texts"] == ref["burst"]["texts"]
        out["systems"][key] = {
            "label": r["label"], "ttft_median_s": ttft, "decode_tps_median": _median(tps),
            "req_per_s": r["burst"]["requests"] / r["burst"]["wall_s"],
            "consumer_cached_median": _median([float(x["cached"]) for x in r["rows"]]),
            "outputs_identical": same, "b_on_a_cached_tokens": (r.get("b_on_a") or {}).get("cached"),
        }
    s = out["systems"]
    targets = {}
    for kv in ("pd-kvgate-embedded", "pd-kvgate-uds"):
        if kv in s and "pd-example" in s:
            targets[f"ttft_{kv}_over_example"] = {
                n: round(s[kv]["ttft_median_s"][n] / s["pd-example"]["ttft_median_s"][n], 2)
                for n in s[kv]["ttft_median_s"] if s[kv]["ttft_median_s"][n] and s["pd-example"]["ttft_median_s"].get(n)}
    out["targets"] = targets
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def markdown(res: dict[str, Any]) -> str:
    lengths = [str(n) for n in res["config"]["lengths"]]
    head = "| system | " + " | ".join(f"TTFT {n} (ms)" for n in lengths) + \
        " | decode tok/s | req/s | consumer cached tokens | outputs = single | B with A's receipt: tokens loaded |"
    lines = [head, "|" + " --- |" * (len(lengths) + 6)]
    for s in res["systems"].values():
        same = {None: "-", True: "yes", False: "NO"}[s["outputs_identical"]]
        lines.append(f"| {s['label']} | " + " | ".join(_ms(s["ttft_median_s"][n]) for n in lengths)
                     + f" | {s['decode_tps_median'] or 0:.1f} | {s['req_per_s']:.2f} | {s['consumer_cached_median'] or 0:.0f} | {same}"
                     + f" | {'-' if s['b_on_a_cached_tokens'] is None else s['b_on_a_cached_tokens']} |")
    for key, why in res["failed"].items():
        lines.append(f"| {LABELS.get(key, key)} | failed: {why.splitlines()[0][:200]} |")
    if res["targets"]:
        lines += ["", "TTFT over ExampleConnector's P/D: " + "; ".join(
            f"{k.removeprefix('ttft_').removesuffix('_over_example')}: " + ", ".join(f"{n}: {v}x" for n, v in t.items())
            for k, t in res["targets"].items())]
    return "\n".join(lines) + "\n"


def run_and_write(cfg: PdConfig, workdir: Path | None, json_path: Path = ROOT / "bench-results" / "e2e-pd.json") -> dict[str, Any]:
    """Run the workload (in ``workdir``, else a temporary directory), write its JSON (figures and
    raw rows) and Markdown table beside it, print the table; the figures."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvgate-e2e-pd-") as tmp:
        raw = run(cfg, workdir or Path(tmp))
    res = analyze(raw)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"result": res, "raw": raw}, indent=1) + "\n")
    md = markdown(res)
    json_path.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {json_path}, {json_path.with_suffix('.md')}")
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_e2e.pd", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, short prompts (develops the harness)")
    p.add_argument("--json", type=Path, default=ROOT / "bench-results" / "e2e-pd.json")
    p.add_argument("--workdir", type=Path, help="keep engine logs and sockets here (default: a temporary directory)")
    add_args(p)
    a = p.parse_args(argv)
    a.pd_only = True
    cfg = config(a)
    assert cfg is not None
    run_and_write(cfg, a.workdir, a.json)


if __name__ == "__main__":
    main()
