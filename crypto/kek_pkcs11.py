"""``Pkcs11Kek``: a KEK that never leaves an HSM, reached over PKCS#11 (python-pkcs11).

The KEK is an AES-256 secret key inside the token, generated there as sensitive and
non-extractable (``generate_pkcs11_kek``, or ``pkcs11-tool --keygen``); a key whose
``CKA_SENSITIVE`` is false or ``CKA_EXTRACTABLE`` true is refused. Data keys are wrapped *inside
the token* with ``CKM_AES_GCM``, the caller's context (tenant, key version) as AAD, random 96-bit
nonces. Wrapped format v1: ``0x01 || len(label) (1 byte) || label (UTF-8) || nonce (12) ||
ciphertext || tag (16)``. ``key_id`` is ``pkcs11:<token label>/<key label>``; the key label is the
KEK version (``kvgate-kek-1`` ...), and rotation (``kvgate keys rotate-kek``) adds a key object.

Providers of one process share one logged-in session per (module, token); a provider built with a
different PIN than the live login is refused. It logs in when built (a wrong PIN, a missing module,
token or key is a ``KekError`` there). A lost token is a ``KekError`` and relogin is tried at most
once per ``reconnect_interval_s``, so a dead HSM costs the data path a miss, not a stall.
python-pkcs11 is imported lazily (an optional dependency). Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from crypto.contexts import ContextLike
from crypto.errors import KekError
from crypto.kek import Secret, check_context

__all__ = ["Pkcs11Kek", "generate_pkcs11_kek"]

_VERSION = 1
_NONCE_BYTES = 12
_TAG_BYTES = 16
_MAX_KEY_BYTES = 1024
_HEALTH_CONTEXT = b"kvgate/kek/health"
# Errors that mean "the session or token is gone": drop the session and log in again later.
_CONNECTION_ERRORS = (
    "SessionHandleInvalid", "SessionClosed", "ObjectHandleInvalid", "DeviceRemoved", "DeviceError",
    "TokenNotPresent", "TokenNotRecognised", "NoSuchToken", "NoSuchKey", "UserNotLoggedIn",
    "CryptokiNotInitialized", "SlotIDInvalid",
)


def _pkcs11() -> Any:
    try:
        import pkcs11  # optional dependency, imported where chosen
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise KekError("the pkcs11 KEK provider needs python-pkcs11 (pip install python-pkcs11)") from exc
    return pkcs11


def _library(module: Path) -> Any:
    p11 = _pkcs11()
    try:
        return p11.lib(str(module))  # one per module path and process (python-pkcs11 caches it)
    except p11.PKCS11Error as exc:
        raise KekError(f"cannot load PKCS#11 module {module}: {exc}") from exc


_SLOTS: dict[tuple[str, str], Any] = {}  # (module, token label) -> the slot it was found in


def _token(module: Path, token_label: str) -> Any:
    """The token (``_find_token``). Where it cannot be found and no session of the process is
    open on the module, the library is initialised again (C_Finalize, C_Initialize) and the
    token looked for once more: a library may keep a token that went away (SoftHSM2 does) as
    unusable until then, so without it a token that is back would never be seen again."""
    try:
        return _find_token(module, token_label)
    except KekError:
        if not _reinitialize(module):
            raise
    return _find_token(module, token_label)


def _reinitialize(module: Path) -> bool:
    """Initialise the module's library again where no live login of this process uses it (it
    would end their sessions); True if it was done. Called with ``_LOGINS_LOCK`` held."""
    if any(login.session is not None and login.key[0] == str(module) for login in _LOGINS.values()):
        return False
    p11 = _pkcs11()
    try:
        _library(module).reinitialize()
    except p11.PKCS11Error:
        return False
    for key in [k for k in _SLOTS if k[0] == str(module)]:
        del _SLOTS[key]
    return True


def _find_token(module: Path, token_label: str) -> Any:
    """The token, from the slot it was last seen in (a reconnect does not enumerate every slot:
    one broken token elsewhere must not stop this one), else found by label."""
    p11 = _pkcs11()
    lib = _library(module)
    slot = _SLOTS.get((str(module), token_label))
    if slot is not None:
        try:
            token = slot.get_token()
            if token.label == token_label:
                return token
        except p11.PKCS11Error:
            pass
    try:
        token = lib.get_token(token_label=token_label)
    except p11.NoSuchToken:
        raise KekError(f"PKCS#11 token {token_label!r} not found in {module}") from None
    except p11.PKCS11Error as exc:
        raise KekError(f"cannot list PKCS#11 tokens in {module}: {type(exc).__name__}") from None
    _SLOTS[(str(module), token_label)] = token.slot
    return token


def _login(module: Path, token_label: str, pin: Secret, *, rw: bool = False) -> Any:
    p11 = _pkcs11()
    token = _token(module, token_label)
    try:
        return token.open(user_pin=pin.reveal().decode("utf-8"), rw=rw)
    except p11.PinIncorrect:
        raise KekError(f"PKCS#11 login to token {token_label!r} failed: wrong PIN") from None
    except p11.PinLocked:
        raise KekError(f"PKCS#11 token {token_label!r}: the user PIN is locked") from None
    except p11.PKCS11Error as exc:
        raise KekError(f"PKCS#11 login to token {token_label!r} failed: {type(exc).__name__}") from None


class _Login:
    """The process's logged-in session on one token (shared by every provider of the process)."""

    def __init__(self, key: tuple[str, str], session: Any, pin: Secret) -> None:
        self.key = key
        self.session: Any = session
        self.pin = pin
        self.users = 1
        self.lock = threading.Lock()


