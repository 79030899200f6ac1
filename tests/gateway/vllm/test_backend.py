"""The connector's backends (gateway/vllm/backend.py): the loop thread vLLM's threads call through
(a late answer is a GatewayTimeout and the work is cancelled), and a backend that cannot open its
state refuses the engine's start with the cause, leaving no thread behind."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.vllm.backend import EmbeddedBackend, LoopThread, backend_for
from gateway.vllm.config import ConnectorConfig
from gateway.vllm.errors import ConnectorConfigError, GatewayTimeout


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvgate-connector" and t.is_alive()]


def test_building_a_backend_starts_no_thread(tmp_path):
    before = len(_loop_threads())
    EmbeddedBackend({"state_dir": str(tmp_path)})
    assert len(_loop_threads()) == before


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


def test_a_backend_that_cannot_open_its_state_refuses_with_the_cause(tmp_path):
    kek = tmp_path / "kek.key"
    kek.write_bytes(b"not a key")  # a KEK file that is not one: open_runtime fails
    config = ConnectorConfig.from_extra({"kvgate_settings": {"state_dir": str(tmp_path), "kek_file": str(kek)}})
    before = len(_loop_threads())
    with pytest.raises(ConnectorConfigError, match="kvgate could not open its state"):
        backend_for(config)
    assert len(_loop_threads()) == before
