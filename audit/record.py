"""The audit record and its canonical encoding: the one place the chain hash is defined.

An :class:`~audit.types.AuditEvent` becomes a :class:`PendingEvent` at ``emit()`` time (validated,
given a UUIDv7 event id and its emit time, details frozen into canonical JSON text); the writer
later gives it ``seq``, ``recorded_at`` and ``prev_hash``, and an :class:`AuditRecord` results.

Chain hash, version 1: ``sha256(canonical_json({"v": 1, "seq", "event_id", "occurred_at",
"recorded_at", "actor": {"subject", "issuer", "tenant", "client_id", "token_id", "source"},
"action", "outcome", "target": {"tenant", "namespace", "chunk_count", "chunk_digest", "tier_from",
"tier_to"}, "details": <canonical JSON text of the details>, "prev_hash": <64 hex digits;
GENESIS_HASH for seq 1>})).hexdigest()``. ``canonical_json`` is ``json.dumps(sort_keys=True,
separators=(",", ":"), ensure_ascii=True, allow_nan=False)`` as UTF-8; TIME is UTC
``YYYY-MM-DDTHH:MM:SS.ffffffZ``; absent values are ``null`` (empty strings are stored as absent).
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

from audit.errors import InvalidAuditEvent
from audit.types import Actor, AuditEvent, Target

__all__ = [
    "ACTOR_FIELDS",
    "GENESIS_HASH",
    "OUTCOMES",
    "RECORD_VERSION",
    "TARGET_FIELDS",
    "AuditRecord",
    "PendingEvent",
    "canonical_details",
    "canonical_json",
    "chain_hash",
    "format_time",
    "parse_time",
    "uuid7",
]

RECORD_VERSION = 1
GENESIS_HASH = "0" * 64
OUTCOMES = frozenset({"success", "failure", "denied"})
MAX_FIELD_CHARS = 1024
MAX_DETAILS_CHARS = 64 * 1024
_ACTION_RE = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)*$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")
_UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
ACTOR_FIELDS = _ACTOR_FIELDS = tuple(f.name for f in fields(Actor))
TARGET_FIELDS = _TARGET_FIELDS = tuple(f.name for f in fields(Target))
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _details_default(value: Any) -> Any:
    """Details may hold a few non-JSON types; each becomes plain JSON once, at emit."""
    if isinstance(value, datetime):
        return format_time(value)  # naive datetimes raise ValueError
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


_DETAILS_ENCODER = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False, default=_details_default
)


def canonical_json(value: Any) -> str:
    """Deterministic JSON text; raises TypeError/ValueError for what JSON cannot carry."""
    return _ENCODER.encode(value)


def canonical_details(details: Mapping[str, Any]) -> str:
    if not isinstance(details, Mapping):
        raise InvalidAuditEvent(f"details must be a mapping, not {type(details).__name__}")
    if not details:
        return "{}"
    try:
        text = _DETAILS_ENCODER.encode(details if type(details) is dict else dict(details))
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidAuditEvent(f"details are not JSON-serialisable: {exc}") from None
    if len(text) > MAX_DETAILS_CHARS:
        raise InvalidAuditEvent(f"details are {len(text)} characters; the limit is {MAX_DETAILS_CHARS}")
    return text


def format_time(value: datetime) -> str:
    if value.tzinfo is None:
        raise ValueError("audit times must be timezone-aware")
    return value.astimezone(UTC).strftime(_TIME_FORMAT)


def parse_time(text: str) -> datetime:
    """Parse the canonical TIME form (strict); raises ValueError otherwise."""
    return datetime.strptime(text, _TIME_FORMAT).replace(tzinfo=UTC)


def uuid7(at: datetime) -> str:
    """A UUIDv7 (RFC 9562) whose 48-bit timestamp is ``at`` in milliseconds; 74 random bits."""
    ms = int(at.timestamp() * 1000) & ((1 << 48) - 1)
    rand = int.from_bytes(os.urandom(10), "big") >> 6  # 74 bits from the OS CSPRNG (fork-safe)
    value = (ms << 80) | (0x7 << 76) | ((rand >> 62) << 64) | (0b10 << 62) | (rand & ((1 << 62) - 1))
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _clean_str(owner: str, name: str, value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidAuditEvent(f"{owner}.{name} must be a string or None, not {type(value).__name__}")
    if len(value) > MAX_FIELD_CHARS:
        raise InvalidAuditEvent(f"{owner}.{name} is longer than {MAX_FIELD_CHARS} characters")
    if "\x00" in value:
        raise InvalidAuditEvent(f"{owner}.{name} contains a NUL character")
    return value


def _needs_cleaning(owner: str, obj: object, names: tuple[str, ...]) -> bool:
    """Validate string fields in one pass; True when one must be normalised ("" -> None)."""
    dirty = False
    for n in names:
        v = getattr(obj, n)
        if v is None:
            continue
        if type(v) is str and v and len(v) <= MAX_FIELD_CHARS and "\x00" not in v:
            continue
        if _clean_str(owner, n, v) is None:  # raises unless v == ""
            dirty = True
    return dirty


def _clean_actor(actor: object) -> Actor:
    if not isinstance(actor, Actor):
        raise InvalidAuditEvent(f"actor must be an audit.types.Actor, not {type(actor).__name__}")
    if type(actor) is Actor and not _needs_cleaning("actor", actor, _ACTOR_FIELDS):
        return actor  # frozen and already clean: no copy on the hot path
    return Actor(*(_clean_str("actor", n, getattr(actor, n)) for n in _ACTOR_FIELDS))


_TARGET_STR_FIELDS = tuple(n for n in _TARGET_FIELDS if n != "chunk_count")


def _clean_target(target: object) -> Target:
    if not isinstance(target, Target):
        raise InvalidAuditEvent(f"target must be an audit.types.Target, not {type(target).__name__}")
    count = target.chunk_count
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise InvalidAuditEvent("target.chunk_count must be a non-negative int or None")
    if count is not None and count >= 1 << 63:
        raise InvalidAuditEvent("target.chunk_count is too large")
    dirty = _needs_cleaning("target", target, _TARGET_STR_FIELDS)
    digest = target.chunk_digest
    if digest and not _HEX64_RE.fullmatch(digest):
        raise InvalidAuditEvent("target.chunk_digest must be 64 lowercase hex digits (sha256)")
    if type(target) is Target and not dirty:
        return target
    cleaned = {n: _clean_str("target", n, getattr(target, n)) for n in _TARGET_STR_FIELDS}
    return Target(chunk_count=count, **cleaned)


@dataclass(frozen=True, slots=True)
class PendingEvent:
    """A validated event with its identity and emit time, not yet placed in the chain."""

    event_id: str
    occurred_at: datetime
    action: str
    outcome: str
    actor: Actor
    target: Target
    details: str  # canonical JSON text

    @classmethod
    def from_event(cls, event: AuditEvent, now: datetime) -> PendingEvent:
        if not isinstance(event, AuditEvent):
            raise InvalidAuditEvent(f"expected an audit.types.AuditEvent, not {type(event).__name__}")
        action = event.action
        if not isinstance(action, str) or len(action) > 128 or not _ACTION_RE.fullmatch(action):
            raise InvalidAuditEvent(f"action {action!r} is not a dotted lowercase name")
        if event.outcome not in OUTCOMES:
            raise InvalidAuditEvent(f"outcome {event.outcome!r} is not one of {sorted(OUTCOMES)}")
        if now.tzinfo is None:
            raise InvalidAuditEvent("the audit clock returned a naive datetime")
        given = event.event_id
        if given is not None and (not isinstance(given, str) or not _UUID_RE.fullmatch(given)):
            raise InvalidAuditEvent("event_id must be a lowercase UUID string")
        return cls(
            event_id=given or uuid7(now),
            occurred_at=now.astimezone(UTC),
            action=action,
            outcome=event.outcome,
            actor=_clean_actor(event.actor),
            target=_clean_target(event.target),
            details=canonical_details(event.details),
        )

    def to_json(self) -> str:
        """One spool line (without the newline)."""
        return canonical_json(
            {
                "v": RECORD_VERSION,
                "event_id": self.event_id,
                "occurred_at": format_time(self.occurred_at),
                "action": self.action,
                "outcome": self.outcome,
                "actor": {n: getattr(self.actor, n) for n in _ACTOR_FIELDS},
                "target": {n: getattr(self.target, n) for n in _TARGET_FIELDS},
                "details": self.details,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> PendingEvent:
        """Inverse of :meth:`to_json`; raises ValueError/KeyError/TypeError on a bad line."""
        doc = json.loads(text)
        if doc.get("v") != RECORD_VERSION:
            raise ValueError(f"unknown spool record version {doc.get('v')!r}")
        return cls(
            event_id=str(doc["event_id"]),
            occurred_at=parse_time(doc["occurred_at"]),
            action=doc["action"],
            outcome=doc["outcome"],
            actor=Actor(**{n: doc["actor"][n] for n in _ACTOR_FIELDS}),
            target=Target(**{n: doc["target"][n] for n in _TARGET_FIELDS}),
            details=doc["details"],
        )


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """A row of the chain."""

    seq: int
    event: PendingEvent
    recorded_at: datetime
    prev_hash: str
    hash: str

    @classmethod
    def chain(cls, event: PendingEvent, *, seq: int, recorded_at: datetime, prev_hash: str) -> AuditRecord:
        rec = cls(seq=seq, event=event, recorded_at=recorded_at, prev_hash=prev_hash, hash="")
        return cls(
            seq=seq, event=event, recorded_at=recorded_at, prev_hash=prev_hash, hash=chain_hash(rec.hashed_fields())
        )

    def hashed_fields(self) -> dict[str, Any]:
        """The exact document the hash covers (see the module docstring)."""
        e = self.event
        return {
            "v": RECORD_VERSION,
            "seq": self.seq,
            "event_id": e.event_id,
            "occurred_at": format_time(e.occurred_at),
            "recorded_at": format_time(self.recorded_at),
            "actor": {n: getattr(e.actor, n) for n in _ACTOR_FIELDS},
            "action": e.action,
            "outcome": e.outcome,
            "target": {n: getattr(e.target, n) for n in _TARGET_FIELDS},
            "details": e.details,
            "prev_hash": self.prev_hash,
        }

    def to_row(self) -> dict[str, Any]:
        """Column values for the audit table (see audit.models)."""
        e = self.event
        row: dict[str, Any] = {
            "seq": self.seq,
            "event_id": e.event_id,
            "occurred_at": e.occurred_at,
            "recorded_at": self.recorded_at,
            "action": e.action,
            "outcome": e.outcome,
            "details": e.details,
            "prev_hash": self.prev_hash,
            "hash": self.hash,
        }
        row.update({f"actor_{n}": getattr(e.actor, n) for n in _ACTOR_FIELDS})
        row.update({f"target_{n}": getattr(e.target, n) for n in _TARGET_FIELDS})
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> AuditRecord:
        event = PendingEvent(
            event_id=row["event_id"],
            occurred_at=row["occurred_at"],
            action=row["action"],
            outcome=row["outcome"],
            actor=Actor(**{n: row[f"actor_{n}"] for n in _ACTOR_FIELDS}),
            target=Target(**{n: row[f"target_{n}"] for n in _TARGET_FIELDS}),
            details=row["details"],
        )
        return cls(
            seq=row["seq"], event=event, recorded_at=row["recorded_at"], prev_hash=row["prev_hash"], hash=row["hash"]
        )


def chain_hash(hashed_fields: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json(dict(hashed_fields)).encode("utf-8")).hexdigest()
