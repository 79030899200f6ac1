"""OIDC access-token verification against one or more trusted issuers (RFC 8725, RFC 9068).

``OidcVerifier.verify(token)`` returns a ``Principal`` or raises ``AuthenticationFailed`` (the
precise reason in ``.reason`` for logs and audit). JOSE is done by joserfc; this module decides
*which* key and algorithm a token may use and which claims it must carry. The invariants:
the issuer is chosen by the token's exact ``iss`` and an unknown one is rejected before anything
is fetched; oversized tokens are rejected before parsing; keys come only from the issuer's JWKS
(through its discovery document, https, no redirects, bounded size), never from the token's header
(``jku``, ``x5u``, ``x5c``, ``jwk`` or ``crit`` in a header is refused); an unknown ``kid``
refetches at most once per cooldown and a failed refresh after the lifespan fails closed; ``none``,
HMAC algorithms and ``oct`` keys are never accepted, each key allows only what its type can do;
``iss``, ``aud``, ``exp``, ``sub`` and the tenant claim are required, ``nbf``/``iat`` within
``leeway``, header ``typ`` checked where configured. The full rules and their reasons:
docs/architecture.md, section 5."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self
from urllib.parse import urlsplit

import httpx
from cryptography.hazmat.primitives.asymmetric import rsa
from joserfc import jwk
from joserfc.errors import ClaimError, ExpiredTokenError, JoseError
from joserfc.jws import JWSRegistry, extract_compact, validate_compact
from joserfc.jwt import JWTClaimsRegistry

from tenancy.errors import AuthenticationFailed, IssuerConfigError
from tenancy.types import Principal, TenantId

__all__ = [
    "DEFAULT_ALGORITHMS",
    "DEFAULT_MAX_TOKEN_BYTES",
    "SUPPORTED_ALGORITHMS",
    "IssuerConfig",
    "OidcVerifier",
]

SUPPORTED_ALGORITHMS = frozenset({"RS256", "ES256", "EdDSA", "Ed25519"})
DEFAULT_ALGORITHMS = SUPPORTED_ALGORITHMS
DEFAULT_MAX_TOKEN_BYTES = 8 * 1024
_MAX_DOCUMENT_BYTES = 256 * 1024
_MAX_JWKS_KEYS = 64
_MAX_NAME = 256
_MAX_ROLES = 256
_MIN_RSA_BITS = 2048
# Which algorithms a key type can verify, and which public members of the JWK are kept.
_KEY_KINDS: dict[tuple[str, str | None], tuple[frozenset[str], tuple[str, ...]]] = {
    ("RSA", None): (frozenset({"RS256"}), ("n", "e")),
    ("EC", "P-256"): (frozenset({"ES256"}), ("crv", "x", "y")),
    ("OKP", "Ed25519"): (frozenset({"EdDSA", "Ed25519"}), ("crv", "x")),
}


def _check_url(url: str, allow_http: bool, what: str) -> None:
    parts = urlsplit(url)
    if parts.scheme == "https" and parts.hostname:
        return
    if parts.scheme == "http" and parts.hostname:
        if allow_http:
            return
        host = parts.hostname
        try:
            if host == "localhost" or ipaddress.ip_address(host).is_loopback:
                return
        except ValueError:
            pass
    raise IssuerConfigError(f"{what} must be an https URL (http only for loopback): {url!r}")


_REFUSED_HEADERS = frozenset({"jku", "x5u", "x5c", "jwk"})


@dataclass(frozen=True, slots=True)
class IssuerConfig:
    """One trusted issuer. ``issuer`` is its exact ``iss``; discovery is fetched from
    ``discovery_url`` or ``{issuer}/.well-known/openid-configuration``. Times are seconds."""

    issuer: str
    audience: str
    tenant_claim: str = "tenant"
    roles_claim: str = "roles"
    algorithms: frozenset[str] = DEFAULT_ALGORITHMS
    required_typ: str | None = None
    jwks_lifespan: float = 300.0
    refetch_cooldown: float = 30.0
    leeway: float = 60.0
    discovery_url: str | None = None
    allow_http: bool = False

    def __post_init__(self) -> None:
        _check_url(self.issuer, self.allow_http, "issuer")
        if self.discovery_url is not None:
            _check_url(self.discovery_url, self.allow_http, "discovery_url")
        object.__setattr__(self, "algorithms", frozenset(self.algorithms))
        bad = self.algorithms - SUPPORTED_ALGORITHMS
        if not self.algorithms or bad:
            raise IssuerConfigError(
                f"algorithms must be a non-empty subset of {sorted(SUPPORTED_ALGORITHMS)}; "
                f"refused: {sorted(bad)}"
            )
        if not self.audience or not self.tenant_claim or not self.roles_claim:
            raise IssuerConfigError("audience, tenant_claim and roles_claim must be non-empty")
        if self.required_typ is not None:
            object.__setattr__(self, "required_typ", _normalise_typ(self.required_typ))
        if not (self.jwks_lifespan > 0 and self.refetch_cooldown > 0):
            raise IssuerConfigError("jwks_lifespan and refetch_cooldown must be positive")
        if not 0 <= self.leeway <= 300:
            raise IssuerConfigError("leeway must be between 0 and 300 seconds")

    @property
    def discovery(self) -> str:
        return self.discovery_url or self.issuer.rstrip("/") + "/.well-known/openid-configuration"


@dataclass(frozen=True, slots=True)
class _TokenKey:
    key: Any
    algorithms: frozenset[str]


def _import_jwk(data: object, allowed: frozenset[str]) -> tuple[str | None, _TokenKey] | None:
    """A verification key from one JWKS entry, or ``None`` if it is unusable for us.

    Only public members are imported (a ``d`` published by mistake is dropped), ``oct`` and
    unknown key types are skipped, and the usable algorithms are narrowed to the key's type,
    its own ``alg`` and the issuer's allowlist."""
    if not isinstance(data, dict):
        return None
    kty, crv = data.get("kty"), data.get("crv")
    wanted: tuple[Any, Any] = (kty, None) if kty == "RSA" else (kty, crv)  # JSON values: a miss if not str
    kind = _KEY_KINDS.get(wanted)
    if kind is None or data.get("use", "sig") != "sig":
        return None
    ops = data.get("key_ops")
    if ops is not None and (not isinstance(ops, list) or "verify" not in ops):
        return None
    algs = kind[0] & allowed
    if "alg" in data:
        algs &= {data["alg"]} if isinstance(data["alg"], str) else set()
    kid = data.get("kid")
    if not algs or (kid is not None and _short_str(kid) is None):
        return None
    try:
        key = jwk.import_key({m: data[m] for m in ("kty", *kind[1])})
        raw = key.raw_value
        if isinstance(raw, rsa.RSAPublicKey) and raw.key_size < _MIN_RSA_BITS:
            return None
    except (JoseError, ValueError, TypeError, KeyError):
        return None
    return kid, _TokenKey(key, frozenset(algs))


