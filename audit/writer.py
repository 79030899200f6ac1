"""The background audit writer: ``emit()`` on the hot path, batches to the database off it.

    writer = AuditWriter("postgresql+asyncpg://...", spool_dir=state_dir / "audit-spool")
    await writer.start()          # adopts and replays orphaned spool files, starts the task
    writer.emit(AuditEvent(...))  # any thread; validates, stamps, queues; no I/O, no await
    await writer.record(event)    # control actions: returns once this event is durable
    await writer.flush()          # everything emitted so far is durable (database or spool)
    await writer.aclose()         # flushes, replays what it can, stops, releases the spool

Batches are written in emit order; a failed write goes to the spool (fsync), and every later batch
goes behind it until the spool is replayed, oldest first, so the chain order is each process's emit
order. ``emit`` (data plane) may lose, on a crash, what was emitted within one flush interval plus
one database write; ``aclose`` writes or spools everything. ``record`` (control actions) returns
only once the event and everything before it is committed or fsync-ed to the spool: nothing
acknowledged is lost. SQLite needs a database file. Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from audit.db import create_audit_engine
from audit.errors import AuditError, AuditStorageError, AuditWriterClosed, SpoolError
from audit.record import PendingEvent
from audit.spool import Spool
from audit.store import AuditStore
from audit.types import AuditEvent

__all__ = ["AuditWriter", "WriterStats"]

T = TypeVar("T")


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (spool file work) on the loop's default executor, or inline where that takes
    no more work: once the interpreter exits, executors refuse new work, and a writer closed then
    (by a finalizer at exit) must still spool its events and release its spool files."""
    try:
        fut = asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        return fn(*args)
    return await fut

log = logging.getLogger(__name__)


def _utcnow() -> datetime:
    return datetime.now(UTC)


class WriterStats:
    """Counters for metrics (read them from any thread; they only grow)."""

    __slots__ = ("db_errors", "duplicates", "replayed", "spool_errors", "spooled", "written")

    def __init__(self) -> None:
        self.written = self.duplicates = self.spooled = self.replayed = 0
        self.db_errors = self.spool_errors = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


