"""`kvgate doctor`: every dependency and setting checked, one row each, with the fix.

    settings        the configuration validates (KVGATE_* and KVGATE_CONFIG)
    state dir       exists (or can be made), owner-only (0700)
    files           database, KEK file, audit key, spool: owner-only (0600 / 0700)
    database        reachable; schema at head (SQLite is migrated by serve; Postgres needs migrate)
    redis           reachable (PING) where a Redis tier or URL is configured
    kek             a wrap/unwrap round trip through the configured provider
    oidc            each issuer's discovery document and JWKS reachable (the development issuer
                    is served by `kvgate serve` itself)
    signing key     the audit signing key loads (created at the first export if absent)

Each check returns a ``Check``; nothing here raises for a failed dependency, and nothing is
changed (the doctor never migrates, creates keys or writes to a tier).
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.cli.errors import explain, redact_url
from gateway.config import Settings

__all__ = ["Check", "run_checks"]

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | FAIL
    detail: str
    fix: str = ""


def _mode_check(path: Path, want: int, what: str) -> Check | None:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return None
    if mode & ~want:
        return Check(f"permissions: {what}", WARN, f"{path} is {mode:o}, wider than {want:o}", f"chmod {want:o} {path}")
    return Check(f"permissions: {what}", OK, f"{path} is {mode:o}")


def _files(settings: Settings) -> list[Check]:
    out: list[Check] = []
    state = settings.state_dir
    if not state.exists():
        return [Check("state dir", WARN, f"{state} does not exist yet", "kvgate migrate (or serve) creates it, mode 0700")]
    if not os.access(state, os.W_OK):
        return [Check("state dir", FAIL, f"{state} is not writable", f"chown/chmod {state} for the kvgate user")]
    out.append(Check("state dir", OK, str(state)))
    candidates = [(state, 0o700, "state dir"), (state / "audit-spool", 0o700, "audit spool")]
    if settings.audit_signer_kind == "file":
        candidates.append((settings.audit_key_path, 0o600, "audit key"))
    if settings.database_url is None:
        candidates.append((state / "kvgate.db", 0o600, "database"))
    if settings.kek_provider == "file":
        candidates.append((settings.kek_path, 0o600, "KEK file"))
    for path, want, what in candidates:
        c = _mode_check(path, want, what)
        if c is not None:
            out.append(c)
    return out


async def _database(settings: Settings) -> Check:
    from sqlalchemy.ext.asyncio import create_async_engine

    from gateway.services.dbschema import SchemaBehind, check_schema

    url = settings.db_url
    shown = redact_url(url)
    if url.startswith("sqlite") and settings.database_url is None and not (settings.state_dir / "kvgate.db").exists():
        return Check("database", WARN, f"{shown}: no database yet", "kvgate serve (or kvgate migrate) creates it")
    engine = create_async_engine(url)
    try:
        async with asyncio.timeout(5):
            await check_schema(engine)
        return Check("database", OK, f"{shown}: schema at head")
    except SchemaBehind as exc:
        if url.startswith("sqlite"):
            return Check("database", WARN, f"{shown}: {str(exc).split(':')[0]}", "kvgate serve migrates SQLite itself (or run kvgate migrate)")
        return Check("database", FAIL, f"{shown}: {str(exc).split(':')[0]}", "kvgate migrate")
    except (TimeoutError, Exception) as exc:
        return Check("database", FAIL, f"{shown}: {explain(exc)}", "start the database or fix KVGATE_DATABASE_URL")
    finally:
        await engine.dispose()


async def _redis(settings: Settings) -> Check | None:
    if not settings.redis_url:
        return None
    shown = redact_url(settings.redis_url)
    if settings.redis_url.startswith(("redis+cluster://", "rediss+cluster://")):
        from storage.redis_cluster import probe_cluster

        try:
            t0 = time.perf_counter()
            line = await probe_cluster(settings.redis_url)
            return Check("redis", OK, f"{shown}: {line} in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        except Exception as exc:
            return Check("redis", FAIL, f"{shown}: {explain(exc)}", "start the cluster's nodes or fix KVGATE_REDIS_URL")
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
    try:
        t0 = time.perf_counter()
        async with asyncio.timeout(3):
            await client.ping()
        return Check("redis", OK, f"{shown}: PING in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    except (TimeoutError, Exception) as exc:
        return Check("redis", FAIL, f"{shown}: {explain(exc)}", "start Redis or fix KVGATE_REDIS_URL")
    finally:
        await client.aclose()


def _kek(settings: Settings) -> Check:
    from gateway.services.runtime import make_kek

    if settings.kek_provider == "file" and not settings.kek_path.exists():
        return Check(
            "kek", WARN, f"no KEK file at {settings.kek_path} yet",
            "kvgate migrate or serve creates it for a registry that holds no wrapped keys yet (development only)",
        )
    try:
        kek = make_kek(settings)
        try:
            context = b"kvgate/doctor/v1"
            probe = os.urandom(32)
            if kek.unwrap(kek.wrap(probe, context), context) != probe:
                return Check("kek", FAIL, f"{settings.kek_provider}: round trip returned other bytes", "check the provider")
        finally:
            close = getattr(kek, "close", None)
            if close is not None:
                close()
        return Check("kek", OK, f"{settings.kek_provider}: wrap/unwrap round trip")
    except Exception as exc:
        return Check("kek", FAIL, f"{settings.kek_provider}: {explain(exc)}", _kek_fix(settings))


def _kek_fix(settings: Settings) -> str:
    return {
        "pkcs11": "check KVGATE_PKCS11_MODULE, KVGATE_PKCS11_TOKEN_LABEL, KVGATE_PKCS11_PIN and the key label",
        "kms": "check KVGATE_KMS_KEY_ID, the region/endpoint, credentials and that the key is enabled",
    }.get(settings.kek_provider, "check KVGATE_KEK_FILE")


async def _issuers(settings: Settings) -> list[Check]:
    import httpx

    out: list[Check] = []
    if settings.dev_issuer:
        out.append(Check("oidc: development issuer", OK if settings.mode == "development" else FAIL,
                         f"{settings.public_url}/dev-issuer (served by kvgate serve)",
                         "" if settings.mode == "development" else "KVGATE_DEV_ISSUER=false in production"))
    async with httpx.AsyncClient(timeout=3.0, follow_redirects=False) as http:
        for iss in settings.issuers:
            name = f"oidc: {iss.issuer}"
            try:
                r = await http.get(iss.issuer.rstrip("/") + "/.well-known/openid-configuration")
                r.raise_for_status()
                jwks_uri = r.json()["jwks_uri"]
                j = await http.get(jwks_uri)
                j.raise_for_status()
                n = len(j.json().get("keys", []))
                out.append(Check(name, OK if n else FAIL, f"discovery and JWKS ({n} keys)", "" if n else "the JWKS has no keys"))
            except Exception as exc:
                out.append(Check(name, FAIL, explain(exc), "check the issuer URL (exact iss) and that it is reachable"))
    if not out:
        out.append(Check("oidc", FAIL, "no issuer configured", "set KVGATE_ISSUERS (or KVGATE_DEV_ISSUER=true for development)"))
    return out


def _signing_key(settings: Settings) -> Check:
    kind = settings.audit_signer_kind
    if kind != "file":  # the key pair in the HSM or KMS: open it and sign a probe
        from gateway.services.auditing import close_signer, make_audit_signer

        try:
            signer = make_audit_signer(settings)
            try:
                signer.sign(b"kvgate/doctor/v1")
                key = signer.key_id
            finally:
                close_signer(signer)
        except Exception as exc:
            return Check("signing key", FAIL, f"{kind}: {explain(exc)}", "the message names the key and the setting")
        return Check("signing key", OK, f"{kind}: key {key} signs")
    path = settings.audit_key_path
    if not path.exists():
        return Check("signing key", WARN, f"no audit key at {path} yet", "created at the first audit export")
    try:
        from audit import AuditSigningKey

        AuditSigningKey.load(path)
        return Check("signing key", OK, f"{path} loads")
    except Exception as exc:
        return Check("signing key", FAIL, f"{path}: {explain(exc)}", "restore the key file or move it away to create a new one")


async def run_checks(load: Callable[[], Settings]) -> list[Check]:
    try:
        settings = load()
    except Exception as exc:
        return [Check("settings", FAIL, explain(exc), "fix the named setting (README: Configuration)")]
    out = [Check("settings", OK, f"mode {settings.mode}, tiers {', '.join(settings.tiers)}")]
    out += _files(settings)
    steps: list[Awaitable[Check | None]] = [_database(settings), _redis(settings)]
    for c in await asyncio.gather(*steps):
        if c is not None:
            out.append(c)
    out.append(await asyncio.to_thread(_kek, settings))
    out += await _issuers(settings)
    out.append(await asyncio.to_thread(_signing_key, settings))
    return out
