"""The connector's backends (gateway/vllm/backend.py): the loop thread vLLM's threads call through
(a late answer is a GatewayTimeout and the work is cancelled), and a backend that cannot open its
state refuses the engine's start with the cause, leaving no thread behind."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.vllm.backend import EmbeddedBackend, LoopThread, SharedBackends
from gateway.vllm.config import ConnectorConfig
from gateway.vllm.errors import ConnectorConfigError, GatewayTimeout


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvgate-connector" and t.is_alive()]


def test_building_a_backend_starts_no_thread(tmp_path):
    before = len(_loop_threads())
    EmbeddedBackend({"state_dir": str(tmp_path)})
    assert len(_loop_threads()) == before


def test_the_embedded_memory_tier_is_populated_behind_unless_the_settings_say_otherwise(tmp_path, monkeypatch):
    from gateway.config import Settings

    assert Settings(state_dir=tmp_path).memory_prefault == "off"  # the control: kvgate serve's default
    assert EmbeddedBackend({"state_dir": str(tmp_path)}).settings.memory_prefault == "behind"
    assert EmbeddedBackend({"state_dir": str(tmp_path), "memory_prefault": "off"}).settings.memory_prefault == "off"
    monkeypatch.setenv("KVGATE_MEMORY_PREFAULT", "start")
    assert EmbeddedBackend({"state_dir": str(tmp_path)}).settings.memory_prefault == "start"


def test_a_late_answer_is_a_timeout_and_the_work_is_cancelled():
    loop = LoopThread(timeout_s=5.0)
    with pytest.raises(RuntimeError, match="not running"):
        loop.call(asyncio.sleep(0))
    loop.start()
    try:
        async def answer() -> int:
            return 42

        assert loop.call(answer()) == 42  # positive control
        cancelled = threading.Event()

        async def slow() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        with pytest.raises(GatewayTimeout, match="did not answer in 0.05 s"):
            loop.call(slow(), timeout=0.05)
        assert cancelled.wait(5)
    finally:
        loop.stop()
    assert not _loop_threads()


def test_closing_lets_submitted_work_end_and_cancels_what_outlives_the_bound(caplog):
    """A report submitted and not waited for (a refused receipt's) ends before the backend
    closes; work that outlives the bound is cancelled, not dropped while pending (asyncio's
    "Task was destroyed but it is pending")."""
    from gateway.vllm import backend as backend_mod

    class Fake:
        def __init__(self) -> None:
            self.loop = LoopThread(timeout_s=5.0, settle_s=2.0)
            self.closed_after: list[str] = []

        async def aclose(self) -> None:
            self.closed_after = list(events)

    events: list[str] = []
    cancelled = threading.Event()

    async def report() -> None:
        await asyncio.sleep(0.2)
        events.append("reported")

    async def stuck() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    fake = Fake()
    fake.loop.start()
    report_done = fake.loop.submit(report())
    backend_mod.close(fake, drain_s=5.0)  # type: ignore[arg-type]
    assert report_done.result(0) is None and fake.closed_after == ["reported"]  # ended, then closed
    assert not _loop_threads()

    fake = Fake()
    fake.loop.start()
    fake.loop.submit(stuck())
    with caplog.at_level("WARNING", logger="kvgate.vllm"):
        backend_mod.close(fake, drain_s=0.1)  # type: ignore[arg-type]
    assert cancelled.is_set() and "tasks still running after 0.1 s" in caplog.text
    assert not _loop_threads()


def test_a_timed_out_call_returns_only_once_its_worker_threads_have_stopped_writing():
    """A load that decrypts straight into the engine's cache runs its scatter on the data path's
    threads; when the connector gives up on it (timeout), vLLM recomputes or reuses those blocks
    at once, so nothing may still be writing there when ``call`` returns. Beside it, the control:
    a plain executor job (not through ``DataPath.run``) is still writing when the timeout comes."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from crypto.envelope import ChunkCipher
    from gateway.datapath import DataPath

    dp = DataPath(ChunkCipher(), threads=1)
    plain = ThreadPoolExecutor(1)
    loop = LoopThread(timeout_s=5.0)
    loop.start()
    try:
        def scatter(done: list[float]) -> None:
            time.sleep(0.4)
            done.append(time.monotonic())

        for through_datapath in (True, False):
            done: list[float] = []

            async def load(done: list[float] = done, through_datapath: bool = through_datapath) -> None:
                if through_datapath:
                    await dp.run(scatter, done)
                else:
                    await asyncio.get_running_loop().run_in_executor(plain, scatter, done)

            with pytest.raises(GatewayTimeout):
                loop.call(load(), timeout=0.05)
            returned = time.monotonic()
            if through_datapath:
                assert done and done[0] <= returned  # the write ended before call returned
            else:
                assert not done  # the control: still writing after the timeout
                time.sleep(0.6)
                assert done and done[0] > returned
    finally:
        loop.stop()
        dp.close()
        plain.shutdown()


def test_a_backend_that_cannot_open_its_state_refuses_with_the_cause(tmp_path):
    kek = tmp_path / "kek.key"
    kek.write_bytes(b"not a key")  # a KEK file that is not one: open_runtime fails
    config = ConnectorConfig.from_extra({"kvgate_settings": {"state_dir": str(tmp_path), "kek_file": str(kek)}})
    before = len(_loop_threads())
    shared = SharedBackends()
    with pytest.raises(ConnectorConfigError, match="kvgate could not open its state"):
        shared.acquire(config)
    assert len(_loop_threads()) == before


def test_a_connector_pointed_at_another_state_dir_names_it_and_creates_no_kek(tmp_path):
    """The embedded connector of a worker configured with the registry's database but another state
    directory: the engine's start is refused with the state directory, the KEK file and the fix, and
    no KEK file appears there. Control: the registry's own state directory opens."""
    from tests.support.gw import gateway_runtime

    real, wrong = tmp_path / "real", tmp_path / "wrong"
    url = f"sqlite+aiosqlite:///{real / 'kvgate.db'}"

    async def registry_with_a_tenant() -> None:
        async with gateway_runtime(real, url) as rt:
            await rt.admin.create_tenant("acme")

    asyncio.run(registry_with_a_tenant())
    good = ConnectorConfig.from_extra({"kvgate_settings": {"state_dir": str(real), "database_url": url}})
    shared = SharedBackends()
    shared.release(shared.acquire(good))
    bad = ConnectorConfig.from_extra({"kvgate_settings": {"state_dir": str(wrong), "database_url": url}})
    with pytest.raises(ConnectorConfigError, match="kvgate could not open its state: no new KEK was created") as err:
        shared.acquire(bad)
    for needle in (f"state directory {wrong}", str(wrong / "kek.key"), "KVGATE_STATE_DIR", str(real / "kvgate.db")):
        assert needle in str(err.value)
    assert not (wrong / "kek.key").exists()


async def test_an_embedded_backends_copies_behind_yield_to_this_process_engine_steps(tmp_path):
    """The slower tiers' copies wait while the engine of this process runs forward steps
    (``copies_finish_s``), and go once it is idle."""
    from gateway.datapath.gate import STEPS
    from storage.types import ChunkKey

    backend = EmbeddedBackend(
        {"state_dir": str(tmp_path), "tiers": ["memory", "disk"], "memory_bytes": 64 << 20}, copies_finish_s=30.0,
    )
    await backend.open()
    try:
        tiers = backend.runtime.tiers
        disk = tiers.tier("disk")
        STEPS.forward_begins()
        try:
            await tiers.put(ChunkKey("aa", "bb", "1" * 64), b"x" * 4096)
            await asyncio.sleep(0.2)
            assert await disk.list_keys() == []  # a step is running: the copy waits
        finally:
            STEPS.forward_ends()
        await asyncio.wait_for(tiers.flush(), 5)  # the engine is idle: it goes
        assert await disk.list_keys() == [ChunkKey("aa", "bb", "1" * 64)]
    finally:
        await backend.aclose()
