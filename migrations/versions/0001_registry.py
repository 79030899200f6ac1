"""registry: tenants, namespaces, data keys, pins, clear jobs, secrets, revocations

Revision ID: 0001_registry
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001_registry"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "kv_tenants",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("disabled_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_kv_tenants"),
    )
    op.create_table(
        "kv_namespaces",
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("wrapped_salt", sa.LargeBinary, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "name", name="pk_kv_namespaces"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["kv_tenants.id"], ondelete="CASCADE", name="fk_kv_namespaces_tenant_id_kv_tenants"
        ),
    )
    op.create_table(
        "kv_data_keys",
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("wrapped_key", sa.LargeBinary, nullable=True),
        sa.Column("kek_id", sa.String(256), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("invocations", sa.BigInteger, nullable=False),
        sa.Column("invocation_limit", sa.BigInteger, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("destroyed_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("tenant_id", "version", name="pk_kv_data_keys"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["kv_tenants.id"], ondelete="CASCADE", name="fk_kv_data_keys_tenant_id_kv_tenants"
        ),
    )
    op.create_table(
        "kv_pins",
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("namespace", sa.String(128), nullable=False),
        sa.Column("digest", sa.String(128), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "namespace", "digest", name="pk_kv_pins"),
    )
    op.create_table(
        "kv_clear_jobs",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("namespace", sa.String(128), nullable=True),
        sa.Column("scope", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("details", sa.JSON, nullable=False),
        sa.Column("deleted_chunks", sa.BigInteger, nullable=False),
        sa.Column("deleted_bytes", sa.BigInteger, nullable=False),
        sa.Column("requested_at", TS, nullable=False),
        sa.Column("completed_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_kv_clear_jobs"),
    )
    op.create_index("ix_kv_clear_jobs_tenant_id", "kv_clear_jobs", ["tenant_id"])
    op.create_index("ix_kv_clear_jobs_state", "kv_clear_jobs", ["state"])
    op.create_table(
        "kv_secrets",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("wrapped", sa.LargeBinary, nullable=False),
        sa.Column("kek_id", sa.String(256), nullable=False),
        sa.Column("created_at", TS, server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("name", "version", name="pk_kv_secrets"),
    )
    op.create_table(
        "kv_revocations",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("cap_id", sa.String(64), nullable=True),
        sa.Column("not_before", sa.Float, nullable=True),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_kv_revocations"),
    )
    op.create_index("ix_kv_revocations_tenant_id", "kv_revocations", ["tenant_id"])
    op.create_index("ix_kv_revocations_cap_id", "kv_revocations", ["cap_id"])


def downgrade() -> None:
    op.drop_index("ix_kv_revocations_cap_id", "kv_revocations")
    op.drop_index("ix_kv_revocations_tenant_id", "kv_revocations")
    op.drop_table("kv_revocations")
    op.drop_table("kv_secrets")
    op.drop_index("ix_kv_clear_jobs_state", "kv_clear_jobs")
    op.drop_index("ix_kv_clear_jobs_tenant_id", "kv_clear_jobs")
    op.drop_table("kv_clear_jobs")
    op.drop_table("kv_pins")
    op.drop_table("kv_data_keys")
    op.drop_table("kv_namespaces")
    op.drop_table("kv_tenants")
