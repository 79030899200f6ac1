"""The soak run: the stack started, tenants made, workers spawned and released together, the fault
schedule played while the server's resident memory is sampled and checkpoints are taken, then the
audit log exported and verified offline, the server stopped with SIGTERM, and every invariant
evaluated (``checks``) into the report (``report``). Everything started is stopped by its pid and
the throwaway database dropped, whatever happened."""

from __future__ import annotations

import json
import math
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from scripts.soak import checks, faults, report
from scripts.soak.stack import Stack, StackError, rss_kib
from tests.support.paths import REPO

# relative frequencies; the admin actions are rare, as in production (a worker does tens of
# operations a second here, so a weight of 0.2 is a clear every several seconds per worker)
DEFAULT_WEIGHTS = {"store": 25, "load": 25, "lookup": 15, "peer": 15, "pin": 2, "unpin": 1.5, "clear_namespace": 0.2,
                   "rotate": 0.3, "clear_tenant": 0.08, "revoke": 0.08}


@dataclass
class Config:
    duration_s: float = 600.0
    workers: int = 16
    tenants: int = 0  # 0: half the workers (at least 2), so most tenants have two workers
    prompts: int = 24  # per worker
    min_tokens: int = 32
    max_tokens: int = 96
    chunk_tokens: int = 16
    tiers: list[str] = field(default_factory=lambda: ["memory", "redis"])
    memory_mib: int = 4  # small, so that loads reach Redis
    fault_every_s: float = 40.0
    warmup_s: float = 20.0
    kinds: list[str] = field(default_factory=lambda: list(faults.KINDS))
    holds: dict[str, float] = field(default_factory=lambda: {
        "redis_stall": 8.0, "redis_restart": 1.0, "kek_outage": 12.0, "postgres_outage": 10.0,
        "sigterm_restart": 0.0, "sigkill_restart": 0.0})
    kek_cache_ttl_s: float = 2.0
    checkpoint_every_s: float = 30.0
    server_checkpoint_interval_s: float = 60.0
    p99_bound_s: float = 2.0
    rss_slope_mib_per_min: float | None = 2.0
    rss_warmup_s: float = 30.0
    rss_ceiling_mib: float | None = None
    rss_interval_s: float = 0.5
    think_s: float = 0.0
    seed: int = 1
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    out: Path = REPO / "bench-results" / "soak"
    keep: bool = False  # keep the working directory (logs, state) for a post-mortem


def _tenants(cfg: Config) -> int:
    return cfg.tenants or max(2, math.ceil(cfg.workers / 2))


def scopes(cfg: Config) -> dict[int, tuple[str, str]]:
    """Worker -> (tenant, namespace): tenant ``i mod m``; the first worker of a tenant uses
    namespace ``a``, later ones alternate ``a`` (a shared namespace) and ``b`` (another namespace
    of the same tenant), each with capabilities of its own."""
    m = _tenants(cfg)
    return {i: (f"t{i % m}", "a" if i < m or i % 2 == 0 else "b") for i in range(cfg.workers)}


