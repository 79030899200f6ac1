"""What the soak runs against, each part its own and stopped by its process id: a throwaway
Postgres cluster (initdb, pg_ctl) on a port of its own holding a database the soak creates and
drops, a redis-server on a port of its own (restarted and stalled by the faults), a SoftHSM2 token
holding the KEK and the audit signing key, an OIDC issuer over HTTP, and ``kvgate serve`` in
production mode as a subprocess that the faults stop with SIGTERM or SIGKILL and start again."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.support.oidc_issuer import LocalIssuer
from tests.support.paths import REPO
from tests.support.postgres import PG_BIN, ThrowawayPostgres
from tests.support.redis_server import Server as RedisServer
from tests.support.services import free_port
from tests.support.softhsm import MODULE_PATHS, token_dir, token_in_subprocesses

TOKEN_LABEL = "kvgate-soak"
KEK_LABEL = "kek-1"
SIGNING_LABEL = "audit-1"
PIN = "1111"
ISSUER_KID = "soak-1"
DATABASE = "kvgate_soak"


class StackError(RuntimeError):
    """A part of the stack is missing or did not start (the message says which and why)."""


def preflight() -> None:
    """Every tool the soak needs, named with its fix, before anything is started."""
    missing = []
    if not (PG_BIN / "pg_ctl").exists():
        missing.append(f"PostgreSQL server binaries in {PG_BIN} (KVGATE_TEST_PG_BIN; apt-get install postgresql)")
    if shutil.which("redis-server") is None:
        missing.append("redis-server (apt-get install redis-server)")
    if shutil.which("softhsm2-util") is None or not any(p and Path(p).is_file() for p in MODULE_PATHS):
        missing.append("SoftHSM2 (apt-get install softhsm2)")
    if importlib.util.find_spec("pkcs11") is None:
        missing.append("python-pkcs11 (pip install 'kvgate[pkcs11]')")
    if missing:
        raise StackError("the soak needs: " + "; ".join(missing))


def _sql(admin_url: str, statement: str) -> None:
    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(admin_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run())


class Hsm:
    """The SoftHSM2 token: a KEK and an audit signing key pair, made in subprocesses (SoftHSM2
    reads its configuration once per process). ``take_away``/``give_back``: the KEK outage, the
    token's directory moved aside and back, as an HSM that stops answering."""

    def __init__(self, root: Path) -> None:
        self.env = token_in_subprocesses(root, TOKEN_LABEL, kek_label=KEK_LABEL, signing_label=SIGNING_LABEL)
        self.dir = token_dir(root / "tokens", TOKEN_LABEL)
        self.aside = root / "token-aside"

    def take_away(self) -> None:
        self.dir.rename(self.aside)

    def give_back(self) -> None:
        if self.aside.exists():
            self.aside.rename(self.dir)