async def _fetch_json(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    try:
        async with http.stream("GET", url, headers={"Accept": "application/json"}) as resp:
            if resp.status_code != 200:
                raise AuthenticationFailed(f"key source answered {resp.status_code}: {url}")
            body = bytearray()
            async for part in resp.aiter_bytes():
                body += part
                if len(body) > _MAX_DOCUMENT_BYTES:
                    raise AuthenticationFailed(f"key source document too large: {url}")
        doc = json.loads(bytes(body))
    except httpx.HTTPError as exc:
        raise AuthenticationFailed(
            f"key source unreachable: {url} ({type(exc).__name__})"
        ) from None
    except ValueError:
        raise AuthenticationFailed(f"key source sent invalid JSON: {url}") from None
    if not isinstance(doc, dict):
        raise AuthenticationFailed(f"key source document is not an object: {url}")
    return doc


@dataclass(eq=False)
class _KeyCache:
    """The JWKS of one issuer, with lifespan and refetch cooldown (docs/architecture.md, section 5)."""

    config: IssuerConfig
    http: Callable[[], httpx.AsyncClient]
    clock: Callable[[], float]
    keys: dict[str | None, _TokenKey] = field(default_factory=dict)
    fetched_at: float = -math.inf
    attempted_at: float = -math.inf
    jwks_uri: str | None = None
    discovered_at: float = -math.inf
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def key_for(self, kid: str | None) -> _TokenKey:
        if self.clock() - self.fetched_at >= self.config.jwks_lifespan:
            await self.refresh(forced=False)
        key = self._lookup(kid)
        if key is None:
            await self.refresh(forced=True)
            key = self._lookup(kid)
        if key is None:
            raise AuthenticationFailed("unknown key id")
        return key

    def _lookup(self, kid: str | None) -> _TokenKey | None:
        if kid is None:
            return next(iter(self.keys.values())) if len(self.keys) == 1 else None
        return self.keys.get(kid)

    async def refresh(self, *, forced: bool) -> None:
        async with self.lock:
            now = self.clock()
            cfg = self.config
            if now - self.attempted_at < cfg.refetch_cooldown:
                if now - self.fetched_at >= cfg.jwks_lifespan:
                    self.keys = {}  # stale and refetched too recently: fail closed
                return
            if not forced and now - self.fetched_at < cfg.jwks_lifespan:
                return  # another task refreshed while this one waited
            self.attempted_at = now
            try:
                self.keys = await self._fetch(now)
                self.fetched_at = now
            except AuthenticationFailed:
                if now - self.fetched_at >= cfg.jwks_lifespan:
                    self.keys = {}
                raise

    async def _fetch(self, now: float) -> dict[str | None, _TokenKey]:
        cfg = self.config
        if self.jwks_uri is None or now - self.discovered_at >= cfg.jwks_lifespan:
            doc = await _fetch_json(self.http(), cfg.discovery)
            uri = doc.get("jwks_uri")
            if doc.get("issuer") != cfg.issuer:
                raise AuthenticationFailed("discovery document names another issuer")
            if not isinstance(uri, str):
                raise AuthenticationFailed("discovery document has no jwks_uri")
            try:
                _check_url(uri, cfg.allow_http, "jwks_uri")
            except IssuerConfigError:
                raise AuthenticationFailed("discovery document has an unsafe jwks_uri") from None
            self.jwks_uri, self.discovered_at = uri, now
        jwks = await _fetch_json(self.http(), self.jwks_uri)
        entries = jwks.get("keys")
        if not isinstance(entries, list):
            raise AuthenticationFailed("JWKS has no keys list")
        keys: dict[str | None, _TokenKey] = {}
        for entry in entries[:_MAX_JWKS_KEYS]:
            imported = _import_jwk(entry, cfg.algorithms)
            if imported is not None and imported[0] not in keys:
                keys[imported[0]] = imported[1]
        return keys


class _AllowlistRegistry(JWSRegistry):
    """A JWS registry that accepts exactly the algorithms given, with no other policy.

    joserfc's default registry warns on ``EdDSA`` (deprecated by RFC 9864 in favour of
    ``Ed25519``); the allowlist here is explicit, so that warning adds nothing.
    """

    def get_alg(self, name: str) -> Any:
        if not self.allowed or name not in self.allowed or name not in self.algorithms:
            raise JoseError(f"algorithm {name!r} is not allowed")
        return self.algorithms[name]


def _normalise_typ(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    v = value.strip().lower()
    return v.removeprefix("application/")


def _short_str(value: object, limit: int = _MAX_NAME) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= limit and value.isprintable():
        return value
    return None


def _roles(claims: dict[str, Any], roles_claim: str) -> frozenset[str]:
    out: set[str] = set()
    for name in (roles_claim, "scope"):
        value = claims.get(name)
        if isinstance(value, str):
            items: list[object] = list(value.split())
        elif isinstance(value, list) and name == roles_claim:
            items = value
        else:
            continue
        out.update(s for s in map(_short_str, items) if s is not None)
    if len(out) > _MAX_ROLES:
        raise AuthenticationFailed("too many roles")
    return frozenset(out)


class OidcVerifier:
    """Verifies bearer access tokens from the configured issuers.

    ``http`` is an ``httpx.AsyncClient`` to fetch discovery documents and JWKS with (the
    verifier makes and closes its own when ``None``). ``clock`` returns seconds since the epoch
    and drives claim checks, JWKS lifespan and refetch cooldown.

    A token that verified is remembered (by its SHA-256, at most ``verified_max`` of them) for
    ``verified_cache_s`` seconds, never past its ``exp``: a worker sends the same access token
    on every lookup and load, and checking its signature and claims each time would add that cost
    to every one of them. The window also ends when the JWKS it verified under is due for a
    refetch, so a signing key removed from the JWKS stops validating exactly when it would without
    the cache; 0 turns it off. A token differing in any byte is verified anew.
    """

    def __init__(
        self,
        issuers: list[IssuerConfig],
        *,
        http: httpx.AsyncClient | None = None,
        max_token_bytes: int = DEFAULT_MAX_TOKEN_BYTES,
        clock: Callable[[], float] = time.time,
        verified_cache_s: float = 30.0,
        verified_max: int = 4096,
    ) -> None:
        if not issuers:
            raise IssuerConfigError("no issuers configured")
        by_issuer: dict[str, IssuerConfig] = {}
        for cfg in issuers:
            if cfg.issuer in by_issuer:
                raise IssuerConfigError(f"issuer configured twice: {cfg.issuer}")
            by_issuer[cfg.issuer] = cfg
        self._configs = by_issuer
        self._owns_http = http is None
        self._http = http
        self._clock = clock
        self._max_token_bytes = max_token_bytes
        self._caches = {
            name: _KeyCache(cfg, self._client, clock) for name, cfg in by_issuer.items()
        }
        self._verified_cache_s = max(0.0, float(verified_cache_s))
        self._verified_max = max(1, int(verified_max))
        self._verified: OrderedDict[bytes, tuple[Principal, float]] = OrderedDict()

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(5.0), follow_redirects=False)
        return self._http

    async def aclose(self) -> None:
        """Close the HTTP client if the verifier made it."""
        if self._owns_http and self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def refresh(self) -> None:
        """Fetch every issuer's discovery document and JWKS now (for start-up and readiness)."""
        for cache in self._caches.values():
            await cache.refresh(forced=True)
        self._verified.clear()

    async def verify(self, token: str) -> Principal:
        """Verify ``token`` and return its principal; raise ``AuthenticationFailed`` otherwise."""
        if not isinstance(token, str):
            raise AuthenticationFailed("token is not a string")
        if len(token) > self._max_token_bytes:
            raise AuthenticationFailed("token too large")
        remember = self._verified_cache_s > 0 and token.isascii()  # a JWS is ASCII; anything else fails below
        if remember:
            digest = hashlib.sha256(token.encode("ascii")).digest()
            seen = self._verified.get(digest)
            if seen is not None:
                if self._clock() < seen[1]:
                    self._verified.move_to_end(digest)
                    return seen[0]
                del self._verified[digest]
        principal = await self._checked(token)
        if remember:
            keys = self._caches[principal.issuer]
            until = min(
                self._clock() + self._verified_cache_s,
                principal.expires_at,
                keys.fetched_at + keys.config.jwks_lifespan,  # never past the JWKS it verified under
            )
            self._verified[digest] = (principal, until)
            while len(self._verified) > self._verified_max:
                self._verified.popitem(last=False)
        return principal

    async def _checked(self, token: str) -> Principal:
        try:
            return await self._verify(token)
        except AuthenticationFailed:
            raise
        except ExpiredTokenError:
            raise AuthenticationFailed("token expired") from None
        except ClaimError as exc:
            raise AuthenticationFailed(
                f"claim {exc.claim!r} rejected: {exc.error}: {exc.description}"
            ) from None
        except (JoseError, ValueError, TypeError, KeyError, UnicodeError, RecursionError) as exc:
            raise AuthenticationFailed(f"malformed token ({type(exc).__name__})") from None

    async def _verify(self, token: str) -> Principal:
        obj = extract_compact(token.encode("ascii"))
        header = obj.headers()
        refused = _REFUSED_HEADERS.intersection(header)
        if refused:
            raise AuthenticationFailed(f"header parameter not accepted: {sorted(refused)[0]}")
        if "crit" in header:  # kvgate understands no JWS extension, so any crit is unknown
            raise AuthenticationFailed("crit header parameter not understood")
        unverified = json.loads(obj.payload)
        if not isinstance(unverified, dict):
            raise AuthenticationFailed("payload is not a JSON object")
        iss = unverified.get("iss")
        cfg = self._configs.get(iss) if isinstance(iss, str) else None
        if cfg is None:
            raise AuthenticationFailed("untrusted issuer")
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in cfg.algorithms:
            raise AuthenticationFailed(f"algorithm not allowed: {str(alg)[:32]!r}")
        if cfg.required_typ is not None and _normalise_typ(header.get("typ")) != cfg.required_typ:
            raise AuthenticationFailed("wrong token type")
        kid = header.get("kid")
        if kid is not None and _short_str(kid) is None:
            raise AuthenticationFailed("malformed kid")
        key = await self._caches[cfg.issuer].key_for(kid)
        if alg not in key.algorithms:
            raise AuthenticationFailed("algorithm not allowed for this key")
        registry = _AllowlistRegistry(algorithms=[alg])
        if not validate_compact(obj, key.key, [alg], registry):
            raise AuthenticationFailed("bad signature")

        claims = unverified
        now_fn = self._clock
        JWTClaimsRegistry(
            now=lambda: int(now_fn()),
            leeway=int(cfg.leeway),
            iss={"essential": True, "value": cfg.issuer},
            aud={"essential": True, "value": cfg.audience},
            exp={"essential": True},
            sub={"essential": True},
        ).validate(claims)
        exp = claims["exp"]
        if not isinstance(exp, (int, float)) or isinstance(exp, bool) or not math.isfinite(exp):
            raise AuthenticationFailed("claim rejected: exp")
        subject = _short_str(claims.get("sub"))
        if subject is None:
            raise AuthenticationFailed("claim rejected: sub")
        tenant = _short_str(claims.get(cfg.tenant_claim), 128)
        if tenant is None:
            raise AuthenticationFailed("no tenant claim")
        client_id = _short_str(claims.get("client_id")) or _short_str(claims.get("azp"))
        return Principal(
            subject=subject,
            issuer=cfg.issuer,
            tenant=TenantId(tenant),
            roles=_roles(claims, cfg.roles_claim),
            client_id=client_id,
            token_id=_short_str(claims.get("jti")),
            expires_at=float(exp),
        )
