"""Wrap contexts: what a KEK binds a wrapped key to (its AAD, or KMS's encryption context).

A ``WrapContext`` is a purpose (a versioned label with named, typed fields) and the fields'
values. It encodes itself as ``lp(label, *values)``: each part as u32 length (big endian) || bytes,
a str as UTF-8, an int as u64 (big endian). Every wrapped key in a registry is bound to these
exact bytes, so the encoding must never change: a change would make stored keys unwrappable.

The purposes kvgate wraps under (the only place they are spelled):
- ``kvgate/dek/v1`` (tenant, key-version): a tenant's data key (``dek_context``);
- ``kvgate/ns-salt/v1`` (tenant, namespace, epoch): a namespace epoch's salt (``ns_salt_context``);
- ``kvgate/secret/v1`` (secret): a gateway secret by name (``secret_context``).

``WrapContext.decode`` turns such bytes back into the typed context (``None`` for anything else),
so a provider handed raw bytes still sees the fields (KMS copies them into its encryption context
for CloudTrail). Providers accept ``WrapContext`` or raw bytes (``context_bytes``)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from crypto.errors import InvalidParameter

__all__ = [
    "DEK",
    "NS_SALT",
    "PURPOSES",
    "SECRET",
    "ContextLike",
    "Purpose",
    "WrapContext",
    "context_bytes",
    "dek_context",
    "lp",
    "ns_salt_context",
    "secret_context",
]

_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_MAX_U64 = (1 << 64) - 1


def lp(*parts: str | bytes | int) -> bytes:
    """Length-prefixed canonical encoding: no two different field lists encode alike."""
    out = bytearray()
    for part in parts:
        if isinstance(part, int):
            raw = _U64.pack(part)
        elif isinstance(part, str):
            raw = part.encode("utf-8")
        else:
            raw = bytes(part)
        out += _U32.pack(len(raw)) + raw
    return bytes(out)


@dataclass(frozen=True, slots=True)
class Purpose:
    """A wrap purpose: its label and its fields' names and types (``str`` or ``int``)."""

    label: str
    fields: tuple[tuple[str, type[str | int]], ...]


DEK = Purpose("kvgate/dek/v1", (("tenant", str), ("key-version", int)))
NS_SALT = Purpose("kvgate/ns-salt/v1", (("tenant", str), ("namespace", str), ("epoch", int)))
SECRET = Purpose("kvgate/secret/v1", (("secret", str),))
PURPOSES: dict[str, Purpose] = {p.label: p for p in (DEK, NS_SALT, SECRET)}


@dataclass(frozen=True, slots=True)
class WrapContext:
    """A purpose and its field values; ``encode()`` (or ``bytes(ctx)``) is what a KEK binds."""

    purpose: Purpose
    values: tuple[str | int, ...]
    _encoded: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fields = self.purpose.fields
        if len(self.values) != len(fields):
            raise InvalidParameter(f"{self.purpose.label} takes {len(fields)} fields, got {len(self.values)}")
        for (name, kind), value in zip(fields, self.values, strict=True):
            if kind is int:
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_U64:
                    raise InvalidParameter(f"{self.purpose.label}: {name} must be an int in [0, 2**64)")
            elif not isinstance(value, str):
                raise InvalidParameter(f"{self.purpose.label}: {name} must be a str")
            else:
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise InvalidParameter(f"{self.purpose.label}: {name} is not valid UTF-8") from None
        object.__setattr__(self, "_encoded", lp(self.purpose.label, *self.values))

    def encode(self) -> bytes:
        """``lp(label, *values)``: the bytes every KEK provider binds."""
        return self._encoded

    def __bytes__(self) -> bytes:
        return self._encoded

    def fields(self) -> dict[str, str]:
        """The field values as text, by name (for audit trails such as KMS's encryption context)."""
        return {name: str(value) for (name, _), value in zip(self.purpose.fields, self.values, strict=True)}

    @classmethod
    def decode(cls, raw: bytes | bytearray) -> WrapContext | None:
        """The typed context ``raw`` encodes, or None if it is not one of ``PURPOSES``."""
        parts = _split(bytes(raw))
        if not parts:
            return None
        try:
            purpose = PURPOSES.get(parts[0].decode("utf-8"))
        except UnicodeDecodeError:
            return None
        if purpose is None or len(parts) != len(purpose.fields) + 1:
            return None
        values: list[str | int] = []
        for (_, kind), part in zip(purpose.fields, parts[1:], strict=True):
            if kind is int:
                if len(part) != _U64.size:
                    return None
                values.append(int.from_bytes(part, "big"))
            else:
                try:
                    values.append(part.decode("utf-8"))
                except UnicodeDecodeError:
                    return None
        return cls(purpose, tuple(values))


ContextLike = WrapContext | bytes | bytearray
"""What a KEK provider's ``wrap``/``unwrap`` take: a typed context, or its (or any) raw bytes."""


def context_bytes(context: ContextLike) -> bytes:
    """The bytes a provider binds for ``context``; ``TypeError`` for anything else."""
    if isinstance(context, WrapContext):
        return context.encode()
    if isinstance(context, (bytes, bytearray)):
        return bytes(context)
    raise TypeError("a wrap context must be a WrapContext or bytes")


def _split(raw: bytes) -> list[bytes] | None:
    parts, i = [], 0
    while i < len(raw):
        if i + 4 > len(raw):
            return None
        (n,) = _U32.unpack_from(raw, i)
        if i + 4 + n > len(raw):
            return None
        parts.append(raw[i + 4 : i + 4 + n])
        i += 4 + n
    return parts


def dek_context(tenant: str, version: int) -> WrapContext:
    """The context of ``tenant``'s data key ``version``."""
    return WrapContext(DEK, (tenant, version))


def ns_salt_context(tenant: str, namespace: str, epoch: int) -> WrapContext:
    """The context of the salt of ``tenant``/``namespace`` at ``epoch``."""
    return WrapContext(NS_SALT, (tenant, namespace, epoch))


def secret_context(name: str) -> WrapContext:
    """The context of the gateway secret ``name``."""
    return WrapContext(SECRET, (name,))
