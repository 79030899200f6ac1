"""``KmsSigner``: the audit signing key as an asymmetric AWS KMS key (``ECC_NIST_P256``,
``SIGN_VERIFY``); the private key never leaves KMS.

``sign(data)`` calls KMS ``Sign`` with ``ECDSA_SHA_256`` and ``MessageType=RAW`` (KMS hashes the
message; documents signed here are small JSON, and RAW is capped at 4096 bytes by KMS) and returns
the DER signature. ``public_key_pem()`` is the key's SubjectPublicKeyInfo from ``GetPublicKey``,
fetched once, for auditors. A key that is missing, of the wrong kind or refused (botocore errors)
is a ``SigningKeyError``. boto3 is imported lazily.
"""

from __future__ import annotations

from typing import Any

from crypto.errors import SigningKeyError

__all__ = ["KmsSigner"]

_RAW_LIMIT = 4096


class KmsSigner:
    algorithm = "ECDSA-P256-SHA256"

    def __init__(self, key_id: str, *, region: str | None = None, endpoint_url: str | None = None,
                 client: Any = None, timeout_s: float = 5.0) -> None:
        from crypto.kek_kms import KmsKek

        self._key_id = key_id
        self._client = client if client is not None else KmsKek._make_client(region, endpoint_url, timeout_s)
        meta = self._call("DescribeKey", lambda: self._client.describe_key(KeyId=key_id))["KeyMetadata"]
        spec = meta.get("KeySpec") or meta.get("CustomerMasterKeySpec")
        if meta.get("KeyUsage") != "SIGN_VERIFY" or spec != "ECC_NIST_P256":
            raise SigningKeyError(
                f"KMS key {key_id} must be an ECC_NIST_P256 SIGN_VERIFY key (it is {spec}, {meta.get('KeyUsage')})"
            )
        self._arn = meta["Arn"]
        der = self._call("GetPublicKey", lambda: self._client.get_public_key(KeyId=self._arn))["PublicKey"]
        from cryptography.hazmat.primitives import serialization

        self._pem = serialization.load_der_public_key(der).public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def __repr__(self) -> str:
        return f"KmsSigner(kms:{self._arn})"

    def _call(self, what: str, fn: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except (BotoCoreError, ClientError) as exc:
            code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
            raise SigningKeyError(f"KMS {what} of key {self._key_id} failed: {code or type(exc).__name__}") from None

    def sign(self, data: bytes) -> bytes:
        if len(data) > _RAW_LIMIT:
            raise SigningKeyError(f"KMS signs at most {_RAW_LIMIT} bytes of message; got {len(data)}")
        out = self._call("Sign", lambda: self._client.sign(
            KeyId=self._arn, Message=bytes(data), MessageType="RAW", SigningAlgorithm="ECDSA_SHA_256"
        ))
        return bytes(out["Signature"])

    def public_key_pem(self) -> bytes:
        return self._pem
