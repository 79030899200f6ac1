"""``KmsKek``: a KEK that is an AWS KMS key (boto3; any KMS-compatible endpoint).

Data keys are wrapped with KMS ``Encrypt`` and unwrapped with ``Decrypt``; the KEK never leaves
KMS. The caller's context (tenant, key version) goes into the KMS *encryption context*, which KMS
authenticates with the ciphertext, records in CloudTrail, and requires again to decrypt.
Wrapped format v1: ``0x01 || len(arn) (2 bytes, big endian) || key ARN (ASCII) || KMS blob``;
``Decrypt`` always names that ARN, and only the configured key and ``previous_key_ids`` are
accepted (strict mode). ``key_id`` is ``kms:<key ARN>`` (an alias is resolved once, at start).

A key that is not ``Enabled`` (checked with ``DescribeKey`` at most every ``state_ttl_s``) is
refused, and ``DisabledException`` / ``KMSInvalidStateException`` are a ``KekError``. Connection
failures open a short circuit (``retry_interval_s``), so an unreachable KMS costs the data path a
miss, not a stall. boto3 is imported lazily, so it stays an optional dependency.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import base64
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from crypto.contexts import ContextLike, WrapContext, context_bytes
from crypto.errors import KekError
from crypto.kek import check_context

__all__ = ["KmsKek", "encryption_context"]

_VERSION = 1
_MAX_KEY_BYTES = 1024
_HEALTH_CONTEXT = b"kvgate/kek/health"
_CONNECTION_ERRORS = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError")


def encryption_context(context: ContextLike) -> dict[str, str]:
    """The KMS encryption context for a wrap context: the whole context (``kvgate:ctx``), plus
    its purpose and fields in readable form when it is one of kvgate's (``crypto.contexts``)."""
    typed = context if isinstance(context, WrapContext) else WrapContext.decode(context_bytes(context))
    raw = typed.encode() if typed is not None else context_bytes(context)
    out = {"kvgate:ctx": base64.urlsafe_b64encode(raw).decode("ascii")}
    if typed is None:
        return out
    readable = {"kvgate:purpose": typed.purpose.label}
    readable.update({f"kvgate:{name}": value for name, value in typed.fields().items()})
    return out | readable


