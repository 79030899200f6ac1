"""A failed or partial load is never stored back, on a real vLLM engine (CPU, tiny
Llama, fp32 so greedy outputs are bit-exact, vLLM's prefix cache off).

Every scenario has the shape that poisoned the cache before: a request that loads and stores in
the same step. Per scenario X every request is a 256-token prefix shared by all of X's requests
(4 chunks of 64, a system prompt or a conversation so far) and a 64-token question of its own, so
its lookup hits at most the 256 shared tokens and it stores its 320 (the question's chunk is new).
X1 stores, X2 hits (positive control), a fault, X3 recovers, then X4-X6 (the requests *after*
the recovery) must answer exactly as the engine alone does on the same prompt and load without a
failure.

    engine 1 (Redis on 6379 under a fresh prefix, then disk; KEK in moto's KMS)
        P  a ciphertext bit flipped in every tier            -> integrity failure at chunk 1
        Q  chunk 2's Redis value torn, no other copy         -> load ends at chunk 2 (a miss)
        R  the KMS key disabled (DEK cache expired)          -> KEK outage, nothing loads
    engine 2 (a redis-server of our own, the only tier)
        S  the server SIGSTOPped as the lookup hit, resumed 1 s later -> tier deadline
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine.engine_env import cleanup_redis, redis_or_fail, require_vllm
from tests.engine.engine_steps import _ids, _run, _setup, _trace
from tests.engine.tiny_model import build_tiny_llama
from tests.support.services import free_port, missing

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK, BLOCK, MODEL_NAME, REGION = 64, 32, "tiny-llama", "us-east-1"
FULL_HIT = 256  # the shared prefix; each request's own 64-token question is never in kvgate before it


def _prompts(model_dir: Path, seed: int) -> dict[int, list[int]]:
    """X1..X6: one 256-token prefix, each with a 64-token question of its own."""
    prefix = _ids(model_dir, 256, seed)
    return {n: prefix + _ids(model_dir, 64, seed * 100 + n) for n in range(1, 7)}


def _baselines(x: str, prompts: dict[int, list[int]]) -> list[dict]:
    """The engine alone (no capability) on each of X's prompts."""
    return [{"op": "gen", "name": f"base{x}{n}", "ids": ids} for n, ids in prompts.items()]


def _scenario(x: str, prompts: dict[int, list[int]], fault: list[dict], **gen3) -> list[dict]:
    """X1 stores, X2 hits, the fault, X3 recovers, X4-X6 follow (tenant A)."""

    def gen(n: int, **kw) -> dict:
        return {"op": "gen", "name": f"{x}{n}", "ids": prompts[n], "cap": "A", **kw}

    return [gen(1), gen(2), *fault, gen(3, **gen3), gen(4), gen(5), gen(6)]


