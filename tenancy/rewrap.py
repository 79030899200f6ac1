"""Registry queries for a KEK rotation: every wrapped data key, gateway secret and namespace
salt, read in batches and rewrapped with conditional UPDATEs (a row changed meanwhile, a key
destroyed during the rotation say, is left alone). SQLAlchemy stays in the packages that own
tables; ``gateway.services.kekrotate`` drives the rotation."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Table, and_, bindparam, select, tuple_, update

from tenancy.models import DataKey, Namespace, WrappedSecret
from tenancy.registry import Registry

__all__ = ["RewrapQueries"]


class RewrapQueries:
    """The registry queries a rotation needs."""

    def __init__(self, registry: Registry) -> None:
        self.engine = registry.engine

    async def data_keys(self, new_id: str, after: tuple[str, int] | None, limit: int) -> list[Any]:
        q = select(DataKey.tenant_id, DataKey.version, DataKey.wrapped_key, DataKey.kek_id).where(
            DataKey.kek_id != new_id, DataKey.wrapped_key.is_not(None)
        )
        if after is not None:
            q = q.where(tuple_(DataKey.tenant_id, DataKey.version) > tuple_(*after))
        q = q.order_by(DataKey.tenant_id, DataKey.version).limit(limit)
        async with self.engine.connect() as conn:
            return list((await conn.execute(q)).all())

    async def update_data_keys(self, new_id: str, rows: list[dict[str, Any]]) -> int:
        t = cast(Table, DataKey.__table__)
        stmt = (
            update(t)
            .where(and_(t.c.tenant_id == bindparam("t"), t.c.version == bindparam("v"),
                        t.c.kek_id == bindparam("old_id"), t.c.wrapped_key == bindparam("old")))
            .values(wrapped_key=bindparam("new"), kek_id=new_id)
        )
        return await self._many(stmt, rows)

    async def secrets(self, new_id: str) -> list[Any]:
        q = select(WrappedSecret.name, WrappedSecret.version, WrappedSecret.wrapped, WrappedSecret.kek_id).where(
            WrappedSecret.kek_id != new_id
        ).order_by(WrappedSecret.name, WrappedSecret.version)
        async with self.engine.connect() as conn:
            return list((await conn.execute(q)).all())

    async def update_secrets(self, new_id: str, rows: list[dict[str, Any]]) -> int:
        t = cast(Table, WrappedSecret.__table__)
        stmt = (
            update(t)
            .where(and_(t.c.name == bindparam("n"), t.c.version == bindparam("v"),
                        t.c.kek_id == bindparam("old_id"), t.c.wrapped == bindparam("old")))
            .values(wrapped=bindparam("new"), kek_id=new_id)
        )
        return await self._many(stmt, rows)

    async def salts(self, after: tuple[str, str] | None, limit: int) -> list[Any]:
        q = select(Namespace.tenant_id, Namespace.name, Namespace.epoch, Namespace.wrapped_salt)
        if after is not None:
            q = q.where(tuple_(Namespace.tenant_id, Namespace.name) > tuple_(*after))
        q = q.order_by(Namespace.tenant_id, Namespace.name).limit(limit)
        async with self.engine.connect() as conn:
            return list((await conn.execute(q)).all())

    async def update_salts(self, rows: list[dict[str, Any]]) -> int:
        t = cast(Table, Namespace.__table__)
        stmt = (
            update(t)
            .where(and_(t.c.tenant_id == bindparam("t"), t.c.name == bindparam("n"),
                        t.c.epoch == bindparam("e"), t.c.wrapped_salt == bindparam("old")))
            .values(wrapped_salt=bindparam("new"))
        )
        return await self._many(stmt, rows)

    async def _many(self, stmt: Any, rows: list[dict[str, Any]]) -> int:
        if not rows:
            return 0
        async with self.engine.begin() as conn:
            res = await conn.execute(stmt, rows)
        count = res.rowcount
        return len(rows) if count is None or count < 0 else count  # some drivers do not count executemany
