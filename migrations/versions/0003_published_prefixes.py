"""published prefixes: sharing scopes, their members, publications and their chunks

Revision ID: 0003_published_prefixes
Revises: 0002_audit

A scope's keys live in the existing tables under an internal owner row of kv_tenants
(tenancy.sharing.scope_owner); downgrade drops the four tables and those owner rows (their
namespaces and data keys go with them, by cascade).
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_published_prefixes"
down_revision = "0002_audit"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "kv_scopes",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("everyone", sa.Boolean, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_kv_scopes"),
    )
    op.create_table(
        "kv_scope_members",
        sa.Column("scope", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.PrimaryKeyConstraint("scope", "tenant_id", name="pk_kv_scope_members"),
        sa.ForeignKeyConstraint(
            ["scope"], ["kv_scopes.name"], ondelete="CASCADE", name="fk_kv_scope_members_scope_kv_scopes"
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["kv_tenants.id"], ondelete="CASCADE", name="fk_kv_scope_members_tenant_id_kv_tenants"
        ),
    )
    op.create_index("ix_kv_scope_members_tenant_id", "kv_scope_members", ["tenant_id"])
    op.create_table(
        "kv_prefixes",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("scope", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("tokens", sa.LargeBinary, nullable=False),
        sa.Column("num_tokens", sa.Integer, nullable=False),
        sa.Column("key_version", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("revoked_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_kv_prefixes"),
        sa.ForeignKeyConstraint(["scope"], ["kv_scopes.name"], name="fk_kv_prefixes_scope_kv_scopes"),
    )
    op.create_index("ix_kv_prefixes_scope", "kv_prefixes", ["scope"])
    op.create_index("ix_kv_prefixes_state", "kv_prefixes", ["state"])
    op.create_table(
        "kv_prefix_chunks",
        sa.Column("prefix_id", sa.String(32), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.Column("chained_hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("prefix_id", "fingerprint", "idx", name="pk_kv_prefix_chunks"),
        sa.ForeignKeyConstraint(
            ["prefix_id"], ["kv_prefixes.id"], ondelete="CASCADE", name="fk_kv_prefix_chunks_prefix_id_kv_prefixes"
        ),
    )


def downgrade() -> None:
    op.drop_table("kv_prefix_chunks")
    op.drop_index("ix_kv_prefixes_state", "kv_prefixes")
    op.drop_index("ix_kv_prefixes_scope", "kv_prefixes")
    op.drop_table("kv_prefixes")
    op.drop_index("ix_kv_scope_members_tenant_id", "kv_scope_members")
    op.drop_table("kv_scope_members")
    op.drop_table("kv_scopes")
    # the scopes' owner rows (tenancy.sharing.OWNER_PREFIX); their namespaces and keys cascade
    # on Postgres; SQLite enforces cascades only with its foreign_keys pragma, so delete them too
    for table in ("kv_namespaces", "kv_data_keys"):
        op.execute(sa.text(f"DELETE FROM {table} WHERE tenant_id LIKE 'scope:%'"))
    op.execute(sa.text("DELETE FROM kv_tenants WHERE id LIKE 'scope:%'"))