class AuditWriter:
    """An :class:`~audit.types.AuditSink` that chains events into the audit database."""

    def __init__(
        self,
        database: str | AsyncEngine,
        *,
        spool_dir: str | Path,
        batch_size: int = 500,
        flush_interval: float = 0.05,
        retry_initial: float = 0.2,
        retry_max: float = 5.0,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        if not 1 <= batch_size <= 5000:
            raise ValueError("batch_size must be between 1 and 5000")
        if flush_interval <= 0 or retry_initial <= 0 or retry_max < retry_initial:
            raise ValueError("flush_interval, retry_initial must be > 0 and retry_max >= retry_initial")
        self._owns_engine = isinstance(database, str)
        self._engine = create_audit_engine(database) if isinstance(database, str) else database
        self.store = AuditStore(self._engine, clock=clock)
        self._spool = Spool(spool_dir)
        self._batch_size = batch_size
        self._interval = flush_interval
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._clock = clock
        self._lock = threading.Lock()
        self._queue: collections.deque[PendingEvent] = collections.deque()
        self._held: list[PendingEvent] = []  # drained but neither in the database nor spooled
        self._enqueued = 0
        self._persisted = 0
        self._wake_pending = False
        self._closed = False
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._progress: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._retry_at = 0.0
        self._retry_delay = retry_initial
        self.stats = WriterStats()

    # -- hot path ---------------------------------------------------------------------------

    def emit(self, event: AuditEvent) -> None:
        """Validate, stamp and queue ``event``. Raises only InvalidAuditEvent / AuditWriterClosed."""
        pending = PendingEvent.from_event(event, self._clock())
        with self._lock:
            if self._closed:
                raise AuditWriterClosed("the audit writer is closed")
            self._queue.append(pending)
            self._enqueued += 1
            wake = len(self._queue) >= self._batch_size and not self._wake_pending
            if wake:
                self._wake_pending = True
        if wake and self._loop is not None and self._wake is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # loop closed: the periodic wake or aclose() picks it up
                pass

    async def record(self, event: AuditEvent, timeout: float | None = 30.0) -> None:
        """Emit ``event`` and return once it is durable (committed, or fsync-ed to the spool).
        Raises AuditStorageError when that does not happen within ``timeout`` seconds."""
        self.emit(event)
        try:
            await self.flush(timeout)
        except TimeoutError:
            raise AuditStorageError(
                f"audit event {event.action} was not made durable within {timeout}s (database and spool failing)"
            ) from None

    # -- numbers for metrics ----------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Events emitted and not yet durable (in memory)."""
        return len(self._queue) + len(self._held)

    @property
    def spool_events(self) -> int:
        return self._spool.pending_events

    @property
    def spool_bytes(self) -> int:
        return self._spool.pending_bytes

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Adopt orphaned spool files, replay the spool (if the database answers), start the task."""
        if self._closed:
            raise AuditWriterClosed("the audit writer is closed")
        if self._task is not None:
            return
        await _off_loop(self._spool.open)
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        await self._replay()
        self._task = asyncio.create_task(self._run(), name="kvgate-audit-writer")

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every event emitted before this call is in the database or the spool."""
        with self._lock:
            target = self._enqueued
        if self._task is None:
            raise AuditError("the audit writer is not running: call start() first")
        async with asyncio.timeout(timeout):
            while self._persisted < target:
                assert self._wake is not None and self._progress is not None
                self._progress.clear()
                self._wake.set()
                if self._task.done():
                    raise AuditError("the audit writer task has stopped")
                await self._progress.wait()

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until the queue and the spool are empty: everything is in the database."""
        async with asyncio.timeout(timeout):
            await self.flush()
            while self._spool.has_pending or self.queue_depth:
                assert self._wake is not None and self._progress is not None
                self._progress.clear()
                self._retry_at = 0.0
                self._wake.set()
                await self._progress.wait()

    async def aclose(self, timeout: float = 30.0) -> None:
        """Stop accepting events, write or spool all of them, try one last replay, stop."""
        if self._task is None and not self._closed and self._queue:
            await self.start()  # events emitted before start() are not dropped
        with self._lock:
            if self._closed and self._task is None:
                return
            self._closed = True
        try:
            if self._task is not None:
                self._stopping = True
                assert self._wake is not None
                self._wake.set()
                try:
                    await asyncio.wait_for(asyncio.shield(self._task), timeout)
                except TimeoutError:
                    log.error(
                        "audit writer did not stop within %.1fs; %d events stay queued", timeout, self.queue_depth
                    )
                    self._task.cancel()
                self._task = None
        finally:
            await _off_loop(self._spool.close)
            if self._owns_engine:
                await self._engine.dispose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the task ---------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._wake is not None and self._progress is not None
        while True:
            replay_due = self._spool.has_pending and time.monotonic() >= self._retry_at
            if not (self._stopping or self._held or replay_due or len(self._queue) >= self._batch_size):
                try:
                    await asyncio.wait_for(self._wake.wait(), self._interval)
                except TimeoutError:
                    pass
            self._wake.clear()
            with self._lock:
                self._wake_pending = False
            try:
                await self._step()
            except Exception:  # never let the task die: log, back off, go on
                log.exception("audit writer step failed")
                await asyncio.sleep(self._retry_initial)
            self._progress.set()
            if self._stopping and not self._queue and not self._held:
                await self._replay(force=True)
                self._progress.set()
                return

    def _take(self, limit: int) -> list[PendingEvent]:
        batch, self._held = self._held, []
        with self._lock:
            while self._queue and len(batch) < limit:
                batch.append(self._queue.popleft())
        return batch

    async def _step(self) -> None:
        if self._spool.has_pending:
            batch = self._take(1 << 30)  # keep order: all new events go behind the spool
            if batch:
                await self._spool_batch(batch)
            await self._replay(max_batches=20)  # then spool what came in meanwhile, and go on
            return
        while True:
            batch = self._take(self._batch_size)
            if not batch:
                return
            try:
                result = await self.store.append(batch)
            except AuditError as exc:
                self.stats.db_errors += 1
                log.warning("audit database unavailable (%s); spooling %d events", exc, len(batch))
                self._schedule_retry()
                await self._spool_batch(batch)
                return
            self.stats.written += result.written
            self.stats.duplicates += result.duplicates
            self._persisted += len(batch)
            self._retry_delay = self._retry_initial
            self._signal_progress()

    async def _spool_batch(self, batch: list[PendingEvent]) -> None:
        try:
            await _off_loop(self._spool.append, batch)
        except SpoolError:
            self.stats.spool_errors += 1
            log.exception("audit spool write failed; %d events held in memory", len(batch))
            self._held = batch + self._held
            await asyncio.sleep(self._retry_delay)
            self._retry_delay = min(self._retry_max, self._retry_delay * 2)
            return
        self.stats.spooled += len(batch)
        self._persisted += len(batch)
        self._signal_progress()

    def _signal_progress(self) -> None:
        if self._progress is not None:
            self._progress.set()

    def _schedule_retry(self) -> None:
        self._retry_at = time.monotonic() + self._retry_delay
        self._retry_delay = min(self._retry_max, self._retry_delay * 2)

    async def _replay(self, force: bool = False, max_batches: int | None = None) -> None:
        """Replay spooled events oldest first until the spool is empty, a write fails or
        ``max_batches`` batches are done."""
        if not force and time.monotonic() < self._retry_at:
            return
        done = 0
        while self._spool.has_pending and (max_batches is None or done < max_batches):
            done += 1
            chunk = await _off_loop(self._spool.read, self._batch_size)
            if chunk is None:
                return
            file, events, offset, lines = chunk
            if events:
                try:
                    result = await self.store.append(events)
                except AuditError as exc:
                    self.stats.db_errors += 1
                    log.info("audit spool replay deferred: %s", exc)
                    self._schedule_retry()
                    return
                self.stats.written += result.written
                self.stats.duplicates += result.duplicates
                self.stats.replayed += len(events)
            await _off_loop(self._spool.commit, file, offset, lines)
            self._retry_delay = self._retry_initial
            self._retry_at = 0.0
