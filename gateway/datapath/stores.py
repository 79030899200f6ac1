"""``ChunkStore``: where the data path's envelopes go, behind one seam.

    TierStore   (embedded) this process's tiers through the chunk service (``gateway.chunks``):
                the capability verified, the namespace resolved, keys from the keyring
    HttpStore   (remote, ``gateway.remote.client``) a kvgate server, which runs the same chunk service
                and issues one key per envelope: the worker never holds the tenant's data key

A store opens a ``ChunkSession`` per request (the capability checked for one operation, the
namespace resolved, the chunks' storage keys computed once); the data plane (``plane.py``) runs
the same store / lookup / retrieve over either. Nothing here touches plaintext. Keys are asked
for in one go: ``sealing_keys`` once per store, ``opening_keys`` per load batch from the fetched
envelopes' headers (no round trip in either mode: a remote session received each key with its
envelope). Each answer is an ``EnvelopeKeys`` per chunk: a ``DataKey`` in process, the server's
``IssuedKey`` for that one envelope in remote mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import trace

from crypto.envelope import DataKey, EnvelopeContext, EnvelopeKeys
from crypto.errors import KekError, KeyUnavailable
from gateway.chunking import Chunk
from gateway.chunks.service import ChunkService, FetchFailed, KeysUnavailable, Located, NamespaceChunks
from gateway.types import KVModel
from tenancy.keyring import Keyring

__all__ = [
    "ChunkSession", "ChunkStore", "FetchFailed", "Fetched", "KeyRef", "KeysUnavailable", "Presence", "TierStore",
]


@dataclass(slots=True)
class Fetched:
    envelope: memoryview
    tier: str
    passed_over: Sequence[BaseException] = ()  # faster tiers that failed before this one served it


@dataclass(slots=True)
class Reserved:
    """A slot handed out for one envelope: seal into ``view``, then commit or abort it."""

    view: memoryview
    token: Any


Presence = Located
"""What the tiers hold of a session's chunks, and the prefix walk over it (``gateway.chunks``)."""

KeyRef = tuple[int, bytes]
"""``(key version, salt)`` read from an envelope's header."""


class ChunkSession(Protocol):
    """One request's access to one namespace. A chunk's keys are asked for (``sealing_keys`` /
    ``opening_keys``) before its ``context`` is used."""

    def context(self, i: int, model: KVModel, version: int) -> EnvelopeContext: ...
    async def presence(self) -> Presence: ...
    async def sealing_keys(self, indices: Sequence[int], sizes: Sequence[int] | None = None) -> list[tuple[int, EnvelopeKeys]]:
        """``(key version, keys)`` to seal chunk ``i`` with, for each of ``indices``, in one go.
        Fewer (a prefix) when keys ran out part way; KeyUnavailable or KekError when none can be had.
        ``sizes``: each envelope's size, for a store that reserves its slots with its keys."""
    async def opening_keys(self, refs: Sequence[tuple[int, KeyRef]]) -> list[EnvelopeKeys | None]:
        """The keys to open each ``(chunk index, (key version, salt))``, in one go; None where that
        key version is unavailable (destroyed: a miss)."""
    def prefetch(self, indices: Sequence[int]) -> None: ...
    async def fetch(self, i: int) -> Fetched: ...
    async def put(self, i: int, envelope: memoryview) -> None: ...
    async def flush(self) -> None:
        """Every envelope handed to ``put`` is stored (a store that batches puts sends them now),
        or this raises what stopped it: ``NamespaceChanged`` where a clear ended the namespace
        epoch they were sealed for (then none of the store's envelopes is kept)."""
    def reserve(self, i: int, nbytes: int) -> Reserved | None:
        """A slot of the fastest tier to seal chunk ``i`` straight into, or None (then ``put``)."""
    async def commit(self, reserved: Reserved) -> bool: ...
    def abort(self, reserved: Reserved) -> None: ...
    async def integrity_failure(self, i: int, tier: str, envelope_sha256: bytes) -> None:
        """Chunk ``i``'s envelope (of this digest) failed authentication: audited as
        ``integrity.failure`` and the stored copy dropped, by the chunk service of either mode."""
    async def aclose(self) -> None: ...


