"""Wiring of the audit log's signing key and checkpoints (settings -> audit objects).

The signer lives where the KEK lives, so that in production neither private key is a file on the
gateway's disk: ``pkcs11`` signs with an EC key pair in the same token as the KEK, ``kms`` with an
ECC_NIST_P256 KMS key; ``file`` is the development Ed25519 PEM (settings refuse it in production,
as they refuse the local KEK file). HSM and KMS libraries load only when chosen.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from audit.checkpoint import CheckpointDirectory
from audit.checkpointer import Checkpointer
from audit.errors import AuditKeyError
from audit.signing import AuditSigner, AuditSigningKey, EcdsaSigner
from audit.store import AuditStore
from audit.types import AuditSink
from crypto.errors import KekError, SigningKeyError
from gateway.config import Settings

__all__ = ["make_audit_signer", "make_checkpointer"]


def make_audit_signer(settings: Settings) -> AuditSigner:
    """The configured audit signer; AuditKeyError, naming the key, where it was looked for, the
    setting that names it and the fix, when it cannot be opened."""
    kind = settings.audit_signer_kind
    try:
        if kind == "pkcs11":
            from crypto.kek import Secret
            from crypto.signer_pkcs11 import Pkcs11Signer

            assert settings.pkcs11_module and settings.pkcs11_token_label and settings.pkcs11_pin  # validated
            return EcdsaSigner(Pkcs11Signer(
                settings.pkcs11_module, settings.pkcs11_token_label,
                Secret(settings.pkcs11_pin.get_secret_value().encode("utf-8")), settings.audit_pkcs11_key_label,
            ))
        if kind == "kms":
            from crypto.signer_kms import KmsSigner

            assert settings.audit_kms_key_id  # validated
            return EcdsaSigner(KmsSigner(
                settings.audit_kms_key_id, region=settings.kms_region, endpoint_url=settings.kms_endpoint_url
            ))
    except SigningKeyError as exc:
        raise AuditKeyError(f"{exc}. {_signer_fix(kind, key=True)}") from None
    except KekError as exc:
        raise AuditKeyError(f"{exc}. {_signer_fix(kind, key=False)}") from None
    return AuditSigningKey.load_or_create(settings.audit_key_path)


def _signer_fix(kind: str, *, key: bool) -> str:
    """Which settings name the audit signer's key (``kind`` pkcs11 or kms), and what to do."""
    if kind == "pkcs11" and key:
        return ("The audit signing key (KVGATE_AUDIT_SIGNER=pkcs11) is the EC P-256 key pair labelled "
                "KVGATE_AUDIT_PKCS11_KEY_LABEL in the token KVGATE_PKCS11_TOKEN_LABEL. Fix: generate it in that "
                "token (crypto.signer_pkcs11.generate_pkcs11_signing_key) or set KVGATE_AUDIT_PKCS11_KEY_LABEL "
                "to the label of the pair it holds")
    if kind == "pkcs11":
        return ("The audit signing key (KVGATE_AUDIT_SIGNER=pkcs11) is in the token KVGATE_PKCS11_TOKEN_LABEL. "
                "Fix: check KVGATE_PKCS11_MODULE, KVGATE_PKCS11_TOKEN_LABEL and KVGATE_PKCS11_PIN")
    return ("The audit signing key (KVGATE_AUDIT_SIGNER=kms) is KVGATE_AUDIT_KMS_KEY_ID. Fix: name an enabled "
            "ECC_NIST_P256 SIGN_VERIFY key there, and check KVGATE_KMS_REGION, KVGATE_KMS_ENDPOINT_URL and the "
            "credentials")


def close_signer(signer: AuditSigner) -> None:
    backend = getattr(signer, "_backend", None)
    close = getattr(backend, "close", None)
    if close is not None:
        close()


def make_checkpointer(
    settings: Settings, store: AuditStore, signer: AuditSigner, sink: AuditSink | None
) -> tuple[Checkpointer, Callable[[], Awaitable[None]] | None]:
    """The checkpointer, and a close function for its Redis stream mirror (where Redis is set)."""
    mirrors = []
    close = None
    if settings.redis_url and settings.audit_checkpoint_stream:
        from storage.streams import RedisStream

        stream = RedisStream(settings.redis_url, settings.redis_prefix + settings.audit_checkpoint_stream)

        async def mirror(doc: dict[str, Any]) -> None:
            await stream.append(json.dumps(doc, sort_keys=True).encode("utf-8"))

        mirrors.append(mirror)
        close = stream.aclose
    cp = Checkpointer(store, signer, CheckpointDirectory(settings.audit_checkpoint_path), sink=sink, mirrors=mirrors)
    return cp, close
