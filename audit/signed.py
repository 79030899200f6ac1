"""Signed JSON documents (export manifests, checkpoints): one way to sign, one way to check.

A document is signed over the canonical JSON (audit.record.canonical_json) of its fields without
``signature``, after ``signature_algorithm`` and ``key_id`` are added; ``signature`` is base64.
Light on purpose: the offline verifier imports this, never SQLAlchemy.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from typing import Any

from audit.record import canonical_json
from audit.signing import AuditSigner, PublicKey, algorithm_of, key_id, verify_signature

__all__ = ["check_signature", "sign_document"]


def sign_document(body: Mapping[str, Any], signer: AuditSigner, *, unsigned: Iterable[str] = ()) -> dict[str, Any]:
    """``body`` plus ``signature_algorithm``, ``key_id`` and ``signature``. Fields named in
    ``unsigned`` are carried but left out of what is signed."""
    skip = set(unsigned) | {"signature"}
    signed = {k: v for k, v in body.items() if k not in skip}
    signed.update(signature_algorithm=signer.algorithm, key_id=signer.key_id)
    signature = signer.sign(canonical_json(signed).encode("utf-8"))
    extra = {k: v for k, v in body.items() if k in skip and k != "signature"}
    return {**signed, **extra, "signature": base64.b64encode(signature).decode("ascii")}


def check_signature(doc: Mapping[str, Any], public_key: PublicKey, *, unsigned: Iterable[str] = ()) -> str | None:
    """None when ``doc`` is signed by ``public_key``; otherwise what is wrong, in words."""
    sig_text = doc.get("signature")
    if not isinstance(sig_text, str):
        return "no signature"
    try:
        signature = base64.b64decode(sig_text, validate=True)
    except (binascii.Error, ValueError):
        return "the signature is not base64"
    skip = set(unsigned) | {"signature"}
    signed = {k: v for k, v in doc.items() if k not in skip}
    try:
        data = canonical_json(signed).encode("utf-8")
    except (TypeError, ValueError):
        return "the document cannot be canonicalised"
    if doc.get("signature_algorithm", "Ed25519") != algorithm_of(public_key):
        return f"signed with {doc.get('signature_algorithm')!r}, but the public key is {algorithm_of(public_key)}"
    if not verify_signature(public_key, signature, data):
        return "the signature is invalid (document modified or signed by another key)"
    if doc.get("key_id") not in (None, key_id(public_key)):
        return "the key id differs from the public key's"
    return None
