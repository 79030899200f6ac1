"""Published prefixes: shared system prompts, read by the members of a sharing scope and written
only by their publisher (docs/architecture.md, "Published prefixes"; docs/prefixes.md).

``Prefixes`` holds the scopes' members and the chained hashes of every active publication's
chunks in memory (``match``: a request's leading hashes against the scopes its capability may
still read; never by probing a tier), refreshed from the registry every ``refresh_s`` seconds and
at once after a change here or a broadcast from another process. ``check_write`` is the only way
into a scope's namespace: a capability of the scope's owner (minted by ``publish`` alone) for
chunks a warm-up reported and that chain from the published tokens (``warm``). ``revoke``
crypto-shreds (the publication's data-key version, or every key of the scope and its namespace
epoch with its last publication), deletes the chunks from every tier, then audits; a revoke cut
short by a crash is finished at the next start (``resume``). ``tokenize`` turns a prefix
published as text into its token ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from audit.types import Actions, Actor, AuditEvent, AuditSink, Target, record_durably
from gateway.errors import AccessDenied, ChunkMissing, Conflict, InvalidRequest
from gateway.services.access import Access
from gateway.services.invalidation import Invalidation
from gateway.services.namespaces import NamespaceResolver, keys_digest
from storage.manager import TierManager
from tenancy.capabilities import CapabilityAuthority
from tenancy.errors import CapabilityDenied, DependencyUnavailable
from tenancy.keyring import Keyring
from tenancy.names import InvalidName, check_name
from tenancy.registry import Registry, UnknownTenant
from tenancy.sharing import (
    OWNER_PREFIX,
    SCOPE_NAMESPACE,
    PublicationRecord,
    ScopeExists,
    ScopeRecord,
    SharingRegistry,
    SharingTable,
    UnknownPublication,
    UnknownScope,
    is_scope_owner,
    scope_owner,
)
from tenancy.types import Capability

if TYPE_CHECKING:
    from gateway.services.broadcast import Broadcaster

__all__ = ["SCOPE_NAMESPACE", "Prefixes", "Published", "RevokeResult", "SharedMatch", "chain_from_digest", "tokenize"]

log = logging.getLogger("kvgate.prefixes")

_MAX_TOKENS = 1 << 20
_MAX_MODEL = 256
_MAX_TEXT = 4 << 20
_MAX_TOKENIZER = 512
_HEX64 = re.compile(r"[0-9a-f]{64}")
_WRITE_OPS = ("lookup", "put")  # a warm-up's store checks what is there, then puts


def chain_from_digest(fingerprint: str, tokens: bytes, chunk_tokens: int) -> list[str]:
    """The chained hashes (hex) of the whole chunks of ``tokens`` (int32 little endian) under the
    model fingerprint of hex digest ``fingerprint``: ``gateway.chunking.chain_hashes`` from
    h_0 = the digest itself, without the partial last chunk."""
    prev = bytes.fromhex(fingerprint)
    width = 4 * chunk_tokens
    out: list[str] = []
    for start in range(0, len(tokens) - width + 1, width):
        prev = hashlib.sha256(prev + tokens[start : start + width]).digest()
        out.append(prev.hex())
    return out


def tokenize(text: str, tokenizer: str, *, add_special_tokens: bool = True) -> list[int]:
    """The token ids of ``text`` under the Hugging Face tokenizer ``tokenizer`` (a hub name or a
    directory where this process runs), loaded with ``transformers.AutoTokenizer`` without remote
    code; ``add_special_tokens`` as vLLM tokenizes a completion prompt (a leading BOS). Blocking:
    run it off the event loop. InvalidRequest where the text or name is not one, transformers is
    not installed here, or the tokenizer cannot be loaded."""
    if not isinstance(text, str) or not 0 < len(text) <= _MAX_TEXT:
        raise InvalidRequest(f"text is 1..{_MAX_TEXT} characters")
    if not isinstance(tokenizer, str) or not 0 < len(tokenizer) <= _MAX_TOKENIZER or not tokenizer.isprintable():
        raise InvalidRequest(f"tokenizer is a Hugging Face tokenizer name or path, 1..{_MAX_TOKENIZER} printable characters")
    try:
        auto = importlib.import_module("transformers").AutoTokenizer  # only a publish by text loads it
    except ImportError:
        raise InvalidRequest(
            "publishing text needs transformers where kvgate runs (pip install transformers); or publish token ids"
        ) from None
    try:
        tok = auto.from_pretrained(tokenizer, trust_remote_code=False)
        ids = tok(text, add_special_tokens=add_special_tokens)["input_ids"]
    except Exception as exc:  # a name that is no tokenizer fails in many ways: each is the caller's
        raise InvalidRequest(f"tokenizer {tokenizer!r} could not be loaded or used ({type(exc).__name__})") from None
    return [int(t) for t in ids]


@dataclass(frozen=True, slots=True)
class SharedMatch:
    """The leading ``count`` chunks of a request are published in ``scope`` (keys of ``owner``)."""

    scope: str
    owner: str
    count: int


@dataclass(frozen=True, slots=True)
class Published:
    publication: PublicationRecord
    capability: str
    cap_id: str
    expires_at: float
    whole_chunks: int


@dataclass(frozen=True, slots=True)
class RevokeResult:
    prefix_id: str
    scope: str
    deleted_chunks: int
    destroyed_key_versions: list[int]
    scope_shredded: bool


@dataclass(frozen=True, slots=True)
class _Table:
    raw: SharingTable
    by_hash: dict[bytes, frozenset[str]]
    at: float

    def readable(self, cap: Capability) -> frozenset[str]:
        """The scopes ``cap`` names that its tenant still reads."""
        raw = self.raw
        return frozenset(s for s in cap.scopes if s in raw.everyone or cap.tenant in raw.members.get(s, ()))


def _token_bytes(tokens: Sequence[int]) -> bytes:
    if not isinstance(tokens, (list, tuple)) or not 0 < len(tokens) <= _MAX_TOKENS:
        raise InvalidRequest(f"token_ids must be a list of 1..{_MAX_TOKENS} token ids")
    if not all(type(t) is int and 0 <= t <= 2**31 - 1 for t in tokens):
        raise InvalidRequest("token ids are integers in [0, 2^31 - 1]")
    return struct.pack(f"<{len(tokens)}i", *tokens)


class Prefixes:
    def __init__(
        self,
        *,
        registry: Registry,
        keyring: Keyring,
        resolver: NamespaceResolver,
        tiers: TierManager,
        authority: CapabilityAuthority,
        access: Access,
        invalidation: Invalidation,
        audit: AuditSink,
        chunk_tokens: int,
        broadcaster: Broadcaster | None = None,
        refresh_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.sharing = SharingRegistry(registry)
        self.keyring = keyring
        self.resolver = resolver
        self.tiers = tiers
        self.authority = authority
        self.access = access
        self.invalidation = invalidation
        self.audit = audit
        self.chunk_tokens = chunk_tokens
        self.broadcaster = broadcaster
        self.refresh_s = refresh_s
        self._clock = clock
        self._table: _Table | None = None
        self._generation = 0
        self._lock = asyncio.Lock()

    # -- the match table -----------------------------------------------------------------------
    def invalidate(self) -> None:
        """Read the registry again before the next match (a change here or elsewhere)."""
        self._generation += 1
        self._table = None

    def forgotten(self, tenant: str | None) -> None:
        """``Invalidation``'s listener: a scope's owner changed here or elsewhere (a broadcast)."""
        if tenant is None or is_scope_owner(tenant):
            self.invalidate()

    async def _current(self) -> _Table:
        table = self._table
        if table is not None and self._clock() - table.at < self.refresh_s:
            return table
        async with self._lock:
            table = self._table
            if table is not None and self._clock() - table.at < self.refresh_s:
                return table
            generation = self._generation
            raw = await self.sharing.table()
            by_hash: dict[bytes, set[str]] = {}
            for scope, hashes in raw.hashes.items():
                for h in hashes:
                    by_hash.setdefault(bytes.fromhex(h), set()).add(scope)
            # a change made while the registry was being read: this table is used once, not kept
            at = self._clock() if generation == self._generation else float("-inf")
            table = _Table(raw, {h: frozenset(s) for h, s in by_hash.items()}, at)
            self._table = table
            return table

    async def scopes_of(self, tenant: str) -> list[str]:
        """The scopes ``tenant`` reads now (what a capability minted now lists)."""
        raw = (await self._current()).raw
        return sorted(s for s in raw.members if s in raw.everyone or tenant in raw.members[s])

    async def revision(self, tenant: str) -> str:
        """What a tenant reads of published prefixes now, as a digest ("" where it reads no
        scope): the scopes it reads and their active publications. The vLLM middleware folds it
        into the tenant's ``cache_salt``, so a revoke, a new publication or a membership removed
        leaves nothing of a scope in vLLM's own prefix cache under the salt that follows."""
        raw = (await self._current()).raw
        scopes = sorted(s for s in raw.members if s in raw.everyone or tenant in raw.members[s])
        if not scopes:
            return ""
        h = hashlib.sha256(b"kvgate/shared-revision/v1")
        for scope in scopes:
            pubs = sorted(raw.publications.get(scope, ()))
            h.update(struct.pack("<I", len(pubs)) + scope.encode() + b"\0" + b"".join(p.encode() + b"\0" for p in pubs))
        return h.hexdigest()[:32]

    async def match(self, cap: Capability, hashes: Sequence[bytes]) -> SharedMatch | None:
        """The leading chunks of ``hashes`` published in one scope ``cap`` may read, or None. A
        registry that cannot be read now shares nothing (the tenant's own namespace serves)."""
        if not cap.scopes or not hashes or is_scope_owner(cap.tenant):
            return None
        try:
            table = await self._current()
        except DependencyUnavailable:
            log.warning("published prefixes: the registry cannot be read; nothing is shared now")
            return None
        candidates = table.readable(cap)
        count = 0
        for h in hashes:
            got = table.by_hash.get(h)
            narrowed = candidates & got if got else frozenset()
            if not narrowed:
                break
            candidates, count = narrowed, count + 1
        if not count:
            return None
        scope = min(candidates)
        return SharedMatch(scope, scope_owner(scope), count)

    async def check_write(self, cap: Capability, op: str, hashes: Sequence[bytes]) -> None:
        """A capability of a scope's owner may only look up and put the chunks its scope's
        publications recorded; anything else is refused (AccessDenied, audited)."""
        scope = cap.tenant[len(OWNER_PREFIX):]
        reason = ""
        if cap.namespace != SCOPE_NAMESPACE or op not in _WRITE_OPS:
            reason = "not an operation on published chunks"
        elif op == "put":
            wanted = {h.hex() for h in hashes}
            table = await self._current()
            if not wanted <= table.raw.hashes.get(scope, frozenset()):
                self.invalidate()  # recorded just now by another process, perhaps: read again
                table = await self._current()
                if not wanted <= table.raw.hashes.get(scope, frozenset()):
                    reason = "chunk not published"
        if reason:
            self.access.denied(op, reason)
            raise AccessDenied(reason)

    # -- scopes --------------------------------------------------------------------------------
    async def _changed(self, owner: str, kind: str = "scope", **fields: Any) -> None:
        self.invalidate()
        if self.broadcaster is not None:  # other processes read the registry again
            await self.broadcaster.publish(kind, owner, **fields)

    async def create_scope(
        self, name: str, *, everyone: bool = False, members: Sequence[str] = (), actor: Actor | None = None,
    ) -> ScopeRecord:
        try:
            check_name(name, "scope")
            for tenant in members:
                check_name(tenant, "tenant")
        except InvalidName as exc:
            raise InvalidRequest(str(exc)) from None
        if everyone and members:
            raise InvalidRequest("a scope of every tenant names no members")
        try:
            rec = await self.sharing.create_scope(name, everyone=everyone, members=members)
        except ScopeExists:
            raise Conflict(f"scope {name!r} exists") from None
        except UnknownTenant as exc:
            raise InvalidRequest(str(exc)) from None
        await self._changed(scope_owner(name))
        await self._scope_event(name, "create", actor, everyone=everyone, members=list(rec.members))
        return rec

    async def _scope_event(self, scope: str, change: str, actor: Actor | None, **details: Any) -> None:
        await record_durably(self.audit, AuditEvent(
            Actions.SCOPE_CHANGE, actor=actor or Actor(),
            target=Target(tenant=details.get("tenant")), details={"scope": scope, "change": change, **details},
        ))

    async def set_member(self, scope: str, tenant: str, *, member: bool, actor: Actor | None = None) -> bool:
        """Add (``member``) or remove a tenant; whether anything changed. A tenant removed reads
        nothing of the scope from the next request on (here; elsewhere within ``refresh_s``, or
        at once where a broadcaster carries the change)."""
        try:
            check_name(scope, "scope")
            check_name(tenant, "tenant")
        except InvalidName as exc:
            raise InvalidRequest(str(exc)) from None
        try:
            if member:
                changed = await self.sharing.add_member(scope, tenant)
            else:
                changed = await self.sharing.remove_member(scope, tenant)
        except (UnknownScope, UnknownTenant) as exc:
            raise InvalidRequest(str(exc)) from None
        await self._changed(scope_owner(scope))
        await self._scope_event(scope, "add" if member else "remove", actor, tenant=tenant, changed=changed)
        return changed

    async def list_scopes(self) -> list[ScopeRecord]:
        return await self.sharing.list_scopes()

    # -- publish, warm, revoke -------------------------------------------------------------------
    async def publish(
        self, scope: str, model: str, token_ids: Sequence[int], *, ttl: int | None = None, actor: Actor | None = None,
        tokenizer: str | None = None,
    ) -> Published:
        """Record a prefix for ``scope`` and hand back the one capability that may write it (a
        warm-up's: ops lookup and put on the scope's namespace, for the chunks ``warm`` records).
        ``tokenizer``: the one the token ids came from (``tokenize``), for the audit record."""
        try:
            check_name(scope, "scope")
        except InvalidName as exc:
            raise InvalidRequest(str(exc)) from None
        if not isinstance(model, str) or not 0 < len(model) <= _MAX_MODEL or not model.isprintable():
            raise InvalidRequest(f"model is 1..{_MAX_MODEL} printable characters")
        raw = _token_bytes(token_ids)
        whole = len(token_ids) // self.chunk_tokens
        if whole == 0:
            raise InvalidRequest(f"a prefix shorter than one chunk ({self.chunk_tokens} tokens) shares nothing")
        owner = scope_owner(scope)
        try:
            await self.sharing.get_scope(scope)
        except UnknownScope as exc:
            raise InvalidRequest(str(exc)) from None
        version = await self.keyring.rotate(owner)  # each publication seals under a version of its own
        digest = hashlib.sha256(raw).hexdigest()
        pub = await self.sharing.add_publication(scope, model, digest, raw, len(token_ids), version)
        await self._changed(owner)  # its members' revision (their cache_salt) follows at once
        token, cap = self.authority.issue(owner, SCOPE_NAMESPACE, _WRITE_OPS, ttl)
        await record_durably(self.audit, AuditEvent(
            Actions.PREFIX_PUBLISH, actor=actor or Actor(), target=Target(tenant=owner, namespace=SCOPE_NAMESPACE),
            details={
                "prefix_id": pub.id, "scope": scope, "model": model, "digest": digest, "num_tokens": len(token_ids),
                "whole_chunks": whole, "key_version": version, "cap_id": cap.cap_id, "expires_at": cap.expires_at,
                **({"tokenizer": tokenizer} if tokenizer is not None else {}),
            },
        ))
        return Published(pub, token, cap.cap_id, cap.expires_at, whole)

    async def get(self, prefix_id: str) -> PublicationRecord:
        try:
            return await self.sharing.get_publication(prefix_id)
        except UnknownPublication:
            raise ChunkMissing("no such prefix") from None

    async def publications(self, scope: str | None = None) -> list[PublicationRecord]:
        return await self.sharing.list_publications(scope)

    async def warm(
        self, token: str, prefix_id: str, fingerprint: str, hashes: Sequence[str], *, actor: Actor | None = None,
    ) -> list[str]:
        """Record the chunks a warm-up is about to store: ``hashes`` must be the whole chunks'
        chained hashes of the published tokens under the model fingerprint of digest
        ``fingerprint``, and ``token`` the publication scope's write capability."""
        pub = await self.get(prefix_id)
        owner = scope_owner(pub.scope)
        try:
            self.authority.verify(token, tenant=owner, namespace=SCOPE_NAMESPACE, op="put")
        except CapabilityDenied as exc:
            self.access.denied("put", exc.reason)
            raise AccessDenied(exc.reason) from None
        if not isinstance(fingerprint, str) or not _HEX64.fullmatch(fingerprint):
            raise InvalidRequest("fingerprint is the model fingerprint's sha256, 64 lowercase hex characters")
        if pub.state != "active":
            raise Conflict("the prefix is revoked")
        expected = chain_from_digest(fingerprint, pub.tokens, self.chunk_tokens)
        if list(hashes) != expected:
            self.access.denied("put", "hashes do not chain from the published tokens")
            raise InvalidRequest("the hashes are not the published tokens' whole chunks under this fingerprint")
        await self.sharing.record_chunks(prefix_id, fingerprint, expected)
        await self._changed(owner)
        await record_durably(self.audit, AuditEvent(
            Actions.PREFIX_WARM, actor=actor or Actor(), target=Target(tenant=owner, namespace=SCOPE_NAMESPACE, chunk_count=len(expected)),
            details={"prefix_id": prefix_id, "scope": pub.scope, "fingerprint": fingerprint},
        ))
        return expected

    async def warm_state(self, prefix_id: str) -> tuple[int, int]:
        """(chunks recorded for the prefix, of those in a tier of this process): a warm-up is
        done when every recorded chunk is stored."""
        pub = await self.get(prefix_id)
        hashes = [bytes.fromhex(h) for h in await self.sharing.chunks_of(prefix_id)]
        owner = scope_owner(pub.scope)
        if not hashes or await self.registry.get_namespace(owner, SCOPE_NAMESPACE) is None:
            return len(hashes), 0  # no store has been made: the first one creates the namespace
        ns = await self.resolver.keys(owner, SCOPE_NAMESPACE)
        present = await self.tiers.contains_many(self.resolver.chunk_keys(ns, hashes))
        return len(hashes), sum(present)

    async def revoke(self, prefix_id: str, *, actor: Actor | None = None) -> RevokeResult:
        pub = await self.get(prefix_id)
        if pub.state == "revoked":
            raise Conflict("the prefix is revoked already")
        await self.sharing.set_state(prefix_id, "revoking", expect=("active", "revoking"))
        self.invalidate()  # no member matches it from here on (here; elsewhere, _finish broadcasts)
        return await self._finish(pub, actor)

    async def resume(self) -> list[RevokeResult]:
        """Finish every revoke a crash interrupted (called at start)."""
        return [await self._finish(p, Actor(subject="kvgate:resume"))
                for p in await self.sharing.list_publications() if p.state == "revoking"]

    async def _finish(self, pub: PublicationRecord, actor: Actor | None) -> RevokeResult:
        owner = scope_owner(pub.scope)
        live = [p for p in await self.sharing.list_publications(pub.scope) if p.state == "active" and p.id != pub.id]
        hashes = [bytes.fromhex(h) for h in await self.sharing.chunks_of(pub.id)]
        ns = await self.resolver.keys(owner, SCOPE_NAMESPACE)
        keys = self.resolver.chunk_keys(ns, hashes)
        # shred first: the data-key version of this publication (not one a live publication of
        # the scope seals under), or, with the scope's last publication, every key of the scope
        # and its namespace epoch
        if live:
            versions = sorted({pub.key_version} - {p.key_version for p in live})
            destroyed = await self.keyring.destroy(owner, versions) if versions else []
        else:
            rec = await self.registry.get_namespace(owner, SCOPE_NAMESPACE)
            if rec is not None:
                salt = await self.resolver.new_epoch_salt(owner, SCOPE_NAMESPACE, rec.epoch + 1)
                await self.registry.bump_epoch(owner, SCOPE_NAMESPACE, rec.epoch + 1, salt)
            destroyed = await self.keyring.destroy(owner)
        self.invalidation.forget_keys(owner)
        # then delete the ciphertext from every tier
        left = await self.tiers.delete_many(keys)
        if not live:
            await self.tiers.delete_owner(self.resolver.owner_label(owner))
        await self.sharing.set_state(pub.id, "revoked", expect=("revoking",))
        # a clear of the scope's owner where nothing of it is left: other processes drop their
        # memory copies too; else they forget its keys and read the registry again
        await self._changed(owner, "clear" if not live else "scope")
        await record_durably(self.audit, AuditEvent(
            Actions.PREFIX_REVOKE, actor=actor or Actor(),
            target=Target(tenant=owner, namespace=SCOPE_NAMESPACE, chunk_count=len(keys), chunk_digest=keys_digest(keys)),
            details={
                "prefix_id": pub.id, "scope": pub.scope, "digest": pub.digest, "model": pub.model,
                "destroyed_key_versions": destroyed, "scope_shredded": not live, "left_in_unreachable_tiers": len(left),
            },
        ))
        return RevokeResult(pub.id, pub.scope, len(keys), destroyed, not live)
