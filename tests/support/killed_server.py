"""A real ``kvgate serve`` process to kill -9: admin actions or capability mints over HTTP, then
SIGKILL, then count what the audit log kept. Used by tests/e2e/test_audit_crash.py,
scripts/audit_kill_loss.py and scripts/mint_durability.py (which also run it against an older
checkout: ``code_root`` is where the server's code is imported from).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.paths import REPO
from tests.support.services import free_port

REPO = REPO


class ServeProcess:
    def __init__(self, state_dir: Path, db_url: str | None = None, *, code_root: Path = REPO) -> None:
        self.state_dir = state_dir
        self.db_url = db_url
        self.code_root = code_root
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = state_dir.parent / f"serve-{self.port}.log"

    def env(self) -> dict[str, str]:
        env = {
            **os.environ, "PYTHONPATH": str(self.code_root), "KVGATE_STATE_DIR": str(self.state_dir),
            "KVGATE_TIERS": '["memory"]', "KVGATE_MEMORY_BYTES": str(64 << 20), "KVGATE_CPU_THREADS": "1",
        }
        if self.db_url:
            env["KVGATE_DATABASE_URL"] = self.db_url
        return env

    def start(self, timeout: float = 120) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        cmd = [sys.executable, "-m", "gateway"]
        subprocess.run([*cmd, "migrate"], env=self.env(), cwd=self.code_root, check=True, capture_output=True,
                       timeout=300)
        out = self.log.open("ab")
        self.proc = subprocess.Popen([*cmd, "serve", "--port", str(self.port)], env=self.env(), cwd=self.code_root,
                                     stdout=out, stderr=out)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(self.base_url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvgate serve did not start; see {self.log}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def token(self, tenant: str, roles: tuple[str, ...]) -> str:
        from tenancy.devissuer import DevIssuer

        return DevIssuer(self.state_dir, issuer_url=self.base_url + "/dev-issuer").mint(tenant, list(roles))

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill9()


@dataclass
class Acked:
    action: str  # the audit action name
    tenant: str


async def admin_actions(server: ServeProcess, n: int, prefix: str) -> list[Acked]:
    """``n`` admin actions, alternating tenant create and key rotate; each one is acknowledged
    (2xx) before the next is sent. Returns what was acknowledged, in order."""
    op = {"Authorization": f"Bearer {server.token('platform', ('kv.operator',))}"}
    done: list[Acked] = []
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        for i in range(n):
            tenant = f"{prefix}-{i // 2}"
            if i % 2 == 0:
                r = await http.post("/v1/admin/tenants", json={"tenant": tenant}, headers=op)
                assert r.status_code == 201, r.text
                done.append(Acked("tenant.create", tenant))
            else:
                r = await http.post(f"/v1/admin/tenants/{tenant}/keys/rotate", headers=op)
                assert r.status_code == 200, r.text
                done.append(Acked("key.rotate", tenant))
    return done


async def denials(server: ServeProcess, n: int, prefix: str) -> list[Acked]:
    """``n`` refused admin calls (a worker token rotating keys of tenant ``<prefix>-<i>``): data-plane
    style events (``authz.denied``), batched, not acknowledged durably. Returns the 403s seen."""
    worker = {"Authorization": f"Bearer {server.token('someone', ('kv.worker',))}"}
    done: list[Acked] = []
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        for i in range(n):
            r = await http.post(f"/v1/admin/tenants/{prefix}-{i}/keys/rotate", headers=worker)
            assert r.status_code == 403, r.text
            done.append(Acked("authz.denied", f"{prefix}-{i}"))
    return done


async def logged(db_url: str) -> list[tuple[int, str, str | None]]:
    """(seq, action, target tenant) of every audit row, in chain order (read with SQLAlchemy)."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT seq, action, target_tenant FROM kv_audit_events ORDER BY seq"))
            return [(r[0], r[1], r[2]) for r in rows]
    finally:
        await engine.dispose()


@dataclass
class Mint:
    cap_id: str
    seconds: float  # the request's latency, as the caller saw it


async def create_tenant(server: ServeProcess, tenant: str) -> None:
    op = {"Authorization": f"Bearer {server.token('platform', ('kv.operator',))}"}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        r = await http.post("/v1/admin/tenants", json={"tenant": tenant}, headers=op)
        assert r.status_code == 201, r.text


async def capability_mints(server: ServeProcess, n: int, tenant: str, callers: int = 16) -> list[Mint]:
    """``n`` capabilities minted (``POST /v1/capabilities``) by ``callers`` concurrent clients, each
    sending its next request once the last one is answered. Returns every acknowledged (201) mint;
    the list is complete when the last caller is answered."""
    headers = {"Authorization": f"Bearer {server.token(tenant, ('kv.worker',))}"}
    body = {"namespace": "default", "ops": ["lookup", "get", "put"], "ttl": 600}
    done: list[Mint] = []
    left = iter(range(n))
    limits = httpx.Limits(max_connections=callers, max_keepalive_connections=callers)

    async def caller(http: httpx.AsyncClient) -> None:
        for _ in left:
            t0 = time.perf_counter()
            r = await http.post("/v1/capabilities", json=body, headers=headers)
            assert r.status_code == 201, r.text
            done.append(Mint(r.json()["cap_id"], time.perf_counter() - t0))

    async with httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits) as http:
        await asyncio.gather(*(caller(http) for _ in range(callers)))
    return done


async def minted(db_url: str) -> set[str]:
    """The ``cap_id`` of every ``capability.mint`` row in the audit log."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(text("SELECT details FROM kv_audit_events WHERE action = 'capability.mint'"))
            return {json.loads(r[0])["cap_id"] for r in rows}
    finally:
        await engine.dispose()


def kill_after_mints(server: ServeProcess, n: int, delay_s: float, tenant: str, callers: int = 16) -> list[Mint]:
    """Create ``tenant``, mint ``n`` capabilities with ``callers`` concurrent clients, wait
    ``delay_s`` after the last acknowledged one, SIGKILL the server. Returns the acknowledged mints."""
    asyncio.run(create_tenant(server, tenant))
    acked = asyncio.run(capability_mints(server, n, tenant, callers))
    if delay_s:
        time.sleep(delay_s)
    server.kill9()
    return acked


def lost_and_order(acked: list[Acked], rows: list[tuple[int, str, str | None]]) -> tuple[int, bool]:
    """How many acknowledged actions have no event, and whether those present are in order."""
    where = {(a, t): seq for seq, a, t in rows}
    seqs = [where.get((x.action, x.tenant)) for x in acked]
    present = [s for s in seqs if s is not None]
    return len(acked) - len(present), present == sorted(present)


def kill_after(server: ServeProcess, n: int, delay_s: float, prefix: str, kind: str = "admin") -> list[Acked]:
    acked = asyncio.run((admin_actions if kind == "admin" else denials)(server, n, prefix))
    if delay_s:
        time.sleep(delay_s)
    server.kill9()
    return acked
