"""Wrap contexts (crypto.contexts): the bytes every KEK binds, pinned; typed and raw contexts
interchangeable (keys wrapped before the type existed still unwrap); a context swapped by an
attacker refused beside its positive control."""

from __future__ import annotations

from pathlib import Path

import pytest

from crypto.contexts import (
    DEK,
    NS_SALT,
    SECRET,
    WrapContext,
    context_bytes,
    dek_context,
    lp,
    ns_salt_context,
    secret_context,
)
from crypto.errors import InvalidParameter, KekError
from crypto.kek import LocalFileKek
from crypto.kek_kms import encryption_context

GOLDEN = {
    "dek": "0000000d6b76676174652f64656b2f76310000000461636d65000000080000000000000007",
    "ns-salt": "000000116b76676174652f6e732d73616c742f76310000000461636d650000000463686174000000080000000000000003",
    "secret": "000000106b76676174652f7365637265742f763100000005696e646578",
}


def _typed() -> dict[str, WrapContext]:
    return {
        "dek": dek_context("acme", 7),
        "ns-salt": ns_salt_context("acme", "chat", 3),
        "secret": secret_context("index"),
    }


def test_contexts_encode_to_the_pinned_length_prefixed_bytes() -> None:
    for name, ctx in _typed().items():
        assert ctx.encode().hex() == GOLDEN[name] and bytes(ctx) == ctx.encode() == context_bytes(ctx)
    assert dek_context("acme", 7).encode() == lp("kvgate/dek/v1", "acme", 7)
    assert ns_salt_context("a", "b", 0).encode() == lp("kvgate/ns-salt/v1", "a", "b", 0)
    assert secret_context("s").encode() == lp("kvgate/secret/v1", "s")
    assert lp("ab", "c") != lp("a", "bc")


def test_decode_gives_back_the_typed_context() -> None:
    for ctx in _typed().values():
        assert WrapContext.decode(ctx.encode()) == ctx
        assert WrapContext.decode(bytearray(ctx.encode())) == ctx
    assert dek_context("acme", 7).fields() == {"tenant": "acme", "key-version": "7"}
    assert (DEK.label, NS_SALT.label, SECRET.label) == ("kvgate/dek/v1", "kvgate/ns-salt/v1", "kvgate/secret/v1")


@pytest.mark.parametrize(
    "raw",
    [
        b"", b"kvgate/kek/health", b"\x00\x00", lp("kvgate/other/v1", "x"), lp("kvgate/dek/v1", "acme"),
        lp("kvgate/dek/v1", "acme", 7, 8), lp("kvgate/dek/v1", "acme", b"\x07"), lp("kvgate/dek/v1", b"\xff", 7),
        lp(b"\xff\xfe", "x"), lp("kvgate/dek/v1", "acme", 7)[:-1],
    ],
)
def test_decode_refuses_anything_else(raw: bytes) -> None:
    assert WrapContext.decode(raw) is None


@pytest.mark.parametrize(
    "build",
    [
        lambda: dek_context("acme", True), lambda: dek_context("acme", -1), lambda: dek_context("acme", 1 << 64),
        lambda: dek_context(b"acme", 1), lambda: ns_salt_context("a", "b\udc80", 0),
        lambda: WrapContext(DEK, ("acme",)), lambda: WrapContext(SECRET, ("a", "b")),
    ],
)
def test_bad_fields_are_typed_errors(build: object) -> None:
    with pytest.raises(InvalidParameter):
        build()  # type: ignore[operator]  # the parametrized builders are callables


def test_context_bytes_refuses_other_types() -> None:
    with pytest.raises(TypeError):
        context_bytes("kvgate/dek/v1")  # type: ignore[arg-type]  # the point of the test


def test_kms_encryption_context_is_the_same_for_typed_and_raw_contexts() -> None:
    for ctx in _typed().values():
        assert encryption_context(ctx) == encryption_context(ctx.encode()) == encryption_context(bytearray(ctx.encode()))
    assert encryption_context(ns_salt_context("acme", "chat", 3)) == {
        "kvgate:ctx": "AAAAEWt2Z2F0ZS9ucy1zYWx0L3YxAAAABGFjbWUAAAAEY2hhdAAAAAgAAAAAAAAAAw==",
        "kvgate:purpose": "kvgate/ns-salt/v1",
        "kvgate:tenant": "acme",
        "kvgate:namespace": "chat",
        "kvgate:epoch": "3",
    }
    assert encryption_context(b"kvgate/kek/health") == {"kvgate:ctx": "a3ZnYXRlL2tlay9oZWFsdGg="}


def test_keys_wrapped_under_raw_bytes_unwrap_under_the_typed_context(tmp_path: Path) -> None:
    kek = LocalFileKek(tmp_path / "kek.key")
    for ctx in _typed().values():
        old = kek.wrap(b"k" * 32, lp(ctx.purpose.label, *ctx.values))  # as tenancy/gateway wrapped before
        assert kek.unwrap(old, ctx) == b"k" * 32
        assert kek.unwrap(kek.wrap(b"j" * 32, ctx), ctx.encode()) == b"j" * 32


def test_a_key_moved_to_another_tenant_or_epoch_does_not_unwrap(tmp_path: Path) -> None:
    kek = LocalFileKek(tmp_path / "kek.key")
    salt = kek.wrap(b"s" * 32, ns_salt_context("acme", "chat", 3))
    assert kek.unwrap(salt, ns_salt_context("acme", "chat", 3)) == b"s" * 32  # positive control
    for other in (ns_salt_context("globex", "chat", 3), ns_salt_context("acme", "chat", 4),
                  ns_salt_context("acme", "chat2", 3), dek_context("acme", 3), secret_context("chat")):
        with pytest.raises(KekError, match="unwrap failed"):
            kek.unwrap(salt, other)
    with pytest.raises(KekError):
        kek.wrap(b"s" * 32, "kvgate/dek/v1")  # type: ignore[arg-type]  # a str is not a context
