"""An append-only Redis stream of small opaque records (``XADD``), read back newest first.

The gateway uses it to keep a second copy of the audit log's signed checkpoints outside the
audit database (gateway.services.auditing); this module only moves bytes, so redis-py stays inside
``storage``. Errors become :class:`StreamUnavailable`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RedisStream", "StreamUnavailable"]


class StreamUnavailable(Exception):
    """Redis could not be reached or refused the command."""


class RedisStream:
    def __init__(self, url: str, key: str, *, maxlen: int | None = None) -> None:
        self.key = key
        self._maxlen = maxlen
        self._client: Any
        if url.startswith(("redis+cluster://", "rediss+cluster://")):  # one key: any slot will do
            from storage._cluster_client import make_cluster_client

            self._client = make_cluster_client(url, connect_timeout_s=2.0, socket_timeout_s=2.0, max_connections=4)
        else:
            import redis.asyncio as aioredis  # redis-py only where a stream is configured

            self._client = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)

    async def append(self, record: bytes) -> str:
        """Append one record; returns its stream id."""
        try:
            sid = await self._client.xadd(self.key, {b"r": record}, maxlen=self._maxlen, approximate=True)
        except Exception as exc:
            raise StreamUnavailable(f"XADD {self.key} failed: {type(exc).__name__}: {exc}") from None
        return sid.decode() if isinstance(sid, bytes) else str(sid)

    async def latest(self, count: int = 1) -> list[bytes]:
        """The newest ``count`` records, newest first."""
        try:
            entries = await self._client.xrevrange(self.key, count=count)
        except Exception as exc:
            raise StreamUnavailable(f"XREVRANGE {self.key} failed: {type(exc).__name__}: {exc}") from None
        return [fields[b"r"] for _sid, fields in entries]

    async def aclose(self) -> None:
        await self._client.aclose()
