"""A store seals between the engine's forward steps (``gateway.datapath.gate``): while a forward
runs its slices wait, as the forward ends they run, and a forward that never ends only delays
each slice to its deadline, so the store still finishes within ``finish_s``. Loads never wait."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.datapath import DataPath
from gateway.datapath.gate import STEPS, StepGate
from gateway.types import KVModel
from gateway.vllm.backend import SharedBackends
from gateway.vllm.config import ConnectorConfig
from gateway.vllm.ledger import LoadOp, StoreOp
from gateway.vllm.worker import WorkerSide
from tests.gateway.vllm import test_worker as wt
from tests.support.gw import ALL_OPS, gateway_runtime, gathered, model_for, random_cache, small_geometry, zero_cache

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="stores get threads of their own only on Linux")

TOKENS = list(range(300, 300 + 16 * 8))  # 8 chunks of 16 tokens, 32 blocks of 4


@pytest.fixture
def steps() -> Iterator[StepGate]:
    yield STEPS
    STEPS.forward_ends()
    STEPS.finish_s = 0.0


@pytest.fixture
def seals(monkeypatch) -> list[float]:
    """The monotonic time each store slice started sealing."""
    at: list[float] = []
    seal = DataPath.seal_batch

    def spy(self, *a):
        at.append(time.monotonic())
        return seal(self, *a)

    monkeypatch.setattr(DataPath, "seal_batch", spy)
    return at


def test_the_gate_lets_a_slice_run_when_idle_when_the_forward_ends_or_at_its_deadline() -> None:
    gate = StepGate(finish_s=1.0)
    assert gate.deadline(10.0, 0, 4) == 10.25 and gate.deadline(10.0, 3, 4) == 11.0
    assert StepGate().deadline(10.0, 0, 4) is None  # finish_s 0: never waits
    assert gate.wait_turn(time.monotonic() + 30) < 0.2  # no forward yet: at once
    gate.forward_begins()
    t0 = time.monotonic()
    gate.wait_turn(t0 + 0.2)  # a forward that does not end: until the deadline
    assert 0.15 <= time.monotonic() - t0 < 2.0
    loop_ends = asyncio.new_event_loop()
    try:
        loop_ends.call_later(0.1, gate.forward_ends)
        t0 = time.monotonic()
        loop_ends.run_until_complete(asyncio.to_thread(gate.wait_turn, t0 + 30))
        assert time.monotonic() - t0 < 5.0  # the forward's end, not the 30 s deadline
    finally:
        loop_ends.close()


def test_a_gap_between_steps_takes_one_slice_and_an_idle_engine_takes_every_slice() -> None:
    gate = StepGate(finish_s=1.0, per_gap=1, idle_s=1.0)
    far = time.monotonic() + 30
    gate.forward_begins()
    gate.forward_ends()
    assert gate.wait_turn(far) < 0.2  # the gap's one slice
    waiter = threading.Thread(target=gate.wait_turn, args=(far,))
    t0 = time.monotonic()
    waiter.start()  # a second slice of the same gap waits ...
    time.sleep(0.2)
    assert waiter.is_alive()
    gate.forward_begins()  # ... through the next forward, for the next gap
    time.sleep(0.1)
    assert waiter.is_alive()
    gate.forward_ends()
    waiter.join(5)
    assert not waiter.is_alive() and time.monotonic() - t0 < 0.9  # that gap's slice, not the idle second
    t0 = time.monotonic()
    gate.wait_turn(far)  # no third step comes: the engine is idle after idle_s, and the slice runs
    assert 0.5 <= time.monotonic() - t0 < 5
    assert gate.wait_turn(far) < 0.2 and gate.wait_turn(far) < 0.2  # idle: every slice at once


def test_a_step_without_a_forward_is_idle_at_once() -> None:
    """vLLM steps without pause while nothing is scheduled (a producer's blocks waiting for their
    hand-off store): such a step marks the engine idle, so a slice runs at once, not after idle_s
    of no steps (which never come) or at its deadline; the next forward holds slices again."""
    gate = StepGate(finish_s=60.0, idle_s=30.0)
    far = time.monotonic() + 60
    gate.forward_begins()
    gate.forward_ends()  # the prefill's forward ended just now
    waiter = threading.Thread(target=gate.wait_turn, args=(far,))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # a gap after a forward: waits for idle_s
    t0 = time.monotonic()
    gate.forward_begins()
    gate.forward_ends()  # positive control: a step that ran a forward does not make it idle
    time.sleep(0.2)
    assert waiter.is_alive()
    gate.idle()  # a step with nothing scheduled
    waiter.join(5)
    assert not waiter.is_alive() and time.monotonic() - t0 < 2.0
    assert gate.wait_turn(far) < 0.2 and gate.forced == 0


@asynccontextmanager
async def _acme(tmp_path: Path, seed: int) -> AsyncIterator[tuple[Any, KVModel, str, list[torch.Tensor]]]:
    """An embedded gateway whose stores run at nice 9, tenant acme's capability, the model and a
    cache of 32 random blocks to store from."""
    g = small_geometry()
    async with gateway_runtime(tmp_path, store_nice=9) as rt:
        await rt.admin.create_tenant("acme")
        cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        yield rt, model_for(g), cap, random_cache(g, 32, seed=seed)


async def test_a_store_seals_only_once_the_forward_has_ended(tmp_path, steps, seals) -> None:
    async with _acme(tmp_path, seed=5) as (rt, model, cap, src):
        g = model.geometry
        steps.finish_s = 60.0
        steps.forward_begins()
        store = asyncio.ensure_future(rt.gateway.store(cap, model, TOKENS, src, block_ids=list(range(32))))
        await asyncio.sleep(0.5)
        assert not seals and not store.done()  # the forward runs: nothing sealed
        ended = time.monotonic()
        steps.forward_ends()
        res = await asyncio.wait_for(store, 30)
        assert res.stored == 8 and seals and min(seals) >= ended
        # loads are never held back by a forward (the engine waits for them)
        steps.forward_begins()
        dst = zero_cache(g, 32)
        t0 = time.monotonic()
        got = await rt.gateway.retrieve(cap, model, TOKENS, dst, block_ids=list(range(32)))
        assert time.monotonic() - t0 < 30 and got.loaded_tokens == len(TOKENS)
        assert torch.equal(gathered(src, g, range(32), len(TOKENS)), gathered(dst, g, range(32), len(TOKENS)))


async def test_a_forward_that_never_ends_delays_a_store_to_its_bound_and_no_further(tmp_path, steps, seals) -> None:
    async with _acme(tmp_path, seed=6) as (rt, model, cap, src):
        steps.finish_s = 1.0
        steps.forward_begins()  # and never ends
        t0 = time.monotonic()
        res = await asyncio.wait_for(rt.gateway.store(cap, model, TOKENS, src, block_ids=list(range(32))), 30)
        took = time.monotonic() - t0
        assert res.stored == 8
        assert 0.8 <= took < 1.0 + 10  # the last slice started at its deadline, not before
        assert steps.forced >= 2
        assert max(seals) - min(seals) >= 0.4  # slices spread over the bound, not all at its end
        # the control: with finish_s 0 a forward does not hold a store back at all
        steps.finish_s = 0.0
        seals.clear()
        other = [t + 10_000 for t in TOKENS]
        t0 = time.monotonic()
        res = await asyncio.wait_for(rt.gateway.store(cap, model, other, src, block_ids=list(range(32))), 30)
        assert res.stored == 8 and time.monotonic() - t0 < 0.8



def test_the_connectors_worker_holds_a_store_while_the_next_step_runs_and_lets_it_go_at_its_end(tmp_path, steps) -> None:
    """On the worker side (a real embedded backend, the CPU paged layout): a store submitted at
    one step's ``wait_for_save`` does not seal while the next step's forward runs (begun at
    ``bind_connector_metadata``), and seals once that step's ``wait_for_save`` ends it; it loads
    back bit-exact. A ``save`` that fails still ends the step."""
    shared = SharedBackends()
    backend = shared.acquire(ConnectorConfig.from_extra({"kvgate_settings": {
        "state_dir": str(tmp_path), "tiers": ["memory"], "memory_bytes": 64 << 20, "chunk_tokens": wt.CHUNK,
        "segment_bytes": 4096, "cpu_threads": 1,
    }}))
    try:
        cap = wt._capability(backend)
        gated = wt.GatedBackend(backend)  # its store waits for gated.gate (a slow tier) first
        src, dst = wt._cpu_cache(seed=7), wt._cpu_cache(seed=8)
        writer = wt._gated_worker(gated, src, tmp_path, store_finish_s=60.0)
        assert steps.finish_s == 60.0
        ids, dst_ids = list(range(3, 15)), list(range(20, 32))
        writer.forward_begins()
        writer.save([StoreOp("w", cap, wt.TOKENS, ids)])  # the step's end: submitted, held by the tier
        assert not steps.busy
        writer.forward_begins()  # the next step's forward
        gated.gate.set()
        assert not writer.wait_stores(1.0)  # its sealing waits for the forward
        writer.save([])  # that step ends
        assert writer.wait_stores(30)
        (end,) = [e for e in wt._events(tmp_path) if e["event"] == "store"]
        assert end["stored_chunks"] == 3 and end["gate_wait_ms"] >= 500 and end["gate_forced"] == 0
        reader = wt._worker(backend, dst, tmp_path)
        reader.load([LoadOp("r", cap, wt.TOKENS, dst_ids)])
        assert reader.take_load_errors() == set()
        for a, b in zip(wt._blocks(src, ids), wt._blocks(dst, dst_ids), strict=True):
            assert torch.equal(a, b)
        unregistered = WorkerSide(gated, wt.CHUNK, wt.BLOCK, "tiny")
        unregistered.forward_begins()
        with pytest.raises(RuntimeError, match="registered"):
            unregistered.save([StoreOp("x", cap, wt.TOKENS, ids)])
        assert not steps.busy
    finally:
        shared.release(backend)
