"""Known answers for the AEAD layer (``CpuAesGcm``): NIST CAVP and Wycheproof AES-256-GCM."""

from __future__ import annotations

import pytest

from crypto.aead import TAG_BYTES, CpuAesGcm
from crypto.errors import DecryptionFailed
from tests.support.vectors import AeadVector, load_nist_gcm, load_wycheproof_gcm

# Cases with 256-bit key, 96-bit IV and 128-bit tag in each file, as shipped today; the floors make
# an empty or broken loader fail instead of passing vacuously.
SOURCES = {
    "nist-encrypt": (lambda: load_nist_gcm("gcmEncryptExtIV256.rsp"), 375, 0),
    "nist-decrypt": (lambda: load_nist_gcm("gcmDecrypt256.rsp"), 150, 150),
    "wycheproof": (load_wycheproof_gcm, 35, 20),
}


def _check(v: AeadVector) -> str | None:
    """Return a description of the mismatch, or None if the AEAD behaves as the vector says."""
    aead = CpuAesGcm(v.key)
    sealed = v.ct + v.tag
    out = bytearray(b"\xa5" * len(v.ct))
    try:
        aead.open_into(v.iv, sealed, v.aad, out)
    except DecryptionFailed:
        if v.ok:
            return f"{v.source} {v.case}: valid case rejected"
        if any(out):
            return f"{v.source} {v.case}: output not wiped after failure"
        return None
    if not v.ok:
        return f"{v.source} {v.case}: invalid case accepted"
    if bytes(out) != v.pt:
        return f"{v.source} {v.case}: wrong plaintext"
    buf = bytearray(len(v.pt) + TAG_BYTES)
    aead.seal_into(v.iv, v.pt, v.aad, buf)
    if bytes(buf) != sealed:
        return f"{v.source} {v.case}: wrong ciphertext or tag"
    return None


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_known_answers(source: str) -> None:
    load, min_valid, min_invalid = SOURCES[source]
    vectors = load()
    valid = sum(v.ok for v in vectors)
    assert valid >= min_valid, f"only {valid} valid vectors loaded"
    assert len(vectors) - valid >= min_invalid, (
        f"only {len(vectors) - valid} invalid vectors loaded"
    )
    failures = [msg for v in vectors if (msg := _check(v)) is not None]
    assert failures == []


def test_checker_catches_a_wrong_answer() -> None:
    """Positive control: a vector with a flipped ciphertext bit is reported by the checker."""
    v = next(v for v in load_nist_gcm("gcmEncryptExtIV256.rsp") if v.pt)
    bad_ct = bytes([v.ct[0] ^ 1]) + v.ct[1:]
    assert _check(AeadVector(**{**v.__dict__, "ct": bad_ct})) is not None
    assert _check(AeadVector(**{**v.__dict__, "ok": False})) is not None
