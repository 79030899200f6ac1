"""The audit table: one append-only, hash-chained row per event (``kv_audit_events``).

``audit_metadata`` is this package's own MetaData; Alembic (migrations/versions/0002_audit.py)
gets it next to the registry's. ``create_all`` on it also installs the append-only guard through
an ``after_create`` DDL event, so tests that skip Alembic get the same protection:

- Postgres: a trigger refuses UPDATE, DELETE (per row) and TRUNCATE with SQLSTATE 42501.
- SQLite: triggers RAISE(ABORT) on UPDATE and DELETE.

``details`` is TEXT holding the canonical JSON that was hashed (not JSONB, which would reorder
keys and renormalise numbers); cast it (``details::jsonb``) to query it on Postgres.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    MetaData,
    String,
    Table,
    Text,
    event,
)
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.types import TypeDecorator

__all__ = [
    "APPEND_ONLY_DDL",
    "UTCDateTime",
    "audit_events",
    "audit_metadata",
    "install_append_only_guard",
]

audit_metadata = MetaData(
    naming_convention={
        "ix": "ix_%(column_0_label)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite keeps naive UTC text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("audit times must be timezone-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        t: datetime = value
        if t.tzinfo is None:
            return t.replace(tzinfo=UTC)
        return t.astimezone(UTC)


TABLE = "kv_audit_events"
_S = String(1024)

audit_events = Table(
    TABLE,
    audit_metadata,
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("event_id", String(36), nullable=False, unique=True),
    Column("occurred_at", UTCDateTime(), nullable=False),
    Column("recorded_at", UTCDateTime(), nullable=False),
    Column("actor_subject", _S),
    Column("actor_issuer", _S),
    Column("actor_tenant", _S),
    Column("actor_client_id", _S),
    Column("actor_token_id", _S),
    Column("actor_source", _S),
    Column("action", String(128), nullable=False),
    Column("outcome", String(16), nullable=False),
    Column("target_tenant", _S),
    Column("target_namespace", _S),
    Column("target_chunk_count", BigInteger),
    Column("target_chunk_digest", String(64)),
    Column("target_tier_from", _S),
    Column("target_tier_to", _S),
    Column("details", Text, nullable=False),
    Column("prev_hash", String(64), nullable=False),
    Column("hash", String(64), nullable=False),
    CheckConstraint("outcome IN ('success', 'failure', 'denied')", name="outcome"),
    Index("ix_kv_audit_events_recorded_at", "recorded_at"),
    Index("ix_kv_audit_events_target_tenant_seq", "target_tenant", "seq"),
    Index("ix_kv_audit_events_actor_tenant_seq", "actor_tenant", "seq"),
)

_PG_REFUSE = (
    "CREATE OR REPLACE FUNCTION kv_audit_events_refuse_change() RETURNS trigger "
    "LANGUAGE plpgsql AS $fn$ BEGIN "
    "RAISE EXCEPTION USING MESSAGE = 'kv_audit_events is append-only: ' || TG_OP || ' refused', "
    "ERRCODE = 'insufficient_privilege'; "
    "END $fn$"
)

# One statement per string (asyncpg prepares statements one at a time). The same text is in the
# 0002_audit migration, which keeps its own frozen copy.
APPEND_ONLY_DDL: dict[str, tuple[str, ...]] = {
    "postgresql": (
        _PG_REFUSE,
        (
            f"CREATE TRIGGER kv_audit_events_append_only BEFORE UPDATE OR DELETE ON {TABLE} "
            "FOR EACH ROW EXECUTE FUNCTION kv_audit_events_refuse_change()"
        ),
        (
            f"CREATE TRIGGER kv_audit_events_no_truncate BEFORE TRUNCATE ON {TABLE} "
            "FOR EACH STATEMENT EXECUTE FUNCTION kv_audit_events_refuse_change()"
        ),
    ),
    "sqlite": (
        (
            f"CREATE TRIGGER kv_audit_events_no_update BEFORE UPDATE ON {TABLE} "
            "BEGIN SELECT RAISE(ABORT, 'kv_audit_events is append-only: UPDATE refused'); END"
        ),
        (
            f"CREATE TRIGGER kv_audit_events_no_delete BEFORE DELETE ON {TABLE} "
            "BEGIN SELECT RAISE(ABORT, 'kv_audit_events is append-only: DELETE refused'); END"
        ),
    ),
}


def install_append_only_guard(connection: Connection) -> None:
    """Create the triggers that refuse UPDATE/DELETE on the audit table (sync connection)."""
    for statement in APPEND_ONLY_DDL.get(connection.dialect.name, ()):
        connection.exec_driver_sql(statement)


@event.listens_for(audit_events, "after_create")
def _guard_after_create(target: Table, connection: Connection, **_: Any) -> None:
    install_append_only_guard(connection)
