"""Per-tenant versioned data keys (DEKs), kept only wrapped by the KEK (as MultiFernet: the newest
version encrypts, any live version decrypts, destroyed versions are gone).

Invocation limit: every envelope sealed under a DEK takes one invocation from that version's
budget in the registry. Processes reserve blocks of invocations with one conditional UPDATE, so
the limit holds across threads, processes and replicas; when a version's budget is spent the
keyring rotates to a new version. (Each envelope derives its own AES key from the DEK and a random
256-bit salt, so GCM nonces never repeat under one AES key; the DEK limit bounds how much any one
DEK protects, well below NIST SP 800-38D's 2^32 random-IV bound per key.)

Unwrapped DEKs live in process memory only, in a cache bounded in size (LRU) and in time
(``cache_ttl`` seconds after the unwrap, the active version's encryption budget included); destroy
and forget drop them. After the TTL the DEK is unwrapped again from the registry, so a KEK that
was disabled or became unreachable stops serving within one TTL, and a chunk whose key cannot be
unwrapped is a miss (``KeyUnavailable``), never plaintext.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from crypto.contexts import dek_context
from crypto.errors import KeyUnavailable
from crypto.kek import KekProvider
from tenancy.registry import Registry

__all__ = ["DEFAULT_INVOCATION_LIMIT", "Keyring", "dek_context"]

DEFAULT_INVOCATION_LIMIT = 2**32


@dataclass(slots=True)
class _Budget:
    version: int
    dek: bytes
    remaining: int
    expires: float


class Keyring:
    def __init__(
        self,
        registry: Registry,
        kek: KekProvider,
        *,
        invocation_limit: int = DEFAULT_INVOCATION_LIMIT,
        reserve_block: int = 1024,
        cache_size: int = 4096,
        cache_ttl: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if invocation_limit < 1 or reserve_block < 1:
            raise ValueError("invocation_limit and reserve_block must be positive")
        if cache_ttl <= 0 or cache_size < 1:
            raise ValueError("cache_ttl and cache_size must be positive")
        self._registry = registry
        self._kek = kek
        self.invocation_limit = invocation_limit
        self._block = reserve_block
        self._budgets: dict[str, _Budget] = {}
        self._cache: OrderedDict[tuple[str, int], tuple[bytes, float]] = OrderedDict()
        self._cache_size = cache_size
        self._ttl = cache_ttl
        self._clock = clock
        self._locks: dict[str, asyncio.Lock] = {}

    def __repr__(self) -> str:
        return f"Keyring(kek={self._kek.key_id!r}, cached={len(self._cache)})"

    def _lock(self, tenant: str) -> asyncio.Lock:
        lock = self._locks.get(tenant)
        if lock is None:
            lock = self._locks[tenant] = asyncio.Lock()
        return lock

    def _remember(self, tenant: str, version: int, dek: bytes) -> None:
        self._cache[(tenant, version)] = (dek, self._clock() + self._ttl)
        self._cache.move_to_end((tenant, version))
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _wrap_new(self, tenant: str) -> tuple[Callable[[int], bytes], dict[int, tuple[bytes, bytes]]]:
        made: dict[int, tuple[bytes, bytes]] = {}  # version -> (key, its wrapping) of each attempt

        def wrap(version: int) -> bytes:
            dek = os.urandom(32)
            wrapped = self._kek.wrap(dek, dek_context(tenant, version))
            made[version] = (dek, wrapped)
            return wrapped

        return wrap, made

    async def create(self, tenant: str, *, expect_active: int | None = None) -> int:
        """Make a new active version (retiring the current one); returns the active version."""
        wrap, made = self._wrap_new(tenant)
        rec = await self._registry.add_key(
            tenant, wrap, self._kek.key_id, self.invocation_limit, expect_active=expect_active
        )
        attempt = made.get(rec.version)
        # remembered only where the stored key is the one made here: an attempt whose insert lost
        # the version number to another process made a key that was never stored
        if attempt is not None and attempt[1] == rec.wrapped_key:
            self._remember(tenant, rec.version, attempt[0])
        self._budgets.pop(tenant, None)
        return rec.version

    async def rotate(self, tenant: str) -> int:
        current = await self._registry.active_key(tenant)
        return await self.create(tenant, expect_active=current.version if current else None)

    async def encryption_key(self, tenant: str) -> tuple[int, bytes]:
        """The active version and its DEK, with one invocation taken from its budget."""
        budget = self._budgets.get(tenant)
        if budget is not None and budget.remaining > 0 and budget.expires > self._clock():
            budget.remaining -= 1
            return budget.version, budget.dek
        async with self._lock(tenant):
            budget = self._budgets.get(tenant)
            if budget is not None and budget.remaining > 0 and budget.expires > self._clock():
                budget.remaining -= 1
                return budget.version, budget.dek
            for _ in range(8):
                rec = await self._registry.active_key(tenant)
                if rec is None:
                    await self.create(tenant, expect_active=None)
                    continue
                left = rec.invocation_limit - rec.invocations
                take = min(self._block, left)
                if take > 0 and await self._registry.reserve_invocations(tenant, rec.version, take):
                    dek = await self.decryption_key(tenant, rec.version)
                    self._budgets[tenant] = _Budget(rec.version, dek, take - 1, self._clock() + self._ttl)
                    return rec.version, dek
                force = take <= 0
                if not force:
                    current = await self._registry.get_key(tenant, rec.version)
                    force = current is not None and current.state == "active"
                if force:
                    # spent (or raced to spent): force a new version
                    await self.create(tenant, expect_active=rec.version)
            raise KeyUnavailable("could not obtain an encryption key (contention)")

    async def decryption_key(self, tenant: str, version: int) -> bytes:
        cached = self._cache.get((tenant, version))
        if cached is not None:
            if cached[1] > self._clock():
                self._cache.move_to_end((tenant, version))
                return cached[0]
            del self._cache[(tenant, version)]  # expired: unwrap again (the KEK decides)
        rec = await self._registry.get_key(tenant, version)
        if rec is None or rec.state == "destroyed" or rec.wrapped_key is None:
            raise KeyUnavailable("key version unavailable")
        try:
            # a KMS or HSM call (up to seconds): in a worker thread, never on the event loop
            dek = await asyncio.to_thread(self._kek.unwrap, rec.wrapped_key, dek_context(tenant, version))
        except Exception as exc:  # KekError or a provider outage: the chunk is a miss
            raise KeyUnavailable("key version could not be unwrapped") from exc
        self._remember(tenant, version, dek)
        return dek

    async def destroy(self, tenant: str, versions: list[int] | None = None) -> list[int]:
        """Destroy key versions (all by default): wrapped material erased, caches dropped."""
        destroyed = await self._registry.destroy_keys(tenant, versions)
        self.forget(tenant)
        return destroyed

    def forget(self, tenant: str | None) -> None:
        """Drop every cached DEK and budget of a tenant (after a clear elsewhere); of every
        tenant when ``tenant`` is None (a missed broadcast)."""
        if tenant is None:
            self._budgets.clear()
            self._cache.clear()
            return
        self._budgets.pop(tenant, None)
        for key in [k for k in self._cache if k[0] == tenant]:
            del self._cache[key]
