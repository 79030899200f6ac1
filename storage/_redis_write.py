"""The Redis tier's write path: put and delete of one chunk, and the cleanup of a replaced version.

put, in one MULTI/EXEC: read the old header (GETRANGE) and the pin flag, write the new segments
(named after a fresh random version), swap the head, add every new key to the group's index set,
register owner and group, and add the payload bytes to the counters. Then, outside the
transaction, unlink the old version's segments (readers holding the old header notice they are
gone and read again) and subtract the old bytes; re-PERSIST a pinned chunk when a TTL is set.

delete, in one MULTI/EXEC: read the old header and unlink the head (so exactly one of racing
deleters and writers owns the old version), then clean up as above.

If the client dies between the transaction and the cleanup, the old segments stay listed in the
group's index set (and expire with their TTL, if any): a group clear still finds them.
"""

from __future__ import annotations

import secrets
from typing import Any

from storage._redis_layout import (
    HEADER_SIZE,
    BadHeader,
    Header,
    Layout,
    pack_header,
    unpack_header,
)
from storage.types import ChunkKey

__all__ = ["delete_chunk", "put_chunk"]


async def put_chunk(
    redis: Any, lay: Layout, key: ChunkKey, view: memoryview, *, segment_bytes: int, ttl_s: int | None
) -> int:
    """Write the chunk; return the shared byte counter's new value."""
    size, seg = view.nbytes, segment_bytes
    head = lay.head(key)
    count = 0 if size <= seg else -(-size // seg)
    header = Header(length=size, segments=count, version=secrets.token_bytes(8))
    seg_keys = lay.segments(head, header)
    pipe = redis.pipeline(transaction=True)
    pipe.getrange(head, 0, HEADER_SIZE - 1)
    pipe.sismember(lay.pins, head)
    for i, name in enumerate(seg_keys):
        pipe.set(name, view[i * seg:(i + 1) * seg], ex=ttl_s)  # views: no copy of the payload
    value = pack_header(header) + view if count == 0 else pack_header(header)
    pipe.set(head, value, ex=ttl_s)
    pipe.sadd(lay.group_set(key.owner, key.group), head, *seg_keys)
    pipe.sadd(lay.group_owners(key.group), key.owner)
    pipe.sadd(lay.owner_groups(key.owner), key.group)
    pipe.sadd(lay.owners, key.owner)
    pipe.incrby(lay.group_bytes(key.owner, key.group), size)
    pipe.incrby(lay.bytes, size)
    result = await pipe.execute()
    used = int(result[-1])
    old, pinned = result[0], bool(result[1])
    after = redis.pipeline(transaction=False)
    if pinned and ttl_s is not None:
        for name in (head, *seg_keys):
            after.persist(name)
    if old:
        forgotten = await _forget(after, lay, key, head, old)
        used = used if forgotten is None else forgotten
    elif len(after):
        await after.execute()
    return used


async def delete_chunk(redis: Any, lay: Layout, key: ChunkKey) -> tuple[bool, int | None]:
    """Delete the chunk; return whether it was there and the byte counter's new value (if known)."""
    head = lay.head(key)
    pipe = redis.pipeline(transaction=True)
    pipe.getrange(head, 0, HEADER_SIZE - 1)
    pipe.unlink(head)
    pipe.srem(lay.group_set(key.owner, key.group), head)
    pipe.srem(lay.pins, head)
    old, removed, _, _ = await pipe.execute()
    used = await _forget(redis.pipeline(transaction=False), lay, key, head, old) if old else None
    return bool(removed), used


async def _forget(pipe: Any, lay: Layout, key: ChunkKey, head: str, old_header: bytes) -> int | None:
    """Unlink a replaced or deleted version's segments and subtract its bytes (plus whatever is
    already queued on ``pipe``); return the byte counter's new value."""
    try:
        old = unpack_header(old_header)
    except BadHeader:
        if len(pipe):
            await pipe.execute()
        return None
    names = lay.segments(head, old)
    if names:
        pipe.unlink(*names)
        pipe.srem(lay.group_set(key.owner, key.group), *names)
    pipe.decrby(lay.group_bytes(key.owner, key.group), old.length)
    pipe.decrby(lay.bytes, old.length)
    result = await pipe.execute()
    return int(result[-1])