class KmsKek:
    """A KEK that is a symmetric AWS KMS key; ``previous_key_ids`` may still unwrap (rotation)."""

    def __init__(
        self,
        key_id: str,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        previous_key_ids: Sequence[str] = (),
        client: Any = None,
        state_ttl_s: float = 60.0,
        retry_interval_s: float = 1.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._owns_client = client is None
        self._closed = False
        self._client = client if client is not None else self._make_client(region, endpoint_url, timeout_s)
        self._endpoint = endpoint_url
        self._state_ttl = state_ttl_s
        self._retry = retry_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state_until: dict[str, float] = {}
        self._down_until = 0.0
        self._arn = self._describe(key_id)
        self._allowed = {self._arn} | {self._describe(k) for k in previous_key_ids}
        self._arn_bytes = self._arn.encode("ascii")

    @staticmethod
    def _make_client(region: str | None, endpoint_url: str | None, timeout_s: float) -> Any:
        try:
            import boto3  # optional dependency, imported where chosen
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise KekError("the kms KEK provider needs boto3 (pip install boto3)") from exc
        config = Config(
            connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 2, "mode": "standard"}
        )
        from botocore.exceptions import BotoCoreError

        try:
            return boto3.client("kms", region_name=region, endpoint_url=endpoint_url, config=config)
        except BotoCoreError as exc:  # NoRegionError and friends
            raise KekError(f"cannot create a KMS client: {exc}") from None

    @property
    def key_id(self) -> str:
        return f"kms:{self._arn}"

    @property
    def key_version(self) -> str:
        return self._arn

    def __repr__(self) -> str:
        return f"KmsKek(key_id={self.key_id!r}, endpoint={self._endpoint!r})"

    # -- KMS calls ---------------------------------------------------------------------------------
    def _request(self, what: str, fn: Callable[[], Any]) -> Any:
        """Call KMS; every botocore error becomes ``KekError`` (connection failures trip a short
        circuit so a dead endpoint fails fast)."""
        from botocore.exceptions import BotoCoreError, ClientError

        if self._closed:
            raise KekError(f"KEK {self.key_id} is closed")
        if self._clock() < self._down_until:
            raise KekError("KMS is unreachable (retrying shortly)")
        try:
            return fn()
        except (BotoCoreError, ClientError) as exc:
            name = type(exc).__name__
            code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
            if name in _CONNECTION_ERRORS:
                self._down_until = self._clock() + self._retry
                raise KekError(f"KMS {what} failed: endpoint unreachable ({name})") from None
            raise KekError(f"KMS {what} failed: {code or name}") from None

    def _describe(self, key_id: str) -> str:
        if not isinstance(key_id, str) or not key_id:
            raise KekError("a KMS key id must be a non-empty string")
        meta = self._request("DescribeKey", lambda: self._client.describe_key(KeyId=key_id))["KeyMetadata"]
        if meta.get("KeySpec", "SYMMETRIC_DEFAULT") != "SYMMETRIC_DEFAULT" or meta.get("KeyUsage", "ENCRYPT_DECRYPT") != "ENCRYPT_DECRYPT":
            raise KekError(f"KMS key {key_id} must be a symmetric ENCRYPT_DECRYPT key")
        return str(meta["Arn"])

    def _check_state(self, arn: str) -> None:
        now = self._clock()
        with self._lock:
            if self._state_until.get(arn, 0.0) > now:
                return
        meta = self._request("DescribeKey", lambda: self._client.describe_key(KeyId=arn))["KeyMetadata"]
        state = meta.get("KeyState", "Enabled" if meta.get("Enabled", True) else "Disabled")
        if state != "Enabled":
            with self._lock:
                self._state_until.pop(arn, None)
            raise KekError(f"KMS key {arn} is {state}")
        with self._lock:
            self._state_until[arn] = now + self._state_ttl

    # -- KekProvider -------------------------------------------------------------------------------
    def wrap(self, plaintext_key: bytes, context: ContextLike) -> bytes:
        if not isinstance(plaintext_key, (bytes, bytearray)) or not 0 < len(plaintext_key) <= _MAX_KEY_BYTES:
            raise KekError(f"plaintext_key must be 1 to {_MAX_KEY_BYTES} bytes")
        check_context(context)
        self._check_state(self._arn)
        res = self._request(
            "Encrypt",
            lambda: self._client.encrypt(
                KeyId=self._arn, Plaintext=bytes(plaintext_key), EncryptionContext=encryption_context(context)
            ),
        )
        blob = bytes(res["CiphertextBlob"])
        return bytes([_VERSION]) + struct.pack(">H", len(self._arn_bytes)) + self._arn_bytes + blob

    def _parse(self, wrapped: bytes) -> tuple[str, bytes]:
        if not isinstance(wrapped, (bytes, bytearray)) or len(wrapped) < 4 or wrapped[0] != _VERSION:
            self._failed()
        (n,) = struct.unpack_from(">H", wrapped, 1)
        if n == 0 or len(wrapped) <= 3 + n:
            self._failed()
        try:
            arn = bytes(wrapped[3 : 3 + n]).decode("ascii")
        except UnicodeDecodeError:
            self._failed()
        return arn, bytes(wrapped[3 + n :])

    def key_id_of(self, wrapped: bytes, context: ContextLike | None = None) -> str:
        """The key id of the KMS key that wrapped ``wrapped`` (named in the blob; ``context`` is
        not needed; ``KekError`` if malformed)."""
        return f"kms:{self._parse(wrapped)[0]}"

    def unwrap(self, wrapped: bytes, context: ContextLike) -> bytes:
        check_context(context)
        arn, blob = self._parse(wrapped)
        if arn not in self._allowed:
            raise KekError(f"wrapped under KMS key {arn}, which is neither the KEK nor a previous one")
        self._check_state(arn)
        res = self._request(
            "Decrypt",
            lambda: self._client.decrypt(
                CiphertextBlob=blob, KeyId=arn, EncryptionContext=encryption_context(context)
            ),
        )
        if res.get("KeyId") not in (arn, None):
            self._failed()
        return bytes(res["Plaintext"])

    def _failed(self) -> NoReturn:
        raise KekError(f"unwrap failed under KEK {self.key_id} (wrong key, context or data)")

    def close(self) -> None:
        """Stop serving (later calls raise ``KekError``) and close the boto3 client if this
        provider made it (one handed in belongs to the caller). Idempotent."""
        self._closed = True
        if self._owns_client:
            self._owns_client = False
            close = getattr(self._client, "close", None)
            if close is not None:
                close()

    def health(self) -> None:
        probe = os.urandom(32)
        with self._lock:
            self._state_until.pop(self._arn, None)  # always ask KMS for the state here
        if self.unwrap(self.wrap(probe, _HEALTH_CONTEXT), _HEALTH_CONTEXT) != probe:
            raise KekError("KMS KEK self-test failed")  # pragma: no cover
