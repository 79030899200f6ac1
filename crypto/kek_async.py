"""KEK calls off the event loop: a provider's blocking ``wrap``/``unwrap``/``health``/``close`` (an
HSM or KMS round trip, with timeouts of seconds) run in a worker thread via ``asyncio.to_thread``,
so a slow or dead KEK stalls one request, not the loop. Coalescing concurrent unwraps of one key is
the caller's business (the namespace resolver's)."""

from __future__ import annotations

import asyncio

from crypto.contexts import ContextLike
from crypto.kek import KekProvider

__all__ = ["AsyncKek", "aclose", "ahealth", "aunwrap", "awrap"]


async def awrap(provider: KekProvider, plaintext_key: bytes, context: ContextLike) -> bytes:
    """``provider.wrap`` in a worker thread."""
    return await asyncio.to_thread(provider.wrap, plaintext_key, context)


async def aunwrap(provider: KekProvider, wrapped: bytes, context: ContextLike) -> bytes:
    """``provider.unwrap`` in a worker thread."""
    return await asyncio.to_thread(provider.unwrap, wrapped, context)


async def ahealth(provider: KekProvider) -> None:
    """``provider.health`` in a worker thread."""
    await asyncio.to_thread(provider.health)


async def aclose(provider: KekProvider) -> None:
    """``provider.close`` in a worker thread (a PKCS#11 logout is a round trip too)."""
    await asyncio.to_thread(provider.close)


class AsyncKek:
    """A ``KekProvider`` with an awaitable face; ``provider`` is the synchronous one underneath."""

    __slots__ = ("provider",)

    def __init__(self, provider: KekProvider) -> None:
        self.provider = provider

    def __repr__(self) -> str:
        return f"AsyncKek({self.provider!r})"

    @property
    def key_id(self) -> str:
        return self.provider.key_id

    async def wrap(self, plaintext_key: bytes, context: ContextLike) -> bytes:
        return await awrap(self.provider, plaintext_key, context)

    async def unwrap(self, wrapped: bytes, context: ContextLike) -> bytes:
        return await aunwrap(self.provider, wrapped, context)

    async def key_id_of(self, wrapped: bytes, context: ContextLike | None = None) -> str | None:
        return await asyncio.to_thread(self.provider.key_id_of, wrapped, context)

    async def health(self) -> None:
        await ahealth(self.provider)

    async def aclose(self) -> None:
        await aclose(self.provider)