class Sampler(threading.Thread):
    """The server's resident memory every ``interval`` seconds, whichever process is serving."""

    def __init__(self, stack: Stack, interval: float) -> None:
        super().__init__(daemon=True, name="soak-rss")
        self.stack, self.interval = stack, interval
        self.samples: list[tuple[float, int, int]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            server = self.stack.server
            pid = server.pid if server is not None else None
            if pid is not None:
                kib = rss_kib(pid)
                if kib is not None:
                    self.samples.append((time.monotonic(), pid, kib))


class Soak:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.root = Path(tempfile.mkdtemp(prefix="kvgate-soak-"))
        self.stack = Stack(self.root, tiers=cfg.tiers, memory_mib=cfg.memory_mib, chunk_tokens=cfg.chunk_tokens,
                           kek_cache_ttl_s=cfg.kek_cache_ttl_s, checkpoint_interval_s=cfg.server_checkpoint_interval_s)
        self.recs: list[dict[str, Any]] = []  # the soak's own acknowledged actions
        self.checkpoints: list[Path] = []
        self.checkpoint_errors: list[str] = []
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.logs: dict[int, Path] = {}
        self.progress = sys.stderr

    def say(self, text: str) -> None:
        print(f"soak: {text}", file=self.progress, flush=True)

    # -- REST as the operator ----------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self.stack.server is not None
        return self.stack.server.url

    def _op(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.operator}"}

    def checkpoint(self) -> None:
        """A signed checkpoint now, kept: the final export must extend every one of them."""
        try:
            r = httpx.post(self.url + "/v1/admin/audit/checkpoints", headers=self._op(), timeout=30)
        except httpx.HTTPError as exc:
            self.checkpoint_errors.append(type(exc).__name__)
            return
        if r.status_code != 201:
            self.checkpoint_errors.append(str(r.status_code))
            return
        path = self.root / f"checkpoint-{len(self.checkpoints)}.json"
        path.write_text(r.text)
        self.checkpoints.append(path)

    # -- workers -----------------------------------------------------------------------------
    def spawn_workers(self, ttl_s: float) -> None:
        cfg = self.cfg
        where = scopes(cfg)
        ephemeral = max(2, int(cfg.duration_s / 60) + 2)
        for i, (tenant, ns) in where.items():
            peers = [{"id": j, "tenant": t, "namespace": n, "prompts": cfg.prompts} for j, (t, n) in where.items() if j != i]
            eph = [{"tenant": f"e{i}-{k}", "token": self.stack.token(f"e{i}-{k}", ["kv.worker"], f"worker-{i}-e{k}", ttl_s)}
                   for k in range(ephemeral)]
            self.logs[i] = self.root / f"worker-{i}.jsonl"
            wcfg = {
                "id": i, "tenant": tenant, "namespace": ns, "url": self.url, "seed": cfg.seed, "prompts": cfg.prompts,
                "min_tokens": cfg.min_tokens, "max_tokens": cfg.max_tokens, "chunk_tokens": cfg.chunk_tokens,
                "token": self.stack.token(tenant, ["kv.worker", "kv.admin"], f"worker-{i}", ttl_s),
                "operator_token": self.stack.token("platform", ["kv.operator"], f"worker-{i}-operator", ttl_s),
                "peers": peers, "ephemeral": eph, "weights": cfg.weights, "think_s": cfg.think_s,
                "go": str(self.root / "go"), "log": str(self.logs[i]),
            }
            path = self.root / f"worker-{i}.json"
            path.write_text(json.dumps(wcfg))
            err = open(self.root / f"worker-{i}.err", "w")  # the child keeps its own copy
            self.procs[i] = subprocess.Popen([sys.executable, "-m", "scripts.soak.worker", str(path)], cwd=REPO,
                                             stdout=subprocess.PIPE, stderr=err, text=True)
            err.close()
        deadline = time.monotonic() + 120 + 10 * cfg.workers
        for i, proc in self.procs.items():
            assert proc.stdout is not None
            while True:
                ready, _, _ = select.select([proc.stdout], [], [], 1.0)
                if ready:
                    line = proc.stdout.readline()
                    if line.strip() == "ready":
                        break
                    if not line:
                        raise StackError(f"worker {i} exited before it was ready: {self._worker_err(i)}")
                if time.monotonic() > deadline:
                    raise StackError(f"worker {i} was not ready in time: {self._worker_err(i)}")

    def _worker_err(self, i: int) -> str:
        try:
            return (self.root / f"worker-{i}.err").read_text()[-2000:]
        except OSError:
            return ""

    def wait_workers(self, timeout: float) -> dict[int, int | None]:
        deadline = time.monotonic() + timeout
        codes: dict[int, int | None] = {}
        for i, proc in self.procs.items():
            try:
                codes[i] = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
                codes[i] = None  # did not end by itself
        return codes

    # -- the audit log at the end --------------------------------------------------------------
    def audit(self) -> dict[str, Any]:
        """The whole log exported by the operator (the server checkpoints it first), verified
        offline by ``kvgate audit verify`` against every checkpoint taken during the run."""
        until = (datetime.now(UTC) + timedelta(seconds=2)).replace(microsecond=0)
        time.sleep(max(0.0, (until - datetime.now(UTC)).total_seconds()) + 0.5)
        params = {"until": until.isoformat()}
        export, manifest, pem = self.root / "audit.jsonl", self.root / "audit.manifest.json", self.root / "audit.pem"
        with httpx.stream("GET", self.url + "/v1/admin/audit/export", params=params, headers=self._op(), timeout=600) as r:
            if r.status_code != 200:
                r.read()
                failed = {"held": False, "why": f"export: {r.status_code} {r.text[:300]}"}
                return {"complete": failed, "verified": failed, "rows": []}
            with open(export, "wb") as f:
                for part in r.iter_bytes():
                    f.write(part)
        m = httpx.get(self.url + "/v1/admin/audit/export/manifest", params=params, headers=self._op(), timeout=600)
        manifest.write_text(m.text)
        pem.write_bytes(httpx.get(self.url + "/v1/admin/audit/public-key", headers=self._op(), timeout=60).content)
        cmd = [sys.executable, "-m", "gateway", "audit", "verify", str(export), "--manifest", str(manifest),
               "--public-key", str(pem)]
        for cp in self.checkpoints:
            cmd += ["--checkpoint", str(cp)]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
        rows = [json.loads(line) for line in export.read_text().splitlines() if line.strip()]
        verified = {"held": done.returncode == 0 and bool(self.checkpoints), "exit_code": done.returncode,
                    "rows": len(rows), "checkpoints": len(self.checkpoints),
                    "checkpoint_failures": self.checkpoint_errors, "output": (done.stdout + done.stderr)[-1500:]}
        return {"verified": verified, "rows": rows}

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        started = datetime.now(UTC).isoformat(timespec="seconds")
        result: dict[str, Any] = {"config": {**asdict(cfg), "out": str(cfg.out), "tenants": _tenants(cfg)},
                                  "started": started, "work_dir": str(self.root)}
        sampler = Sampler(self.stack, cfg.rss_interval_s)
        try:
            self.say(f"starting the stack in {self.root}")
            self.stack.start()
            ttl = cfg.duration_s + 3600
            self.operator = self.stack.token("platform", ["kv.operator"], "soak-operator", ttl)
            for k in range(_tenants(cfg)):
                t0 = time.monotonic()
                r = httpx.post(self.url + "/v1/admin/tenants", json={"tenant": f"t{k}"}, headers=self._op(), timeout=60)
                if r.status_code != 201:
                    raise StackError(f"creating tenant t{k}: {r.status_code} {r.text}")
                self.recs.append({"op": "ack", "w": -1, "t": time.monotonic(), "t0": t0,
                                  "ack": {"action": "tenant.create", "tenant": f"t{k}"}})
            self.checkpoint()
            self.say(f"spawning {cfg.workers} workers")
            self.spawn_workers(ttl)
            plan = faults.plan(cfg.duration_s, cfg.fault_every_s, cfg.warmup_s, cfg.holds, tuple(cfg.kinds))
            injector = faults.Injector(self.stack)
            sampler.start()
            go = time.monotonic()
            end = go + cfg.duration_s
            (self.root / "go").write_text(json.dumps({"end": end}))
            self.say(f"running {cfg.duration_s:.0f} s with {len(plan)} faults")
            next_cp = go + cfg.checkpoint_every_s
            for fault in [*plan, None]:
                due = end if fault is None else go + fault.at
                while time.monotonic() < due:
                    if time.monotonic() >= next_cp:
                        self.checkpoint()
                        next_cp = time.monotonic() + cfg.checkpoint_every_s
                    time.sleep(min(0.2, max(0.0, due - time.monotonic())))
                if fault is not None:
                    self.say(f"t={time.monotonic() - go:.0f}s fault {fault.kind}")
                    injector.run(fault)
            worker_exits = self.wait_workers(120)
            self.say("workers done; exporting and verifying the audit log")
            audit = self.audit()
            assert self.stack.server is not None
            self.stack.server.stop(signal.SIGTERM)
            sampler.stopped.set()
            recs = checks.load_logs([p for p in self.logs.values() if p.exists()]) + self.recs
            kills = [f.start for f in plan if f.kind == "sigkill_restart"]
            if "complete" not in audit:  # an export that failed is broken for both audit invariants
                audit["complete"] = checks.audit_complete(recs, audit["rows"], kills)
            limits = checks.Limits(cfg.p99_bound_s, cfg.rss_slope_mib_per_min, cfg.rss_warmup_s, cfg.rss_ceiling_mib)
            fault_dicts = [f.as_dict() for f in plan]
            for f in fault_dicts:  # times relative to the start, as in the plan
                f["start_rel_s"], f["end_rel_s"] = round(f["start"] - go, 3), round(f["end"] - go, 3)
            res = checks.evaluate(recs, fault_dicts, scopes(cfg), sampler.samples, audit, self.stack.server.exits,
                                  worker_exits, limits)
            result["results"] = res
            result["rss_samples"] = [(round(t - go, 2), pid, kib) for t, pid, kib in sampler.samples]
            result["passed"] = all(inv["held"] for inv in res["invariants"].values())
        except (StackError, OSError, subprocess.SubprocessError, httpx.HTTPError) as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["passed"] = False
            if self.stack.server is not None:
                result["server_log_tail"] = self.stack.server.tail()
        finally:
            sampler.stopped.set()
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)
            self.stack.close()
            if self.stack.server is not None and self.stack.server.log.exists():
                cfg.out.mkdir(parents=True, exist_ok=True)
                shutil.copy(self.stack.server.log, cfg.out / "serve.log")
            if not cfg.keep:
                shutil.rmtree(self.root, ignore_errors=True)
        return result


def run(cfg: Config) -> dict[str, Any]:
    """Run the soak; write ``report.json`` and ``summary.md`` under ``cfg.out``; return the report."""
    result = Soak(cfg).run()
    if "results" in result:
        report.write(cfg.out, result)
    else:
        cfg.out.mkdir(parents=True, exist_ok=True)
        (cfg.out / "report.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (cfg.out / "summary.md").write_text(f"# Soak: FAILED\n\nThe run did not complete: {result.get('error')}\n")
    return result
