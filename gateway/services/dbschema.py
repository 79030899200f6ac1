"""Schema management: ``kvgate migrate`` and the refusal to start on a schema that is behind."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import migrations

# Alembic (about a second of imports on a small host) loads when a schema is checked or
# migrated, not when the server module is imported.
if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy.engine import Connection
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["alembic_config", "upgrade", "downgrade", "check_schema", "SchemaBehind", "head_revision"]


class SchemaBehind(RuntimeError):
    """The database schema is older than this kvgate: run `kvgate migrate`."""


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    from gateway.services.statefiles import ensure_private_sqlite

    ensure_private_sqlite(url)  # SQLite would create the database 0644
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def head_revision(url: str = "sqlite://") -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


async def check_schema(engine: AsyncEngine) -> None:
    """Raise SchemaBehind unless the database is at the head revision."""
    head = head_revision()

    from alembic.runtime.migration import MigrationContext

    def current(sync_conn: Connection) -> str | None:
        return MigrationContext.configure(sync_conn).get_current_revision()

    async with engine.connect() as conn:
        rev = await conn.run_sync(current)
    if rev != head:
        raise SchemaBehind(
            f"the database schema is at revision {rev or 'none'} but this kvgate needs {head}: "
            "run `kvgate migrate`"
        )
