"""Writing checkpoints: extend the last checkpoint by the rows after it, sign, store, log.

    cp = Checkpointer(store, signer, CheckpointDirectory(state_dir / "audit-checkpoints"), sink=writer)
    checkpoint = await cp.checkpoint()       # now; the server also runs one every interval

The tree starts from the newest checkpoint in the directory (its frontier checked against its
signed root), never from what the database holds now, and only the rows after it are read. Each
must continue the chain where the checkpoint left it (``seq`` = size + 1, ``prev_hash`` = its
``last_hash``, its own hash recomputed), so rows the last checkpoint covers that were truncated,
deleted, inserted or rewritten raise :class:`CheckpointTampered` instead of being signed. With no
checkpoint yet, the whole chain is read once from seq 1. The signed checkpoint goes to the
directory, to each ``mirror`` (an async callable; a failing mirror is logged, the directory stays
the record), then into the log as an ``audit.checkpoint`` event, durable before ``checkpoint()``
returns. Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from audit.checkpoint import (
    CHECKPOINT_ACTION,
    Checkpoint,
    CheckpointDirectory,
    make_checkpoint,
    parse_checkpoint,
)
from audit.errors import AuditError
from audit.merkle import CompactRange, leaf_hash
from audit.record import GENESIS_HASH, chain_hash
from audit.signing import AuditSigner, load_public_key_pem
from audit.store import AuditStore
from audit.types import Actor, AuditEvent, AuditSink, record_durably

__all__ = ["CheckpointTampered", "Checkpointer"]

log = logging.getLogger(__name__)


class CheckpointTampered(AuditError):
    """The stored chain no longer extends the newest checkpoint: rows it covers were changed."""


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Checkpointer:
    def __init__(
        self,
        store: AuditStore,
        signer: AuditSigner,
        directory: CheckpointDirectory,
        *,
        sink: AuditSink | None = None,
        mirrors: Sequence[Callable[[dict[str, Any]], Awaitable[object]]] = (),
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self.mirrors = list(mirrors)
        self.store = store
        self.signer = signer
        self.directory = directory
        self._sink = sink
        self._clock = clock
        self._public_key = load_public_key_pem(signer.public_key_pem(), "the audit signer's public key")
        self._lock = asyncio.Lock()

    def latest(self) -> Checkpoint | None:
        return self.directory.latest(self._public_key)

    def covering(self, size: int) -> Checkpoint | None:
        """The smallest stored checkpoint of at least ``size`` rows, else the newest (exports)."""
        return self.directory.covering(size, self._public_key)

    async def checkpoint(self) -> Checkpoint:
        """Sign and store a checkpoint of the whole chain as it is now; raise CheckpointTampered
        if the chain does not extend the newest checkpoint."""
        async with self._lock:
            prev = await asyncio.to_thread(self.latest)
            tree = prev.compact_range() if prev is not None else CompactRange()
            last = prev.last_hash if prev is not None else GENESIS_HASH
            start = tree.size
            async for rec in self.store.iter_records(after_seq=start):
                expected = tree.size + 1
                if rec.seq != expected:
                    raise CheckpointTampered(f"row seq {rec.seq} where seq {expected} was expected (rows deleted)")
                if rec.prev_hash != last:
                    raise CheckpointTampered(
                        f"row seq {rec.seq} does not link to the checkpointed chain (rows before it rewritten or replaced)"
                    )
                if chain_hash(rec.hashed_fields()) != rec.hash:
                    raise CheckpointTampered(f"row seq {rec.seq} does not match its hash (row modified)")
                tree.append(leaf_hash(bytes.fromhex(rec.hash)))
                last = rec.hash
            if tree.size == start and start > 0:
                head = await self.store.head()
                if head.seq != start or head.hash != last:
                    raise CheckpointTampered(
                        f"the chain head is seq {head.seq}; the checkpoint covers {start} rows (rows deleted or rewritten)"
                    )
            doc = make_checkpoint(tree, last, self._clock(), self.signer)
            await asyncio.to_thread(self.directory.write, doc)
            checkpoint = parse_checkpoint(doc, self._public_key)
            for mirror in self.mirrors:
                try:
                    await mirror(doc)
                except Exception:  # a second copy; the directory holds the checkpoint
                    log.exception("audit checkpoint mirror failed")
        if self._sink is not None:
            await record_durably(
                self._sink,
                AuditEvent(
                    CHECKPOINT_ACTION,
                    actor=Actor(subject="kvgate:checkpoint"),
                    details={
                        "tree_size": checkpoint.tree_size, "root_hash": checkpoint.root_hash,
                        "last_hash": checkpoint.last_hash, "created_at": checkpoint.created_at,
                        "key_id": checkpoint.key_id, "signature_algorithm": doc["signature_algorithm"],
                        "signature": doc["signature"],
                    },
                ),
            )
        log.info("audit checkpoint: %d rows, root %s", checkpoint.tree_size, checkpoint.root_hash[:16])
        return checkpoint

    async def consistency(self, first: int, second: int) -> dict[str, object]:
        """The RFC 9162 consistency proof from tree size ``first`` to ``second`` over the stored
        rows, with both roots as the database has them now (the caller compares those roots to
        signed checkpoints; a database that was rewritten gives roots that do not match)."""
        leaves: list[bytes] = []
        async for rec in self.store.iter_records(through_seq=second):
            leaves.append(leaf_hash(bytes.fromhex(rec.hash)))
        if not 0 < first <= second <= len(leaves):
            raise ValueError(f"the log has {len(leaves)} rows; need 0 < first <= second <= {len(leaves)}")
        from audit.merkle import consistency_proof, root_of

        return {
            "first": first, "second": second,
            "first_root": root_of(leaves[:first]).hex(), "second_root": root_of(leaves[:second]).hex(),
            "proof": [h.hex() for h in consistency_proof(leaves[:second], first)],
        }

    async def run_every(self, interval_s: float) -> None:
        """Checkpoint every ``interval_s`` seconds until cancelled; failures are logged, not fatal."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.checkpoint()
            except CheckpointTampered:
                log.critical("audit log tampering detected; no checkpoint signed", exc_info=True)
            except AuditError:
                log.exception("audit checkpoint failed")
