"""One remote worker of the scale run's server figures, in a process of its own.

It reads its job (JSON) on stdin, mints its own capability, prints ``ready``, waits for ``go``
and then, for ``duration_s``, repeats a lookup of a 128-chunk prefix (``POST /v1/lookup``) and a
load of a shorter prefix (``POST /v1/chunks/fetch`` with ``keys``: each envelope after the key
that opens it, received into a buffer of its own, as ``gateway.remote.client`` loads). It prints
one JSON line: counts, errors and every latency. It speaks HTTP/1.1 through the standard
library's client, one kept-alive connection: ``gateway.remote.wire`` would load torch with the
connector's package, too heavy for 64 processes on one host. The envelopes are not opened here
(the server's work is what is measured; the worker's decryption is the data plane's figure).
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from typing import Any
from urllib.parse import urlparse

from gateway.protocol import frames

__all__ = ["Conn", "main"]


class Conn:
    """One kept-alive HTTP/1.1 connection to a kvgate server, with a worker's bearer token."""

    def __init__(self, base_url: str, bearer: str, timeout_s: float = 60.0) -> None:
        u = urlparse(base_url)
        self._http = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout_s)
        self._bearer = bearer
        self.capability = ""

    def close(self) -> None:
        self._http.close()

    def _headers(self, capability: bool = True) -> dict[str, str]:
        out = {"Authorization": f"Bearer {self._bearer}", "Content-Type": "application/json"}
        if capability:
            out["X-KV-Capability"] = self.capability
        return out

    def post(self, path: str, body: dict[str, Any], capability: bool = True) -> http.client.HTTPResponse:
        self._http.request("POST", path, body=json.dumps(body).encode(), headers=self._headers(capability))
        return self._http.getresponse()

    def mint(self, namespace: str = "default", ops: tuple[str, ...] = ("lookup", "get"), ttl: int = 600) -> None:
        """A fresh capability for ``ops`` (``POST /v1/capabilities``), as a remote worker mints its own."""
        r = self.post("/v1/capabilities", {"namespace": namespace, "ops": list(ops), "ttl": ttl}, capability=False)
        body = r.read()
        if r.status != 201:
            raise RuntimeError(f"minting a capability: {r.status} {body[:300]!r}")
        self.capability = json.loads(body)["capability"]

    def put(self, hashes: list[str], envelope: bytes) -> None:
        """Store ``envelope`` under every chained hash of ``hashes``: one framed ``PUT /v1/chunks``."""
        index = frames.encode_index([(bytes.fromhex(h), len(envelope)) for h in hashes])
        body = b"".join([index, envelope * len(hashes)])
        headers = {**self._headers(), "Content-Type": "application/octet-stream"}
        self._http.request("PUT", "/v1/chunks", body=body, headers=headers)
        r = self._http.getresponse()
        answer = r.read()
        if r.status != 204:
            raise RuntimeError(f"put: {r.status} {answer[:300]!r}")

    def lookup(self, hashes: list[str], chunk_tokens: int = 256) -> int:
        """Leading chunks of ``hashes`` the server holds."""
        r = self.post("/v1/lookup", {"hashes": hashes, "chunk_tokens": chunk_tokens})
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"lookup: {r.status} {body[:300]!r}")
        hit: int = json.loads(body)["hit_chunks"]
        return hit

    def load(self, hashes: list[str]) -> int:
        """Fetch the stored prefix of ``hashes`` with each envelope's key; returns the envelopes
        received (each into a buffer of its own)."""
        r = self.post("/v1/chunks/fetch", {"hashes": hashes, "keys": True})
        if r.status != 200:
            raise RuntimeError(f"fetch: {r.status} {r.read()[:300]!r}")
        _ct, t_len, n_len = frames.parse_keyed_head(r.read(frames.KEYED_HEAD))
        r.read(t_len + n_len)
        got = 0
        for _ in hashes:
            head = r.read(frames.KEYED_ITEM_HEAD)
            if len(head) < frames.KEYED_ITEM_HEAD:
                break  # the response ended: the rest is a miss
            item = frames.parse_keyed_item_head(head)
            if item.status != frames.OK:
                break
            buf = bytearray(item.length)
            view, n = memoryview(buf), 0
            while n < item.length:
                k = r.readinto(view[n:])
                if not k:
                    raise RuntimeError("fetch: the stream ended inside an envelope")
                n += k
            got += 1
        r.read()  # to the end, so the connection can be reused
        return got


def run(job: dict[str, Any]) -> dict[str, Any]:
    conn = Conn(job["url"], job["bearer"])
    conn.mint()
    lookup_hashes: list[str] = job["lookup"]
    load_hashes: list[str] = job["load"]
    # a capability's key budget bounds the envelope keys it may be issued: a fresh one in time
    loads_per_capability = max(1, job.get("keys_per_capability", 1 << 16) // max(1, len(load_hashes)) - 1)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return {"error": "no go"}
    lookup_s: list[float] = []
    load_s: list[float] = []
    errors: dict[str, int] = {}
    loads_on_cap = 0
    start = time.perf_counter()
    end = start + float(job["duration_s"])
    while time.perf_counter() < end:
        try:
            t0 = time.perf_counter()
            hit = conn.lookup(lookup_hashes)
            t1 = time.perf_counter()
            lookup_s.append(t1 - t0)
            if hit != len(lookup_hashes):
                errors["lookup_short"] = errors.get("lookup_short", 0) + 1
            if loads_on_cap >= loads_per_capability:
                conn.mint()
                loads_on_cap = 0
            t1 = time.perf_counter()
            got = conn.load(load_hashes)
            load_s.append(time.perf_counter() - t1)
            loads_on_cap += 1
            if got != len(load_hashes):
                errors["load_short"] = errors.get("load_short", 0) + 1
        except (OSError, RuntimeError, http.client.HTTPException) as exc:
            kind = type(exc).__name__
            errors[kind] = errors.get(kind, 0) + 1
            conn.close()
            conn = Conn(job["url"], job["bearer"])
            conn.mint()
            loads_on_cap = 0
    window = time.perf_counter() - start
    conn.close()
    return {"window_s": window, "lookup_s": lookup_s, "load_s": load_s, "errors": errors}


def main() -> None:
    job = json.loads(sys.stdin.readline())
    print(json.dumps(run(job)), flush=True)


if __name__ == "__main__":
    main()
