"""The connector's way to the gateway: embedded (the core in this process) or remote (a server).

    Backend           the protocol: ``open``, the three data operations, ``aclose`` (all async),
                      ``chunk_tokens``, and ``loop`` (the thread that runs them)
    LoopThread        one asyncio event loop in a daemon thread; vLLM calls the connector from
                      its threads and wants plain return values, so an operation is submitted
                      with ``call`` and waited for with a timeout, or with ``submit`` (stores)
                      and not waited for: its future ends, with the same timeout, on the loop
    EmbeddedBackend   open_embedded(Settings(**kvgate_settings)): registry, KEK, tiers, audit
    RemoteBackend     a RemoteGateway per capability (``remote_url``, a service bearer token)
    SHARED            the process's ``SharedBackends``: ``acquire`` hands every connector of the
                      process with one configuration the same backend (a single-process engine's
                      two sides see one memory tier), opened on first use; ``release`` closes it
                      after its last user. Building one starts nothing (its loop thread starts
                      in ``acquire`` or ``start``); nothing is opened at import time."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import ValidationError

from gateway.datapath.gate import STEPS
from gateway.metrics import Metrics
from gateway.vllm.config import ConnectorConfig, explain_validation, refuse_secrets
from gateway.vllm.errors import ConnectorConfigError, GatewayTimeout

if TYPE_CHECKING:
    import torch

    from gateway.config import Settings
    from gateway.types import KVModel, LookupResult, RetrieveResult, StoreResult

__all__ = [
    "SHARED", "Backend", "EmbeddedBackend", "LoopThread", "RemoteBackend", "SharedBackends", "refuse_secrets", "start",
]

T = TypeVar("T")
log = logging.getLogger("kvgate.vllm")


class LoopThread:
    """An asyncio event loop in a daemon thread, for synchronous callers (vLLM's threads)."""

    def __init__(self, timeout_s: float = 30.0, name: str = "kvgate-connector", settle_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self.settle_s = settle_s
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=_run_loop, args=(self._loop,), name=self._name, daemon=True)
            self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and return its result. Past the timeout it is cancelled and
        ``GatewayTimeout`` raised once it has ended (its worker threads too, ``DataPath.run``):
        a load that writes straight into the engine's cache has stopped writing when this
        returns, so vLLM may recompute or reuse those blocks. A coroutine that has not ended
        ``settle_s`` after its cancellation is logged at ERROR and left running."""
        loop = self._loop
        if loop is None:
            coro.close()
            raise RuntimeError("the backend's loop thread is not running")
        wait = self.timeout_s if timeout is None else timeout
        ended = threading.Event()
        box: list[asyncio.Task[T]] = []

        def start() -> None:
            task = loop.create_task(coro)
            task.add_done_callback(lambda _t: ended.set())
            box.append(task)

        loop.call_soon_threadsafe(start)
        if not ended.wait(wait):
            loop.call_soon_threadsafe(lambda: box[0].cancel())  # after start(): the loop runs callbacks in order
            if not ended.wait(self.settle_s):
                log.error("a cancelled gateway call had not ended %g s after its timeout; it may still be running", self.settle_s)
            raise GatewayTimeout(f"the gateway did not answer in {wait:g} s")
        task = box[0]
        if task.cancelled():  # the loop was stopped under it
            raise GatewayTimeout("the gateway call was cancelled")
        return task.result()

    def submit(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> Future[T]:
        """Run ``coro`` on the loop and return at once; the future raises ``GatewayTimeout``
        (the coroutine cancelled) past the timeout. Cancelling a coroutine does not stop work it
        handed to other threads: whatever those read must stay untouched until they end."""
        if self._loop is None:
            coro.close()
            raise RuntimeError("the backend's loop thread is not running")
        wait = self.timeout_s if timeout is None else timeout

        async def bounded() -> T:
            try:
                return await asyncio.wait_for(coro, wait)
            except TimeoutError:
                raise GatewayTimeout(f"the gateway did not answer in {wait:g} s") from None

        return asyncio.run_coroutine_threadsafe(bounded(), self._loop)

    @property
    def running(self) -> bool:
        return self._loop is not None

    def drain(self, timeout_s: float = 5.0) -> int:
        """Wait, at most ``timeout_s``, for the work on the loop to end (a report submitted and
        not waited for); returns how many tasks were still running then."""
        if self._loop is None:
            return 0

        async def wait() -> int:
            me = asyncio.current_task()
            pending = {t for t in asyncio.all_tasks() if t is not me}
            if not pending:
                return 0
            _done, still = await asyncio.wait(pending, timeout=timeout_s)
            return len(still)

        return self.call(wait(), timeout=timeout_s + self.settle_s)

    def stop(self) -> None:
        """Stop the loop: the tasks still on it are cancelled and let end first (at most
        ``settle_s``), so none is dropped while pending."""
        loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return
        settle_s = self.settle_s

        async def shut() -> None:
            me = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not me]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=settle_s)
            loop.stop()

        asyncio.run_coroutine_threadsafe(shut(), loop)
        thread.join(settle_s + 10)


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The loop thread: on every CPU of the process (``gate.spread``: a CPU engine pins the thread
    that starts it), then the loop."""
    from gateway.datapath.gate import spread

    spread()
    loop.run_forever()


class Backend(Protocol):
    """What the connector needs from the gateway (embedded core or remote server)."""

    chunk_tokens: int
    loop: LoopThread

    @property
    def layerwise(self) -> bool:
        """Loads into a CPU cache may go layer by layer now (``gateway.vllm.layers``)."""
        ...

    async def open(self) -> None: ...

    async def lookup(self, cap: str, model: KVModel, tokens: Sequence[int]) -> LookupResult: ...

    async def retrieve(
        self, cap: str, model: KVModel, tokens: Sequence[int], layers: list[torch.Tensor], block_ids: Sequence[int],
        first_chunk: int = 0, write_upto: int | None = None, on_layers: Callable[[int], None] | None = None,
    ) -> RetrieveResult:
        """``on_layers``: a layer-wise load (``DataPlane.retrieve``), told from any thread."""
        ...

    async def store(
        self, cap: str, model: KVModel, tokens: Sequence[int], layers: list[torch.Tensor], block_ids: Sequence[int],
        first_chunk: int = 0,
    ) -> StoreResult:
        """``first_chunk``: the chunks before it are stored already and not in ``layers``."""
        ...

    def prepare(self, cap: str) -> None:
        """A forward step is about to run whose end stores under ``cap``: get ready for that store
        now, on the loop and without waiting (remote mode asks for the tenant's shared-memory
        region, so a first store finds it mapped); nothing where there is nothing to get."""
        ...

    def copies_behind(self) -> bool:
        """Whether a store's copies in the slower tiers are written after it returns."""
        ...

    def counters(self) -> dict[str, int]:
        """How this process's loads and stores went so far, by way (monotonic; each load's and
        store's trace line carries them): empty where there is one way only."""
        ...

    async def report_warm(self, cap: str, prefix_id: str, fingerprint: str, hashes: Sequence[str]) -> int:
        """A published prefix's warm-up reports the chunks it stores (``cap``: the scope's write
        capability); how many the server recorded. AccessDenied or InvalidRequest if refused."""
        ...

    async def copies_written(self) -> None:
        """Wait until the slower tiers hold what was stored so far (the write-behind copies)."""
        ...

    async def aclose(self) -> None: ...


class EmbeddedBackend:
    layerwise = True  # the envelopes are in this process's tiers: opening is all a load does
    def __init__(
        self, settings: dict[str, Any], timeout_s: float = 30.0, store_nice: int = 0, copies_finish_s: float = 0.0,
        store_prefault: bool = True,
    ) -> None:
        """``store_nice``: the connector's (``ConnectorConfig.store_nice``), unless ``settings`` or
        ``KVGATE_STORE_NICE`` names one (as every other setting, the variable fills what is left out).
        ``copies_finish_s``: the write-behind copies yield to this process's engine steps that long
        at most (``ConnectorConfig.copies_finish_s``)."""
        from gateway.config import Settings

        if "store_nice" not in settings and "KVGATE_STORE_NICE" not in os.environ:
            settings = {**settings, "store_nice": store_nice}
        if "store_prefault" not in settings and "KVGATE_STORE_PREFAULT" not in os.environ:
            settings = {**settings, "store_prefault": store_prefault}
        # the memory tier is this engine's cache, sized by its operator: its pages are faulted in
        # behind, in the idle time of start-up, and not by the first stores beside decode steps
        if "memory_prefault" not in settings and "KVGATE_MEMORY_PREFAULT" not in os.environ:
            settings = {**settings, "memory_prefault": "behind"}
        try:
            self.settings: Settings = Settings(**settings)
        except ValidationError as exc:  # every bad field named
            raise ConnectorConfigError(explain_validation(exc, "kvgate_settings")) from None
        self.chunk_tokens = self.settings.chunk_tokens
        self.runtime: Any = None
        self.loop = LoopThread(timeout_s)
        self.copies_finish_s = copies_finish_s

    async def open(self) -> None:
        from gateway.services.runtime import open_embedded

        self.runtime = await open_embedded(self.settings, auto_migrate=True)
        self.runtime.tiers.behind.pace(STEPS.engine_busy, self.copies_finish_s)

    async def lookup(self, cap: str, model: KVModel, tokens: Sequence[int]) -> LookupResult:
        result: LookupResult = await self.runtime.gateway.lookup(cap, model, tokens)
        return result

    async def retrieve(
        self, cap: str, model: KVModel, tokens: Sequence[int], layers: list[torch.Tensor], block_ids: Sequence[int],
        first_chunk: int = 0, write_upto: int | None = None, on_layers: Callable[[int], None] | None = None,
    ) -> RetrieveResult:
        result: RetrieveResult = await self.runtime.gateway.retrieve(
            cap, model, tokens, layers, block_ids=list(block_ids), first_chunk=first_chunk,
            write_upto=write_upto, on_layers=on_layers,
        )
        return result

    async def store(
        self, cap: str, model: KVModel, tokens: Sequence[int], layers: list[torch.Tensor], block_ids: Sequence[int],
        first_chunk: int = 0,
    ) -> StoreResult:
        result: StoreResult = await self.runtime.gateway.store(
            cap, model, tokens, layers, block_ids=list(block_ids), first_chunk=first_chunk
        )
        return result

    def prepare(self, cap: str) -> None:
        return None  # the memory tier is in this process: nothing to ask for

    async def report_warm(self, cap: str, prefix_id: str, fingerprint: str, hashes: Sequence[str]) -> int:
        from audit.types import Actor

        got = await self.runtime.prefixes.warm(cap, prefix_id, fingerprint, hashes, actor=Actor(subject="kvgate:connector"))
        return len(got)

    def counters(self) -> dict[str, int]:
        return {}  # every envelope is in this process's tiers

    def copies_behind(self) -> bool:
        """The scheduler's process looks up in the tiers it shares with the workers (Redis, a
        disk), not in a worker's memory tier: a store is visible to it once these copies, written
        behind (``KVGATE_TIER_WRITE_MODE=write_behind``), are in."""
        return self.runtime is not None and bool(self.runtime.tiers.write_back)

    async def copies_written(self) -> None:
        await self.runtime.tiers.flush()

    async def aclose(self) -> None:
        if self.runtime is not None:
            await self.runtime.aclose()
            self.runtime = None


class RemoteBackend:
    """Remote mode. The service token authenticates the worker (role ``kv.worker`` of one
    tenant, or ``kv.operator`` for a worker shared by tenants); the request's capability decides
    the tenant and namespace of every call."""

    @property
    def layerwise(self) -> bool:
        """Layer by layer only where this worker reads envelopes in place (a region that came with
        its namespace's arena, ``gateway.remote.shm``): each is there as soon as its item is, so the
        forward starts on the first layers while the rest are opened. Through the socket, or
        copied into a region, no layer is in place before the last envelope has arrived, and
        opening in one batch per thread loses the overlap of fetching one batch with opening the
        one before: a layer-wise hit is slower there than a whole-chunk one."""
        return self._shm is not None and self._shm.in_place()

    def __init__(
        self, url: str, token: str, chunk_tokens: int, timeout_s: float = 30.0, cache: int = 256, uds: str | None = None,
        store_nice: int = 0, shm_bytes: int = 0, store_prefault: bool = True,
    ) -> None:
        if not url or not token:
            raise ConnectorConfigError("remote mode needs remote_url and KVGATE_REMOTE_TOKEN (or remote_token_file)")
        if shm_bytes and not uds:
            raise ConnectorConfigError("remote_shm_mb needs remote_uds: shared memory is for a server on this host")
        self.url, self._token, self.chunk_tokens, self.uds = url, token, chunk_tokens, uds
        self.store_nice = store_nice
        self.store_prefault = store_prefault
        self.shm_bytes = shm_bytes
        self._shm: Any = None  # the regions every client of this worker shares (gateway.remote.shm)
        self._clients: OrderedDict[str, Any] = OrderedDict()
        self._cache = cache
        self._connections: Any = None  # the httpx client and data-plane pool every client shares
        self.metrics = Metrics()  # every client's counts
        self.loop = LoopThread(timeout_s)

    async def open(self) -> None:
        from gateway.remote.client import Connections

        self._connections = Connections(self.url, timeout_s=self.loop.timeout_s, uds=self.uds)

    def _client(self, cap: str) -> Any:
        from gateway.remote.client import RemoteGateway
        from tenancy.capabilities import read_unverified

        client = self._clients.get(cap)
        if client is not None:
            self._clients.move_to_end(cap)
            return client

        class _Fixed(RemoteGateway):
            async def capability(self) -> str:  # the request's own capability, never a minted one
                return cap

        if self.shm_bytes and self._shm is None:
            from gateway.remote.shm import RegionCache

            self._shm = RegionCache(self.shm_bytes)
        client = _Fixed(
            self.url, self._token, connections=self._connections, namespace=read_unverified(cap).namespace,
            chunk_tokens=self.chunk_tokens, uds=self.uds, store_nice=self.store_nice, shm_bytes=self.shm_bytes,
            store_prefault=self.store_prefault, shm_cache=self._shm, metrics=self.metrics,
        )
        self._clients[cap] = client
        while len(self._clients) > self._cache:
            self._clients.popitem(last=False)
        return client

    async def lookup(self, cap: str, model: KVModel, tokens: Sequence[int]) -> LookupResult:
        result: LookupResult = await self._client(cap).lookup(model, tokens)
        return result

    async def retrieve(
        self, cap: str, model: KVModel, tokens: Sequence[int], layers: list[torch.Tensor], block_ids: Sequence[int],
        first_chunk: int = 0, write_upto: int | None = None, on_layers: Callable[[int], None] | None = None,
    ) -> RetrieveResult:
        result: RetrieveResult = await self._client(cap).retrieve(
            model, tokens, layers, block_ids=list(block_ids), first_chunk=first_chunk,
            write_upto=write_upto, on_layers=on_layers,
        )
        return result

    async def report_warm(self, cap: str, prefix_id: str, fingerprint: str, hashes: Sequence[str]) -> int:
        """``POST /v1/admin/prefixes/{id}/chunks`` with the service token (an operator's: the route
        reaches every member of the scope) and the capability in ``X-KV-Capability``."""
        import httpx

        from gateway.remote.status import check
        from gateway.remote.wire import RemoteUnavailable

        what = "POST /v1/admin/prefixes/{id}/chunks"
        try:
            r = await self._connections.http.post(
                f"{self.url.rstrip('/')}/v1/admin/prefixes/{prefix_id}/chunks",
                json={"fingerprint": fingerprint, "hashes": list(hashes)},
                headers={"Authorization": f"Bearer {self._token}", "X-KV-Capability": cap},
            )
        except httpx.HTTPError as exc:
            raise RemoteUnavailable(f"{what}: {type(exc).__name__}") from None
        check(r.status_code, what, r.text)
        return int(r.json()["recorded"])

    async def report_refused_receipt(self, cap: str, req_id: str, reason: str) -> None:
        """A P/D receipt refused for a request holding ``cap``, reported to the server, which
        audits it (``gateway.vllm.handoff.audit_refused_receipt``). Best effort: a failure is
        logged, never raised."""
        try:
            await self._client(cap).report_refused_receipt(req_id, reason)
        except Exception as exc:  # unreachable, refused, a capability that does not parse
            log.warning("kvgate could not report the refused receipt of %s to the server: %s", req_id, exc)

    def copies_behind(self) -> bool:
        return False  # the server keeps the tiers: what it took, every worker and scheduler sees

    def counters(self) -> dict[str, int]:
        """Envelopes that came through the shared-memory region (``shm_envelopes``), of those
        read in place in the arena (``arena_envelopes``), loads that found the region lent to
        another and used the stream (``shm_region_busy``), envelopes stores sealed in place
        (``arena_sealed``) and those that found no room there and were sent (``arena_unreserved``):
        every client of this worker's counts."""
        m = self.metrics
        return {"shm_envelopes": m.shm_envelopes, "arena_envelopes": m.arena_envelopes,
                "shm_region_busy": m.shm_region_busy, "arena_sealed": m.arena_sealed,
                "arena_unreserved": m.arena_unreserved}

    async def copies_written(self) -> None:
        return None

    async def store(
        self, cap: str, model: KVModel, tokens: Sequence[int], layers: list[torch.Tensor], block_ids: Sequence[int],
        first_chunk: int = 0,
    ) -> StoreResult:
        result: StoreResult = await self._client(cap).store(
            model, tokens, layers, block_ids=list(block_ids), first_chunk=first_chunk
        )
        return result

    def prepare(self, cap: str) -> None:
        """With shared memory: the tenant's region asked for while the forward before its first
        store runs (the server makes its namespace's arena then, and starts populating it ahead),
        not by the store itself, beside the decode steps after it."""
        if self.shm_bytes:
            try:
                self.loop.submit(self._prepare(cap))
            except RuntimeError:  # the loop is not running: the store finds that out itself
                pass

    async def _prepare(self, cap: str) -> None:
        try:
            self._client(cap).prepare_region()
        except Exception as exc:  # a capability the store itself will refuse: nothing to get ready
            log.debug("kvgate: getting ready for a store: %s", exc)

    async def aclose(self) -> None:
        self._clients.clear()
        if self._connections is not None:
            await self._connections.aclose()


# -- one backend per configuration and process ------------------------------------------------


def start(backend: Backend, open_timeout_s: float = 120.0) -> None:
    """Start the backend's loop thread and open it; on failure stop it again and raise
    ``ConnectorConfigError`` with the cause and the fix in one line (vLLM prints it)."""
    backend.loop.start()
    try:
        backend.loop.call(backend.open(), timeout=max(backend.loop.timeout_s, open_timeout_s))
    except BaseException as exc:
        close(backend)
        if isinstance(exc, Exception) and not isinstance(exc, ConnectorConfigError):
            from gateway.cli.errors import explain

            raise ConnectorConfigError(f"kvgate could not open its state: {explain(exc)}") from exc
        raise


def close(backend: Backend, drain_s: float = 5.0) -> None:
    """Let the work submitted to the backend end (at most ``drain_s``: a report sent and not
    waited for), close the backend, stop its loop thread."""
    try:
        if backend.loop.running:
            still = backend.loop.drain(drain_s)
            if still:
                log.warning("kvgate closes with %d tasks still running after %g s; they are cancelled", still, drain_s)
        backend.loop.call(backend.aclose(), timeout=60)
    finally:
        backend.loop.stop()


def _build(config: ConnectorConfig) -> Backend:
    if config.mode == "embedded":
        return EmbeddedBackend(
            dict(config.kvgate_settings), config.timeout_s, config.store_nice, config.copies_finish_s, config.store_prefault,
        )
    return RemoteBackend(
        config.remote_url, config.remote_token(), config.chunk_tokens, config.timeout_s, uds=config.remote_uds,
        store_nice=config.store_nice, shm_bytes=config.remote_shm_mb << 20, store_prefault=config.store_prefault,
    )


class SharedBackends:
    """Backends shared by connectors: one per configuration (``ConnectorConfig.backend_key``),
    opened by its first ``acquire`` and closed by the ``release`` of its last user.

    The connector cannot be handed an owner: vLLM builds it by class name, once per role (the
    scheduler's and each worker's), with nothing but its configuration, and in a single-process
    engine the scheduler side and the worker side are two connectors of one process that must
    see one backend (one memory tier, one event-loop thread). So the process holds one of these,
    ``SHARED``; tests make their own instances."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[Any, ...], tuple[Backend, int]] = {}  # key -> (backend, users)

    def acquire(self, config: ConnectorConfig) -> Backend:
        """The backend for ``config``: the one already open, or a new one opened now
        (``ConnectorConfigError`` where it cannot be, with nothing kept)."""
        key = config.backend_key()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                backend = _build(config)
                start(backend)
                entry = (backend, 0)
            self._entries[key] = (entry[0], entry[1] + 1)
            return entry[0]

    def release(self, backend: Backend) -> None:
        """One user fewer; the last one closes the backend."""
        with self._lock:
            for key, (b, users) in list(self._entries.items()):
                if b is backend:
                    if users > 1:
                        self._entries[key] = (b, users - 1)
                        return
                    del self._entries[key]
                    break
        close(backend)

    def users(self, backend: Backend) -> int:
        """How many connectors hold ``backend`` (0: closed, or never acquired here)."""
        with self._lock:
            return next((n for b, n in self._entries.values() if b is backend), 0)


SHARED = SharedBackends()  # this process's (SharedBackends says why there is one)