class Server:
    """``kvgate serve`` as its own process on a fixed port, so workers reach it across restarts."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**env, "KVGATE_PUBLIC_URL": self.url, "KVGATE_PORT": str(self.port)}
        self.log = root / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.exits: list[dict[str, Any]] = []  # how each process ended: signal, code, seconds

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gateway", *args], env=self.env, cwd=REPO,
                              capture_output=True, text=True, timeout=timeout, check=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def launch(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(self.port)],
                                         env=self.env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 120) -> float:
        """Seconds until ``/healthz`` answered 200 (StackError if the process ends or time runs out)."""
        t0 = time.monotonic()
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise StackError(f"kvgate serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout:
                raise StackError(f"kvgate serve did not answer /healthz in {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.05)

    def start(self, timeout: float = 120) -> float:
        self.launch()
        return self.wait_healthy(timeout)

    def stop(self, sig: signal.Signals, timeout: float = 60) -> dict[str, Any]:
        """Send ``sig`` and wait for the process to end; returns how it ended."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(30)
            ended = {"signal": sig.name, "exit_code": code, "seconds": round(time.monotonic() - t0, 3), "forced": True}
        else:
            ended = {"signal": sig.name, "exit_code": code, "seconds": round(time.monotonic() - t0, 3), "forced": False}
        self.exits.append(ended)
        return ended

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def rss_kib(pid: int) -> int | None:
    """Resident set size of ``pid`` in KiB (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Stack:
    """Every part, started in order by ``start`` and stopped in reverse by ``close``."""

    def __init__(self, root: Path, *, tiers: list[str], memory_mib: int, chunk_tokens: int,
                 kek_cache_ttl_s: float, checkpoint_interval_s: float) -> None:
        self.root = root
        self.tiers = tiers
        self.memory_mib = memory_mib
        self.chunk_tokens = chunk_tokens
        self.kek_cache_ttl_s = kek_cache_ttl_s
        self.checkpoint_interval_s = checkpoint_interval_s
        self.pg: ThrowawayPostgres | None = None
        self.redis: RedisServer | None = None
        self.hsm: Hsm | None = None
        self.issuer: LocalIssuer | None = None
        self.server: Server | None = None
        self.db_created = False

    def start(self) -> None:
        preflight()
        self.pg = ThrowawayPostgres()
        self.pg.init()
        self.pg.start()
        _sql(self.pg.url, f'CREATE DATABASE "{DATABASE}"')
        self.db_created = True
        self.redis = RedisServer()
        self.redis.start()
        self.hsm = Hsm(self.root / "hsm")
        self.issuer = LocalIssuer()
        self.issuer.start()
        self.issuer.add_key(ISSUER_KID, "EC")
        state = self.root / "state"
        state.mkdir(mode=0o700)
        env = {
            **os.environ, **self.hsm.env,
            "PYTHONPATH": str(REPO),
            "KVGATE_MODE": "production",
            "KVGATE_STATE_DIR": str(state),
            "KVGATE_DATABASE_URL": self.pg.url.rsplit("/", 1)[0] + "/" + DATABASE,
            "KVGATE_REDIS_URL": self.redis.url,
            "KVGATE_REDIS_PREFIX": "soak:",
            "KVGATE_TIERS": json.dumps(self.tiers),
            "KVGATE_MEMORY_BYTES": str(self.memory_mib << 20),
            "KVGATE_MEMORY_PREFAULT": "true",  # the arena is resident from the start: RSS trends are the server's own
            "KVGATE_CHUNK_TOKENS": str(self.chunk_tokens),
            "KVGATE_SEGMENT_BYTES": "4096",
            "KVGATE_CPU_THREADS": "1",
            "KVGATE_PKCS11_PIN": PIN,
            "KVGATE_AUDIT_SIGNER": "pkcs11",
            "KVGATE_AUDIT_PKCS11_KEY_LABEL": SIGNING_LABEL,
            "KVGATE_AUDIT_CHECKPOINT_INTERVAL_S": str(self.checkpoint_interval_s),
            # short, so that a KEK outage reaches data keys within the fault and not only after 5 minutes
            "KVGATE_KEK_CACHE_TTL_S": str(self.kek_cache_ttl_s),
            "KVGATE_ISSUERS": json.dumps([{"issuer": self.issuer.issuer, "audience": "kvgate"}]),
            "KVGATE_DEV_ISSUER": "false",
            "KVGATE_ACCESS_LOG": "false",
            "KVGATE_SHUTDOWN_TIMEOUT_S": "10",
            "KVGATE_LOG_LEVEL": "warning",
        }
        env.pop("KVGATE_CONFIG", None)
        self.server = Server(self.root, env)
        done = self.server.cli("migrate")
        if done.returncode != 0:
            raise StackError(f"kvgate migrate failed:\n{done.stdout}\n{done.stderr}")
        self.server.start()

    def token(self, tenant: str, roles: list[str], subject: str, ttl_s: float) -> str:
        """An access token from the soak's issuer (``at+jwt``, audience kvgate)."""
        assert self.issuer is not None
        now = int(time.time())
        claims = self.issuer.claims(sub=subject, tenant=tenant, roles=roles, iat=now, nbf=now,
                                    exp=now + int(ttl_s), jti=secrets.token_hex(8), client_id="soak")
        return str(self.issuer.sign(ISSUER_KID, claims))

    # -- the parts the faults act on -----------------------------------------------------------
    def redis_pid(self) -> int:
        assert self.redis is not None and self.redis.proc is not None
        return self.redis.proc.pid

    def close(self) -> None:
        errors: list[str] = []
        for step in (self._close_server, self._close_redis, self._close_hsm, self._close_issuer, self._close_pg):
            try:
                step()
            except Exception as exc:  # every part is stopped whatever the one before did
                errors.append(f"{step.__name__}: {exc}")
        if errors:
            print("soak: cleanup: " + "; ".join(errors), file=sys.stderr)

    def _close_server(self) -> None:
        if self.server is not None:
            self.server.kill()

    def _close_redis(self) -> None:
        if self.redis is not None and self.redis.proc is not None:
            try:
                os.kill(self.redis.proc.pid, signal.SIGCONT)  # a stalled server cannot be killed cleanly otherwise
            except ProcessLookupError:
                pass
            self.redis.kill()

    def _close_hsm(self) -> None:
        if self.hsm is not None:
            self.hsm.give_back()

    def _close_issuer(self) -> None:
        if self.issuer is not None:
            self.issuer.stop()

    def _close_pg(self) -> None:
        if self.pg is None:
            return
        try:
            if self.db_created:
                if not (self.pg.data / "postmaster.pid").exists():
                    self.pg.start()
                _sql(self.pg.url, f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        finally:
            self.pg.cleanup()
