"""NamespaceResolver.chunk_keys: the storage-key cache gives exactly what the HMAC gives, per
namespace epoch, and never an entry of another namespace or an earlier epoch."""

from __future__ import annotations

import hashlib
import hmac
import os

import gateway.services.namespaces as namespaces
from gateway.services.namespaces import NamespaceResolver
from tenancy.namespaces import NamespaceDeriver


def _direct(ns, hashes):
    return [hmac.new(ns.index_key, h, hashlib.sha256).hexdigest() for h in hashes]


def test_cached_storage_keys_are_the_hmac_of_their_own_namespace_and_epoch(monkeypatch) -> None:
    deriver = NamespaceDeriver(os.urandom(32))
    resolver = NamespaceResolver(registry=None, kek=None, deriver=deriver)  # chunk_keys needs neither
    a0 = deriver.derive("acme", "default", 0, os.urandom(32))
    a1 = deriver.derive("acme", "default", 1, os.urandom(32))  # after a secure clear
    b0 = deriver.derive("globex", "default", 0, os.urandom(32))
    hashes = [os.urandom(32) for _ in range(64)]
    for _ in range(2):  # the second round is served from the cache
        for ns in (a0, a1, b0):
            keys = resolver.chunk_keys(ns, hashes)
            assert [k.digest for k in keys] == _direct(ns, hashes)
            assert {(k.owner, k.group) for k in keys} == {(ns.owner, ns.group)}
    assert len({k.digest for ns in (a0, a1, b0) for k in resolver.chunk_keys(ns, hashes[:1])}) == 3
    # a mix of cached and new hashes keeps the request's order
    more = [os.urandom(32) for _ in range(8)]
    mixed = more[:4] + hashes[:8] + more[4:]
    assert [k.digest for k in resolver.chunk_keys(a0, mixed)] == _direct(a0, mixed)
    # bounded: a full cache is emptied, and answers stay right
    monkeypatch.setattr(namespaces, "_KEY_CACHE_ENTRIES", 100)
    for _ in range(5):
        fresh = [os.urandom(32) for _ in range(40)]
        assert [k.digest for k in resolver.chunk_keys(a0, fresh)] == _direct(a0, fresh)
        assert len(resolver._chunk_keys) <= 100
    resolver.forget("acme")
    assert not resolver._chunk_keys
