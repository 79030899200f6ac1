"""End-to-end on a real vLLM engine (CPU, tiny Llama): the kvgate connector in embedded mode.

One module-scoped scenario drives two engine lifetimes (each ``engine_run`` in its own process)
and the tests check its pieces:

    engine 1: baseline (no capability) | A: P miss, store | A: P hit from kvgate | B: P zero hits
              | A: Q store | secure clear of A | A (fresh capability): P miss, Q store
    tamper P's chunk 1 in every tier (rewritten consistently, as an attacker with tier access would)
    engine 2: A: Q hit from Redis/disk after the restart | A: P -> lookup hit, load fails the tag,
              vLLM recomputes; output identical | long prompt TTFT, miss vs hit

vLLM's own prefix cache is off, so every hit counted here came through kvgate. Shared tiers are
Redis and disk: on CPU vLLM runs its worker in a process of its own, so the scheduler-side lookup
and the worker-side store meet only in a tier both processes see.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path

import pytest

from tests.engine.engine_env import (
    cleanup_redis,
    redis_or_fail,
    require_vllm,
)
from tests.engine.engine_steps import _ids, _run, _setup, _trace
from tests.engine.tiny_model import build_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK, BLOCK, MODEL_NAME = 64, 32, "tiny-llama"


def _model(geometry_dtype: str = "float32"):
    import torch

    from gateway.services.core import KVModel
    from kernels.layouts import KVGeometry, KVLayout

    # the CPU engine's caches are in vLLM's CPU layout: the connector stores the CPU chunk format
    g = KVGeometry(num_layers=2, num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=BLOCK, layout=KVLayout.CPU)
    return KVModel(MODEL_NAME, g)


async def _tamper(settings: dict, tokens: list[int]) -> int:
    """Flip a ciphertext bit of chunk 1 of ``tokens`` (tenant acme) in every tier holding it."""
    from gateway.config import Settings
    from gateway.services.runtime import open_embedded
    from storage.types import ChunkNotFound

    rt = await open_embedded(Settings(**settings))
    try:
        keys = await rt.gateway.keys_for("acme", "default", _model(), tokens[: (len(tokens) - 1) // CHUNK * CHUNK])
        done = 0
        for tier in rt.tiers.tiers:
            try:
                raw = bytearray((await tier.get(keys[1])).data)
            except ChunkNotFound:
                continue
            raw[-20] ^= 0x80
            await tier.put(keys[1], raw)
            done += 1
        return done
    finally:
        await rt.aclose()


async def _audit_actions(settings: dict) -> list[str]:
    from gateway.config import Settings
    from gateway.services.runtime import open_runtime

    rt = await open_runtime(Settings(**settings))
    try:
        return [r.event.action async for r in rt.audit.store.iter_records()]
    finally:
        await rt.aclose()


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory):
    require_vllm()
    redis_url = redis_or_fail()
    work = tmp_path_factory.mktemp("vllm-engine")
    model_dir = build_tiny_llama(work / "model")
    prefix = f"kvgate-vllm-{secrets.token_hex(4)}:"
    settings = dict(
        state_dir=str(work / "state"), tiers=["redis", "disk"], redis_url=redis_url, redis_prefix=prefix,
        chunk_tokens=CHUNK, cpu_threads=1, disk_fsync=False,
    )
    trace = work / "trace.jsonl"
    caps = asyncio.run(_setup(settings))
    ktc = {
        "kv_connector": "KvgateConnector", "kv_connector_module_path": "gateway.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvgate_settings": settings, "trace_path": str(trace), "model_name": MODEL_NAME,
                                     "load_policy": "always"},
    }
    P, Q, LONG = _ids(model_dir, 300, 1), _ids(model_dir, 200, 2), _ids(model_dir, 960, 3)
    base = {"model": str(model_dir), "block_size": BLOCK, "kv_transfer_config": ktc, "settings": settings, "caps": caps}
    try:
        first = _run({**base, "steps": [
            {"op": "gen", "name": "base_P", "ids": P},
            {"op": "gen", "name": "base_Q", "ids": Q},
            {"op": "gen", "name": "A_P1", "ids": P, "cap": "A"},
            {"op": "gen", "name": "A_P2", "ids": P, "cap": "A"},
            {"op": "gen", "name": "B_P", "ids": P, "cap": "B"},
            {"op": "clear", "tenant": "acme", "new_cap": "A2"},
            {"op": "gen", "name": "A_P_after_clear", "ids": P, "cap": "A2"},
            {"op": "gen", "name": "A_Q_store", "ids": Q, "cap": "A2"},
            {"op": "gen", "name": "A_LONG_store", "ids": LONG, "cap": "A2", "max_tokens": 1},
        ]}, work, "engine1")
        a2 = _a2_cap(settings)
        tampered = asyncio.run(_tamper(settings, P))
        second = _run({**base, "caps": {**caps, "A2": a2}, "steps": [
            {"op": "gen", "name": "warmup", "ids": LONG[:100], "max_tokens": 1},
            {"op": "gen", "name": "ttft_miss", "ids": LONG[:-64] + LONG[-1:] * 64, "cap": "B", "max_tokens": 1},
            {"op": "gen", "name": "ttft_nocap", "ids": LONG, "max_tokens": 1},
            {"op": "gen", "name": "ttft_hit", "ids": LONG, "cap": "A2", "max_tokens": 1},
            {"op": "gen", "name": "A_Q_restart", "ids": Q, "cap": "A2"},
            {"op": "gen", "name": "A_P_tampered", "ids": P, "cap": "A2"},
        ]}, work, "engine2")
        by_name = {r["name"]: r for r in first + second}
        events = _trace(trace)
        actions = asyncio.run(_audit_actions(settings))
        yield {"r": by_name, "trace": events, "tampered": tampered, "audit": actions, "P": P, "Q": Q}
    finally:
        cleanup_redis(redis_url, prefix)


def _a2_cap(settings: dict) -> str:
    """A fresh capability for acme after the clear (the clear revoked the ones minted before)."""
    from gateway.config import Settings
    from gateway.services.runtime import open_runtime

    async def mint() -> str:
        rt = await open_runtime(Settings(**settings))
        try:
            return await rt.access.mint("acme", "default", ["lookup", "get", "put"], 600)
        finally:
            await rt.aclose()

    return asyncio.run(mint())


def _lookups(events: list[dict]) -> list[int]:
    return [e["hit_tokens"] for e in events if e["event"] == "lookup"]


def test_second_request_hits_kvgate_with_identical_output(scenario):
    r = scenario["r"]
    assert r["A_P1"]["kv"]["kvgate"]["hit_tokens"] == 0
    # A_P1 stored P's 9 full blocks (4 chunks and a 32-token tail); the hit loads all of them:
    # vLLM computes only the block holding the last 12 tokens
    assert r["A_P2"]["kv"]["kvgate"]["hit_tokens"] == 288  # (300 - 1) // 32 * 32
    assert r["A_P2"]["cached"] == 288  # vLLM's own prefix cache is off: these came from kvgate
    assert r["A_P1"]["tokens"] == r["A_P2"]["tokens"] == r["base_P"]["tokens"]
    loads = [e for e in scenario["trace"] if e["event"] == "load"]
    assert loads and loads[0]["loaded_tokens"] == 288 and loads[0]["failed_blocks"] == 0
    # it loaded layer by layer while the forward ran (the miss's steps showed vLLM calls
    # wait_for_layer_load for every layer), and that step's forward asked for every layer
    assert loads[0].get("layerwise") is True
    waits = [e for e in scenario["trace"] if e["event"] == "layer_wait"]
    assert waits and all(e["hooks_complete"] for e in waits)


def test_other_tenant_gets_zero_hits_beside_the_positive_control(scenario):
    r = scenario["r"]
    assert r["A_P2"]["kv"]["kvgate"]["hit_tokens"] == 288  # positive control
    assert r["B_P"]["kv"]["kvgate"]["hit_tokens"] == 0 and r["B_P"]["cached"] == 0
    assert r["B_P"]["tokens"] == r["base_P"]["tokens"]


def test_no_capability_means_no_lookup_and_no_store(scenario):
    r = scenario["r"]
    assert r["base_P"]["kv"] is None and r["ttft_nocap"]["kv"] is None and r["base_P"]["cached"] == 0


def test_secure_clear_makes_the_tenant_miss(scenario):
    r = scenario["r"]
    assert r["A_P_after_clear"]["kv"]["kvgate"]["hit_tokens"] == 0 and r["A_P_after_clear"]["cached"] == 0
    assert r["A_P_after_clear"]["tokens"] == r["base_P"]["tokens"]
    assert "clear.completed" in scenario["audit"]


def test_hits_after_engine_restart_come_from_redis_or_disk(scenario):
    r = scenario["r"]
    assert r["A_Q_restart"]["kv"]["kvgate"]["hit_tokens"] == 192  # (200 - 1) // 64 * 64
    assert r["A_Q_restart"]["cached"] == 192
    assert r["A_Q_restart"]["tokens"] == r["base_Q"]["tokens"]


def test_tampered_chunk_is_recomputed_and_audited(scenario):
    r = scenario["r"]
    assert scenario["tampered"] >= 1
    assert r["A_P_tampered"]["kv"]["kvgate"]["hit_tokens"] == 288  # the lookup saw it ...
    load = [e for e in scenario["trace"] if e["event"] == "load"][-1]
    assert load["integrity_failures"] == 1 and load["loaded_tokens"] == CHUNK  # ... the tag stopped it
    assert load.get("layerwise") is True  # layer by layer: the chunks after it left nothing either
    assert load["failed_blocks"] == (288 - CHUNK) // BLOCK
    assert r["A_P_tampered"]["tokens"] == r["base_P"]["tokens"]  # vLLM recomputed
    assert "integrity.failure" in scenario["audit"]


def test_report_ttft_and_miss_latency(scenario):
    """Not a benchmark gate: records numbers for the report (tiny model, this CPU)."""
    r, events = scenario["r"], scenario["trace"]
    assert r["ttft_hit"]["cached"] == 928  # all 30 blocks but the one holding the last token
    miss_lookups = [e["ms"] for e in events if e["event"] == "lookup" and e["hit_tokens"] == 0]
    report = {
        "ttft_s_no_kvgate": r["ttft_nocap"]["s"], "ttft_s_kvgate_miss": r["ttft_miss"]["s"], "ttft_s_kvgate_hit": r["ttft_hit"]["s"],
        "lookup_ms_on_miss_median": sorted(miss_lookups)[len(miss_lookups) // 2],
        "store_ms": [round(e["ms"], 1) for e in events if e["event"] == "store"],  # submit to end (asynchronous)
        "store_submit_ms": [round(e["ms"], 2) for e in events if e["event"] == "store_submit"],  # the step's share
        "load_ms": [round(e["ms"], 1) for e in events if e["event"] == "load"],
    }
    print("KVGATE_VLLM_REPORT", json.dumps(report))
    out = os.environ.get("KVGATE_VLLM_REPORT")
    if out:
        Path(out).write_text(json.dumps(report, indent=2))
