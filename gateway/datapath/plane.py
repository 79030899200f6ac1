"""The data plane: store, lookup and retrieve of a prompt's chunks over any ``ChunkStore``.

    tokens --chain_hashes--> h_i --store.session: capability, namespace--> storage keys
    paged KV --seal (gather + AES-256-GCM, AAD binds identity)--> store.put
    store.fetch --open (every tag checked) + scatter--> paged KV

Embedded and remote mode run this same code; only the store differs. Keys are asked of the
store's session once per request for every chunk to seal, and per load batch, from the fetched
envelopes' headers, for the chunks to open: asking costs no round trip either way (in process the
keys are derived there; a remote session received them with the envelopes, in the fetch stream),
so opening one batch overlaps the fetches of the next. A chunk that fails authentication, whose
key is unavailable, or whose tier (or server) cannot deliver it ends the loaded prefix: a miss,
counted, never handed to the engine.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from crypto.envelope import EnvelopeKeys
from crypto.errors import DecryptionFailed, KekError, KeyUnavailable
from gateway.chunking import Chunk
from gateway.chunks.service import ChunkStats
from gateway.datapath.gate import STEPS
from gateway.datapath.path import DataPath
from gateway.datapath.plan import TokensLike, chunks_of, request_slots
from gateway.datapath.sealers import OnLayers, OpenJob, SealJob
from gateway.datapath.stores import ChunkSession, ChunkStore, Fetched, FetchFailed, KeyRef, KeysUnavailable, Reserved
from gateway.errors import AccessDenied, InvalidRequest, NamespaceChanged
from gateway.logs import RateLimitedLogger
from gateway.metrics import LoadReason, Metrics
from gateway.protocol.shmpages import prefault_behind
from gateway.types import KVModel, LookupResult, RetrieveResult, StoreResult
from kernels.paged import PagedKV
from storage.types import TierError, failure_reason

__all__ = ["DataPlane"]

log = logging.getLogger("kvgate.core")
_degraded_log = RateLimitedLogger(log)  # an outage degrades every load: one line per interval
_changed_log = RateLimitedLogger(log)  # a clear under load refuses many stores at once

BlockIds = Sequence[int] | torch.Tensor | None


class _LayerProgress:
    """How far a layer-wise load is: the least of its batches (each says how many layers of its
    chunks are in place; one that ended counts them all), passed on as it grows, from whatever
    thread moved it."""

    def __init__(self, n: int, on_layers: OnLayers | None) -> None:
        self._at = [0] * n
        self._said = 0
        self._on_layers = on_layers
        self._lock = threading.Lock()

    def batch_at(self, b: int, layers: int) -> None:
        if self._on_layers is None:
            return
        with self._lock:
            self._at[b] = max(self._at[b], layers)
            low = min(self._at)
            if low > self._said:
                self._said = low
                self._on_layers(low)  # under the lock: in order (it only notes the number)


class DataPlane:
    def __init__(self, datapath: DataPath, chunk_tokens: int, metrics: Metrics) -> None:
        self.datapath = datapath
        self.chunk_tokens = chunk_tokens
        self.metrics = metrics
        self.counts = ChunkStats(metrics)

    def chunks(self, model: KVModel, tokens: TokensLike) -> list[Chunk]:
        return chunks_of(model, tokens, self.chunk_tokens)

    def _batches(self, n: int, model: KVModel, chunks: Sequence[Chunk], *, layered: bool = False) -> list[list[int]]:
        """Split n chunks into batches for the CPU pool: at most ~16 MiB each (so tier I/O
        overlaps the next batch's CPU work) and at least one per thread when there is enough.
        ``layered`` (a layer-wise load): one batch per thread, all opened at once, layer by layer
        (smaller batches would run one after another, and the first layer of the last one would
        be in place only near the end)."""
        chunk_bytes = model.geometry.chunk_nbytes(chunks[0].num_tokens)
        by_size = max(1, (16 << 20) // chunk_bytes)
        by_threads = max(1, -(-n // max(1, self.datapath.threads)))
        size = by_threads if layered else min(by_size, by_threads)
        return [list(range(k, min(k + size, n))) for k in range(0, n, size)]

    # -- lookup ------------------------------------------------------------------------------
    async def lookup(self, store: ChunkStore, token: str, model: KVModel, tokens: TokensLike) -> LookupResult:
        """How many leading tokens are stored (prefix walk, stops at the first miss)."""
        chunks = self.chunks(model, tokens)
        try:
            session = await store.session(token, "lookup", chunks)
        except KeysUnavailable:
            self.counts.lookup(0, "key_unavailable")
            return LookupResult(hit_tokens=0, hit_chunks=0, total_chunks=len(chunks), degraded="key_unavailable")
        try:
            found = await session.presence()
        except KeysUnavailable:  # a server whose KEK cannot unwrap the namespace now
            self.counts.lookup(0, "key_unavailable")
            return LookupResult(hit_tokens=0, hit_chunks=0, total_chunks=len(chunks), degraded="key_unavailable")
        finally:
            await session.aclose()
        hits, degraded = found.hits, found.degraded  # the prefix walk (gateway.chunks.service.Located)
        self.counts.lookup(hits, degraded)
        return LookupResult(
            hit_tokens=chunks[hits - 1].end if hits else 0, hit_chunks=hits, total_chunks=len(chunks),
            degraded=degraded, locations=found.locations,
        )

    # -- store -------------------------------------------------------------------------------
    async def store(
        self,
        store: ChunkStore,
        token: str,
        model: KVModel,
        tokens: TokensLike,
        kv_layers: Sequence[torch.Tensor] | PagedKV,
        *,
        block_ids: BlockIds = None,
        slot_mapping: BlockIds = None,
        skip_existing: bool = True,
        first_chunk: int = 0,
    ) -> StoreResult:
        """Encrypt and store every chunk of ``tokens`` whose KV sits in ``kv_layers``, from chunk
        ``first_chunk`` on (the chunks before it are chained into the hashes, never sealed: the
        caller knows them stored and holds no KV for them)."""
        chunks = self.chunks(model, tokens)
        kv, slots = request_slots(model, kv_layers, chunks[-1].end, block_ids, slot_mapping)
        try:
            session = await store.session(token, "put", chunks)
        except KeysUnavailable:  # nothing can be sealed now; the engine goes on
            self.counts.store_failed(len(chunks))
            return StoreResult(tokens=chunks[-1].end, chunks=len(chunks), stored=0, skipped=0, bytes_stored=0)
        todo = list(range(max(0, first_chunk), len(chunks)))
        try:
            if skip_existing and todo:
                try:
                    present = (await session.presence()).present
                except KeysUnavailable:  # a server whose KEK cannot unwrap the namespace now
                    self.counts.store_failed(len(chunks))
                    return StoreResult(tokens=chunks[-1].end, chunks=len(chunks), stored=0, skipped=0, bytes_stored=0)
                todo = [i for i in todo if not present[i]]
            try:
                try:
                    stored, stored_bytes = await self._seal_and_put(session, model, chunks, kv, slots, todo)
                except AccessDenied:
                    # revoked since the session opened (a clear): the keys it sealed with are gone
                    # too. One more try with a fresh capability and keys; a second refusal stands.
                    await session.aclose()
                    session = await store.session(token, "put", chunks)
                    stored, stored_bytes = await self._seal_and_put(session, model, chunks, kv, slots, todo)
            except NamespaceChanged:
                # a clear ended the namespace epoch these envelopes were sealed for: none of them
                # is kept, and no retry (the next store seals under the new epoch)
                self.counts.namespace_changed()
                self.counts.store_failed(len(todo))
                _changed_log.warning("a store raced a clear of its namespace: nothing of it was kept")
                stored = stored_bytes = 0
        finally:
            await session.aclose()
        self.counts.stored(stored, stored_bytes)
        return StoreResult(
            tokens=chunks[-1].end, chunks=len(chunks), stored=stored, skipped=len(chunks) - len(todo),
            bytes_stored=stored_bytes,
        )

    async def _seal_and_put(
        self, session: ChunkSession, model: KVModel, chunks: Sequence[Chunk], kv: PagedKV, slots: torch.Tensor,
        todo: list[int],
    ) -> tuple[int, int]:
        if not todo:
            return 0, 0
        sizes = [self.datapath.envelope_nbytes(kv, chunks[i].end - chunks[i].start) for i in todo]
        try:  # one ask for the keys of every chunk to store (and, in remote mode, their slots)
            got = await session.sealing_keys(todo, sizes)
        except (KekError, KeyUnavailable, KeysUnavailable):  # the KEK provider is unreachable: store nothing
            got = []
        if len(got) < len(todo):  # keys ran out (or could not be had): store less
            self.counts.store_failed(len(todo) - len(got))
            self.counts.key_unavailable()
            todo = todo[: len(got)]
        jobs = [
            SealJob(slots[chunks[i].start : chunks[i].end], keys, session.context(i, model, version))
            for i, (version, keys) in zip(todo, got)
        ]
        if not jobs:
            return 0, 0
        gate = asyncio.Semaphore(max(1, self.datapath.threads))
        batches = self._batches(len(jobs), model, chunks)
        start = time.monotonic()

        # Each envelope is sealed straight into its slot of the fastest tier where one is handed
        # out (gather + encrypt in one pass, no allocation), else into a pool buffer. The slots'
        # pages are faulted in ahead of the seals, in the order the batches seal, on a nice-19 thread.
        held: list[dict[int, Reserved]] = []
        for batch in batches:
            held.append({})
            for k in batch:
                slot = session.reserve(todo[k], self.datapath.envelope_nbytes(kv, jobs[k].slots.numel()))
                if slot is not None:
                    held[-1][k] = slot
                    jobs[k].out = slot.view
        started: set[int] = set()  # the batches whose coroutine ran (the rest give their slots back)
        over = threading.Event()  # the store has ended: its prefault stops
        if self.datapath.store_prefault:
            prefault_behind([s.view for r in held for s in r.values()], over.is_set)

        async def run(batch: list[int], b: int) -> tuple[int, int]:
            """The chunks of ``batch`` (the ``b``-th) stored, and their bytes."""
            reserved = held[b]
            started.add(b)
            try:
                async with gate:
                    # between the engine's forward steps, or once this slice is due (gate.py)
                    envelopes = await self.datapath.run(
                        self.datapath.seal_batch, kv, [jobs[k] for k in batch], store=True,
                        latest=STEPS.deadline(start, b, len(batches)),
                    )
            except BaseException:
                for given in reserved.values():
                    session.abort(given)
                raise
            stored = stored_bytes = 0
            for k, env in zip(batch, envelopes):
                jobs[k].out = None
                slot = reserved.get(k)
                nbytes = env.nbytes  # a committed slot's view is released by the tier
                try:
                    if slot is not None:
                        if not await session.commit(slot):  # a clear or close cancelled it
                            continue
                    else:
                        await session.put(todo[k], env)
                    stored += 1
                    stored_bytes += nbytes
                except TierError:  # no tier took it: the cache loses this chunk, the engine goes on
                    self.counts.store_failed(1)
            return stored, stored_bytes

        # Every batch ends before an error is raised: once ``store`` returns or raises, no seal
        # job reads the KV any more (a caller may reuse that memory at once). Only a cancelled
        # store can leave one running in the pool.
        try:
            ended = await asyncio.gather(*(run(batch, b) for b, batch in enumerate(batches)), return_exceptions=True)
        finally:
            over.set()
            for b, reserved in enumerate(held):  # a batch cancelled before it ran gives its slots back
                if b not in started:
                    for given in reserved.values():
                        session.abort(given)
        for outcome in ended:
            if isinstance(outcome, BaseException):
                raise outcome
        await session.flush()  # a store that batches puts (remote) sends the rest; raises what it met
        done = [n for n in ended if isinstance(n, tuple)]
        return sum(n for n, _b in done), sum(b for _n, b in done)

    # -- retrieve ----------------------------------------------------------------------------
    async def retrieve(
        self,
        store: ChunkStore,
        token: str,
        model: KVModel,
        tokens: TokensLike,
        kv_layers: Sequence[torch.Tensor] | PagedKV,
        *,
        block_ids: BlockIds = None,
        slot_mapping: BlockIds = None,
        first_chunk: int = 0,
        write_upto: int | None = None,
        on_layers: OnLayers | None = None,
    ) -> RetrieveResult:
        """Load the longest stored prefix of ``tokens`` into ``kv_layers``.

        Chunks are fetched, authenticated and unpacked in order; the first miss, failed tag,
        unavailable key or unreachable tier ends the prefix. Returns how many tokens were loaded
        (``loaded_tokens``: the end of the last chunk loaded, counted from the prompt's start).

        ``first_chunk`` > 0: the caller has the first chunks' KV already (an engine's own prefix
        cache held them): every chunk is still hashed (the chain needs them), but only chunks
        from ``first_chunk`` on are fetched and opened, and ``block_ids`` / ``slot_mapping``
        describe the tokens from that chunk's start on.

        ``write_upto``: no token from that position on (counted from the prompt's start) is
        written into ``kv_layers``: its chunk is fetched and authenticated whole, and only its
        earlier tokens are scattered (an engine computes the rest itself and wants its slots
        untouched).

        ``on_layers`` (a layer-wise load, for an engine whose forward can start on the first
        layers while the rest load): the chunks are opened layer by layer, one batch per thread,
        and ``on_layers(n)`` says (from any thread) that layers ``[0, n)`` of every chunk still
        loading are in place; it is called with the model's layer count before this returns, however it
        ends. Where it ends short (a miss, a failed tag), the chunks past the prefix are not in
        place at any layer: the caller treats them as not loaded, as without ``on_layers``."""
        every = self.chunks(model, tokens)
        if not 0 <= first_chunk < len(every):
            raise InvalidRequest(f"first_chunk must lie in [0, {len(every)}), got {first_chunk}")
        if write_upto is not None and (isinstance(write_upto, bool) or not isinstance(write_upto, int) or write_upto < 0):
            raise InvalidRequest(f"write_upto must be an int >= 0, got {write_upto!r}")
        base = every[first_chunk].start
        # positions relative to the first chunk loaded (the slots start there); identity (the
        # chained hash, so the storage key and the envelope's context) is unchanged
        chunks = every if not base else [replace(c, start=c.start - base, end=c.end - base) for c in every[first_chunk:]]
        kv, slots = request_slots(model, kv_layers, chunks[-1].end, block_ids, slot_mapping)
        try:
            session = await store.session(token, "get", chunks)
        except KeysUnavailable:
            self.counts.load_ended("key_unavailable")
            return RetrieveResult(
                loaded_tokens=0, loaded_chunks=0, integrity_failures=0, unavailable=1, reason="key_unavailable"
            )
        try:
            upto = None if write_upto is None else write_upto - base
            loaded, failures, unavailable, ended, passed_over = await self._load(
                session, model, chunks, kv, slots, upto, on_layers)
        finally:
            await session.aclose()
        reason = ""
        if loaded < len(chunks):
            reason = ended.get(loaded, "miss")
            self.counts.load_ended(reason)
            log.info("load ended at chunk %d of %d: %s", loaded, len(chunks), reason)  # callers warn
        degraded = failure_reason(passed_over) if loaded else ""
        if degraded:
            self.counts.load_degraded(degraded)
            _degraded_log.warning("load served by a slower tier because a faster one failed: %s", degraded)
        self.counts.loaded(loaded)
        if not reason:
            self.counts.load_hit()
        return RetrieveResult(
            loaded_tokens=base + chunks[loaded - 1].end if loaded else 0,
            loaded_chunks=loaded,
            integrity_failures=failures,
            unavailable=unavailable,
            reason=reason,
            degraded=degraded,
        )

    async def _load(
        self, session: ChunkSession, model: KVModel, chunks: Sequence[Chunk], kv: PagedKV, slots: torch.Tensor,
        write_upto: int | None = None,
        on_layers: OnLayers | None = None,
    ) -> tuple[int, int, int, dict[int, LoadReason], list[BaseException]]:
        """Fetch, authenticate, decrypt and scatter the stored prefix in batches: every fetch is
        started at once (one streamed request in remote mode), and each batch keys and opens its
        chunks as soon as they are in, so opening one batch overlaps the fetches of the next.
        Also returns the failures of faster tiers that slower ones served past."""
        stats = {"failures": 0, "unavailable": 0}
        ended: dict[int, LoadReason] = {}  # chunk index -> why the prefix ended there
        passed_over: list[BaseException] = []
        gate = asyncio.Semaphore(max(1, self.datapath.threads))
        tiers: dict[int, str] = {}  # chunk index -> the tier its envelope came from

        batches = self._batches(len(chunks), model, chunks, layered=on_layers is not None)
        layers = kv.geometry.num_layers
        progress = _LayerProgress(len(batches), on_layers)

        async def open_jobs(batch: list[int], jobs: list[OpenJob], b: int) -> int:
            """How many leading chunks of the batch were loaded."""
            if not jobs:
                return 0
            async with gate:
                said = functools.partial(progress.batch_at, b) if on_layers is not None else None
                loaded, failed = await self.datapath.run(self.datapath.open_batch, kv, jobs, said)
            if failed:
                bad = batch[loaded]
                stats["failures"] += 1
                ended[bad] = "integrity"
                self.counts.integrity_failure()
                log.warning("integrity failure on a chunk in tier %s; treated as a miss", tiers[bad])
                await session.integrity_failure(bad, tiers[bad], hashlib.sha256(jobs[loaded].envelope).digest())
            self.counts.loaded_bytes(sum(j.envelope.nbytes for j in jobs[:loaded]))
            return loaded

        session.prefetch(range(len(chunks)))

        async def run(batch: list[int], b: int) -> int:
            try:
                return await fetch_and_open(batch, b)
            finally:
                progress.batch_at(b, layers)

        async def fetch_and_open(batch: list[int], b: int) -> int:
            got = await self._fetch_run(session, batch, stats, ended)
            for f in got:
                passed_over.extend(f.passed_over)
            # only the tier is kept past this batch: an envelope's buffer is let go as soon as its
            # batch is opened (a remote load's receive buffers then serve the next batches,
            # instead of every envelope of the prompt being alive, and fresh memory, at once)
            tiers.update((i, f.tier) for i, f in zip(batch, got, strict=False))
            jobs = await self._open_jobs(session, model, chunks, slots, batch[0], got, stats, ended)
            del got
            if write_upto is not None:
                for i, job in enumerate(jobs, start=batch[0]):
                    if chunks[i].end > write_upto:
                        job.write_tokens = max(0, write_upto - chunks[i].start)
            return await open_jobs(batch, jobs, b)

        results = await asyncio.gather(*(run(batch, b) for b, batch in enumerate(batches)))

        # Batches run concurrently; the prefix ends at the first chunk that did not load. A chunk
        # past that point may have been unpacked already: authentic KV in slots the engine
        # recomputes anyway.
        loaded = 0
        for batch, n in zip(batches, results, strict=True):
            loaded += n
            if n < len(batch):
                break
        return loaded, stats["failures"], stats["unavailable"], ended, passed_over

    async def _open_jobs(
        self, session: ChunkSession, model: KVModel, chunks: Sequence[Chunk], slots: torch.Tensor, first: int,
        fetched: Sequence[Fetched], stats: dict[str, int], ended: dict[int, LoadReason],
    ) -> list[OpenJob]:
        """The open jobs of chunks ``first, first + 1, ...`` (their fetched envelopes), with their
        keys asked for in one call (from the envelopes' headers); they stop before the first chunk
        whose key is unavailable, and just after an unparsable header (it fails to open)."""
        refs: list[KeyRef | None] = []
        for found in fetched:
            try:
                refs.append(self.datapath.key_ref(found.envelope))
            except DecryptionFailed:  # not even a parsable header: it fails to open below
                break
        keys: list[EnvelopeKeys | None] = [_UNKEYED] * len(refs)
        keyed = [(first + k, ref) for k, ref in enumerate(refs) if ref is not None]
        if keyed:
            try:
                for (i, _ref), got in zip(keyed, await session.opening_keys(keyed), strict=True):
                    keys[i - first] = got
            except (KeyUnavailable, KekError):
                keys = [None] * len(refs)
        jobs: list[OpenJob] = []
        for k, found in enumerate(fetched):
            i = first + k
            c = chunks[i]
            if k == len(refs):  # the unparsable header: an integrity failure, counted by the caller
                jobs.append(OpenJob(found.envelope, slots[c.start : c.end], _UNKEYED, session.context(i, model, 1)))
                break
            ref, key = refs[k], keys[k]
            if key is None:
                stats["unavailable"] += 1
                self.counts.key_unavailable()
                ended[i] = "key_unavailable"
                break
            ctx = session.context(i, model, 0 if ref is None else ref[0])
            jobs.append(OpenJob(found.envelope, slots[c.start : c.end], key, ctx))
        return jobs

    @staticmethod
    async def _fetch_run(
        session: ChunkSession, indices: Sequence[int], stats: dict[str, int], ended: dict[int, LoadReason]
    ) -> list[Fetched]:
        """The envelopes of ``indices`` in order, up to the first that could not be fetched."""
        out: list[Fetched] = []
        for i in indices:
            try:
                out.append(await session.fetch(i))
            except FetchFailed as exc:
                if exc.unavailable:
                    stats["unavailable"] += 1
                ended[i] = exc.reason
                break
        return out


class _Unkeyed:
    """The keys of an envelope that needs none (a codec without keys) or cannot be opened (an
    unparsable header): sealing and opening with it fail."""

    def sealing_key(self, salt_source: Callable[[int], bytes]) -> tuple[bytes, bytes]:
        raise DecryptionFailed

    def opening_key(self, salt: bytes) -> bytes:
        raise DecryptionFailed


_UNKEYED = _Unkeyed()
