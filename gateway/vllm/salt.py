"""The tenant's ``cache_salt``: vLLM's own prefix cache, isolated per tenant namespace.

vLLM mixes ``cache_salt`` into the hash of a request's first block, so requests with different
salts share no prefix-cache blocks. The salt is an HMAC-SHA256, under a secret the operator
configures, over length-prefixed fields (so no two field lists encode alike):

    cache_salt = base64url(HMAC(secret, lp("kvgate/cache-salt/v1", tenant, namespace, epoch[, shared])))

A client cannot compute another tenant's salt without the secret, and whatever salt a client
sends is replaced. Bumping ``epoch`` (say, after a secure clear) orphans every cached block, and
so does a new ``shared`` (what the tenant reads of published prefixes, changed by a revoke).
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from tenancy.namespaces import lp

__all__ = ["MIN_SECRET_BYTES", "cache_salt"]

MIN_SECRET_BYTES = 32


def cache_salt(secret: bytes, tenant: str, namespace: str, epoch: int = 0, shared: str = "") -> str:
    """``shared``: the revision of the published prefixes the tenant reads (the server's mint
    answer); empty where it reads none, which gives the salt it has without published prefixes."""
    if not isinstance(secret, bytes | bytearray) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the cache-salt secret must be at least {MIN_SECRET_BYTES} bytes")
    if not tenant or not namespace or epoch < 0:
        raise ValueError("tenant and namespace must be non-empty and epoch non-negative")
    fields = (tenant, namespace, epoch, shared) if shared else (tenant, namespace, epoch)
    mac = hmac.new(bytes(secret), lp("kvgate/cache-salt/v1", *fields), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")
