"""The gateway core: the one door for chunk traffic (docs/architecture.md, section 3). Every data
operation (lookup, get, put, pin) verifies its capability token first, then works only inside the
capability's tenant and namespace:

    tokens --chain_hashes--> h_i --HMAC(namespace index key)--> storage key
    paged KV --pack--> staging --seal (AES-256-GCM envelope, AAD binds identity)--> tiers
    tiers --open (every tag checked)--> staging --unpack--> paged KV

``Gateway`` runs the data operations over services built in ``gateway.services.runtime`` and
handed in from its Runtime record: ``Access`` (capabilities), ``NamespaceResolver`` (namespace and
storage keys), ``Keyring`` (data keys), ``Pins`` and ``ChunkService`` (the tier side), with its
own ``DataPlane`` (``gateway/datapath/``). A server holds no Gateway: it never runs these.
The data path (torch) is imported when the first data operation runs, never by the control plane.
A chunk that fails authentication, whose key version is destroyed, or whose tier is unreachable
is a miss: counted, audited where it is an integrity failure, and never handed to the engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from audit.types import Actor
from gateway.chunking import InvalidTokens, chain_hashes
from gateway.chunks.service import ChunkService
from gateway.errors import AccessDenied, InvalidRequest, TenantUnavailable
from gateway.metrics import Metrics
from gateway.services.access import Access
from gateway.services.namespaces import NamespaceResolver
from gateway.services.pins import Pins
from gateway.types import (
    ClearResult,
    KVModel,
    LookupResult,
    RetrieveResult,
    StoreResult,
)
from storage.types import ChunkKey
from tenancy.keyring import Keyring
from tenancy.namespaces import NamespaceKeys
from tenancy.types import Capability

if TYPE_CHECKING:
    from gateway.datapath.path import DataPath
    from gateway.datapath.plane import DataPlane
    from gateway.datapath.stores import ChunkStore

__all__ = ["Gateway", "KVModel", "StoreResult", "LookupResult", "RetrieveResult", "ClearResult", "chunks_of"]

# OpenTelemetry API only: a no-op until the process installs a tracer provider (the server does)
_tracer = trace.get_tracer("kvgate.core")


def chunks_of(model: KVModel, tokens: Any, chunk_tokens: int) -> list[Any]:
    """A prompt's chunks (chained hashes); tokens may be a list, a numpy array or a tensor."""
    if hasattr(tokens, "detach"):  # a torch tensor (only where torch is loaded already)
        tokens = tokens.detach().cpu().numpy()
    try:
        return chain_hashes(tokens, model.fingerprint, chunk_tokens, vocab_size=model.vocab_size)
    except InvalidTokens as exc:
        raise InvalidRequest(str(exc)) from None