_LOGINS: dict[tuple[str, str], _Login] = {}
_LOGINS_LOCK = threading.Lock()


def _live_login(key: tuple[str, str], pin: Secret) -> _Login | None:
    login = _LOGINS.get(key)
    if login is None or login.session is None:
        return None
    if login.pin != pin:
        raise KekError(f"PKCS#11 login to token {key[1]!r} failed: wrong PIN")
    return login


def _acquire(module: Path, token_label: str, pin: Secret) -> _Login:
    key = (str(module), token_label)
    with _LOGINS_LOCK:
        login = _live_login(key, pin)
        if login is not None:
            login.users += 1
            return login
        login = _LOGINS[key] = _Login(key, _login(module, token_label, pin), pin)
        return login


def _close_quietly(session: Any) -> None:
    try:
        session.close()
    except _pkcs11().PKCS11Error:  # the token is already gone: nothing to close
        return


def _release(login: _Login, *, broken: bool = False) -> None:
    """Give up one reference; the last one (or a broken session) logs out and closes."""
    with _LOGINS_LOCK:
        login.users -= 1
        if (broken or login.users <= 0) and login.session is not None:
            if _LOGINS.get(login.key) is login:
                del _LOGINS[login.key]
            session, login.session = login.session, None
            _close_quietly(session)


def generate_pkcs11_kek(module: Path | str, token_label: str, pin: Secret, key_label: str) -> None:
    """Generate a KEK version in the token: AES-256, persistent, private, sensitive and
    non-extractable (it can encrypt and decrypt inside the token, nothing else). Refuses a label
    that is already taken."""
    p11 = _pkcs11()
    from pkcs11 import Attribute, KeyType, ObjectClass

    _check_label(key_label)
    module = Path(module)
    with _LOGINS_LOCK:
        if _live_login((str(module), token_label), pin) is not None:
            try:  # the process is logged in already: a new session shares that login
                session = _token(module, token_label).open(rw=True)
            except p11.PKCS11Error as exc:
                raise KekError(f"cannot open a session on token {token_label!r}: {type(exc).__name__}") from None
        else:
            session = _login(module, token_label, pin, rw=True)
    try:
        if list(session.get_objects({Attribute.CLASS: ObjectClass.SECRET_KEY, Attribute.LABEL: key_label})):
            raise KekError(f"a key labelled {key_label!r} already exists in token {token_label!r}")
        session.generate_key(
            KeyType.AES, 256, label=key_label, store=True,
            template={
                Attribute.SENSITIVE: True, Attribute.EXTRACTABLE: False, Attribute.PRIVATE: True,
                Attribute.ENCRYPT: True, Attribute.DECRYPT: True,
                Attribute.WRAP: False, Attribute.UNWRAP: False,
            },
        )
    except p11.PKCS11Error as exc:
        raise KekError(f"cannot generate KEK {key_label!r}: {type(exc).__name__}") from None
    finally:
        _close_quietly(session)


