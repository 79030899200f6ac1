"""The Redis Cluster tier's write path: put and delete of one chunk, each one MULTI/EXEC on one slot.

put, in one MULTI/EXEC on the chunk's slot: read the old header (GETRANGE) and the pin flag,
write the new segments (named after a fresh random version), swap the head and add the payload
bytes to the tag's counter; sent together with the INCRBY of the total counter's shard (another
slot, so not atomic with it: the total is a gauge; a failed transaction takes its bytes back, and
a shard whose master cannot be reached leaves the total off instead of failing a write that stands).
Then, for a replaced chunk: unlink the old version's segments and subtract its bytes from the tag
counter (same slot, one pipeline) and from the shard. Re-PERSIST a pinned chunk when a
TTL is set. delete: the same with the head unlinked in the transaction.

No index sets: a namespace clear finds every key by its tag (SCAN per master), so a client dying
between the transaction and the cleanup leaves old segments that the next clear still finds.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from storage._cluster_layout import ClusterLayout
from storage._cluster_slot import on_slot
from storage._redis_layout import (
    HEADER_SIZE,
    BadHeader,
    Header,
    pack_header,
    unpack_header,
)
from storage.types import ChunkKey

__all__ = ["delete_chunk", "put_chunk"]


async def put_chunk(
    redis: Any, lay: ClusterLayout, key: ChunkKey, view: memoryview, *, segment_bytes: int, ttl_s: int | None
) -> tuple[str, int | None]:
    """Write the chunk; return the total counter shard's name and its new value (None where that
    shard's master could not be reached: the chunk is written all the same)."""
    size, seg = view.nbytes, segment_bytes
    head = lay.head(key)
    count = 0 if size <= seg else -(-size // seg)
    header = Header(length=size, segments=count, version=secrets.token_bytes(8))
    seg_keys = lay.segments(head, header)
    ex = ("EX", ttl_s) if ttl_s is not None else ()
    cmds: list[tuple[Any, ...]] = [("GETRANGE", head, 0, HEADER_SIZE - 1), ("SISMEMBER", lay.pins(key), head)]
    for i, name in enumerate(seg_keys):
        cmds.append(("SET", name, view[i * seg:(i + 1) * seg], *ex))  # views: no copy of the payload
    cmds.append(("SET", head, pack_header(header) + view if count == 0 else pack_header(header), *ex))
    cmds.append(("INCRBY", lay.tag_bytes(key), size))
    shard = lay.shard(key)
    # the transaction and the shard's increment go out together (two slots: one round trip)
    tx: list[Any] | BaseException
    inc: list[Any] | BaseException
    tx, inc = await asyncio.gather(on_slot(redis, head, cmds, transaction=True),
                                   on_slot(redis, shard, [("INCRBY", shard, size)], transaction=False),
                                   return_exceptions=True)
    if isinstance(tx, BaseException):
        if not isinstance(inc, BaseException):  # the chunk was not written: take its bytes back
            await on_slot(redis, shard, [("DECRBY", shard, size)], transaction=False)
        raise tx
    # the chunk was written: a shard increment that failed is sent once more
    counted = await _counted(redis, shard, "INCRBY", size) if isinstance(inc, BaseException) else inc
    used = None if counted is None else int(counted[0])
    old, pinned = tx[0], bool(tx[1])
    after: list[tuple[Any, ...]] = []  # same slot: one round trip, one node
    if pinned and ttl_s is not None:
        after += [("PERSIST", name) for name in (head, *seg_keys)]
    freed = _forget(after, lay, key, head, old) if old else 0
    if after:
        await on_slot(redis, head, after, transaction=True)
    if freed:
        dec = await _counted(redis, shard, "DECRBY", freed)
        used = None if dec is None else int(dec[0])
    return shard, used


async def _counted(redis: Any, shard: str, op: str, n: int) -> list[Any] | None:
    """Move the total counter's shard after the chunk's own transaction went through; None where
    the shard's master cannot be reached (the total is a gauge: it is then off by ``n``, and the
    chunk's write or delete stands, so it is not reported as failed)."""
    try:
        return list(await on_slot(redis, shard, [(op, shard, n)], transaction=False))
    except Exception:  # any failure of another master's counter
        return None


async def delete_chunk(redis: Any, lay: ClusterLayout, key: ChunkKey) -> tuple[bool, str, int | None]:
    """Delete the chunk; return whether it was there, the counter shard and its new value (if known)."""
    head = lay.head(key)
    old, removed, _ = await on_slot(redis, head, [
        ("GETRANGE", head, 0, HEADER_SIZE - 1), ("UNLINK", head), ("SREM", lay.pins(key), head)], transaction=True)
    used = None
    if old:
        after: list[tuple[Any, ...]] = []
        freed = _forget(after, lay, key, head, old)
        if after:
            await on_slot(redis, head, after, transaction=True)
        if freed:
            dec = await _counted(redis, lay.shard(key), "DECRBY", freed)
            used = None if dec is None else int(dec[0])
    return bool(removed), lay.shard(key), used


def _forget(cmds: list[tuple[Any, ...]], lay: ClusterLayout, key: ChunkKey, head: str, old_header: bytes) -> int:
    """Queue the unlink of a replaced or deleted version's segments and the tag counter's
    decrement on ``cmds``; return the bytes freed (0 for a header this code did not write)."""
    try:
        old = unpack_header(old_header)
    except BadHeader:
        return 0
    names = lay.segments(head, old)
    if names:
        cmds.append(("UNLINK", *names))
    cmds.append(("DECRBY", lay.tag_bytes(key), old.length))
    return old.length
