"""The connector's way to the gateway: embedded (the core in this process) or remote (a server).

vLLM calls the connector from its own threads and expects plain return values; the gateway is
asyncio. A ``Backend`` owns one event loop in a dedicated daemon thread and submits coroutines to
it with ``run_coroutine_threadsafe``, waiting with a timeout. One backend is shared by every
connector of a process with the same configuration (the scheduler-side and worker-side
connectors of a single-process engine then see the same memory tier), opened on first use:

    EmbeddedBackend   open_runtime(Settings(**kvgate_settings)): registry, KEK, tiers, audit
    RemoteBackend     a RemoteGateway per capability, against ``remote_url`` with a service
                      bearer token; the capability from the request goes on every call

Nothing is opened at import time.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import torch

from gateway.core import KVModel, LookupResult, RetrieveResult, StoreResult
from gateway.vllm.errors import ConnectorConfigError, GatewayTimeout

__all__ = ["Backend", "EmbeddedBackend", "RemoteBackend", "backend_for"]

T = TypeVar("T")
_LOCK = threading.Lock()
_BACKENDS: dict[str, Backend] = {}


class Backend:
    """An event loop in a thread of its own, and the three data operations on top of it."""

    chunk_tokens: int

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvgate-connector", daemon=True)
        self._thread.start()
        self.users = 0

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(self.timeout_s if timeout is None else timeout)
        except FutureTimeout:
            fut.cancel()
            raise GatewayTimeout(f"the gateway did not answer in {self.timeout_s if timeout is None else timeout:g} s") from None

    async def open(self) -> None:
        raise NotImplementedError

    async def lookup(self, cap: str, model: KVModel, tokens: Sequence[int]) -> LookupResult:
        raise NotImplementedError

    async def retrieve(
        self, cap: str, model: KVModel, tokens: Sequence[int], layers: list[torch.Tensor], block_ids: Sequence[int]
    ) -> RetrieveResult:
        raise NotImplementedError

    async def store(
        self, cap: str, model: KVModel, tokens: Sequence[int], layers: list[torch.Tensor], block_ids: Sequence[int]
    ) -> StoreResult:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None

    def close(self) -> None:
        try:
            self.call(self.aclose(), timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


class EmbeddedBackend(Backend):
    def __init__(self, settings: dict[str, Any], timeout_s: float = 30.0) -> None:
        from gateway.config import Settings

        try:
            self.settings = Settings(**settings)
        except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError, with every field named
            raise ConnectorConfigError(f"kvgate_settings: {exc}") from None
        self.chunk_tokens = self.settings.chunk_tokens
        self.runtime: Any = None
        super().__init__(timeout_s)

    async def open(self) -> None:
        from gateway.runtime import open_runtime

        self.runtime = await open_runtime(self.settings, auto_migrate=True)

    async def lookup(self, cap, model, tokens):
        return await self.runtime.gateway.lookup(cap, model, tokens)

    async def retrieve(self, cap, model, tokens, layers, block_ids):
        return await self.runtime.gateway.retrieve(cap, model, tokens, layers, block_ids=list(block_ids))

    async def store(self, cap, model, tokens, layers, block_ids):
        return await self.runtime.gateway.store(cap, model, tokens, layers, block_ids=list(block_ids))

    async def aclose(self) -> None:
        if self.runtime is not None:
            await self.runtime.aclose()
            self.runtime = None


class RemoteBackend(Backend):
    """Remote mode. The service token authenticates the worker (role ``kv.worker`` of one
    tenant, or ``kv.operator`` for a worker shared by tenants); the request's capability decides
    the tenant and namespace of every call."""

    def __init__(self, url: str, token: str, chunk_tokens: int, timeout_s: float = 30.0, cache: int = 256) -> None:
        if not url or not token:
            raise ConnectorConfigError("remote mode needs remote_url and KVGATE_REMOTE_TOKEN (or remote_token_file)")
        self.url, self._token, self.chunk_tokens = url, token, chunk_tokens
        self._clients: OrderedDict[str, Any] = OrderedDict()
        self._cache = cache
        self._http: Any = None
        super().__init__(timeout_s)

    async def open(self) -> None:
        import httpx

        self._http = httpx.AsyncClient(timeout=self.timeout_s)

    def _client(self, cap: str) -> Any:
        from gateway.remote import RemoteGateway
        from tenancy.capabilities import read_unverified

        client = self._clients.get(cap)
        if client is not None:
            self._clients.move_to_end(cap)
            return client

        class _Fixed(RemoteGateway):
            async def capability(self) -> str:  # the request's own capability, never a minted one
                return cap

        client = _Fixed(
            self.url, self._token, http=self._http, namespace=read_unverified(cap).namespace,
            chunk_tokens=self.chunk_tokens,
        )
        self._clients[cap] = client
        while len(self._clients) > self._cache:
            self._clients.popitem(last=False)
        return client

    async def lookup(self, cap, model, tokens):
        return await self._client(cap).lookup(model, tokens)

    async def retrieve(self, cap, model, tokens, layers, block_ids):
        return await self._client(cap).retrieve(model, tokens, layers, block_ids=list(block_ids))

    async def store(self, cap, model, tokens, layers, block_ids):
        return await self._client(cap).store(model, tokens, layers, block_ids=list(block_ids))

    async def aclose(self) -> None:
        self._clients.clear()
        if self._http is not None:
            await self._http.aclose()


# settings that hold secrets: vLLM prints the whole --kv-transfer-config at start, so they come
# from the environment (KVGATE_*) or a file, never from kv_connector_extra_config
_SECRET_SETTINGS = ("pkcs11_pin", "api_token")
_URL_SETTINGS = ("database_url", "redis_url")


def refuse_secrets(extra: dict[str, Any]) -> None:
    """ConnectorConfigError if ``kv_connector_extra_config`` carries a secret (vLLM logs it)."""
    settings = extra.get("kvgate_settings") or {}
    found = [k for k in _SECRET_SETTINGS if k in settings]
    found += [k for k in _URL_SETTINGS if isinstance(settings.get(k), str) and _has_password(settings[k])]
    if extra.get("remote_token"):
        found.append("remote_token")
    if found:
        env = ", ".join("KVGATE_REMOTE_TOKEN or remote_token_file" if k == "remote_token" else f"KVGATE_{k.upper()}" for k in found)
        raise ConnectorConfigError(
            f"secrets in --kv-transfer-config ({', '.join(found)}) would be printed in vLLM's log: "
            f"set {env} in the engine's environment instead"
        )


def _has_password(url: str) -> bool:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).password is not None
    except ValueError:
        return False


def backend_for(extra: dict[str, Any]) -> Backend:
    """The process's backend for this configuration (opened on first use, then shared)."""
    refuse_secrets(extra)
    mode = extra.get("mode", "embedded")
    timeout = float(extra.get("timeout_s", 30.0))
    key = json.dumps({k: extra.get(k) for k in ("mode", "kvgate_settings", "remote_url", "chunk_tokens")}, sort_keys=True, default=str)
    with _LOCK:
        backend = _BACKENDS.get(key)
        if backend is None:
            if mode == "embedded":
                backend = EmbeddedBackend(dict(extra.get("kvgate_settings") or {}), timeout)
            elif mode == "remote":
                token = os.environ.get("KVGATE_REMOTE_TOKEN")
                if not token and extra.get("remote_token_file"):
                    with open(extra["remote_token_file"], encoding="utf-8") as f:
                        token = f.read().strip()
                backend = RemoteBackend(extra.get("remote_url", ""), token or "", int(extra.get("chunk_tokens", 256)), timeout)
            else:
                raise ConnectorConfigError(f"mode must be 'embedded' or 'remote', got {mode!r}")
            try:
                backend.call(backend.open(), timeout=max(timeout, 120))
            except BaseException as exc:
                backend.close()
                if isinstance(exc, Exception) and not isinstance(exc, ConnectorConfigError):
                    from gateway.clierrors import explain

                    # refuse to start, with the cause and the fix in one line (vLLM prints it)
                    raise ConnectorConfigError(f"kvgate could not open its state: {explain(exc)}") from exc
                raise
            _BACKENDS[key] = backend
        backend.users += 1
        return backend


def release(backend: Backend) -> None:
    with _LOCK:
        backend.users -= 1
        if backend.users > 0:
            return
        for k, v in list(_BACKENDS.items()):
            if v is backend:
                del _BACKENDS[k]
    backend.close()