def _check_label(label: str) -> None:
    raw = label.encode("utf-8") if isinstance(label, str) else b""
    if not 1 <= len(raw) <= 255:
        raise KekError("a PKCS#11 key label must be 1 to 255 bytes of UTF-8")


class Pkcs11Kek:
    """A KEK inside a PKCS#11 token; data keys are wrapped with AES-GCM in the token."""

    def __init__(
        self,
        module: Path | str,
        token_label: str,
        pin: Secret,
        key_label: str = "kvgate-kek-1",
        *,
        reconnect_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(pin, Secret):
            raise TypeError("pin must be a crypto.kek.Secret")
        _check_label(key_label)
        self._module = Path(module)
        self._token_label = token_label
        self._pin = pin
        self._label = key_label
        self._label_bytes = key_label.encode("utf-8")
        self._interval = reconnect_interval_s
        self._clock = clock
        self._login: _Login | None = None
        self._keys: dict[str, Any] = {}
        self._next_attempt = 0.0
        self._connect()  # fail at start on a wrong PIN, module, token or key

    @property
    def key_id(self) -> str:
        return f"pkcs11:{self._token_label}/{self._label}"

    @property
    def key_version(self) -> str:
        return self._label

    def __repr__(self) -> str:
        return f"Pkcs11Kek(module={str(self._module)!r}, key_id={self.key_id!r}, pin=<hidden>)"

    # -- session -------------------------------------------------------------------------------
    def _connect(self) -> None:
        login = _acquire(self._module, self._token_label, self._pin)
        self._login, self._keys = login, {}
        try:
            with login.lock:
                self._key(login.session, self._label, check=True)
        except BaseException:
            self._drop(broken=False)
            raise

    def _drop(self, *, broken: bool) -> None:
        login, self._login, self._keys = self._login, None, {}
        if login is not None:
            _release(login, broken=broken)

    def close(self) -> None:
        """Give up this provider's share of the session (the last one logs out)."""
        self._drop(broken=False)

    def _ensure(self) -> _Login:
        login = self._login
        if login is not None and login.session is not None:
            return login
        if login is not None:  # another provider found the session broken
            self._drop(broken=False)
        now = self._clock()
        if now < self._next_attempt:
            raise KekError(f"PKCS#11 token {self._token_label!r} is unavailable (retrying shortly)")
        self._next_attempt = now + self._interval
        self._connect()
        assert self._login is not None
        return self._login

    def _key(self, session: Any, label: str, *, check: bool = False) -> Any:
        key = self._keys.get(label)
        if key is not None:
            return key
        p11 = _pkcs11()
        from pkcs11 import Attribute, KeyType, ObjectClass

        try:
            key = session.get_key(object_class=ObjectClass.SECRET_KEY, key_type=KeyType.AES, label=label)
        except p11.NoSuchKey:
            raise KekError(f"no AES key labelled {label!r} in token {self._token_label!r}") from None
        except p11.MultipleObjectsReturned:
            raise KekError(f"several keys labelled {label!r} in token {self._token_label!r}") from None
        if check and (not key[Attribute.SENSITIVE] or key[Attribute.EXTRACTABLE]):
            raise KekError(
                f"KEK {label!r} in token {self._token_label!r} must be sensitive and non-extractable"
            )
        self._keys[label] = key
        return key

    def _call(self, label: str, op: Callable[[Any], bytes]) -> bytes:
        """Run ``op(key)`` under the lock; on a lost session, drop it (next call logs in again)."""
        p11 = _pkcs11()
        login = self._ensure()
        with login.lock:
            if login.session is None:
                raise KekError(f"PKCS#11 token {self._token_label!r} went away")
            try:
                return op(self._key(login.session, label))
            except p11.PKCS11Error as exc:
                if type(exc).__name__ not in _CONNECTION_ERRORS:
                    raise KekError(f"PKCS#11 operation failed under {label!r}: {type(exc).__name__}") from None
                lost = KekError(f"PKCS#11 token {self._token_label!r} went away: {type(exc).__name__}")
            except KekError:
                if label != self._label:
                    raise
                lost = KekError(f"KEK {label!r} vanished from token {self._token_label!r}")
        self._drop(broken=True)  # our session (or our own key) is gone: log in again later
        raise lost

    # -- KekProvider -----------------------------------------------------------------------------
    def wrap(self, plaintext_key: bytes, context: ContextLike) -> bytes:
        if not isinstance(plaintext_key, (bytes, bytearray)) or not 0 < len(plaintext_key) <= _MAX_KEY_BYTES:
            raise KekError(f"plaintext_key must be 1 to {_MAX_KEY_BYTES} bytes")
        aad = check_context(context)
        from pkcs11 import Mechanism
        from pkcs11.mechanisms import GCMParams

        nonce = secrets.token_bytes(_NONCE_BYTES)
        params = GCMParams(nonce, aad, _TAG_BYTES * 8)
        sealed = self._call(
            self._label, lambda k: k.encrypt(bytes(plaintext_key), mechanism=Mechanism.AES_GCM, mechanism_param=params)
        )
        return bytes([_VERSION, len(self._label_bytes)]) + self._label_bytes + nonce + bytes(sealed)

    def _parse(self, wrapped: bytes) -> tuple[str, bytes, bytes]:
        if not isinstance(wrapped, (bytes, bytearray)) or len(wrapped) < 2 or wrapped[0] != _VERSION:
            self._failed()
        n = wrapped[1]
        start = 2 + n + _NONCE_BYTES
        if n == 0 or not start + _TAG_BYTES < len(wrapped) <= start + _TAG_BYTES + _MAX_KEY_BYTES:
            self._failed()
        try:
            label = bytes(wrapped[2 : 2 + n]).decode("utf-8")
        except UnicodeDecodeError:
            self._failed()
        return label, bytes(wrapped[2 + n : start]), bytes(wrapped[start:])

    def key_id_of(self, wrapped: bytes, context: ContextLike | None = None) -> str:
        """The key id of the KEK version that wrapped ``wrapped`` (named in the blob; ``context``
        is not needed; ``KekError`` if malformed)."""
        return f"pkcs11:{self._token_label}/{self._parse(wrapped)[0]}"

    def unwrap(self, wrapped: bytes, context: ContextLike) -> bytes:
        aad = check_context(context)
        label, nonce, sealed = self._parse(wrapped)
        from pkcs11 import Mechanism
        from pkcs11.mechanisms import GCMParams

        params = GCMParams(nonce, aad, _TAG_BYTES * 8)
        return bytes(self._call(label, lambda k: k.decrypt(sealed, mechanism=Mechanism.AES_GCM, mechanism_param=params)))

    def _failed(self) -> NoReturn:
        raise KekError(f"unwrap failed under KEK {self.key_id} (wrong key, context or data)")

    def health(self) -> None:
        probe = secrets.token_bytes(32)
        if self.unwrap(self.wrap(probe, _HEALTH_CONTEXT), _HEALTH_CONTEXT) != probe:
            raise KekError("PKCS#11 KEK self-test failed")  # pragma: no cover - AES is deterministic