class Gateway:
    """The data operations over services built elsewhere (``gateway.services.runtime.gateway_over``
    hands them in from the Runtime record); it owns only its data path and data plane."""

    def __init__(
        self,
        *,
        access: Access,
        resolver: NamespaceResolver,
        keyring: Keyring,
        chunks: ChunkService,
        pins: Pins,
        metrics: Metrics,
        datapath: Callable[[], DataPath],
        chunk_tokens: int = 256,
    ) -> None:
        """``datapath``: builds the data path on first use (it loads torch)."""
        self.access = access
        self.resolver = resolver
        self.keyring = keyring
        self.chunks = chunks
        self.pins = pins
        self.metrics = metrics
        self.chunk_tokens = chunk_tokens
        self._make_datapath = datapath
        self._datapath: DataPath | None = None
        self._plane: DataPlane | None = None
        self._store: ChunkStore | None = None

    @property
    def datapath(self) -> DataPath:
        """This process's data path (built at the first data operation)."""
        if self._datapath is None:
            self._datapath = self._make_datapath()
        return self._datapath

    @property
    def plane(self) -> DataPlane:
        if self._plane is None:
            from gateway.datapath.plane import DataPlane

            self._plane = DataPlane(self.datapath, self.chunk_tokens, self.metrics)
        return self._plane

    @property
    def store_(self) -> ChunkStore:
        """The ChunkStore data operations go through: this process's tiers (``TierStore``)."""
        if self._store is None:
            from gateway.datapath.stores import TierStore

            self._store = TierStore(self.chunks, self.keyring)
        return self._store

    # -- capabilities and namespaces -----------------------------------------------------------
    async def mint_capability(
        self, tenant: str, namespace: str, ops: Sequence[str], ttl: int | None = None, *, actor: Actor | None = None
    ) -> str:
        """Mint a capability for an authenticated principal (the caller has checked its roles)."""
        return await self.access.mint(tenant, namespace, ops, ttl, actor=actor)

    def authorize(self, token: str, op: str, *, chunks: Sequence[str] = ()) -> Capability:
        """Verify a capability for one operation; every denial is audited (AccessDenied)."""
        return self.access.authorize(token, op, chunks=chunks)

    async def namespace_keys(self, tenant: str, namespace: str) -> NamespaceKeys:
        return await self.resolver.keys(tenant, namespace)

    def forget_namespace(self, tenant: str | None, namespace: str | None = None) -> None:
        self.resolver.forget(tenant, namespace)

    # -- data operations: a span each, the tenant only as its opaque owner label --------------
    async def store(self, token: str, model: KVModel, tokens: Any, kv_layers: Any, **kw: Any) -> StoreResult:
        """Encrypt and store every chunk of ``tokens`` whose KV sits in ``kv_layers``
        (``block_ids`` or ``slot_mapping``; ``skip_existing``; ``first_chunk``)."""
        with _tracer.start_as_current_span("kvgate.store") as span:
            res = await self.plane.store(self.store_, token, model, tokens, kv_layers, **kw)
            span.set_attributes({"kvgate.chunks": res.chunks, "kvgate.stored": res.stored, "kvgate.bytes": res.bytes_stored})
            return res

    async def lookup(self, token: str, model: KVModel, tokens: Any) -> LookupResult:
        """How many leading tokens are stored (prefix walk, stops at the first miss)."""
        with _tracer.start_as_current_span("kvgate.lookup") as span:
            res = await self.plane.lookup(self.store_, token, model, tokens)
            span.set_attributes({"kvgate.chunks": res.total_chunks, "kvgate.hit_chunks": res.hit_chunks})
            return res

    async def retrieve(self, token: str, model: KVModel, tokens: Any, kv_layers: Any, **kw: Any) -> RetrieveResult:
        """Load the longest stored prefix of ``tokens`` into ``kv_layers``."""
        with _tracer.start_as_current_span("kvgate.load") as span:
            res = await self.plane.retrieve(self.store_, token, model, tokens, kv_layers, **kw)
            span.set_attributes({
                "kvgate.loaded_chunks": res.loaded_chunks, "kvgate.integrity_failures": res.integrity_failures,
                "kvgate.unavailable": res.unavailable,
            })
            return res

    # -- pins and keys (no KV involved) ------------------------------------------------------
    async def pin(self, token: str, model: KVModel, tokens: Any, *, pin: bool = True) -> int:
        """Pin (or unpin) every stored chunk of ``tokens``; returns how many chunks were changed."""
        chunks = chunks_of(model, tokens, self.chunk_tokens)
        cap = self.access.authorize(token, "pin", chunks=[c.chained_hash.hex() for c in chunks])
        try:
            ns = await self.resolver.keys(cap.tenant, cap.namespace)
        except TenantUnavailable:
            self.metrics.denials += 1
            raise AccessDenied("tenant unavailable") from None
        keys = self.resolver.chunk_keys(ns, [c.chained_hash for c in chunks])
        return await self.pins.set(cap, keys, pin=pin)

    async def keys_for(self, tenant: str, namespace: str, model: KVModel, tokens: Sequence[int]) -> list[ChunkKey]:
        """Storage keys of a prompt's chunks (admin operations: move, chunk-list clear)."""
        chunks = chunks_of(model, tokens, self.chunk_tokens)
        ns = await self.resolver.keys(tenant, namespace)
        return self.resolver.chunk_keys(ns, [c.chained_hash for c in chunks])

    async def aclose(self) -> None:
        """Close the data path (its threads); the services are the Runtime's to close."""
        if self._datapath is not None:
            self._datapath.close()
