"""Commands on one slot of a Redis Cluster, sent the way the single-node tier sends a pipeline.

redis-py's asyncio ``ClusterPipeline(transaction=True)`` runs every queued command through
``asyncio.run`` in a new thread (to resolve its slot), which costs a thread per command and can
open connections on a foreign event loop. Every command of a chunk operation targets one slot (the
chunk's hash tag), so the tier sends them itself: take a connection of the master that owns the
slot in the client's slot map, write ``[ASKING] [MULTI] cmd... [EXEC]`` in one packed write (the
connection class writes payload views piece by piece, as on a single node), read the replies.

Redirections: ``-MOVED`` (a reshard finished, or a failover) updates the client's slot map and
sends again; ``-ASK`` (the slot is migrating and a key is already on the target) sends again to
the target after ``ASKING`` (which holds for a whole MULTI); ``-TRYAGAIN`` (a multi-key command
whose keys are split by an ongoing migration) waits 20 ms and sends again. All bounded by
``_REDIRECTS`` and, above this, by the caller's deadline. A connection error marks the slot map
stale (redis-py reloads it on the next call) and is raised for the tier's breaker to count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ConnectionError,
    ExecAbortError,
    MaxConnectionsError,
    MovedError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["on_slot"]

_REDIRECTS = 8
Command = Sequence[Any]


async def on_slot(client: RedisCluster, key: str, commands: Sequence[Command], *, transaction: bool) -> list[Any]:
    """Run ``commands`` (all on ``key``'s slot) on that slot's master; their replies in order
    (raw RESP values). ``transaction``: wrapped in MULTI/EXEC. The first error reply is raised."""
    slot = key_slot(key.encode())
    ask: Any = None
    for _ in range(_REDIRECTS):
        if client._initialize:
            await client.initialize()
        node = ask or client.nodes_manager.get_node_from_slot(slot)
        replies = await _send(client, node, commands, transaction=transaction, asking=ask is not None)
        ask = None
        errors = [r for r in replies if isinstance(r, ResponseError)]
        if not errors:
            return replies
        first = errors[0]
        if isinstance(first, MovedError):
            await client.nodes_manager.move_slot(first)
        elif isinstance(first, AskError):
            ask = client.get_node(host=first.host, port=first.port)
            if ask is None:
                client._initialize = True
        elif isinstance(first, TryAgainError):
            await asyncio.sleep(0.02)
        else:
            raise first
    raise TryAgainError("slot kept redirecting")


async def _acquire(node: Any) -> Any:
    """A connection of ``node``; when all ``max_connections`` are busy, wait for one (as the
    single-node tier's blocking pool does; the caller's deadline bounds the wait) instead of
    failing with MaxConnectionsError, which the breaker would count against a healthy node."""
    while True:
        try:
            return node.acquire_connection()
        except MaxConnectionsError:
            await asyncio.sleep(0.001)


async def _send(client: RedisCluster, node: Any, commands: Sequence[Command], *, transaction: bool,
                asking: bool) -> list[Any]:
    wrapped: list[Command] = [*([("ASKING",)] if asking else []), *([("MULTI",)] if transaction else []),
                              *commands, *([("EXEC",)] if transaction else [])]
    conn = await _acquire(node)
    try:
        await conn.send_packed_command(conn.pack_commands(wrapped), False)
        replies: list[Any] = []
        for _ in wrapped:
            try:
                replies.append(await conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
    except BaseException as exc:
        await conn.disconnect(nowait=True)
        if isinstance(exc, (ConnectionError, RedisTimeoutError, OSError)):
            client._initialize = True  # reload the slot map on the next call (a failover?)
        raise
    finally:
        node.release(conn)
    if asking:
        replies.pop(0)
    if not transaction:
        return replies
    queued, done = replies[1:-1], replies[-1]
    errors = [r for r in queued if isinstance(r, ResponseError)]
    if errors:
        return errors  # the transaction was aborted (EXECABORT): report why
    if isinstance(done, ExecAbortError) or not isinstance(done, list):
        return [done if isinstance(done, ResponseError) else ResponseError("EXEC failed")]
    return done
