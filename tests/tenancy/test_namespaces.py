"""Namespace derivation: tenants and epochs give unrelated keys; labels are stable and opaque."""

import os

import pytest

from tenancy.namespaces import NamespaceDeriver, lp

M = os.urandom(32)
S = os.urandom(32)


def test_same_inputs_same_keys_positive_control():
    d = NamespaceDeriver(M)
    a, b = d.derive("acme", "default", 0, S), NamespaceDeriver(M).derive("acme", "default", 0, S)
    assert a.storage_key(b"h" * 32) == b.storage_key(b"h" * 32)
    assert a.binding_secret == b.binding_secret


@pytest.mark.parametrize(
    "other",
    [("globex", "default", 0, S), ("acme", "other", 0, S), ("acme", "default", 1, S), ("acme", "default", 0, os.urandom(32))],
)
def test_any_change_gives_unrelated_keys(other):
    d = NamespaceDeriver(M)
    a, b = d.derive("acme", "default", 0, S), d.derive(*other)
    assert a.storage_key(b"h" * 32) != b.storage_key(b"h" * 32)
    assert a.binding_secret != b.binding_secret and a.index_key != b.index_key


def test_master_secret_matters_and_secrets_are_hidden():
    a = NamespaceDeriver(M).derive("acme", "d", 0, S)
    b = NamespaceDeriver(os.urandom(32)).derive("acme", "d", 0, S)
    assert a.storage_key(b"x") != b.storage_key(b"x")
    assert a.index_key.hex() not in repr(a) and a.binding_secret.hex() not in repr(a)
    assert M.hex() not in repr(NamespaceDeriver(M))


def test_labels_are_stable_across_epochs_and_differ_by_tenant():
    d = NamespaceDeriver(M)
    e0, e1 = d.derive("acme", "d", 0, S), d.derive("acme", "d", 1, os.urandom(32))
    assert (e0.owner, e0.group) == (e1.owner, e1.group)
    assert d.owner_label("acme") != d.owner_label("globex")
    assert d.group_label("acme", "d") != d.group_label("acme", "e")
    assert "acme" not in e0.owner + e0.group


def test_length_prefixing_is_unambiguous():
    assert lp("ab", "c") != lp("a", "bc")
    d = NamespaceDeriver(M)
    assert d.group_label("ab", "c") != d.group_label("a", "bc")


def test_bad_secret_sizes():
    with pytest.raises(ValueError):
        NamespaceDeriver(b"short")
    with pytest.raises(ValueError):
        NamespaceDeriver(M).derive("a", "b", 0, b"short")
