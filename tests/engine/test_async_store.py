"""Asynchronous stores on a real vLLM engine (CPU, tiny Llama, fp32, vLLM's prefix cache off).

The worker gathers a request's blocks in ``wait_for_save`` and seals and puts them on the
backend's loop, not waited for. Here every store is held up for a few seconds
(``slow_store_connector``), and the engine has a KV cache of 32 blocks, so:

    base_P   P alone, no capability (the engine's own answer)
    A_P1     tenant A: P finishes (one output token) with its store still held up
    LONG     no capability, 960 tokens: 31 of the 32 blocks, so it runs on P's freed blocks
             while P's store is still in flight
    settle   wait until the connector's trace says every store ended
    A_P2     tenant A: P hits all 288 tokens kvgate stored, and answers exactly as base_P:
             the store sealed P's KV as it was when submitted, not what LONG wrote over it

vLLM's own cache is off and LONG has no capability, so nothing of it reaches kvgate: a wrong
hit could only come from a store that read blocks after they were reused.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest

from tests.engine.engine_env import cleanup_redis, redis_or_fail, require_vllm
from tests.engine.engine_steps import _ids, _run, _setup, _trace
from tests.engine.tiny_model import build_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK, BLOCK, MODEL_NAME, DELAY_S = 64, 32, "tiny-llama", 4.0


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module):
    require_vllm()
    redis_url = redis_or_fail()
    work = tmp_path_factory.mktemp("vllm-async-store")
    model_dir = build_tiny_llama(work / "model")
    prefix = f"kvgate-vllm-{secrets.token_hex(4)}:"
    settings = dict(
        state_dir=str(work / "state"), tiers=["redis", "disk"], redis_url=redis_url, redis_prefix=prefix,
        chunk_tokens=CHUNK, cpu_threads=1, disk_fsync=False,
    )
    trace = work / "trace.jsonl"
    caps = asyncio.run(_setup(settings))
    ktc = {
        "kv_connector": "SlowStoreConnector", "kv_connector_module_path": "tests.engine.slow_store_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvgate_settings": settings, "trace_path": str(trace), "model_name": MODEL_NAME,
                                     "load_policy": "always"},
    }
    P, LONG = _ids(model_dir, 300, 1), _ids(model_dir, 960, 3)
    monkeypatch_module.setenv("KVGATE_TEST_STORE_DELAY_S", str(DELAY_S))
    plan = {
        "model": str(model_dir), "block_size": BLOCK, "kv_transfer_config": ktc, "settings": settings, "caps": caps,
        "num_blocks": 33,  # 32 blocks of 32 tokens (max_model_len 1024) and vLLM's null block
        "steps": [
            {"op": "gen", "name": "base_P", "ids": P},
            {"op": "gen", "name": "A_P1", "ids": P, "cap": "A", "max_tokens": 1, "settle": False},
            {"op": "gen", "name": "LONG", "ids": LONG, "max_tokens": 1, "settle": False},
            {"op": "settle"},
            {"op": "gen", "name": "A_P2", "ids": P, "cap": "A"},
        ],
    }
    try:
        results = _run(plan, work, "engine")
        yield {"r": {r["name"]: r for r in results if r["op"] == "gen"}, "trace": _trace(trace)}
    finally:
        cleanup_redis(redis_url, prefix)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _store_events(run: dict, name: str) -> tuple[dict, dict]:
    req = run["r"][name]["req"]
    mine = [e for e in run["trace"] if e["event"] in ("store_submit", "store") and (e["req"] == req or e["req"].startswith(f"{req}-"))]
    (submit,) = [e for e in mine if e["event"] == "store_submit"]
    (end,) = [e for e in mine if e["event"] == "store"]
    return submit, end


def test_a_request_finishes_and_its_blocks_are_reused_while_its_store_is_in_flight(run):
    r = run["r"]
    submit, end = _store_events(run, "A_P1")
    assert submit["tokens"] == 288 and end["stored_chunks"] == 5 and end["reason"] == ""  # 4 chunks, a 32-token tail
    # the engine did not wait: P finished, then LONG ran on the freed blocks, then the store ended
    assert submit["t"] < r["A_P1"]["t_end"] < r["LONG"]["t_end"] < end["t"]
    assert end["ms"] >= DELAY_S * 1e3 > submit["ms"]


def test_the_hit_after_an_async_store_answers_exactly_as_the_engine_alone(run):
    r = run["r"]
    assert r["A_P1"]["kv"]["kvgate"]["hit_tokens"] == 0
    assert r["A_P2"]["kv"]["kvgate"]["hit_tokens"] == 288 and r["A_P2"]["cached"] == 288  # positive control
    assert r["A_P2"]["tokens"] == r["base_P"]["tokens"]
    assert r["A_P1"]["tokens"] == r["base_P"]["tokens"][:1]
    loads = [e for e in run["trace"] if e["event"] == "load"]
    assert [(e["loaded_tokens"], e["failed_blocks"]) for e in loads] == [(288, 0)]
