"""Capability tokens: short-lived, attenuable grants for chunk operations.

Format: macaroon-style HMAC chaining over HMAC-SHA256 from ``cryptography``::

    kvc1.<kid>.<b64url(root)>[.<b64url(caveat)>]*.<b64url(tag)>
    sig_0 = HMAC(key[kid], "kvgate-cap/1" 0x00 kid 0x00 root);  sig_i = HMAC(sig_{i-1}, caveat_i);  tag = sig_n

``root`` is canonical JSON ``{"exp", "iat", "id", "ns", "ops", "t"}`` (times in milliseconds), and
``sc`` (the sharing scopes it may read) where there are any; a caveat is canonical JSON with one
member: ``ops`` (a list), ``exp``, ``chunks`` (chained-hash hex strings) or ``sc``. ``attenuate()`` appends a caveat without a secret; a caveat only narrows (ops and chunk
allowlists intersect, the earliest expiry wins), cannot be removed, and an unknown one denies; a
widening request is refused. A capability never crosses tenants: the tenant is in the MAC'd root and
``verify`` compares it to the caller's; revocation is per id and per tenant (``RevocationList``).
``verify`` does the same work whatever is named (no registry lookup), compares tags with
``hmac.compare_digest`` and raises ``CapabilityDenied`` for every failure. Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import base64
import hmac as std_hmac
import json
import re
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from cryptography.hazmat.primitives import hashes, hmac

from tenancy.errors import CapabilityDenied, CapabilityRequestInvalid
from tenancy.types import ALL_OPERATIONS, Capability, Namespace, TenantId

__all__ = [
    "DEFAULT_MAX_TTL",
    "CapabilityAuthority",
    "RevocationList",
    "attenuate",
    "read_unverified",
]

DEFAULT_MAX_TTL = 600
_PREFIX = "kvc1"
_DOMAIN = b"kvgate-cap/1\x00"
# A capability travels in one header (the server's header block is 16 KiB), and each verified
# token is cached: bound both, the cache in bytes, not only in entries (holder-side attenuation
# mints distinct valid tokens at will).
_MAX_TOKEN_CHARS = 8 * 1024
_CACHE_BYTES = 8 << 20
_MAX_CAVEATS = 32
_MAX_CHUNKS = 4096
_CACHE_SIZE = 8192
_KID = re.compile(r"[A-Za-z0-9_-]{1,32}")
_B64 = re.compile(r"[A-Za-z0-9_-]*")
_HEX = re.compile(r"[0-9a-f]{1,128}")
_ROOT_KEYS = frozenset({"exp", "iat", "id", "ns", "ops", "t"})
_ROOT_KEYS_SCOPED = _ROOT_KEYS | {"sc"}
_MAX_SCOPES = 64
_DUMMY_KEY = b"\x00" * 32


def _cache_cost(token: str) -> int:
    # the token string, the decoded blocks folded into a Capability (about as large again,
    # chunk lists as frozensets of str), and the dict entry
    return 3 * len(token) + 512


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64d(text: str) -> bytes:
    if not _B64.fullmatch(text):
        raise CapabilityDenied("bad base64")
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except ValueError:
        raise CapabilityDenied("bad base64") from None
    if _b64e(data) != text:
        raise CapabilityDenied("non-canonical base64")
    return data


def _canon(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _mac(key: bytes, data: bytes) -> bytes:
    h = hmac.HMAC(key, hashes.SHA256())
    h.update(data)
    return h.finalize()


def _name(value: object, what: str, limit: int = 128) -> str:
    if isinstance(value, str) and 0 < len(value) <= limit and value.isprintable():
        return value
    raise CapabilityDenied(f"bad {what}")


def _ops(value: object) -> frozenset[str]:
    if (
        not isinstance(value, list)
        or not value
        or len(value) > len(ALL_OPERATIONS)
        or not all(isinstance(v, str) for v in value)
    ):
        raise CapabilityDenied("bad ops")
    ops = frozenset(value)
    if len(ops) != len(value) or not ops <= ALL_OPERATIONS:
        raise CapabilityDenied("bad ops")
    return ops


def _millis(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53:
        return value
    raise CapabilityDenied("bad time")


def _chunks(value: object) -> frozenset[str]:
    if not isinstance(value, list) or not value or len(value) > _MAX_CHUNKS:
        raise CapabilityDenied("bad chunk list")
    if not all(isinstance(c, str) and _HEX.fullmatch(c) for c in value):
        raise CapabilityDenied("bad chunk hash")
    return frozenset(value)


def _scopes(value: object) -> frozenset[str]:
    if not isinstance(value, list) or not value or len(value) > _MAX_SCOPES:
        raise CapabilityDenied("bad scope list")
    names = frozenset(_name(v, "scope", 64) for v in value)
    if len(names) != len(value):
        raise CapabilityDenied("bad scope list")
    return names


def _split(token: object) -> tuple[str, list[str], list[bytes], bytes]:
    """Structural parse: kid, raw segments, decoded root+caveats, tag. No secrets involved."""
    if not isinstance(token, str) or len(token) > _MAX_TOKEN_CHARS:
        raise CapabilityDenied("not a capability token")
    parts = token.split(".")
    if len(parts) < 4 or len(parts) > 4 + _MAX_CAVEATS or parts[0] != _PREFIX:
        raise CapabilityDenied("not a capability token")
    kid = parts[1]
    if not _KID.fullmatch(kid):
        raise CapabilityDenied("bad key id")
    blocks = [_b64d(p) for p in parts[2:-1]]
    tag = _b64d(parts[-1])
    if len(tag) != 32:
        raise CapabilityDenied("bad tag")
    return kid, parts, blocks, tag


def _load(block: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(block)
    except (ValueError, RecursionError):
        raise CapabilityDenied("bad block") from None
    if not isinstance(obj, dict) or _canon(obj) != block:
        raise CapabilityDenied("bad block")
    return obj


def _fold(kid: str, blocks: list[bytes]) -> Capability:
    """The effective capability: the root narrowed by every caveat, in order."""
    root = _load(blocks[0])
    if set(root) != _ROOT_KEYS and set(root) != _ROOT_KEYS_SCOPED:
        raise CapabilityDenied("bad root block")
    ops = _ops(root["ops"])
    exp = _millis(root["exp"])
    scopes = _scopes(root["sc"]) if "sc" in root else frozenset()
    chunks: frozenset[str] | None = None
    for block in blocks[1:]:
        caveat = _load(block)
        if len(caveat) != 1:
            raise CapabilityDenied("bad caveat")
        ((name, value),) = caveat.items()
        if name == "ops":
            ops &= _ops(value)
        elif name == "exp":
            exp = min(exp, _millis(value))
        elif name == "chunks":
            allowed = _chunks(value)
            chunks = allowed if chunks is None else chunks & allowed
        elif name == "sc":
            scopes &= _scopes(value)
        else:
            raise CapabilityDenied("unknown caveat")
    return Capability(
        cap_id=_name(root["id"], "id"),
        tenant=TenantId(_name(root["t"], "tenant")),
        namespace=Namespace(_name(root["ns"], "namespace")),
        ops=ops,
        issued_at=_millis(root["iat"]) / 1000,
        expires_at=exp / 1000,
        chunks=chunks,
        key_id=kid,
        scopes=scopes,
    )


def read_unverified(token: str) -> Capability:
    """What a token claims to grant, WITHOUT checking its tag (for holders: expiry, scope).

    Never use the result for an access decision; ``CapabilityAuthority.verify`` does that."""
    kid, _, blocks, _ = _split(token)
    return _fold(kid, blocks)


def attenuate(
    token: str,
    *,
    ops: Iterable[str] | None = None,
    expires_at: float | None = None,
    chunks: Iterable[str] | None = None,
    scopes: Iterable[str] | None = None,
) -> str:
    """A narrower copy of ``token``, made by its holder without the gateway's key (``scopes``:
    the sharing scopes it may still read; an empty list reads none).

    Raises ``CapabilityDenied`` if the token is malformed or the request would widen it (more
    operations, a later expiry, chunks outside an existing allowlist), and
    ``CapabilityRequestInvalid`` if nothing is asked for."""
    kid, parts, blocks, tag = _split(token)
    current = _fold(kid, blocks)
    caveats: list[dict[str, Any]] = []
    if ops is not None:
        wanted = sorted(set(ops))
        if not set(wanted) <= current.ops:
            raise CapabilityDenied("attenuation would widen ops")
        _ops(wanted)
        caveats.append({"ops": wanted})
    if expires_at is not None:
        ms = int(expires_at * 1000)
        if ms > round(current.expires_at * 1000):
            raise CapabilityDenied("attenuation would extend expiry")
        caveats.append({"exp": _millis(ms)})
    if chunks is not None:
        wanted = sorted(set(chunks))
        _chunks(wanted)
        if current.chunks is not None and not set(wanted) <= current.chunks:
            raise CapabilityDenied("attenuation would widen chunks")
        caveats.append({"chunks": wanted})
    if scopes is not None:
        kept = sorted(set(scopes))
        if not set(kept) <= current.scopes:
            raise CapabilityDenied("attenuation would widen scopes")
        # an empty list is spelt as a scope no capability names (a list is never empty)
        caveats.append({"sc": kept or ["-"]})
    if not caveats:
        raise CapabilityRequestInvalid("attenuate needs ops, expires_at, chunks or scopes")
    if len(blocks) - 1 + len(caveats) > _MAX_CAVEATS:
        raise CapabilityDenied("too many caveats")
    out = parts[:-1]
    for caveat in caveats:
        block = _canon(caveat)
        tag = _mac(tag, block)
        out.append(_b64e(block))
    result = ".".join([*out, _b64e(tag)])
    if len(result) > _MAX_TOKEN_CHARS:
        raise CapabilityDenied("capability too large")
    return result


class RevocationList:
    """Revoked capability ids and per-tenant revocation instants, in memory.

    ``revoke(cap_id, until)`` revokes one capability (keep the entry until ``until``, its expiry);
    ``revoke_tenant(tenant, before)`` revokes every capability of ``tenant`` issued at or before
    ``before`` (default: now), which is what secure clear does. ``export()`` and ``load()`` carry
    the entries to and from the registry or a broadcast (JSON-safe dicts); ``prune()`` drops
    entries that can no longer matter. Times are seconds since the epoch.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._ids: dict[str, float] = {}
        self._tenants: dict[str, float] = {}

    def revoke(self, cap_id: str, until: float) -> None:
        self._ids[cap_id] = max(float(until), self._ids.get(cap_id, float("-inf")))

    def revoke_tenant(self, tenant: str, before: float | None = None) -> float:
        instant = self._clock() if before is None else float(before)
        self._tenants[tenant] = max(instant, self._tenants.get(tenant, float("-inf")))
        return instant

    def is_revoked(self, cap: Capability) -> bool:
        if cap.cap_id in self._ids:
            return True
        before = self._tenants.get(cap.tenant)
        return before is not None and cap.issued_at <= before

    def prune(self, max_ttl: float) -> int:
        """Drop id entries past their ``until`` and tenant entries older than ``max_ttl``."""
        now = self._clock()
        ids = [k for k, until in self._ids.items() if until < now]
        tenants = [t for t, before in self._tenants.items() if before + max_ttl < now]
        for k in ids:
            del self._ids[k]
        for t in tenants:
            del self._tenants[t]
        return len(ids) + len(tenants)

    def export(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {"kind": "id", "cap_id": k, "until": v} for k, v in sorted(self._ids.items())
        ]
        out += [
            {"kind": "tenant", "tenant": t, "before": v} for t, v in sorted(self._tenants.items())
        ]
        return out

    def load(self, entries: Iterable[Mapping[str, Any]]) -> None:
        """Merge exported entries; raises ``CapabilityRequestInvalid`` (changing nothing) on bad input."""
        ids: list[tuple[str, float]] = []
        tenants: list[tuple[str, float]] = []
        for e in entries:
            try:
                if e["kind"] == "id":
                    ids.append((_name(e["cap_id"], "id"), _seconds(e["until"])))
                elif e["kind"] == "tenant":
                    tenants.append((_name(e["tenant"], "tenant"), _seconds(e["before"])))
                else:
                    raise KeyError("kind")
            except (KeyError, TypeError, CapabilityDenied) as exc:
                raise CapabilityRequestInvalid(f"bad revocation entry: {exc}") from None
        for k, until in ids:
            self.revoke(k, until)
        for t, before in tenants:
            self.revoke_tenant(t, before)


