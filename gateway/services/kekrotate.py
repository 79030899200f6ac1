"""KEK rotation: rewrap every KEK-wrapped secret under the configured (new) KEK version.

Rewrapped in this order, each row in its own small conditional UPDATE: data keys
(``kv_data_keys.wrapped_key``, context ``crypto.contexts.dek_context(tenant, version)``), gateway
secrets (``kv_secrets``: the namespace master secret, the capability key), namespace epoch salts
(``kv_namespaces.wrapped_salt``). The DEKs themselves do not change, so chunk envelopes are not
touched and every chunk written before the rotation still opens after it.

Resumable: a pass rewraps only rows not yet under the new KEK, so a restart after a crash does only
what is left. Every UPDATE is conditional on the blob (and epoch) it read, so a key destroyed or an
epoch bumped by a concurrent secure clear is never resurrected or overwritten. A row is unwrapped
by the provider in ``previous`` whose ``key_id`` matches it, else by any that can. Audited as
``kek.rotate`` (phase ``started`` and ``completed`` / ``incomplete``, with counts). The queries
live in ``tenancy.rewrap`` (tenancy owns the tables). Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from audit.types import Actions, Actor, AuditEvent, AuditSink, record_durably
from crypto.contexts import ContextLike, dek_context, ns_salt_context, secret_context
from crypto.errors import KekError
from crypto.kek import KekProvider, LocalFileKek
from tenancy.registry import Registry
from tenancy.rewrap import RewrapQueries

if TYPE_CHECKING:
    from gateway.config import Settings

__all__ = ["ROTATE_ACTION", "RotationReport", "rotate_from_settings", "rotate_kek"]

ROTATE_ACTION = Actions.KEK_ROTATE


@dataclass
class RotationReport:
    kek_id: str
    data_keys: int = 0
    secrets: int = 0
    salts: int = 0
    already_current: int = 0
    failed: list[str] = field(default_factory=list)  # row names, never key material

    @property
    def rewrapped(self) -> int:
        return self.data_keys + self.secrets + self.salts

    @property
    def complete(self) -> bool:
        return not self.failed


class _Rewrapper:
    """Unwraps with whichever provider can, wraps with the new KEK (synchronous provider calls)."""

    def __init__(self, kek: KekProvider, previous: Sequence[KekProvider]) -> None:
        self.kek = kek
        self.previous = list(previous)

    def is_current(self, blob: bytes, context: ContextLike) -> bool:
        key_id_of: Callable[[bytes, ContextLike], str | None] | None = getattr(self.kek, "key_id_of", None)
        try:
            if key_id_of is not None:
                return key_id_of(blob, context) == self.kek.key_id
            self.kek.unwrap(blob, context)
            return True
        except KekError:
            return False

    def rewrap(self, blob: bytes, context: ContextLike, kek_id: str | None) -> bytes:
        order = sorted([*self.previous, self.kek], key=lambda p: p.key_id != kek_id)
        for provider in order:
            try:
                plain = provider.unwrap(blob, context)
            except KekError:
                continue
            return self.kek.wrap(plain, context)
        raise KekError(f"no configured KEK can unwrap this row (wrapped under {kek_id or 'an unknown KEK'})")


async def rotate_kek(
    registry: Registry,
    kek: KekProvider,
    *,
    previous: Sequence[KekProvider] = (),
    audit: AuditSink | None = None,
    actor: Actor | None = None,
    batch_size: int = 500,
) -> RotationReport:
    """Rewrap every wrapped data key, gateway secret and namespace salt under ``kek``.

    Safe to run again at any time (it resumes, or finds nothing to do). Rows no provider can
    unwrap are listed in ``report.failed`` and left as they are."""
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    rows, rw, report = RewrapQueries(registry), _Rewrapper(kek, previous), RotationReport(kek.key_id)
    actor = actor or Actor(subject="kvgate:kek-rotate")
    await _emit(audit, actor, "success", {"phase": "started", "to": kek.key_id, "from": [p.key_id for p in previous]})
    try:
        await _rotate_data_keys(rows, rw, report, batch_size)
        await _rotate_secrets(rows, rw, report)
        await _rotate_salts(rows, rw, report, batch_size)
    except BaseException as exc:
        await _emit(audit, actor, "failure", _details(report, "interrupted") | {"error": type(exc).__name__})
        raise
    await _emit(audit, actor, "success" if report.complete else "failure",
                _details(report, "completed" if report.complete else "incomplete"))
    return report


def _details(report: RotationReport, phase: str) -> dict[str, Any]:
    return {"phase": phase, "to": report.kek_id, "data_keys": report.data_keys, "secrets": report.secrets,
            "salts": report.salts, "already_current": report.already_current, "failed": len(report.failed)}


async def _emit(audit: AuditSink | None, actor: Actor, outcome: str, details: dict[str, Any]) -> None:
    """Each phase of a rotation is durable before the rotation goes on (or returns)."""
    if audit is not None:
        await record_durably(audit, AuditEvent(ROTATE_ACTION, outcome=outcome, actor=actor, details=details))


def _rewrap_batch(rw: _Rewrapper, items: Sequence[tuple[str, bytes, ContextLike, str | None]], failed: list[str]) -> list[bytes | None]:
    out: list[bytes | None] = []
    for name, blob, context, kek_id in items:
        try:
            out.append(rw.rewrap(blob, context, kek_id))
        except KekError:
            failed.append(name)
            out.append(None)
    return out


async def _rotate_data_keys(rows: RewrapQueries, rw: _Rewrapper, report: RotationReport, batch: int) -> None:
    after: tuple[str, int] | None = None
    while page := await rows.data_keys(rw.kek.key_id, after, batch):
        after = (page[-1].tenant_id, page[-1].version)
        items = [(f"data_key:{r.tenant_id}/{r.version}", r.wrapped_key, dek_context(r.tenant_id, r.version), r.kek_id) for r in page]
        new = await asyncio.to_thread(_rewrap_batch, rw, items, report.failed)
        report.data_keys += await rows.update_data_keys(rw.kek.key_id, [
            {"t": r.tenant_id, "v": r.version, "old_id": r.kek_id, "old": r.wrapped_key, "new": n}
            for r, n in zip(page, new) if n is not None
        ])


async def _rotate_secrets(rows: RewrapQueries, rw: _Rewrapper, report: RotationReport) -> None:
    page = await rows.secrets(rw.kek.key_id)
    items = [(f"secret:{r.name}/{r.version}", r.wrapped, secret_context(r.name), r.kek_id) for r in page]
    new = await asyncio.to_thread(_rewrap_batch, rw, items, report.failed)
    report.secrets += await rows.update_secrets(rw.kek.key_id, [
        {"n": r.name, "v": r.version, "old_id": r.kek_id, "old": r.wrapped, "new": n}
        for r, n in zip(page, new) if n is not None
    ])


async def _rotate_salts(rows: RewrapQueries, rw: _Rewrapper, report: RotationReport, batch: int) -> None:
    after: tuple[str, str] | None = None
    while page := await rows.salts(after, batch):
        after = (page[-1].tenant_id, page[-1].name)

        def work(page: list[Any] = page) -> list[tuple[Any, bytes]]:
            todo = []
            for r in page:
                context = ns_salt_context(r.tenant_id, r.name, r.epoch)
                if rw.is_current(r.wrapped_salt, context):
                    report.already_current += 1
                    continue
                (new,) = _rewrap_batch(rw, [(f"salt:{r.tenant_id}/{r.name}", r.wrapped_salt, context, None)], report.failed)
                if new is not None:
                    todo.append((r, new))
            return todo

        todo = await asyncio.to_thread(work)
        report.salts += await rows.update_salts([
            {"t": r.tenant_id, "n": r.name, "e": r.epoch, "old": r.wrapped_salt, "new": n} for r, n in todo
        ])


async def rotate_from_settings(
    settings: Settings, *, previous_kek_files: Sequence[Path] = (), batch_size: int = 500
) -> RotationReport:
    """``kvgate keys rotate-kek``: the configured KEK is the new one; old key files (a move off
    the development provider, or between key files) are given as ``previous_kek_files``."""
    from audit.writer import AuditWriter
    from gateway.services.dbschema import check_schema
    from gateway.services.runtime import make_kek
    from gateway.services.statefiles import open_kek

    previous = [LocalFileKek(p, create=False) for p in previous_kek_files]
    # a new key file is created only beside the old ones that unwrap the registry's keys
    kek = make_kek(settings) if previous else await open_kek(settings)
    registry = Registry.from_url(settings.db_url)
    try:
        await check_schema(registry.engine)
        audit = AuditWriter(settings.db_url, spool_dir=settings.state_dir / "audit-spool")
        await audit.start()
        try:
            return await rotate_kek(registry, kek, previous=previous, audit=audit, batch_size=batch_size)
        finally:
            await audit.aclose()
    finally:
        await registry.aclose()
        close = getattr(kek, "close", None)
        if close is not None:
            close()
