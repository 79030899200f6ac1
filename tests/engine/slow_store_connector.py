"""A test-only ``KvgateConnector`` whose worker-side stores wait ``KVGATE_TEST_STORE_DELAY_S``
seconds on the backend's loop before they run (a slow tier, as an engine may meet one). Named in
``kv_connector`` / ``kv_connector_module_path`` by tests/engine/test_async_store.py; vLLM builds it
in its worker process, where nothing of the test can be patched."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from gateway.vllm.connector import KvgateConnector


class _SlowStores:
    def __init__(self, inner: Any, delay_s: float) -> None:
        self._inner, self._delay = inner, delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def store(self, *args: Any) -> Any:
        await asyncio.sleep(self._delay)
        return await self._inner.store(*args)


class SlowStoreConnector(KvgateConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._worker is not None:
            delay = float(os.environ.get("KVGATE_TEST_STORE_DELAY_S", "0"))
            self._worker._backend = _SlowStores(self._worker._backend, delay)  # a test double
