"""Key-encryption-key (KEK) providers, and ``Secret``, a holder for key material.

``KekProvider`` is the narrow interface the key hierarchy needs: wrap a data key (DEK) under the
KEK with a caller-chosen context bound as AAD (a ``crypto.contexts.WrapContext``; raw bytes are
accepted too), unwrap it, report health, tell which KEK wrapped a blob (``key_id_of``) and let go
of sessions (``close``). The methods block (an HSM or KMS round trip); ``crypto.kek_async`` runs
them in a worker thread. Production providers (PKCS#11 HSM, cloud KMS) implement the same protocol.

``LocalFileKek`` is the development provider: a 32-byte random key in a file, created on first use
with mode 0600, atomically (one key even when two processes start at once). Loading refuses a file
with any group/other permission bits, a non-regular file, or one not exactly 32 bytes, with a
``KekError`` that says what is wrong and how to fix it. Wrapped format v1: ``0x01 || nonce (12) ||
ciphertext || tag (16)``, AES-256-GCM with a random 96-bit nonce and ``context`` as AAD.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from hashlib import sha256
from pathlib import Path
from typing import NoReturn, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from crypto.contexts import ContextLike, WrapContext, context_bytes
from crypto.errors import KekError

__all__ = ["KekProvider", "LocalFileKek", "Secret", "check_context"]

_KEY_BYTES = 32
_NONCE_BYTES = 12
_TAG_BYTES = 16
_WRAP_VERSION = 1
_MAX_WRAPPED_KEY = 1024
_HEALTH_CONTEXT = b"kvgate/kek/health"


class Secret:
    """Key material whose ``repr``/``str`` hide the value; ``reveal()`` returns it.

    Compared in constant time; not hashable and not picklable, so it does not leak into logs,
    dict keys or IPC by accident.
    """

    __slots__ = ("_value",)

    def __init__(self, value: bytes) -> None:
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError("Secret holds bytes")
        self._value = bytes(value)

    def reveal(self) -> bytes:
        return self._value

    def __len__(self) -> int:
        return len(self._value)

    def __repr__(self) -> str:
        return f"Secret(<{len(self._value)} bytes hidden>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value, other._value)

    __hash__ = None  # type: ignore[assignment]  # unhashable on purpose: a secret is never a dict key

    def __reduce__(self) -> NoReturn:
        raise TypeError("Secret is not picklable")


class KekProvider(Protocol):
    """Wraps and unwraps data keys under a key-encryption key."""

    @property
    def key_id(self) -> str:
        """A stable, non-secret identifier of the KEK (stored next to wrapped keys)."""
        ...

    def wrap(self, plaintext_key: bytes, context: ContextLike) -> bytes:
        """Encrypt ``plaintext_key`` bound to ``context``; ``KekError`` on failure."""
        ...

    def unwrap(self, wrapped: bytes, context: ContextLike) -> bytes:
        """Recover a key wrapped under the same ``context``; ``KekError`` on any failure."""
        ...

    def key_id_of(self, wrapped: bytes, context: ContextLike | None = None) -> str | None:
        """The key id of the KEK that wrapped ``wrapped``, if this provider can tell: HSM and KMS
        blobs name their key (``KekError`` if malformed); a blob that does not is this KEK's when
        it unwraps under ``context`` (given), else None."""
        ...

    def health(self) -> None:
        """Return if the provider can wrap and unwrap now; raise ``KekError`` otherwise."""
        ...

    def close(self) -> None:
        """Release sessions and clients (idempotent); the provider is not used afterwards."""
        ...


def check_context(context: object) -> bytes:
    """The bytes of a wrap context (``WrapContext`` or bytes); ``KekError`` for anything else."""
    if not isinstance(context, (bytes, bytearray, WrapContext)):
        raise KekError("context must be a WrapContext or bytes")
    return context_bytes(context)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_key_file(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise KekError(f"cannot open KEK file {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KekError(f"KEK file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise KekError(
                f"KEK file {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must not be "
                f"accessible by group or others (run: chmod 600 {path})"
            )
        if st.st_size != _KEY_BYTES:
            raise KekError(
                f"KEK file {path} must hold exactly {_KEY_BYTES} bytes, it has {st.st_size}"
            )
        data = os.read(fd, _KEY_BYTES + 1)
    except OSError as exc:
        raise KekError(f"cannot read KEK file {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if len(data) != _KEY_BYTES:
        raise KekError(f"KEK file {path} must hold exactly {_KEY_BYTES} bytes, read {len(data)}")
    return data


def _create_key_file(path: Path) -> None:
    """Publish a fresh key at ``path`` unless one already exists (then keep the existing one)."""
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        try:
            os.write(fd, secrets.token_bytes(_KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic and never replaces: the first process to get here wins
        except FileExistsError:
            return
        _fsync_dir(directory)
    finally:
        tmp.unlink(missing_ok=True)


class LocalFileKek:
    """A KEK held in a local 0600 file of 32 random bytes (development and single-host setups)."""

    def __init__(self, path: Path, *, create: bool = True) -> None:
        self._path = Path(path)
        self._key = Secret(self._load(create))
        self._closed = False
        digest = sha256(b"kvgate/kek-id/v1" + self._key.reveal()).hexdigest()
        self._key_id = f"local:{digest[:16]}"

    def _load(self, create: bool) -> bytes:
        try:
            return _read_key_file(self._path)
        except FileNotFoundError:
            if not create:
                raise KekError(f"KEK file {self._path} does not exist (create=False)") from None
        try:
            _create_key_file(self._path)
            return _read_key_file(self._path)
        except FileNotFoundError:
            raise KekError(f"KEK file {self._path} vanished while it was being created") from None
        except OSError as exc:
            raise KekError(f"cannot create KEK file {self._path}: {exc.strerror}") from exc

    @property
    def key_id(self) -> str:
        return self._key_id

    @property
    def path(self) -> Path:
        return self._path

    def __repr__(self) -> str:
        return f"LocalFileKek(path={str(self._path)!r}, key_id={self._key_id!r})"

    def _secret(self) -> bytes:
        if self._closed:
            raise KekError(f"KEK {self._key_id} is closed")
        return self._key.reveal()

    def wrap(self, plaintext_key: bytes, context: ContextLike) -> bytes:
        if not isinstance(plaintext_key, (bytes, bytearray)) or not plaintext_key:
            raise KekError("plaintext_key must be non-empty bytes")
        if len(plaintext_key) > _MAX_WRAPPED_KEY:
            raise KekError(f"plaintext_key must be at most {_MAX_WRAPPED_KEY} bytes")
        aad = check_context(context)
        nonce = secrets.token_bytes(_NONCE_BYTES)
        sealed = AESGCM(self._secret()).encrypt(nonce, bytes(plaintext_key), aad)
        return bytes([_WRAP_VERSION]) + nonce + sealed

    def unwrap(self, wrapped: bytes, context: ContextLike) -> bytes:
        if not isinstance(wrapped, (bytes, bytearray)):
            raise KekError("wrapped must be bytes")
        aad = check_context(context)
        header = 1 + _NONCE_BYTES
        if (
            len(wrapped) <= header + _TAG_BYTES
            or len(wrapped) > header + _TAG_BYTES + _MAX_WRAPPED_KEY
        ):
            self._unwrap_failed()
        if wrapped[0] != _WRAP_VERSION:
            self._unwrap_failed()
        nonce, sealed = bytes(wrapped[1:header]), bytes(wrapped[header:])
        try:
            return AESGCM(self._secret()).decrypt(nonce, sealed, aad)
        except InvalidTag:
            pass
        self._unwrap_failed()

    def key_id_of(self, wrapped: bytes, context: ContextLike | None = None) -> str | None:
        """This KEK's id if ``wrapped`` unwraps under ``context``; None otherwise (the blob does not
        name its KEK, so without a context this provider cannot tell)."""
        if context is None:
            return None
        try:
            self.unwrap(wrapped, context)
        except KekError:
            return None
        return self._key_id

    def close(self) -> None:
        """Stop serving: later calls raise ``KekError`` (the key bytes go with the object)."""
        self._closed = True

    def _unwrap_failed(self) -> NoReturn:
        raise KekError(f"unwrap failed under KEK {self._key_id} (wrong key, context or data)")

    def health(self) -> None:
        """Check the key file still holds the loaded key (a restart would otherwise mint a new
        one and orphan every wrapped key) and that a wrap/unwrap round trip works."""
        try:
            on_disk = _read_key_file(self._path)
        except FileNotFoundError:
            raise KekError(f"KEK file {self._path} has disappeared") from None
        if not hmac.compare_digest(on_disk, self._secret()):
            raise KekError(f"KEK file {self._path} changed since it was loaded")
        probe = secrets.token_bytes(_KEY_BYTES)
        if self.unwrap(self.wrap(probe, _HEALTH_CONTEXT), _HEALTH_CONTEXT) != probe:
            raise KekError("KEK self-test failed")  # pragma: no cover - AES is deterministic