class _Moto:
    def __init__(self, log: Path) -> None:
        for mod in ("boto3", "moto", "flask"):
            if importlib.util.find_spec(mod) is None:
                missing(f"{mod} is not installed (pip install boto3 'moto[server]')")
        self.port = free_port()
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)], stdout=self.log,
            stderr=self.log,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto server did not start (see {log})")
                time.sleep(0.2)
        import boto3

        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.key_id = boto3.client("kms", region_name=REGION, endpoint_url=self.endpoint).create_key()["KeyMetadata"]["KeyId"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


class _OwnRedis:
    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            missing("redis-server is not installed")
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("redis-server did not start")
                time.sleep(0.05)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def _ktc(settings: dict, trace: Path) -> dict:
    return {
        "kv_connector": "KvgateConnector", "kv_connector_module_path": "gateway.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvgate_settings": settings, "trace_path": str(trace), "model_name": MODEL_NAME,
                                     "load_policy": "always"},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    require_vllm()
    redis_url = redis_or_fail()
    work = tmp_path_factory.mktemp("vllm-load-failures")
    model_dir = build_tiny_llama(work / "model")
    P, Q, R, S = (_prompts(model_dir, seed) for seed in (11, 12, 13, 14))
    prefix = f"kvgate-vllm-lf-{secrets.token_hex(4)}:"
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION=REGION)
    moto = _Moto(work / "moto.log")
    own = _OwnRedis()
    try:
        # engine 1: shared Redis + disk, KEK in KMS; data keys stay in memory 1 s only
        s1 = dict(
            state_dir=str(work / "state1"), tiers=["redis", "disk"], redis_url=redis_url, redis_prefix=prefix,
            chunk_tokens=CHUNK, cpu_threads=1, disk_fsync=False, kek_provider="kms", kms_key_id=moto.key_id,
            kms_region=REGION, kms_endpoint_url=moto.endpoint, kek_cache_ttl_s=1.0, kms_key_state_ttl_s=0.2,
        )
        trace1 = work / "trace1.jsonl"
        s2 = dict(
            state_dir=str(work / "state2"), tiers=["redis"], redis_url=own.url, redis_prefix="kvgate-lf:",
            chunk_tokens=CHUNK, cpu_threads=1,
        )
        caps2 = asyncio.run(_setup(s2))
        # F: a capability minted against other kvgate state (another database and state dir)
        caps1 = {**asyncio.run(_setup(s1)), "F": caps2["A"]}
        base1 = {"model": str(model_dir), "block_size": BLOCK, "kv_transfer_config": _ktc(s1, trace1), "settings": s1, "caps": caps1}
        steps1 = [
            *_baselines("P", P), *_baselines("Q", Q), *_baselines("R", R),
            {"op": "gen", "name": "foreign1", "ids": P[1], "cap": "F"}, {"op": "gen", "name": "foreign2", "ids": Q[1], "cap": "F"},
            *_scenario("P", P, [{"op": "tamper", "ids": P[1], "chunk": 1, "how": "flip"}]),
            *_scenario("Q", Q, [{"op": "tamper", "ids": Q[1], "chunk": 2, "how": "corrupt_head"}]),
            *_scenario("R", R, [{"op": "sleep", "s": 1.5}, {"op": "kms_disable"}]),
        ]
        # R4..R6 run with the key enabled again (after the key-state cache expired)
        i = next(k for k, st in enumerate(steps1) if st.get("name") == "R4")
        steps1[i:i] = [{"op": "kms_enable"}, {"op": "sleep", "s": 1.0}]
        first = _run({**base1, "steps": steps1}, work, "engine1")

        # engine 2: a Redis of our own, the only tier, stalled during a load
        trace2 = work / "trace2.jsonl"
        base2 = {"model": str(model_dir), "block_size": BLOCK, "kv_transfer_config": _ktc(s2, trace2), "settings": s2, "caps": caps2}
        steps2 = [*_baselines("S", S), *_scenario("S", S, [], stall_redis_pid=own.proc.pid, stall_s=1.0)]
        i = next(k for k, st in enumerate(steps2) if st.get("name") == "S4")
        steps2[i:i] = [{"op": "sleep", "s": 2.5}]  # the circuit breaker's cooldown (2 s)
        second = _run({**base2, "steps": steps2}, work, "engine2")
        t1, t2 = _trace(trace1), _trace(trace2)  # request ids restart with each engine
        for results, t in ((first, t1), (second, t2)):
            for r in results:
                r["trace"] = t
        logs = (work / "engine1.log").read_text() + (work / "engine2.log").read_text()
        yield {"r": {r["name"]: r for r in first + second if r["op"] == "gen"}, "trace": t1 + t2, "log": logs}
    finally:
        own.stop()
        moto.stop()
        cleanup_redis(redis_url, prefix)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _events(runs: dict, name: str, event: str) -> list[dict]:
    r = runs["r"][name]
    req = r["req"]
    return [e for e in r["trace"] if e["event"] == event and (e["req"] == req or e["req"].startswith(f"{req}-"))]


