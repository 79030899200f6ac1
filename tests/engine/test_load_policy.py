"""Load or recompute on a real vLLM engine (CPU, fp32, greedy; vLLM's prefix cache off), kvgate's
only tier a Redis reached through a TCP proxy the test throttles (tests/support/tcp_proxy.py).

The model is a small random Llama (scripts/bench_e2e/model.py; 6 layers, 12 KiB of KV per token)
so a prompt's prefill costs enough to be worth loading over a fast link. Two engines, the same
kvgate state, ``load_policy: adaptive``:
    fast link   P and Q are computed and stored; P again loads (no load measured yet), then Q
                again loads because the measured load is faster than the measured prefill
    slow link   R (no capability) is computed; P again loads and measures the slow link; then Q
                again is recomputed, and the trace says why (load estimate over recompute estimate);
                Q once more, naming its own policy ``always``, loads over the slow link
Every answer to Q (computed, loaded, recomputed beside a hit) is the same greedy output.
Run it under the shared engine lock: ``flock /tmp/engine.lock``.
"""

from __future__ import annotations

import asyncio
import secrets
from urllib.parse import urlsplit

import pytest

from tests.engine.engine_env import cleanup_redis, redis_or_fail, require_vllm
from tests.engine.engine_steps import _run, _setup, _trace
from tests.support.tcp_proxy import tcp_proxy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK, BLOCK, MODEL_NAME, PROMPT = 256, 32, "policy-llama", 960
SLOW_BPS = 4e6  # 4 MB/s: a 960-token prompt's KV (11 MiB) takes seconds, its prefill far less


def _model(path):
    from scripts.bench_e2e.model import ModelSize, build_llama

    size = ModelSize(hidden=512, layers=6, heads=8, kv_heads=4, intermediate=1408, max_len=2048)
    return build_llama(path, size)


def _gen(name: str, ids: list[int], cap: str | None, policy: str | None = None) -> dict:
    return {"op": "gen", "name": name, "ids": ids, "cap": cap, "max_tokens": 6, "policy": policy}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    require_vllm()
    from scripts.bench_e2e.model import prompt_ids

    redis_url = redis_or_fail()
    target = urlsplit(redis_url)
    work = tmp_path_factory.mktemp("vllm-load-policy")
    model_dir = _model(work / "model")
    P, Q, R = (prompt_ids(PROMPT, seed) for seed in (31, 32, 33))
    prefix = f"kvgate-vllm-lp-{secrets.token_hex(4)}:"
    out = {}
    with tcp_proxy(target.hostname or "127.0.0.1", target.port or 6379) as proxy:
        settings = dict(
            state_dir=str(work / "state"), tiers=["redis"], redis_url=proxy.url_for("redis") + "/0", redis_prefix=prefix,
            chunk_tokens=CHUNK, cpu_threads=1,
            # a load over the slow link takes seconds: it must end, not miss the tier's read deadline
            tier_read_timeout_s=60.0, tier_write_timeout_s=60.0,
        )
        try:
            caps = asyncio.run(_setup(settings))
            for link, rate, steps in (
                ("fast", None, [_gen("P1", P, "A"), _gen("Q1", Q, "A"), _gen("P2", P, "A"), _gen("Q2", Q, "A")]),
                ("slow", SLOW_BPS, [_gen("R1", R, None), _gen("P3", P, "A"), _gen("Q3", Q, "A"), _gen("Q4", Q, "A", "always")]),
            ):
                proxy.rate_bps = rate
                trace = work / f"trace-{link}.jsonl"
                ktc = {
                    "kv_connector": "KvgateConnector", "kv_connector_module_path": "gateway.vllm.connector",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {
                        "kvgate_settings": settings, "trace_path": str(trace), "model_name": MODEL_NAME,
                        "load_policy": "adaptive",
                    },
                }
                plan = {"model": str(model_dir), "block_size": BLOCK, "kv_transfer_config": ktc, "settings": settings,
                        "caps": caps, "steps": steps}
                events = None
                for r in _run(plan, work, link):
                    events = events or _trace(trace)
                    rid = r.get("req", "")
                    mine = [e for e in events if rid and (e.get("req") == rid or str(e.get("req")).startswith(f"{rid}-"))]
                    out[r["name"]] = {**r, "trace": mine}
        finally:
            proxy.rate_bps = None
            cleanup_redis(redis_url, prefix)
    return out


def _decision(r: dict) -> dict:
    [d] = [e for e in r["trace"] if e["event"] == "decision"]
    return d


def test_load_policy_fast_link_loads_once_measured(runs):
    first = _decision(runs["P2"])
    assert (first["reason"], first["tokens"]) == ("cold_load", first["hit_tokens"]) and first["hit_tokens"] > 0
    d = _decision(runs["Q2"])
    assert d["reason"] == "load_faster" and d["tokens"] == d["hit_tokens"] > 0, d
    assert d["est_load_ms"] < d["est_recompute_ms"], d
    loads = [e for e in runs["Q2"]["trace"] if e["event"] == "load"]
    assert loads and loads[0]["loaded_tokens"] == d["tokens"] and not loads[0]["failed_blocks"]


def test_load_policy_slow_link_recomputes_and_says_why(runs):
    probe = _decision(runs["P3"])  # a new engine measures the link first
    assert probe["reason"] == "cold_load" and probe["tokens"] > 0
    d = _decision(runs["Q3"])
    assert d["reason"] == "recompute_faster" and d["tokens"] == 0 and d["hit_tokens"] > 0, d
    assert d["est_load_ms"] > d["est_recompute_ms"] > 0, d
    assert d["est_lead_ms"] > 0.5 * d["est_load_ms"], d  # over a slow link a load is mostly its fetch
    assert not [e for e in runs["Q3"]["trace"] if e["event"] == "load"]  # nothing loaded
    assert runs["Q3"]["kv"] is None or runs["Q3"]["kv"].get("kvgate", {}).get("hit_tokens", 0) == 0


def test_load_policy_a_request_naming_always_loads_where_the_engine_would_recompute(runs):
    d = _decision(runs["Q4"])  # the control is Q3: the same prompt, the engine's adaptive recomputed
    assert d["reason"] == "always" and d["tokens"] == d["hit_tokens"] > 0, d
    loads = [e for e in runs["Q4"]["trace"] if e["event"] == "load"]
    assert loads and loads[0]["loaded_tokens"] == d["tokens"] and not loads[0]["failed_blocks"]
    assert 0.5 * loads[0]["ms"] <= loads[0]["lead_ms"] <= loads[0]["ms"]  # the fetch comes first


def test_load_policy_greedy_outputs_identical_loaded_or_recomputed(runs):
    computed, loaded, recomputed = runs["Q1"]["tokens"], runs["Q2"]["tokens"], runs["Q3"]["tokens"]
    assert computed and computed == loaded == recomputed == runs["Q4"]["tokens"]
    assert runs["P1"]["tokens"] == runs["P2"]["tokens"] == runs["P3"]["tokens"]
