"""The namespace resolver: the one place that turns (tenant, namespace) into keys and chained
hashes into storage keys ("Namespaces are cryptographic", docs/architecture.md, section 1).

    (tenant, namespace) --registry: epoch, wrapped salt--> KEK unwrap --> NamespaceKeys (cached)
    NamespaceKeys + chained hash h_i --HMAC(index key)--> ChunkKey(owner, group, digest)

KEK calls (a PKCS#11 token or a cloud KMS, up to seconds each) run in a worker thread, never on
the event loop, and at most one unwrap per namespace is in flight: concurrent first requests for
the same namespace wait for it instead of each calling the KEK; other namespaces go on. Secure
clear bumps a namespace's epoch with a fresh wrapped salt (``new_epoch_salt``) and drops the
cached keys (``forget``), so the next request derives keys under the new epoch.

Storage keys are cached (``chunk_keys``: a prompt's prefix recurs, and its HMACs weigh on a lookup),
bounded (emptied when full), emptied by ``forget``, and keyed by the namespace epoch's index key and
the chained hash, so a new epoch never meets an entry of a previous one."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections.abc import Sequence

from crypto.contexts import ns_salt_context
from crypto.kek import KekProvider
from gateway.errors import TenantUnavailable
from storage.types import ChunkKey
from tenancy.namespaces import NamespaceDeriver, NamespaceKeys
from tenancy.registry import Registry, TenantDisabled, UnknownTenant

__all__ = ["NamespaceResolver", "keys_digest"]

_Key = tuple[str, str]
_KEY_CACHE_ENTRIES = 1 << 16  # storage keys kept (about 20 MiB at most); emptied when full


def keys_digest(keys: Sequence[ChunkKey]) -> str:
    """One digest over a set of storage keys, for audit events (order does not matter)."""
    h = hashlib.sha256()
    for d in sorted(k.digest for k in keys):
        h.update(d.encode())
    return h.hexdigest()


class NamespaceResolver:
    def __init__(self, registry: Registry, kek: KekProvider, deriver: NamespaceDeriver) -> None:
        self.registry = registry
        self.kek = kek
        self.deriver = deriver
        self._cache: dict[_Key, NamespaceKeys] = {}
        self._inflight: dict[_Key, asyncio.Future[NamespaceKeys]] = {}
        self._chunk_keys: dict[tuple[bytes, bytes], ChunkKey] = {}  # (index key, chained hash)

    # -- keys --------------------------------------------------------------------------------
    async def keys(self, tenant: str, namespace: str) -> NamespaceKeys:
        """The namespace's current keys; raises TenantUnavailable (unknown or disabled tenant)
        or the KEK provider's error (KekError / KeyUnavailable) when it cannot unwrap."""
        key = (tenant, namespace)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        pending = self._inflight.get(key)
        if pending is not None:  # one unwrap per namespace in flight: wait for it
            return await asyncio.shield(pending)
        fut: asyncio.Future[NamespaceKeys] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            keys = await self._load(tenant, namespace)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved here: waiters (if any) re-raise it themselves
            raise
        else:
            fut.set_result(keys)
            if self._inflight.get(key) is fut:  # not forgotten meanwhile (a clear): cache it
                self._cache[key] = keys
            return keys
        finally:
            if self._inflight.get(key) is fut:
                del self._inflight[key]

    async def _load(self, tenant: str, namespace: str) -> NamespaceKeys:
        try:
            await self.registry.require_active(tenant)
        except (UnknownTenant, TenantDisabled) as exc:
            raise TenantUnavailable("tenant unavailable") from exc
        rec = await self.registry.get_namespace(tenant, namespace)
        if rec is None:
            wrapped = await asyncio.to_thread(self.kek.wrap, os.urandom(32), ns_salt_context(tenant, namespace, 0))
            rec = await self.registry.create_namespace(tenant, namespace, wrapped)
        salt = await asyncio.to_thread(self.kek.unwrap, rec.wrapped_salt, ns_salt_context(tenant, namespace, rec.epoch))
        return self.deriver.derive(tenant, namespace, rec.epoch, salt)

    async def new_epoch_salt(self, tenant: str, namespace: str, epoch: int) -> bytes:
        """A fresh salt for ``epoch``, wrapped by the KEK (secure clear's epoch bump)."""
        return await asyncio.to_thread(self.kek.wrap, os.urandom(32), ns_salt_context(tenant, namespace, epoch))

    def forget(self, tenant: str | None, namespace: str | None = None) -> None:
        """Drop cached keys (after a clear here or, via broadcast, elsewhere); all of them when
        ``tenant`` is None. An unwrap in flight for a forgotten namespace is not cached."""
        for table in (self._cache, self._inflight):
            for key in [
                k for k in table
                if tenant is None or (k[0] == tenant and (namespace is None or k[1] == namespace))
            ]:
                del table[key]
        self._chunk_keys.clear()  # rare (a clear, a rotation, a disable): all of them, simply

    # -- storage keys: built here and nowhere else ---------------------------------------------
    @staticmethod
    def chunk_key(ns: NamespaceKeys, chained_hash: bytes) -> ChunkKey:
        return ChunkKey(ns.owner, ns.group, ns.storage_key(chained_hash))

    def chunk_keys(self, ns: NamespaceKeys, chained_hashes: Sequence[bytes]) -> list[ChunkKey]:
        """A request's storage keys (cached; labels checked once, not per chunk)."""
        index_key, cache = ns.index_key, self._chunk_keys
        got = [cache.get((index_key, h)) for h in chained_hashes]
        missing = [h for h, key in zip(chained_hashes, got, strict=True) if key is None]
        if not missing:
            return [key for key in got if key is not None]  # every one cached (the common case)
        made = dict(zip(missing, ChunkKey.many(
            ns.owner, ns.group, [hmac.digest(index_key, h, "sha256").hex() for h in missing]
        ), strict=True))
        if len(cache) + len(made) > _KEY_CACHE_ENTRIES:
            cache.clear()
        for h, key in made.items():
            cache[(index_key, h)] = key
        return [key if key is not None else made[h] for h, key in zip(chained_hashes, got, strict=True)]

    def chunk_key_of_labels(self, tenant: str, group: str, digest: str) -> ChunkKey:
        """A stored chunk's key from a clear job's record (owner label, group label, digest)."""
        return ChunkKey(self.deriver.owner_label(tenant), group, digest)

    def owner_label(self, tenant: str) -> str:
        return self.deriver.owner_label(tenant)

    def group_label(self, tenant: str, namespace: str) -> str:
        return self.deriver.group_label(tenant, namespace)
