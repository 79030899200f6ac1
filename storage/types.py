"""The one contract every storage tier meets. Imports nothing of the project.

Tiers hold opaque keys and ciphertext envelopes. They never see a tenant's name, a namespace's
name or a secret: ``owner`` and ``group`` are opaque labels the gateway derives (HMACs), used for
per-owner quotas and for deleting a whole namespace without listing every key.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ChunkKey",
    "StoredChunk",
    "TierError",
    "ChunkNotFound",
    "TierUnavailable",
    "TierTimeout",
    "TierFull",
    "InvalidChunk",
    "failure_reason",
]


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """Where a chunk lives in every tier.

    owner:  opaque label of the tenant (hex), for quotas and tenant-wide deletion.
    group:  opaque label of the namespace (hex), for namespace-wide deletion.
    digest: the namespaced storage key, HMAC-SHA256(namespace secret, chained hash), hex.
    """

    owner: str
    group: str
    digest: str

    def __post_init__(self) -> None:
        o, g, d = self.owner, self.group, self.digest
        if (  # the common case in one expression (a lookup builds 128 keys); the loop says which field
            type(o) is str and type(g) is str and type(d) is str
            and 0 < len(o) <= 128 and 0 < len(g) <= 128 and 0 < len(d) <= 128
            and _HEX.issuperset(o) and _HEX.issuperset(g) and _HEX.issuperset(d)
        ):
            return
        for name in ("owner", "group", "digest"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or not _is_hex(value) or len(value) > 128:
                raise ValueError(f"ChunkKey.{name} must be a non-empty lowercase hex string")

    @classmethod
    def many(cls, owner: str, group: str, digests: Iterable[str]) -> list[ChunkKey]:
        """The keys of one owner and group (a request's chunks), with the constructor's checks;
        the labels are checked once (half the cost of 128 constructor calls)."""
        cls(owner, group, "0")  # the constructor's checks (and errors) for the labels
        new, put = object.__new__, object.__setattr__
        out = []
        for digest in digests:
            if not (type(digest) is str and 0 < len(digest) <= 128 and _HEX.issuperset(digest)):
                cls(owner, group, digest)  # raises the constructor's error (or accepts a str subclass)
            key = new(cls)
            put(key, "owner", owner)
            put(key, "group", group)
            put(key, "digest", digest)
            out.append(key)
        return out


_HEX = frozenset("0123456789abcdef")


def _is_hex(value: str) -> bool:
    return _HEX.issuperset(value)  # one C call: a lookup builds 128 keys per request


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """An envelope as a tier returns it. ``data`` is read-only; ``tier`` names where it was found."""

    key: ChunkKey
    data: memoryview
    tier: str

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class TierError(Exception):
    """Base of every storage error.

    TierError
     +-- ChunkNotFound     the key is not in this tier (a miss; a typed result, never None)
     +-- TierUnavailable   the tier cannot be reached or timed out (a miss for loads)
     |    +-- TierTimeout  it did not answer within the operation's deadline
     +-- TierFull          the chunk cannot fit (larger than the budget, or every byte pinned)
     +-- InvalidChunk      the bytes or key handed to put are not acceptable
    """


class ChunkNotFound(TierError):
    def __init__(self, key: ChunkKey, tier: str = "", *, tier_errors: Sequence[TierError] = ()) -> None:
        super().__init__(f"chunk not found in tier {tier or '?'}")
        self.key = key
        self.tier = tier
        # from a tier manager: the tiers that could not answer (so the key may exist there)
        self.tier_errors = tuple(tier_errors)


class TierUnavailable(TierError):
    pass


class TierTimeout(TierUnavailable):
    """The tier did not answer within the operation's deadline."""


class TierFull(TierError):
    pass


class InvalidChunk(TierError):
    pass


def failure_reason(errors: Iterable[BaseException]) -> Literal["", "tier_timeout", "tier_unavailable"]:
    """Why tiers could not answer, as the gateway's counters and results name it: ``tier_timeout``
    where any of ``errors`` missed its deadline, else ``tier_unavailable``; ``""`` for none. The
    one classifier of both modes (embedded loads and lookups, the server's fetch and lookup)."""
    reason: Literal["", "tier_unavailable"] = ""
    for exc in errors:
        if isinstance(exc, TierTimeout):
            return "tier_timeout"
        reason = "tier_unavailable"
    return reason
