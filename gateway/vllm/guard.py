"""The tenant checks shared by the ASGI middleware and the reverse proxy.

For one inference request: ``identify`` finds the tenant and namespace (a bearer token, OIDC, else 401;
or a trusted gateway's tenant header, ``peers.TrustedPeers``, from any other peer a 403 audited as
``authz.denied``; a namespace header only for a namespace the caller holds); ``rewrite`` then mints a
capability through the kvgate server's ``POST /v1/capabilities`` (the caller's token, or the service
token for a header-named tenant, so the server's role checks and audit apply; or in process with
``mint=``; refused -> 403) and replaces the client's ``cache_salt`` with ``salt.cache_salt`` and its
``kv_transfer_params`` (but a prefill engine's receipt) with {kvgate_capability, kvgate_epoch[, kvgate_receipt]}.

The salt's epoch is the namespace's own, as the server reports it with each capability: a secure clear
bumps it, so the next request's salt shares no prefix-cache block with any cached before; the answer's
``shared`` revision does that for a published prefix revoked or a scope left. A published prefix's
warm-up (``warm_up``: headers X-KV-Warm-Up and X-KV-Capability, a scope's write capability) passes only
from a trusted peer or with an operator's token (else 403, audited), with a fresh cache_salt. Settings:
``KVGATE_VLLM_*`` through ``config.MiddlewareSettings``; design: docs/architecture.md.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from audit.types import Actions, Actor, AuditEvent, AuditSink, Target, record_durably
from audit.writer import AuditWriter
from gateway.errors import GatewayError
from gateway.vllm.config import MiddlewareSettings
from gateway.vllm.errors import (
    BadRequest,
    ConnectorConfigError,
    Forbidden,
    Unauthorized,
    Unavailable,
)
from gateway.vllm.handoff import EPOCH_PARAM, RECEIPT_PARAM
from gateway.vllm.peers import Peer, TrustedPeers
from gateway.vllm.salt import cache_salt
from gateway.vllm.scheduler import MAX_CAPABILITY_CHARS, WARM_PARAM
from tenancy.capabilities import read_unverified
from tenancy.errors import AuthenticationFailed, CapabilityDenied
from tenancy.names import escape, is_name
from tenancy.oidc import IssuerConfig, OidcVerifier
from tenancy.roles import KV_OPERATOR
from tenancy.sharing import SCOPE_NAMESPACE, is_scope_owner
from tenancy.types import Principal, TenantId

__all__ = [
    "CAPABILITY_PARAM", "GUARDED_PATHS", "NAMESPACE_GRANT", "WARM_HEADER", "WARM_PATH", "GuardConfig", "Identity",
    "TenantGuard", "WarmUp",
]

log = logging.getLogger("kvgate.vllm")
RETRY_AFTER_S = 5  # Retry-After of a 503 (the gateway is down or cannot mint now)

CAPABILITY_PARAM = "kvgate_capability"
NAMESPACE_GRANT = "kv.namespace:"  # a role or scope value kv.namespace:NAME grants namespace NAME
TRUSTED_ISSUER = "kvgate:trusted-peer"  # the issuer of a principal a trusted peer's header names
WARM_HEADER = "x-kv-warm-up"  # a published prefix's id: the request is its warm-up
WARM_CAPABILITY_HEADER = "x-kv-capability"  # the warm-up's capability (the publish answer's)
WARM_PATH = "/v1/completions"  # a warm-up's prompt is the prefix's token ids
_PREFIX_ID = re.compile(r"[0-9a-f]{24}")
GUARDED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/inference/v1/generate")
# in-process mint: (principal, namespace) -> (capability, namespace epoch); it reads no published
# prefixes (their revision, which the server's mint answer carries, is "")
MintFn = Callable[[Principal, str], Awaitable[tuple[str, int]]]


def _loopback(url: str) -> bool:
    return (urlsplit(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class GuardConfig:
    issuers: list[IssuerConfig]
    salt_secret: bytes = field(repr=False)
    gateway_url: str | None = None  # the kvgate server that mints capabilities
    namespace: str = "default"
    capability_ttl: int = 300
    max_body_bytes: int = 16 << 20
    tenant_header: str | None = None  # lowercase; None: no tenant is taken from a header
    namespace_header: str | None = None
    trusted_peers: TrustedPeers = field(default_factory=TrustedPeers)
    trusted_namespaces: frozenset[str] | None = frozenset()  # None: any (``*``)
    service_token: str | None = field(default=None, repr=False)
    audit_database_url: str | None = field(default=None, repr=False)
    audit_spool_dir: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GuardConfig:
        """From ``KVGATE_VLLM_*`` (``config.MiddlewareSettings``; see docs/vllm.md)."""
        return cls.from_settings(MiddlewareSettings.from_env(env))

    @classmethod
    def from_settings(cls, s: MiddlewareSettings) -> GuardConfig:
        cfg = IssuerConfig(
            issuer=s.issuer, audience=s.audience, tenant_claim=s.tenant_claim, roles_claim=s.roles_claim,
            required_typ=s.required_typ, allow_http=_loopback(s.issuer),
        )
        spaces = [n.strip() for n in (s.trusted_namespaces or "").split(",") if n.strip()]
        if any(n != "*" and not is_name(n) for n in spaces):
            raise ConnectorConfigError("KVGATE_VLLM_TRUSTED_NAMESPACES: a comma-separated list of namespace names, or *")
        return cls(
            issuers=[cfg], salt_secret=s.salt_secret_bytes(), gateway_url=s.gateway_url, namespace=s.namespace,
            capability_ttl=s.capability_ttl, tenant_header=s.tenant_header, namespace_header=s.namespace_header,
            trusted_peers=TrustedPeers.parse(s.trusted_peers),
            trusted_namespaces=None if "*" in spaces else frozenset(spaces),
            service_token=s.service_token_value(),
            audit_database_url=s.audit_database_url.get_secret_value() if s.audit_database_url else None,
            audit_spool_dir=s.audit_spool_dir,
        )


@dataclass(frozen=True)
class Identity:
    """Who a request is for: the principal, the caller's own token (None for a tenant a trusted
    peer's header named: the service token mints), the namespace, and the peer."""

    principal: Principal
    token: str | None
    namespace: str
    peer: Peer


