"""The tenant checks shared by the ASGI middleware and the reverse proxy.

``TenantGuard.admit(authorization, body)``, for one inference request, returns the new body:
    1. verify the bearer token (OIDC, ``tenancy.oidc.OidcVerifier``) -> the tenant; else 401
    2. mint a capability for (tenant, namespace, lookup/get/put): through the kvgate server's
       ``POST /v1/capabilities`` with the caller's own token (so the server's role checks and
       audit apply), or in process with ``mint=`` (a coroutine); refused -> 403
    3. strip any client-supplied ``cache_salt`` and ``kv_transfer_params`` from the JSON body and
       set ``cache_salt`` (``salt.cache_salt``) and ``kv_transfer_params`` {kvgate_capability}

The salt's epoch is the namespace's own, as the kvgate server reports it with each minted
capability (every request mints one, so it is never stale): a secure clear bumps it, and the next
request's salt shares no prefix-cache block with any block vLLM cached before the clear; the
same answer's ``shared`` revision does that for a published prefix revoked or a scope left. ``GuardConfig.from_env()`` reads
``KVGATE_VLLM_*`` through ``config.MiddlewareSettings`` (see docs/vllm.md)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from gateway.errors import GatewayError
from gateway.vllm.config import MiddlewareSettings
from gateway.vllm.errors import (
    BadRequest,
    ConnectorConfigError,
    Forbidden,
    Unauthorized,
    Unavailable,
)
from gateway.vllm.salt import cache_salt
from tenancy.errors import AuthenticationFailed
from tenancy.oidc import IssuerConfig, OidcVerifier
from tenancy.types import Principal

__all__ = ["CAPABILITY_PARAM", "GUARDED_PATHS", "GuardConfig", "TenantGuard"]

log = logging.getLogger("kvgate.vllm")
RETRY_AFTER_S = 5  # Retry-After of a 503 (the gateway is down or cannot mint now)

CAPABILITY_PARAM = "kvgate_capability"
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
        return cls(
            issuers=[cfg], salt_secret=s.salt_secret_bytes(), gateway_url=s.gateway_url, namespace=s.namespace,
            capability_ttl=s.capability_ttl,
        )


class TenantGuard:
    def __init__(self, config: GuardConfig, *, mint: MintFn | None = None, http: httpx.AsyncClient | None = None) -> None:
        if mint is None and not config.gateway_url:
            raise ConnectorConfigError("give a kvgate server URL (KVGATE_VLLM_GATEWAY_URL) or an in-process mint")
        self.config = config
        self._mint = mint
        self._http = http or httpx.AsyncClient(timeout=10.0, follow_redirects=False)
        self.verifier = OidcVerifier(config.issuers, http=self._http)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def principal(self, authorization: str | None) -> tuple[Principal, str]:
        if not authorization or authorization[:7].lower() != "bearer ":
            raise Unauthorized("a bearer token is required")
        token = authorization[7:].strip()
        try:
            return await self.verifier.verify(token), token
        except AuthenticationFailed:
            raise Unauthorized("the bearer token was not accepted") from None

    async def capability(self, principal: Principal, token: str) -> tuple[str, int, str]:
        """A capability for the principal's tenant and the configured namespace, with the
        namespace's current epoch and the revision of the published prefixes the tenant reads."""
        if self._mint is not None:
            try:
                cap, epoch = await self._mint(principal, self.config.namespace)
                return cap, epoch, ""
            except (GatewayError, ValueError):  # refused: unknown or disabled tenant, bad name
                raise Forbidden("no capability for this tenant") from None
            except Exception as exc:
                log.warning("capability mint failed (%s): answering 503", type(exc).__name__)
                raise Unavailable("kvgate cannot mint capabilities right now; retry shortly") from None
        body = {"namespace": self.config.namespace, "ops": ["lookup", "get", "put"], "ttl": self.config.capability_ttl}
        try:
            r = await self._http.post(
                self.config.gateway_url.rstrip("/") + "/v1/capabilities",  # type: ignore[union-attr]  # set whenever the guard mints (checked in config)
                json=body, headers={"Authorization": f"Bearer {token}"},
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

    async def rewrite(self, principal: Principal, token: str, body: bytes) -> bytes:
        """Mint and rewrite for an already verified principal (the middleware verifies the token
        before it reads the body)."""
        try:
            doc: Any = json.loads(body or b"{}")
        except (ValueError, UnicodeError):
            raise BadRequest("the request body must be a JSON object") from None
        if not isinstance(doc, dict):
            raise BadRequest("the request body must be a JSON object")
        cap, epoch, shared = await self.capability(principal, token)
        doc.pop("cache_salt", None)
        doc.pop("kv_transfer_params", None)
        doc["cache_salt"] = cache_salt(self.config.salt_secret, principal.tenant, self.config.namespace, epoch, shared)
        doc["kv_transfer_params"] = {CAPABILITY_PARAM: cap}
        return json.dumps(doc).encode()


def problem(status: int, title: str, detail: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail}).encode()
    headers = [(b"content-type", b"application/problem+json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="kvgate"'))
    if status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    return headers, body
