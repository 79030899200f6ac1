"""A real OIDC issuer over HTTP on 127.0.0.1 for tests, with keys that rotate at runtime.

``LocalIssuer`` serves ``/.well-known/openid-configuration`` and ``/jwks.json`` from a
``ThreadingHTTPServer`` in a daemon thread (started by ``start()`` / the context manager, never at
import), counts every request per path, and signs tokens with its current keys through joserfc.
``RecordingServer`` answers anything with 200 and records every request: point ``jku`` / ``x5u``
headers at it to prove the verifier never fetches them.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from joserfc import jwt
from joserfc.jwk import ECKey, OKPKey, RSAKey
from joserfc.jws import JWSRegistry

__all__ = ["LocalIssuer", "RecordingServer"]

_ANY_ALG = JWSRegistry(algorithms=list(JWSRegistry.algorithms))


class _Server:
    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with owner._lock:
                    owner.hits[self.path] += 1
                status, body = owner.respond(self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None

    def respond(self, path: str) -> tuple[int, Any]:
        return 200, {}

    def start(self) -> _Server:
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(5)
        self._httpd.server_close()

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def total_hits(self) -> int:
        with self._lock:
            return sum(self.hits.values())


class RecordingServer(_Server):
    """Answers every GET with an empty JWKS and records that it was contacted."""

    def respond(self, path: str) -> tuple[int, Any]:
        return 200, {"keys": []}


class LocalIssuer(_Server):
    """An OIDC issuer whose JWKS can be changed while it runs."""

    DISCOVERY = "/.well-known/openid-configuration"
    JWKS = "/jwks.json"

    def __init__(self) -> None:
        super().__init__()
        self.issuer = self.url
        self.keys: dict[str, Any] = {}
        self.published: set[str] = set()
        self.discovery_override: dict[str, Any] | None = None
        self.extra_jwks: list[dict[str, Any]] = []

    def respond(self, path: str) -> tuple[int, Any]:
        if path == self.DISCOVERY:
            doc = {"issuer": self.issuer, "jwks_uri": self.url + self.JWKS}
            return 200, self.discovery_override or doc
        if path == self.JWKS:
            with self._lock:
                keys = [self.public_jwk(kid) for kid in sorted(self.published)]
                keys += self.extra_jwks
            return 200, {"keys": keys}
        return 404, {}

    def public_jwk(self, kid: str) -> dict[str, Any]:
        data = dict(self.keys[kid].as_dict(private=False))
        data.update({"kid": kid, "use": "sig"})
        return data

    def add_key(self, kid: str, kind: str = "RSA", *, publish: bool = True) -> Any:
        key = {
            "RSA": lambda: RSAKey.generate_key(2048),
            "EC": lambda: ECKey.generate_key("P-256"),
            "OKP": lambda: OKPKey.generate_key("Ed25519"),
        }[kind]()
        with self._lock:
            self.keys[kid] = key
            if publish:
                self.published.add(kid)
        return key

    def remove_key(self, kid: str) -> None:
        with self._lock:
            self.published.discard(kid)

    def jwks_hits(self) -> int:
        with self._lock:
            return self.hits[self.JWKS]

    def claims(self, **over: Any) -> dict[str, Any]:
        now = int(time.time())
        base = {
            "iss": self.issuer,
            "sub": "user-1",
            "aud": "kvgate",
            "iat": now,
            "nbf": now,
            "exp": now + 300,
            "jti": "j1",
            "tenant": "acme",
            "roles": ["kv.worker"],
            "client_id": "app",
        }
        base.update(over)
        return {k: v for k, v in base.items() if v is not None}

    def sign(
        self,
        kid: str,
        claims: dict[str, Any] | None = None,
        *,
        alg: str | None = None,
        typ: str | None = "at+jwt",
        key: Any = None,
        **header: Any,
    ) -> str:
        """A token with header ``kid``, signed by that key or by ``key`` (to forge one)."""
        key = key or self.keys[kid]
        alg = alg or {"RSA": "RS256", "EC": "ES256", "OKP": "EdDSA"}[key.key_type]
        hdr: dict[str, Any] = {"alg": alg, "kid": kid, **header}
        if typ is not None:
            hdr["typ"] = typ
        with warnings.catch_warnings():  # joserfc flags EdDSA as deprecated by RFC 9864
            warnings.simplefilter("ignore")
            return jwt.encode(hdr, claims or self.claims(), key, registry=_ANY_ALG)