class ChunkStore(Protocol):
    async def session(self, token: str, op: str, chunks: Sequence[Chunk]) -> ChunkSession:
        """Verify ``token`` for ``op`` on these chunks and resolve the namespace; raises
        AccessDenied, or KeysUnavailable when the KEK cannot unwrap the namespace now."""


class TierStore:
    """The tiers of this process through the chunk service (embedded mode): a session is the
    service's ``NamespaceChunks`` plus the keyring's data keys."""

    def __init__(self, chunks: ChunkService, keyring: Keyring) -> None:
        self.chunks = chunks
        self.keyring = keyring

    async def session(self, token: str, op: str, chunks: Sequence[Chunk]) -> _TierSession:
        # shared: a published prefix's leading chunks are read from their scope (each chunk is
        # opened in the context ``context`` names for it)
        opened = await self.chunks.session(token, op, [c.chained_hash for c in chunks], shared=True)
        trace.get_current_span().set_attribute("kvgate.tenant", opened.ns.owner[:16])  # opaque, not the name
        return _TierSession(opened, self.keyring)


class _TierSession:
    def __init__(self, opened: NamespaceChunks, keyring: Keyring) -> None:
        self.opened = opened
        self.keyring = keyring
        self.cap = opened.cap
        self.ns = opened.ns

    @property
    def owner(self) -> str:
        return self.ns.owner

    def context(self, i: int, model: KVModel, version: int) -> EnvelopeContext:
        ns = self.opened.owner_of(i)  # the capability's namespace, or a published prefix's scope
        return EnvelopeContext(
            tenant=ns.tenant,
            namespace=ns.namespace,
            storage_key=self.opened.keys[i].digest,
            model_fingerprint=model.fingerprint_digest,
            key_version=version,
        )

    async def presence(self) -> Presence:
        return await self.opened.locate()

    async def sealing_keys(self, indices: Sequence[int], sizes: Sequence[int] | None = None) -> list[tuple[int, EnvelopeKeys]]:
        out: list[tuple[int, EnvelopeKeys]] = []
        for _ in indices:  # one invocation of the data key per envelope, counted by the keyring
            try:
                version, dek = await self.keyring.encryption_key(self.cap.tenant)
            except (KekError, KeyUnavailable):
                if not out:
                    raise
                break
            out.append((version, DataKey(dek, self.ns.binding_secret)))
        return out

    async def opening_keys(self, refs: Sequence[tuple[int, KeyRef]]) -> list[EnvelopeKeys | None]:
        by_version: dict[tuple[str, int], EnvelopeKeys | None] = {}
        out: list[EnvelopeKeys | None] = []
        for i, (version, _salt) in refs:
            ns = self.opened.owner_of(i)  # a published chunk opens under its scope's keys
            if (ns.tenant, version) not in by_version:
                try:
                    dek = await self.keyring.decryption_key(ns.tenant, version)
                except (KekError, KeyUnavailable):
                    by_version[ns.tenant, version] = None
                else:
                    by_version[ns.tenant, version] = DataKey(dek, ns.binding_secret)
            out.append(by_version[ns.tenant, version])
        return out

    def prefetch(self, indices: Sequence[int]) -> None:
        return None  # tier reads are issued when the plane asks

    async def fetch(self, i: int) -> Fetched:
        got = await self.opened.fetch(i)
        return Fetched(got.chunk.data, got.chunk.tier, got.passed_over)

    async def put(self, i: int, envelope: memoryview) -> None:
        await self.opened.put(i, envelope)

    async def flush(self) -> None:
        """Every put was stored when it returned; a clear that ended the namespace's epoch
        meanwhile takes them all back (``NamespaceChunks.confirm``: NamespaceChanged)."""
        await self.opened.confirm()

    def reserve(self, i: int, nbytes: int) -> Reserved | None:
        slot = self.opened.reserve(i, nbytes)
        return None if slot is None else Reserved(slot.view, slot)

    async def commit(self, reserved: Reserved) -> bool:
        return bool(await self.opened.commit(reserved.token))

    def abort(self, reserved: Reserved) -> None:
        self.opened.abort(reserved.token)

    async def integrity_failure(self, i: int, tier: str, envelope_sha256: bytes) -> None:
        """A stored envelope failed authentication: audited and its copy dropped (the chunk
        service), so the engine's recompute stores a good one."""
        await self.opened.integrity_failure(i, tier=tier, index=i, envelope_sha256=envelope_sha256)

    async def aclose(self) -> None:
        return None
