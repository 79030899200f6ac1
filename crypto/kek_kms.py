"""``KmsKek``: a KEK that is an AWS KMS key (boto3; any KMS-compatible endpoint).

Data keys are wrapped with KMS ``Encrypt`` and unwrapped with ``Decrypt``; the KEK never leaves
KMS. The caller's context (which binds tenant and key version) goes into the KMS *encryption
context*, as the AWS Encryption SDK does: KMS authenticates it with the ciphertext, records it in
CloudTrail, and refuses to decrypt under any other context. The encryption context carries the
whole context (``kvgate:ctx``, base64url) and, for the contexts kvgate uses, readable copies of
its fields (``kvgate:purpose``, ``kvgate:tenant``, ``kvgate:key-version`` ...) so an auditor
reading CloudTrail sees which tenant's key was unwrapped.

Wrapped format v1 (the key ARN travels with the blob; ``Decrypt`` is always called with that
``KeyId``, and only the configured key and the ``previous_key_ids`` are accepted, the Encryption
SDK's "strict mode")::

    0x01 || len(arn) (2 bytes, big endian) || key ARN (ASCII) || KMS ciphertext blob

Key id and version: ``key_id`` is ``kms:<key ARN>`` (an alias is resolved to its key once, at
start). KMS's own automatic rotation of key material keeps the ARN and needs nothing from kvgate;
moving to another KMS key is a KEK rotation (``kvgate keys rotate-kek``) with the old key listed in
``previous_key_ids`` until it finishes.

Key state: besides mapping ``DisabledException`` and ``KMSInvalidStateException`` to ``KekError``,
the provider checks the key's state with ``DescribeKey`` at most every ``state_ttl_s`` seconds and
refuses to use a key that is not ``Enabled`` (a disabled or pending-deletion key stops serving even
behind emulators that do not enforce the state on Decrypt). Connection failures open a short
circuit (``retry_interval_s``) so an unreachable KMS costs the data path a miss, not a stall.
boto3 is imported here, lazily, so it stays an optional dependency.
"""

from __future__ import annotations

import base64
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from crypto.errors import KekError

__all__ = ["KmsKek", "encryption_context"]

_VERSION = 1
_MAX_KEY_BYTES = 1024
_HEALTH_CONTEXT = b"kvgate/kek/health"
# The contexts kvgate builds (tenancy.namespaces.lp fields), for readable encryption-context copies.
_FIELDS: dict[str, tuple[tuple[str, type], ...]] = {
    "kvgate/dek/v1": (("tenant", str), ("key-version", int)),
    "kvgate/ns-salt/v1": (("tenant", str), ("namespace", str), ("epoch", int)),
    "kvgate/secret/v1": (("secret", str),),
}
_CONNECTION_ERRORS = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError")


def _split_lp(context: bytes) -> list[bytes] | None:
    parts, i = [], 0
    while i < len(context):
        if i + 4 > len(context):
            return None
        (n,) = struct.unpack_from(">I", context, i)
        if i + 4 + n > len(context):
            return None
        parts.append(context[i + 4 : i + 4 + n])
        i += 4 + n
    return parts


def encryption_context(context: bytes) -> dict[str, str]:
    """The KMS encryption context for a wrap context: the whole context, plus readable fields."""
    out = {"kvgate:ctx": base64.urlsafe_b64encode(bytes(context)).decode("ascii")}
    parts = _split_lp(bytes(context))
    if not parts:
        return out
    try:
        purpose = parts[0].decode("utf-8")
    except UnicodeDecodeError:
        return out
    fields = _FIELDS.get(purpose)
    if fields is None or len(parts) != len(fields) + 1:
        return out
    readable = {"kvgate:purpose": purpose}
    for (name, kind), raw in zip(fields, parts[1:]):
        if kind is int:
            if len(raw) != 8:
                return out
            readable[f"kvgate:{name}"] = str(int.from_bytes(raw, "big"))
        else:
            try:
                readable[f"kvgate:{name}"] = raw.decode("utf-8")
            except UnicodeDecodeError:
                return out
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
    def wrap(self, plaintext_key: bytes, context: bytes) -> bytes:
        if not isinstance(plaintext_key, (bytes, bytearray)) or not 0 < len(plaintext_key) <= _MAX_KEY_BYTES:
            raise KekError(f"plaintext_key must be 1 to {_MAX_KEY_BYTES} bytes")
        if not isinstance(context, (bytes, bytearray)):
            raise KekError("context must be bytes")
        self._check_state(self._arn)
        res = self._request(
            "Encrypt",
            lambda: self._client.encrypt(
                KeyId=self._arn, Plaintext=bytes(plaintext_key), EncryptionContext=encryption_context(context)
            ),
        )
        blob = res["CiphertextBlob"]
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

    def key_id_of(self, wrapped: bytes) -> str:
        """The key id of the KMS key that wrapped ``wrapped`` (``KekError`` if malformed)."""
        return f"kms:{self._parse(wrapped)[0]}"

    def unwrap(self, wrapped: bytes, context: bytes) -> bytes:
        if not isinstance(context, (bytes, bytearray)):
            raise KekError("context must be bytes")
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

    def health(self) -> None:
        probe = os.urandom(32)
        with self._lock:
            self._state_until.pop(self._arn, None)  # always ask KMS for the state here
        if self.unwrap(self.wrap(probe, _HEALTH_CONTEXT), _HEALTH_CONTEXT) != probe:
            raise KekError("KMS KEK self-test failed")  # pragma: no cover
