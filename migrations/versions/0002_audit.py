"""audit: the append-only, hash-chained audit events table and its guard triggers

Revision ID: 0002_audit
Revises: 0001_registry

A frozen copy of audit/models.py at this revision (tests compare the two). The triggers refuse
UPDATE, DELETE (and on Postgres TRUNCATE) of audit rows; downgrade drops the table with them.
"""

import sqlalchemy as sa
from alembic import op

revision = "0002_audit"
down_revision = "0001_registry"
branch_labels = None
depends_on = None

TABLE = "kv_audit_events"
TS = sa.DateTime(timezone=True)
S = sa.String(1024)

PG_UP = (
    (
        "CREATE OR REPLACE FUNCTION kv_audit_events_refuse_change() RETURNS trigger "
        "LANGUAGE plpgsql AS $fn$ BEGIN "
        "RAISE EXCEPTION USING MESSAGE = 'kv_audit_events is append-only: ' || TG_OP || ' refused', "
        "ERRCODE = 'insufficient_privilege'; "
        "END $fn$"
    ),
    (
        f"CREATE TRIGGER kv_audit_events_append_only BEFORE UPDATE OR DELETE ON {TABLE} "
        "FOR EACH ROW EXECUTE FUNCTION kv_audit_events_refuse_change()"
    ),
    (
        f"CREATE TRIGGER kv_audit_events_no_truncate BEFORE TRUNCATE ON {TABLE} "
        "FOR EACH STATEMENT EXECUTE FUNCTION kv_audit_events_refuse_change()"
    ),
)
SQLITE_UP = (
    (
        f"CREATE TRIGGER kv_audit_events_no_update BEFORE UPDATE ON {TABLE} "
        "BEGIN SELECT RAISE(ABORT, 'kv_audit_events is append-only: UPDATE refused'); END"
    ),
    (
        f"CREATE TRIGGER kv_audit_events_no_delete BEFORE DELETE ON {TABLE} "
        "BEGIN SELECT RAISE(ABORT, 'kv_audit_events is append-only: DELETE refused'); END"
    ),
)


def upgrade() -> None:
    op.create_table(
        TABLE,
        sa.Column("seq", sa.BigInteger, nullable=False, autoincrement=False),
        sa.Column("event_id", sa.String(36), nullable=False),
        sa.Column("occurred_at", TS, nullable=False),
        sa.Column("recorded_at", TS, nullable=False),
        sa.Column("actor_subject", S),
        sa.Column("actor_issuer", S),
        sa.Column("actor_tenant", S),
        sa.Column("actor_client_id", S),
        sa.Column("actor_token_id", S),
        sa.Column("actor_source", S),
        sa.Column("action", sa.String(128), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("target_tenant", S),
        sa.Column("target_namespace", S),
        sa.Column("target_chunk_count", sa.BigInteger),
        sa.Column("target_chunk_digest", sa.String(64)),
        sa.Column("target_tier_from", S),
        sa.Column("target_tier_to", S),
        sa.Column("details", sa.Text, nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("seq", name="pk_kv_audit_events"),
        sa.UniqueConstraint("event_id", name="uq_kv_audit_events_event_id"),
        sa.CheckConstraint("outcome IN ('success', 'failure', 'denied')", name="ck_kv_audit_events_outcome"),
    )
    op.create_index("ix_kv_audit_events_recorded_at", TABLE, ["recorded_at"])
    op.create_index("ix_kv_audit_events_target_tenant_seq", TABLE, ["target_tenant", "seq"])
    op.create_index("ix_kv_audit_events_actor_tenant_seq", TABLE, ["actor_tenant", "seq"])
    dialect = op.get_bind().dialect.name
    for statement in PG_UP if dialect == "postgresql" else SQLITE_UP if dialect == "sqlite" else ():
        op.execute(statement)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.drop_table(TABLE)  # drops its indexes and triggers too
    if dialect == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS kv_audit_events_refuse_change()")