@dataclass(frozen=True)
class WarmUp:
    """A published prefix's warm-up as the middleware admitted it: the prefix, the scope's write
    capability (checked by the kvgate server on the report and on every put) and the peer."""

    prefix_id: str
    capability: str = field(repr=False)
    peer: Peer


class TenantGuard:
    def __init__(
        self, config: GuardConfig, *, mint: MintFn | None = None, http: httpx.AsyncClient | None = None,
        audit: AuditSink | None = None,
    ) -> None:
        if mint is None and not config.gateway_url:
            raise ConnectorConfigError("give a kvgate server URL (KVGATE_VLLM_GATEWAY_URL) or an in-process mint")
        if config.tenant_header and mint is None and not config.service_token:
            raise ConnectorConfigError(
                "KVGATE_VLLM_TENANT_HEADER needs KVGATE_VLLM_SERVICE_TOKEN or ..._FILE (a kv.operator token that "
                "mints capabilities for the tenants the header names)"
            )
        self.config = config
        self._mint = mint
        self._http = http or httpx.AsyncClient(timeout=10.0, follow_redirects=False)
        self.verifier = OidcVerifier(config.issuers, http=self._http)
        self.audit = audit
        self._owned_audit: AuditWriter | None = None

    @classmethod
    async def open(cls, config: GuardConfig) -> TenantGuard:
        """A guard with its audit writer started where ``audit_database_url`` is set."""
        guard = cls(config)
        if config.audit_database_url:
            spool = config.audit_spool_dir or f"{tempfile.gettempdir()}/kvgate-vllm-audit-spool"
            writer = AuditWriter(config.audit_database_url, spool_dir=spool)
            await writer.start()
            guard.audit = guard._owned_audit = writer
        return guard

    async def aclose(self) -> None:
        if self._owned_audit is not None:
            await self._owned_audit.aclose()
        await self._http.aclose()

    async def identify(self, peer: Peer, headers: Mapping[bytes, bytes]) -> Identity:
        """The request's identity from its connection and headers (see the module docstring);
        Unauthorized, BadRequest or Forbidden (refusals of an identity header audited)."""
        cfg = self.config
        auth = headers.get(b"authorization", b"").decode("latin-1") or None
        named = headers.get(cfg.tenant_header.encode()) if cfg.tenant_header else None
        asked = headers.get(cfg.namespace_header.encode()) if cfg.namespace_header else None
        namespace = asked.decode("latin-1") if asked is not None else cfg.namespace
        if named is not None:
            tenant = named.decode("latin-1")
            if not cfg.trusted_peers.trusts(peer):
                forwarded = peer.kind == "forwarded"
                why = "tenant header beside X-Forwarded-For on TCP" if forwarded else "tenant header from an untrusted peer"
                await self._deny(peer, auth, tenant, namespace, why)
                raise Forbidden(
                    f"{cfg.tenant_header} is accepted only from a trusted gateway"
                    + (" (over TCP, without X-Forwarded-For: the peer address may be that header's)" if forwarded else "")
                )
            if not is_name(tenant):
                await self._deny(peer, auth, tenant, namespace, "tenant header is not a tenant name")
                raise BadRequest(f"{cfg.tenant_header} does not name a tenant")
            token: str | None = None
            if auth is not None:  # a token beside the header must be that tenant's
                principal, token = await self.principal(auth)
                if principal.tenant != tenant:
                    await self._deny(peer, auth, tenant, namespace, "tenant header and token name different tenants")
                    raise Forbidden(f"{cfg.tenant_header} and the bearer token name different tenants")
            else:
                principal = Principal(
                    subject=f"peer:{peer}", issuer=TRUSTED_ISSUER, tenant=TenantId(tenant), roles=frozenset(),
                    client_id=None, token_id=None, expires_at=time.time() + cfg.capability_ttl,
                )
            held = cfg.trusted_namespaces
        else:
            principal, token = await self.principal(auth)
            held = frozenset(r[len(NAMESPACE_GRANT):] for r in principal.roles if r.startswith(NAMESPACE_GRANT))
        if namespace != cfg.namespace and (not is_name(namespace) or (held is not None and namespace not in held)):
            await self._deny(peer, auth, principal.tenant, namespace, "namespace not granted")
            raise Forbidden("the namespace is not one this caller may use")
        return Identity(principal, token, namespace, peer)

    async def warm_up(self, peer: Peer, headers: Mapping[bytes, bytes], method: str, path: str) -> WarmUp | None:
        """A request that names a warm-up (``WARM_HEADER`` or ``WARM_CAPABILITY_HEADER``): admitted
        from a trusted peer (``trusted_peers``) or with a bearer token of ``kv.operator``, else
        Forbidden, audited; BadRequest unless it is a POST to ``WARM_PATH`` with a prefix id and a
        scope's capability. None for any other request (the member path)."""
        prefix = headers.get(WARM_HEADER.encode())
        held = headers.get(WARM_CAPABILITY_HEADER.encode())
        if prefix is None and held is None:
            return None
        auth = headers.get(b"authorization", b"").decode("latin-1") or None
        cap = (held or b"").decode("latin-1")
        try:
            claimed = read_unverified(cap) if 0 < len(cap) <= MAX_CAPABILITY_CHARS else None
        except CapabilityDenied:
            claimed = None
        owner = claimed.tenant if claimed is not None else ""
        if not self.config.trusted_peers.trusts(peer) and not await self._operator(auth):
            forwarded = peer.kind == "forwarded"
            why = "warm-up beside X-Forwarded-For on TCP" if forwarded else "warm-up from an untrusted peer"
            await self._deny(peer, auth, owner, SCOPE_NAMESPACE, why)
            raise Forbidden("a warm-up is accepted only from a trusted peer or with an operator's token")
        if method != "POST" or path != WARM_PATH:
            raise BadRequest(f"a warm-up is a POST to {WARM_PATH}")
        name = (prefix or b"").decode("latin-1")
        if not _PREFIX_ID.fullmatch(name):
            raise BadRequest(f"{WARM_HEADER} names the published prefix (its id, 24 hex digits)")
        if claimed is None or not is_scope_owner(claimed.tenant) or claimed.namespace != SCOPE_NAMESPACE:
            raise BadRequest(f"{WARM_CAPABILITY_HEADER} is the publish answer's capability (a scope's)")
        return WarmUp(name, cap, peer)

    async def _operator(self, auth: str | None) -> bool:
        """Whether ``auth`` is a verified bearer token of an operator (``kv.operator``)."""
        if auth is None:
            return False
        try:
            principal, _ = await self.principal(auth)
        except Unauthorized:
            return False
        return KV_OPERATOR in principal.roles

    @staticmethod
    def rewrite_warm_up(warm: WarmUp, body: bytes) -> bytes:
        """The warm-up's body: the client's cache_salt and kv_transfer_params replaced by a fresh
        salt (no prefix-cache block of a warm-up is ever shared, and it computes every token) and
        {kvgate_capability, kvgate_warm_up}."""
        doc = _json_object(body)
        doc.pop("kv_transfer_params", None)
        doc["cache_salt"] = "warm-up:" + secrets.token_hex(16)
        doc["kv_transfer_params"] = {CAPABILITY_PARAM: warm.capability, WARM_PARAM: warm.prefix_id}
        return json.dumps(doc).encode()

    async def _deny(self, peer: Peer, auth: str | None, tenant: str, namespace: str, reason: str) -> None:
        """Log and audit (``authz.denied``, durably) a refused identity header. The actor is the
        peer, and the token's subject where one came and verifies."""
        caller: Principal | None = None
        if auth is not None:
            try:
                caller, _ = await self.principal(auth)
            except Unauthorized:
                pass
        log.warning("refused a request from %s: %s", peer, reason)
        if self.audit is None:
            return
        event = AuditEvent(
            Actions.AUTHZ_DENIED, outcome="denied",
            actor=Actor(
                subject=caller.subject if caller else None, issuer=caller.issuer if caller else None,
                tenant=caller.tenant if caller else None, client_id=caller.client_id if caller else None,
                token_id=caller.token_id if caller else None, source=str(peer)[:200],
            ),
            target=Target(tenant=tenant if is_name(tenant) else None, namespace=namespace if is_name(namespace) else None),
            details={"reason": reason, "claimed_tenant": escape(tenant, 80), "claimed_namespace": escape(namespace, 80)},
        )
        try:
            await record_durably(self.audit, event)
        except Exception as exc:  # the refusal stands; the audit log says why it has no row
            log.error("the refusal from %s could not be audited (%s)", peer, type(exc).__name__)

    async def principal(self, authorization: str | None) -> tuple[Principal, str]:
        if not authorization or authorization[:7].lower() != "bearer ":
            raise Unauthorized("a bearer token is required")
        token = authorization[7:].strip()
        try:
            return await self.verifier.verify(token), token
        except AuthenticationFailed:
            raise Unauthorized("the bearer token was not accepted") from None

    async def capability(self, principal: Principal, token: str | None, namespace: str | None = None) -> tuple[str, int, str]:
        """A capability for the principal's tenant and ``namespace`` (default: the configured
        one), with the namespace's current epoch and the revision of the published prefixes the
        tenant reads. ``token`` None: the service token mints, naming the tenant."""
        namespace = namespace or self.config.namespace
        if self._mint is not None:
            try:
                cap, epoch = await self._mint(principal, namespace)
                return cap, epoch, ""
            except (GatewayError, ValueError):  # refused: unknown or disabled tenant, bad name
                raise Forbidden("no capability for this tenant") from None
            except Exception as exc:
                log.warning("capability mint failed (%s): answering 503", type(exc).__name__)
                raise Unavailable("kvgate cannot mint capabilities right now; retry shortly") from None
        body: dict[str, Any] = {"namespace": namespace, "ops": ["lookup", "get", "put"], "ttl": self.config.capability_ttl}
        if token is None:
            body["tenant"] = principal.tenant
        try:
            r = await self._http.post(
                self.config.gateway_url.rstrip("/") + "/v1/capabilities",  # type: ignore[union-attr]  # set whenever the guard mints (checked in config)
                json=body, headers={"Authorization": f"Bearer {token or self.config.service_token}"},
            )
        except httpx.HTTPError as exc:
            log.warning("the kvgate server at %s could not be reached (%s): answering 503",
                        self.config.gateway_url, type(exc).__name__)
            raise Unavailable("the kvgate server could not be reached; retry shortly") from None
        if r.status_code >= 500 or r.status_code == 429:
            raise Unavailable("the kvgate server is unavailable; retry shortly")
        if r.status_code != 201:
            raise Forbidden("no capability for this tenant")
        doc = r.json()
        epoch = doc.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise Forbidden("the kvgate server did not report the namespace epoch")
        shared = doc.get("shared", "")  # a server without published prefixes does not say
        if not isinstance(shared, str) or len(shared) > 64:
            raise Forbidden("the kvgate server reported a malformed published-prefix revision")
        return str(doc["capability"]), epoch, shared

    async def admit(self, authorization: str | None, body: bytes) -> tuple[Principal, bytes]:
        """Authenticate, mint, rewrite: the body to forward (or a TenantRequestError)."""
        principal, token = await self.principal(authorization)
        return principal, await self.rewrite(principal, token, body)

    async def rewrite(self, principal: Principal, token: str | None, body: bytes, namespace: str | None = None) -> bytes:
        """Mint and rewrite for an already verified principal (the middleware verifies the token
        before it reads the body)."""
        namespace = namespace or self.config.namespace
        doc = _json_object(body)
        cap, epoch, shared = await self.capability(principal, token, namespace)
        doc.pop("cache_salt", None)
        client = doc.pop("kv_transfer_params", None)
        doc["cache_salt"] = cache_salt(self.config.salt_secret, principal.tenant, namespace, epoch, shared)
        params: dict[str, Any] = {CAPABILITY_PARAM: cap, EPOCH_PARAM: epoch}
        if isinstance(client, dict) and RECEIPT_PARAM in client:
            # a prefill engine's receipt, passed on by the P/D proxy: it grants nothing (the
            # connector loads under this request's own capability and checks the receipt's epoch)
            params[RECEIPT_PARAM] = client[RECEIPT_PARAM]
        doc["kv_transfer_params"] = params
        return json.dumps(doc).encode()


def problem(status: int, title: str, detail: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail}).encode()
    headers = [(b"content-type", b"application/problem+json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="kvgate"'))
    if status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    return headers, body


def _json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or BadRequest."""
    try:
        doc: Any = json.loads(body or b"{}")
    except (ValueError, UnicodeError):
        raise BadRequest("the request body must be a JSON object") from None
    if not isinstance(doc, dict):
        raise BadRequest("the request body must be a JSON object")
    return doc
