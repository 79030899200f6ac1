"""Stores seal on threads of their own at a lower priority (``store_nice``), loads do not: an
engine's forward steps go first while a store is in flight, and a load it waits for is never
slowed down by that setting."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from crypto.envelope import ChunkCipher
from gateway.datapath import DataPath
from gateway.vllm.backend import EmbeddedBackend, LoopThread
from gateway.vllm.config import ConnectorConfig
from tests.support.gw import ALL_OPS, gateway_runtime, random_cache, small_geometry, store_and_load_back

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")


def _where() -> tuple[str, int]:
    return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


async def test_store_work_runs_niced_and_load_work_does_not() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    dp = DataPath(ChunkCipher(), 2, store_nice=7)
    try:
        name, nice = await dp.run(_where, store=True)
        assert name.startswith("kvgate-store") and nice == max(7, base)
        name, nice = await dp.run(_where)  # a load: the normal threads, the inherited priority
        assert name.startswith("kvgate-cpu") and nice == base
    finally:
        dp.close()
    plain = DataPath(ChunkCipher(), 2)  # the control: without store_nice, stores share the threads
    try:
        name, nice = await plain.run(_where, store=True)
        assert name.startswith("kvgate-cpu") and nice == base
    finally:
        plain.close()
    with pytest.raises(ValueError, match="store_nice"):
        DataPath(ChunkCipher(), 2, store_nice=20)


async def test_a_store_seals_on_the_niced_threads_and_a_load_opens_on_the_others(tmp_path, monkeypatch) -> None:
    seen: dict[str, set[tuple[str, int]]] = {"seal": set(), "open": set()}
    seal, open_ = DataPath.seal_batch, DataPath.open_batch

    def spy_seal(self, *a):
        seen["seal"].add(_where())
        return seal(self, *a)

    def spy_open(self, *a):
        seen["open"].add(_where())
        return open_(self, *a)

    monkeypatch.setattr(DataPath, "seal_batch", spy_seal)
    monkeypatch.setattr(DataPath, "open_batch", spy_open)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    g = small_geometry()
    src = random_cache(g, 32, seed=3)
    tokens = list(range(100, 100 + 16 * 4))
    async with gateway_runtime(tmp_path, store_nice=9) as rt:
        await rt.admin.create_tenant("acme")
        cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        await store_and_load_back(rt, cap, g, tokens, src, 16, 32)
    assert seen["seal"] and all(n.startswith("kvgate-store") and p == max(9, base) for n, p in seen["seal"])
    assert seen["open"] and all(n.startswith("kvgate-cpu") and p == base for n, p in seen["open"])


def test_the_connector_stores_niced_by_default_and_kvgate_settings_may_say_otherwise(tmp_path) -> None:
    config = ConnectorConfig.from_extra({})
    assert config.store_nice == 10
    backend = EmbeddedBackend({"state_dir": str(tmp_path)}, store_nice=config.store_nice)
    assert backend.settings.store_nice == 10
    backend = EmbeddedBackend({"state_dir": str(tmp_path), "store_nice": 0}, store_nice=config.store_nice)
    assert backend.settings.store_nice == 0
    assert ConnectorConfig.from_extra({"store_nice": 0}).store_nice == 0


def test_kvgate_store_nice_in_the_environment_is_honoured_by_the_connector(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVGATE_STORE_NICE", "3")
    assert EmbeddedBackend({"state_dir": str(tmp_path)}, store_nice=10).settings.store_nice == 3
    monkeypatch.delenv("KVGATE_STORE_NICE")  # the control: without it, the connector's value
    assert EmbeddedBackend({"state_dir": str(tmp_path)}, store_nice=10).settings.store_nice == 10


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell a pinned thread from a free one")
def test_data_path_threads_started_by_a_pinned_thread_run_on_every_cpu_of_the_process() -> None:
    """A CPU engine pins its main thread to one core; threads it starts inherit that mask. The data
    path's threads (loads and stores) must not: they run on every CPU the process may use."""
    import asyncio

    every = os.sched_getaffinity(0)
    one = {min(every)}
    seen: dict[str, set[int]] = {}

    def pinned_engine_thread() -> None:
        os.sched_setaffinity(0, one)  # as vLLM's CPU worker pins its main thread
        plain: list[set[int]] = []
        t = threading.Thread(target=lambda: plain.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        seen["plain"] = plain[0]  # the control: an ordinary thread inherits the pin
        dp = DataPath(ChunkCipher(), 2, store_nice=5)
        try:
            seen["load"] = asyncio.run(dp.run(os.sched_getaffinity, 0))
            seen["store"] = asyncio.run(dp.run(os.sched_getaffinity, 0, store=True))
        finally:
            dp.close()
        loop = LoopThread(timeout_s=10)  # the connector's loop thread
        loop.start()

        async def where() -> set[int]:
            return os.sched_getaffinity(0)

        try:
            seen["loop"] = loop.call(where())
        finally:
            loop.stop()

    t = threading.Thread(target=pinned_engine_thread)
    t.start()
    t.join()
    assert seen["plain"] == one
    assert seen["load"] == every and seen["store"] == every and seen["loop"] == every