def _seconds(value: object) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 2**40:
        return float(value)
    raise TypeError("time must be a number")


class CapabilityAuthority:
    """Mints and verifies capability tokens with the gateway's capability keys.

    ``keys`` maps key ids to secrets of at least 32 bytes; ``current_kid`` signs new tokens and
    every listed key verifies (rotate by adding a key, switching ``current_kid``, and dropping
    the old key after ``max_ttl``). ``clock`` returns seconds since the epoch.
    """

    def __init__(
        self,
        keys: Mapping[str, bytes],
        current_kid: str,
        *,
        max_ttl: int = DEFAULT_MAX_TTL,
        clock: Callable[[], float] = time.time,
        revocations: RevocationList | None = None,
        cache_size: int = _CACHE_SIZE,
    ) -> None:
        for kid, key in keys.items():
            if not _KID.fullmatch(kid) or not isinstance(key, bytes) or len(key) < 32:
                raise CapabilityRequestInvalid(
                    f"capability key {kid!r}: need an id and >= 32 bytes"
                )
        if current_kid not in keys:
            raise CapabilityRequestInvalid(f"current_kid {current_kid!r} is not among the keys")
        if not 0 < max_ttl <= 86400:
            raise CapabilityRequestInvalid("max_ttl must be between 1 and 86400 seconds")
        self._keys = dict(keys)
        self._current = current_kid
        self.max_ttl = max_ttl
        self._clock = clock
        self.revocations = revocations if revocations is not None else RevocationList(clock=clock)
        self._cache: dict[str, Capability] = {}
        self._cache_size = cache_size
        self._cache_bytes = 0
        self.cache_max_bytes = _CACHE_BYTES

    def __repr__(self) -> str:
        return f"CapabilityAuthority(kids={sorted(self._keys)}, current={self._current!r})"

    def issue(
        self, tenant: str, namespace: str, ops: Collection[str], ttl: int | None = None,
        *, scopes: Collection[str] = (),
    ) -> tuple[str, Capability]:
        """Mint a capability and return the token with its content (for the audit event);
        ``scopes``: the sharing scopes whose published prefixes it may read."""
        op_list = sorted(set(ops))
        if not op_list or not set(op_list) <= ALL_OPERATIONS:
            raise CapabilityRequestInvalid(
                f"ops must be a non-empty subset of {sorted(ALL_OPERATIONS)}"
            )
        ttl = self.max_ttl if ttl is None else ttl
        if isinstance(ttl, bool) or not isinstance(ttl, int) or not 0 < ttl <= self.max_ttl:
            raise CapabilityRequestInvalid(f"ttl must be an integer between 1 and {self.max_ttl}")
        try:
            _name(tenant, "tenant")
            _name(namespace, "namespace")
        except CapabilityDenied as exc:
            raise CapabilityRequestInvalid(exc.reason) from None
        scope_list = sorted(set(scopes))
        if len(scope_list) > _MAX_SCOPES:
            raise CapabilityRequestInvalid(f"at most {_MAX_SCOPES} scopes")
        try:
            for scope in scope_list:
                _name(scope, "scope", 64)
        except CapabilityDenied as exc:
            raise CapabilityRequestInvalid(exc.reason) from None
        now_ms = int(self._clock() * 1000)
        root: dict[str, Any] = {
            "exp": now_ms + ttl * 1000,
            "iat": now_ms,
            "id": secrets.token_urlsafe(16),
            "ns": namespace,
            "ops": op_list,
            "t": tenant,
        }
        if scope_list:
            root["sc"] = scope_list
        block = _canon(root)
        kid = self._current
        tag = _mac(self._keys[kid], _DOMAIN + kid.encode() + b"\x00" + block)
        token = ".".join([_PREFIX, kid, _b64e(block), _b64e(tag)])
        return token, _fold(kid, [block])

    def mint(
        self, tenant: str, namespace: str, ops: Collection[str], ttl: int | None = None
    ) -> str:
        return self.issue(tenant, namespace, ops, ttl)[0]

    def _authenticate(self, token: str) -> Capability:
        if not isinstance(token, str):
            raise CapabilityDenied("not a capability token")
        cap = self._cache.get(token)
        if cap is not None:
            return cap
        kid, _, blocks, tag = _split(token)
        key = self._keys.get(kid)
        expected = _mac(
            _DUMMY_KEY if key is None else key, _DOMAIN + kid.encode() + b"\x00" + blocks[0]
        )
        for block in blocks[1:]:
            expected = _mac(expected, block)
        if not std_hmac.compare_digest(expected, tag) or key is None:
            raise CapabilityDenied("bad tag")
        cap = _fold(kid, blocks)
        if self._cache_size > 0:
            cost = _cache_cost(token)
            while self._cache and (
                len(self._cache) >= self._cache_size or self._cache_bytes + cost > self.cache_max_bytes
            ):
                oldest = next(iter(self._cache))
                del self._cache[oldest]
                self._cache_bytes -= _cache_cost(oldest)
            self._cache[token] = cap
            self._cache_bytes += cost
        return cap

    @property
    def cache_bytes(self) -> int:
        """What the verify cache holds, estimated: the token, its folded content, the entry."""
        return self._cache_bytes

    def verify(
        self,
        token: str,
        *,
        tenant: str | None,
        namespace: str,
        op: str,
        chunk: str | None = None,
        chunks: Iterable[str] = (),
    ) -> Capability:
        """The capability in ``token`` if it covers ``op`` on ``namespace`` of ``tenant`` (and on
        ``chunk`` / every one of ``chunks`` when its holder restricted it to a chunk allowlist).

        ``tenant=None`` accepts the token's own tenant (the caller then MUST use
        ``Capability.tenant``); otherwise it must match. Raises ``CapabilityDenied``."""
        cap = self._authenticate(token)
        now = self._clock()
        wanted = [chunk] if chunk is not None else []
        wanted.extend(chunks)
        denied = (
            "expired"
            if now >= cap.expires_at
            else "revoked"
            if self.revocations.is_revoked(cap)
            else "other tenant"
            if tenant is not None and cap.tenant != tenant
            else "other namespace"
            if cap.namespace != namespace
            else "operation not granted"
            if op not in cap.ops
            else "chunk not granted"
            if cap.chunks is not None and (not wanted or not all(c in cap.chunks for c in wanted))
            else None
        )
        if denied is not None:
            raise CapabilityDenied(denied)
        return cap

    def rotate(self, keys: Mapping[str, bytes], current_kid: str) -> None:
        """Replace the key set (validated like the constructor's) and clear the verify cache."""
        checked = CapabilityAuthority(keys, current_kid, max_ttl=self.max_ttl)
        self._keys, self._current = checked._keys, checked._current
        self._cache.clear()
        self._cache_bytes = 0