def _check(runs: dict, x: str, reasons: set[str], *, healed_at: int) -> None:
    r = runs["r"]

    def base(n: int) -> list[int]:
        return r[f"base{x}{n}"]["tokens"]

    assert r[f"{x}1"]["tokens"] == base(1) and r[f"{x}1"]["kv"]["kvgate"]["hit_tokens"] == 0
    assert r[f"{x}2"]["kv"]["kvgate"]["hit_tokens"] == FULL_HIT and r[f"{x}2"]["tokens"] == base(2)  # positive control
    (store2,) = _events(runs, f"{x}2", "store")  # the same-step store: the new question's chunk
    assert (store2["tokens"], store2["stored_chunks"]) == (320, 1), store2
    (load3,) = _events(runs, f"{x}3", "load")
    assert load3["failed_blocks"] > 0 and load3["reason"] in reasons, load3  # the fault bit
    assert r[f"{x}3"]["tokens"] == base(3)  # vLLM recomputed
    assert all(e["stored_chunks"] == 0 for e in _events(runs, f"{x}3", "store"))  # nothing stored back
    for n in (4, 5, 6):
        assert r[f"{x}{n}"]["tokens"] == base(n), f"{x}{n} answers differently from the engine alone"
        loads = _events(runs, f"{x}{n}", "load")
        assert all(e["failed_blocks"] == 0 for e in loads), loads
        if n >= healed_at:
            assert [e["loaded_tokens"] for e in loads] == [FULL_HIT], (n, loads)


def test_tampered_chunk_then_three_correct_requests(runs):
    # X3 dropped the failed chunk and did not store it again; X4 recomputes and stores it
    _check(runs, "P", {"integrity"}, healed_at=5)


def test_load_error_in_the_middle_of_a_prefix_then_three_correct_requests(runs):
    (load3,) = _events(runs, "Q3", "load")
    assert load3["loaded_tokens"] == 2 * CHUNK  # partial: chunks 0 and 1 loaded
    _check(runs, "Q", {"miss"}, healed_at=5)


def test_kek_outage_then_three_correct_requests(runs):
    (load3,) = _events(runs, "R3", "load")
    assert load3["loaded_tokens"] == 0
    _check(runs, "R", {"key_unavailable"}, healed_at=4)  # nothing was deleted: full hits at once


def test_stalled_redis_then_three_correct_requests(runs):
    _check(runs, "S", {"tier_timeout", "tier_unavailable"}, healed_at=4)


def test_failed_loads_are_logged_with_their_reason(runs):
    # visible under vLLM's default logging configuration, at WARNING, one line per failed load
    for reason in ("integrity", "miss", "key_unavailable"):
        assert re.search(rf"WARNING .*\[kvgate\.vllm\] kvgate load for \S+: \d+ of 256 tokens loaded \({reason}\)", runs["log"]), reason
    assert re.search(r"WARNING .*kvgate load for \S+: \d+ of 256 tokens loaded \(tier_(timeout|unavailable)\)", runs["log"])
    reasons = [e["reason"] for e in runs["trace"] if e["event"] == "load" and e["failed_blocks"]]
    assert sorted(set(reasons)) == sorted(set(reasons) & {"integrity", "miss", "key_unavailable", "tier_timeout", "tier_unavailable"})
    assert len(reasons) == 4, reasons
    print("KVGATE_LOAD_FAILURES", json.dumps({n: runs["r"][n]["tokens"][:4] for n in sorted(runs["r"])}))


def test_capabilities_minted_against_other_state_are_misses_and_one_error(runs):
    r = runs["r"]
    for name, base in (("foreign1", "baseP1"), ("foreign2", "baseQ1")):
        assert r[name]["kv"]["kvgate"]["hit_tokens"] == 0 and r[name]["tokens"] == r[base]["tokens"]
    said = re.findall(r"ERROR .*does not verify against the connector's kvgate state", runs["log"])
    assert len(said) == 1, said  # loud, once, with the fix
    assert "KVGATE_DATABASE_URL" in runs["log"]
