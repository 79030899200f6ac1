"""``Pkcs11Signer``: the audit signing key as an ECDSA P-256 key pair inside a PKCS#11 token
(SoftHSM2 in tests; it offers ``CKM_ECDSA``, not ``CKM_EDDSA``). The private key is generated in
the token as sensitive, non-extractable and sign-only (``generate_pkcs11_signing_key``).

``sign(data)`` hashes ``data`` with SHA-256 here and has the token sign the digest
(``CKM_ECDSA``, raw r || s), returned DER-encoded. ``public_key_pem()`` is the token's public key
object as SubjectPublicKeyInfo PEM. The process's login to the token is shared with the KEK
provider (crypto.kek_pkcs11: one login per token and process); a signer takes its reference and
gives it back on ``close``. A lost token is a ``KekError`` and, as for the KEK, the signer logs in
again at most once per ``reconnect_interval_s`` (refusing a key pair that changed meanwhile). A key
pair that is missing, unsafe or fails to sign is a ``SigningKeyError``; the token, module and login
are ``KekError``, as for the KEK.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crypto.errors import KekError, SigningKeyError
from crypto.kek import Secret
from crypto.kek_pkcs11 import (
    _CONNECTION_ERRORS,
    _LOGINS_LOCK,
    _acquire,
    _check_label,
    _close_quietly,
    _live_login,
    _Login,
    _login,
    _pkcs11,
    _release,
    _token,
)

__all__ = ["Pkcs11Signer", "generate_pkcs11_signing_key"]


def generate_pkcs11_signing_key(module: Path | str, token_label: str, pin: Secret, key_label: str) -> None:
    """Generate a P-256 key pair in the token: private key persistent, private, sensitive,
    non-extractable, sign only. Refuses a label that is taken."""
    p11 = _pkcs11()
    from pkcs11 import Attribute, KeyType, ObjectClass
    from pkcs11.util.ec import encode_named_curve_parameters

    _check_label(key_label)
    module = Path(module)
    with _LOGINS_LOCK:
        if _live_login((str(module), token_label), pin) is not None:
            session = _token(module, token_label).open(rw=True)
        else:
            session = _login(module, token_label, pin, rw=True)
    try:
        if list(session.get_objects({Attribute.CLASS: ObjectClass.PRIVATE_KEY, Attribute.LABEL: key_label})):
            raise SigningKeyError(f"a key labelled {key_label!r} already exists in token {token_label!r}")
        params = session.create_domain_parameters(
            KeyType.EC, {Attribute.EC_PARAMS: encode_named_curve_parameters("secp256r1")}, local=True
        )
        params.generate_keypair(
            store=True, label=key_label,
            private_template={
                Attribute.SENSITIVE: True, Attribute.EXTRACTABLE: False, Attribute.PRIVATE: True,
                Attribute.SIGN: True, Attribute.DECRYPT: False, Attribute.UNWRAP: False, Attribute.DERIVE: False,
            },
            public_template={Attribute.VERIFY: True},
        )
    except p11.PKCS11Error as exc:
        raise SigningKeyError(f"cannot generate signing key {key_label!r}: {type(exc).__name__}") from None
    finally:
        _close_quietly(session)


class Pkcs11Signer:
    algorithm = "ECDSA-P256-SHA256"

    def __init__(
        self, module: Path | str, token_label: str, pin: Secret, key_label: str = "kvgate-audit-1", *,
        reconnect_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(pin, Secret):
            raise TypeError("pin must be a crypto.kek.Secret")
        _check_label(key_label)
        self._token_label = token_label
        self._label = key_label
        self._module = Path(module)
        self._pin = pin
        self._interval = reconnect_interval_s
        self._clock = clock
        self._next_attempt = 0.0
        self._closed = False
        login = _acquire(Path(module), token_label, pin)
        self._login: _Login | None = login
        try:
            self._private, self._pem = self._load()
        except BaseException:
            _release(login)
            raise

    def __repr__(self) -> str:
        return f"Pkcs11Signer(pkcs11:{self._token_label}/{self._label}, pin=<hidden>)"

    def _held(self) -> _Login:
        assert self._login is not None, "signer used after close()"
        return self._login

    def _ensure(self) -> _Login:
        """The live login, or a new one where the token went away (at most one attempt per
        interval, so a dead token costs a signature an error, not a stall)."""
        assert not self._closed, "signer used after close()"
        login = self._login
        if login is not None and login.session is not None:
            return login
        if login is not None:  # the KEK provider (or this signer) found the session broken
            self._login = None
            _release(login)
        now = self._clock()
        if now < self._next_attempt:
            raise KekError(f"PKCS#11 token {self._token_label!r} is unavailable (retrying shortly)")
        self._next_attempt = now + self._interval
        login = self._login = _acquire(self._module, self._token_label, self._pin)
        try:
            private, pem = self._load()
            if pem != self._pem:  # auditors hold the old public key: never sign with another
                raise SigningKeyError(f"signing key {self._label!r} in token {self._token_label!r} changed")
        except BaseException:
            self._login = None
            _release(login)
            raise
        self._private = private
        return login

    def _load(self) -> tuple[Any, bytes]:
        p11 = _pkcs11()
        from cryptography.hazmat.primitives import serialization
        from pkcs11 import Attribute, KeyType, ObjectClass
        from pkcs11.util.ec import encode_ec_public_key

        login = self._held()
        with login.lock:
            session = login.session
            try:
                private = session.get_key(object_class=ObjectClass.PRIVATE_KEY, key_type=KeyType.EC, label=self._label)
                public = session.get_key(object_class=ObjectClass.PUBLIC_KEY, key_type=KeyType.EC, label=self._label)
            except p11.NoSuchKey:
                raise SigningKeyError(
                    f"no EC P-256 key pair labelled {self._label!r} in PKCS#11 token {self._token_label!r} "
                    f"(module {self._module})"
                ) from None
            except p11.MultipleObjectsReturned:
                raise SigningKeyError(
                    f"several key pairs labelled {self._label!r} in PKCS#11 token {self._token_label!r}"
                ) from None
            except p11.PKCS11Error as exc:
                raise SigningKeyError(
                    f"looking up key pair {self._label!r} in PKCS#11 token {self._token_label!r} failed: "
                    f"{type(exc).__name__}"
                ) from None
            if not private[Attribute.SENSITIVE] or private[Attribute.EXTRACTABLE]:
                raise SigningKeyError(
                    f"signing key {self._label!r} in PKCS#11 token {self._token_label!r} must be sensitive "
                    "and non-extractable"
                )
            der = encode_ec_public_key(public)
        pem = serialization.load_der_public_key(der).public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return private, pem

    def sign(self, data: bytes) -> bytes:
        p11 = _pkcs11()
        from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
        from pkcs11 import Mechanism

        digest = hashlib.sha256(data).digest()
        login = self._ensure()
        with login.lock:
            if login.session is None:
                raise KekError(f"PKCS#11 token {self._token_label!r} went away")
            try:
                raw = self._private.sign(digest, mechanism=Mechanism.ECDSA)
            except p11.PKCS11Error as exc:
                lost = type(exc).__name__ in _CONNECTION_ERRORS
                failure = exc
            else:
                lost, failure = False, None
        if failure is not None:
            if lost:  # the session or token is gone: log in again on a later call
                self._login = None
                _release(login, broken=True)
                raise KekError(f"PKCS#11 token {self._token_label!r} went away")
            raise SigningKeyError(
                f"PKCS#11 signing with {self._label!r} in token {self._token_label!r} failed: {type(failure).__name__}"
            ) from None
        half = len(raw) // 2
        return encode_dss_signature(int.from_bytes(raw[:half], "big"), int.from_bytes(raw[half:], "big"))

    def public_key_pem(self) -> bytes:
        return self._pem

    def close(self) -> None:
        self._closed = True
        login, self._login = self._login, None
        if login is not None:
            _release(login)
