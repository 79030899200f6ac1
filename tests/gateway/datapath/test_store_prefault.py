"""A store faults in the pages of the slots its tier reserved behind its seals (``store_prefault``):
every slot, in the order the batches seal, until the store ends; what it stores is unchanged."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import gateway.datapath.plane as plane
from gateway.vllm.backend import EmbeddedBackend
from gateway.vllm.config import ConnectorConfig
from tests.support.gw import ALL_OPS, gateway_runtime, model_for, random_cache, small_geometry, store_and_load_back


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    real = plane.prefault_behind

    def spy(views: Sequence[memoryview], stop: Callable[[], bool]) -> Any:
        calls.append({"at": [int(np.frombuffer(v, np.uint8).ctypes.data) for v in views],
                      "nbytes": [v.nbytes for v in views], "stop": stop, "stopped_at_start": stop()})
        return real(views, stop)

    monkeypatch.setattr(plane, "prefault_behind", spy)
    return calls


@pytest.mark.parametrize("prefault", [True, False])
async def test_a_store_faults_its_slots_in_behind_in_seal_order_until_it_ends(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, prefault: bool,
) -> None:
    calls = _spy(monkeypatch)
    g = small_geometry()
    model = model_for(g)
    src = random_cache(g, 32, seed=5)
    tokens = list(range(300, 300 + 16 * 4))
    async with gateway_runtime(tmp_path, store_prefault=prefault, memory_bytes=64 << 20) as rt:
        await rt.admin.create_tenant("acme")
        cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        await store_and_load_back(rt, cap, g, tokens, src, 16, 32)  # four chunks, exact
        if not prefault:  # the control: the seals fault the pages in themselves
            assert calls == []
            return
        # one prefault per store, over the four slots the memory tier reserved, in the order the
        # batches seal them; running while the store runs, told to stop once it has ended
        assert len(calls) == 1
        (call,) = calls
        assert len(call["at"]) == 4 and len(set(call["at"])) == 4 and len(set(call["nbytes"])) == 1
        assert not call["stopped_at_start"] and call["stop"]()
        # a second store of the same prompt finds it stored: nothing reserved, nothing prefaulted
        assert (await rt.gateway.store(cap, model, tokens, src, block_ids=list(range(16)))).stored == 0
        assert len(calls) == 1


def test_the_connector_prefaults_by_default_and_kvgate_settings_may_say_otherwise(tmp_path: Any) -> None:
    config = ConnectorConfig.from_extra({})
    assert config.store_prefault is True
    assert EmbeddedBackend({"state_dir": str(tmp_path)}, store_prefault=config.store_prefault).settings.store_prefault
    off = ConnectorConfig.from_extra({"store_prefault": False})
    assert EmbeddedBackend({"state_dir": str(tmp_path)}, store_prefault=off.store_prefault).settings.store_prefault is False
    assert EmbeddedBackend({"state_dir": str(tmp_path), "store_prefault": False}).settings.store_prefault is False
