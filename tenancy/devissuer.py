"""A development OIDC issuer, so the embedded default needs no external identity provider.

``DevIssuer(state_dir, issuer_url=...)`` keeps an Ed25519 signing key in
``state_dir/dev-issuer-key.pem`` (created on first use with mode 0600 inside a 0700 directory;
an existing file readable by group or others, or owned by someone else, is refused), mints RFC 9068
access tokens (``typ: at+jwt``, ``alg: EdDSA``, ``kid`` = the key's RFC 7638 thumbprint), and
returns the discovery document and JWKS that the gateway server serves in development mode at
``{issuer_url}/.well-known/openid-configuration`` and ``{issuer_url}/.well-known/jwks.json``.
``issuer_config()`` gives the matching ``IssuerConfig`` for ``OidcVerifier``, so the dev tokens
go through exactly the verification path production tokens do.

It refuses to exist in production: ``DevIssuer(..., production=True)`` raises ``DevIssuerError``.
``kvgate token mint --tenant T --roles R...`` (in ``gateway.cli.main``) is a thin wrapper over
``DevIssuer.mint``.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from joserfc import jwt
from joserfc.jwk import OKPKey

from tenancy.errors import DevIssuerError
from tenancy.oidc import IssuerConfig, _AllowlistRegistry

__all__ = ["DEV_KEY_FILENAME", "DevIssuer"]

DEV_KEY_FILENAME = "dev-issuer-key.pem"
_ALG = "EdDSA"
_TYP = "at+jwt"


class DevIssuer:
    """The local development issuer. ``clock`` returns seconds since the epoch."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        issuer_url: str = "http://127.0.0.1:8000/dev-issuer",
        audience: str = "kvgate",
        production: bool = False,
        tenant_claim: str = "tenant",
        roles_claim: str = "roles",
        default_ttl: int = 3600,
        max_ttl: int = 24 * 3600,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if production:
            raise DevIssuerError(
                "the development issuer is disabled in production; configure a real OIDC issuer"
            )
        if not 0 < default_ttl <= max_ttl:
            raise DevIssuerError("need 0 < default_ttl <= max_ttl")
        self.state_dir = Path(state_dir)
        self.issuer_url = issuer_url.rstrip("/")
        self.audience = audience
        self.tenant_claim = tenant_claim
        self.roles_claim = roles_claim
        self.default_ttl = default_ttl
        self.max_ttl = max_ttl
        self._clock = clock
        self._key: OKPKey | None = None
        # Validate the URL the same way the verifier will (https, or http on loopback).
        self.issuer_config()

    @property
    def key_path(self) -> Path:
        return self.state_dir / DEV_KEY_FILENAME

    @property
    def kid(self) -> str:
        return self._signing_key().thumbprint()

    def issuer_config(self, **overrides: Any) -> IssuerConfig:
        """The ``IssuerConfig`` that trusts this issuer (``typ`` must be ``at+jwt``)."""
        options: dict[str, Any] = {
            "issuer": self.issuer_url,
            "audience": self.audience,
            "tenant_claim": self.tenant_claim,
            "roles_claim": self.roles_claim,
            "algorithms": frozenset({_ALG}),
            "required_typ": _TYP,
        }
        options.update(overrides)
        return IssuerConfig(**options)

    def discovery_document(self) -> dict[str, Any]:
        return {
            "issuer": self.issuer_url,
            "jwks_uri": self.issuer_url + "/.well-known/jwks.json",
            "token_endpoint_auth_methods_supported": ["none"],
            "id_token_signing_alg_values_supported": [_ALG],
            "response_types_supported": ["token"],
            "subject_types_supported": ["public"],
            "claims_supported": [
                "sub",
                "aud",
                "exp",
                "iat",
                "jti",
                "client_id",
                self.tenant_claim,
                self.roles_claim,
            ],
        }

    def jwks(self) -> dict[str, Any]:
        key = self._signing_key()
        public = dict(key.as_dict(private=False))
        public.update({"kid": key.thumbprint(), "use": "sig", "alg": _ALG})
        return {"keys": [public]}

    def mint(
        self,
        tenant: str,
        roles: Iterable[str],
        *,
        subject: str | None = None,
        ttl: int | None = None,
        client_id: str = "kvgate-dev",
    ) -> str:
        """A signed access token for ``tenant`` with ``roles``, valid for ``ttl`` seconds."""
        role_list = sorted(set(roles))
        if not tenant or not tenant.isprintable() or len(tenant) > 128:
            raise DevIssuerError("tenant must be a non-empty printable string of at most 128")
        if any(not r or " " in r or not r.isprintable() for r in role_list):
            raise DevIssuerError("roles must be non-empty printable strings without spaces")
        ttl = self.default_ttl if ttl is None else ttl
        if not 0 < ttl <= self.max_ttl:
            raise DevIssuerError(f"ttl must be between 1 and {self.max_ttl} seconds")
        key = self._signing_key()
        now = int(self._clock())
        claims = {
            "iss": self.issuer_url,
            "sub": subject or f"dev:{tenant}",
            "aud": self.audience,
            "client_id": client_id,
            "iat": now,
            "nbf": now,
            "exp": now + ttl,
            "jti": secrets.token_urlsafe(16),
            self.tenant_claim: tenant,
            self.roles_claim: role_list,
        }
        header = {"alg": _ALG, "typ": _TYP, "kid": key.thumbprint()}
        return jwt.encode(header, claims, key, registry=_AllowlistRegistry(algorithms=[_ALG]))

    def _signing_key(self) -> OKPKey:
        if self._key is None:
            pem = self._load_pem() if self.key_path.exists() else self._create_pem()
            try:
                private = serialization.load_pem_private_key(pem, password=None)
            except (ValueError, TypeError) as exc:
                raise DevIssuerError(f"{self.key_path} is not a PEM private key") from exc
            if not isinstance(private, Ed25519PrivateKey):
                raise DevIssuerError(f"{self.key_path} is not an Ed25519 key")
            self._key = OKPKey.import_key(pem)
        return self._key

    def _load_pem(self) -> bytes:
        path = self.key_path
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise DevIssuerError(f"{path} is not a regular file")
        if st.st_mode & 0o077:
            raise DevIssuerError(f"{path} is readable by others (mode {st.st_mode & 0o777:o})")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise DevIssuerError(f"{path} is owned by another user")
        return path.read_bytes()

    def _create_pem(self) -> bytes:
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        tmp = self.state_dir / f".{DEV_KEY_FILENAME}.{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, self.key_path)  # atomic, and never replaces a key another process made
            except FileExistsError:
                return self._load_pem()
        finally:
            tmp.unlink(missing_ok=True)
        return pem
