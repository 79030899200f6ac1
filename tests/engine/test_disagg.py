"""Prefill/decode disaggregation through kvgate on two real vLLM CPU engines (tiny Llama, fp32).

A producer engine (``kv_role`` kv_producer) and a consumer engine (kv_consumer) run at once, each
in its own process, sharing one throwaway redis-server of the test's own and one kvgate state.
The test is the proxy: each prompt goes to the producer with ``max_tokens`` 1, and the
``kv_transfer_params`` it answers (the receipt) go with the same prompt to the consumer:

    consumer: single-engine baselines (no capability) of every prompt
    producer: A: P1, P2, P3 (stores held back 2 s: the consumer waits for them), S (settled),
              K (store held back for minutes; the producer is killed in the middle of it)
    consumer: A: P1..P3 with their receipts | B with A's receipt of P2 | the shared tier stalled
              (SIGSTOP) for S | K after the producer was killed | K again, no receipt

Run a driver in each engine process: ``python -m tests.engine.test_disagg plan.json out.jsonl``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK, CHUNK, MODEL_NAME, WAIT_S = 32, 64, "tiny-llama", 15.0
LENGTHS = {"P1": 100, "P2": 300, "P3": 520, "S": 200, "K": 150}


# -- in the engine processes --------------------------------------------------------------------
class _DelayedStores:
    def __init__(self, inner: Any, delay_file: str) -> None:
        self._inner, self._file = inner, delay_file

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def store(self, *args: Any) -> Any:
        try:
            delay = float(Path(self._file).read_text() or 0)
        except (OSError, ValueError):
            delay = 0.0
        await asyncio.sleep(delay)
        return await self._inner.store(*args)


@functools.cache
def _delayed_store_connector() -> type:
    """A test-only KvgateConnector whose worker-side stores first wait the seconds written in
    ``KVGATE_TEST_STORE_DELAY_FILE`` (read at each store: the driver sets it per request). Built
    on first use, so that this module imports where vLLM is not installed."""
    from gateway.vllm.connector import KvgateConnector

    class DelayedStoreConnector(KvgateConnector):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            path = os.environ.get("KVGATE_TEST_STORE_DELAY_FILE")
            if self._worker is not None and path:
                self._worker._backend = _DelayedStores(self._worker._backend, path)  # a test double

    return DelayedStoreConnector


def __getattr__(name: str) -> Any:  # vLLM finds the connector class by name in this module
    if name == "DelayedStoreConnector":
        return _delayed_store_connector()
    raise AttributeError(name)


def _peer_line(path: str, name: str, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            for line in Path(path).read_text().splitlines():
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue  # half written
                if doc.get("name") == name:
                    return doc
        time.sleep(0.01)
    raise TimeoutError(f"{name} never appeared in {path}")


def main(plan_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from gateway.vllm.logs import wait_for_stores

    plan = json.loads(Path(plan_path).read_text())
    ktc = plan["kv_transfer_config"]
    llm = LLM(
        model=plan["model"], enforce_eager=True, block_size=BLOCK, enable_prefix_caching=False, dtype="float32",
        max_model_len=1024, kv_transfer_config=ktc, seed=0,
    )
    out = open(out_path, "a", encoding="utf-8")

    def emit(doc: dict) -> None:
        out.write(json.dumps(doc) + "\n")
        out.flush()

    for step in plan["steps"]:
        op = step["op"]
        if op == "wait":
            _peer_line(plan["peer_out"], step["for"])
        elif op == "mark":
            emit({"name": step["name"]})
        elif op == "settle":
            wait_for_stores(ktc["kv_connector_extra_config"]["trace_path"], 60)
        elif op == "signal":
            os.kill(int(step["pid"]), getattr(signal, step["sig"]))
        elif op == "kill_peer":
            os.killpg(int(Path(step["pid_file"]).read_text()), signal.SIGKILL)
            emit({"name": "peer_killed", "t": time.time()})
        elif op == "sleep":
            time.sleep(float(step["s"]))
        elif op == "gen":
            if "delay_s" in step:
                Path(os.environ["KVGATE_TEST_STORE_DELAY_FILE"]).write_text(str(step["delay_s"]))
            params: dict[str, Any] = {}
            if step.get("cap"):
                params["kvgate_capability"] = plan["caps"][step["cap"]]
            if step.get("receipt_from"):
                answer = _peer_line(plan["peer_out"], step["receipt_from"])
                params["kvgate_receipt"] = answer["kv"]["kvgate_receipt"]
            sp = SamplingParams(temperature=0, max_tokens=step["max_tokens"], extra_args={"kv_transfer_params": params})
            t0 = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=step["ids"])], sp, use_tqdm=False)[0]
            emit({
                "name": step["name"], "req": res.request_id, "s": time.perf_counter() - t0,
                "tokens": list(res.outputs[0].token_ids), "cached": res.num_cached_tokens, "kv": res.kv_transfer_params,
            })
    out.close()


# -- the test -----------------------------------------------------------------------------------
def _run_pair(work: Path, producer: dict, consumer: dict) -> tuple[dict, dict, int]:
    from tests.engine.engine_env import PYTHON, engine_env

    root = str(Path(__file__).resolve().parents[2])
    pout, cout, pid_file = work / "producer.jsonl", work / "consumer.jsonl", work / "producer.pid"
    producer["peer_out"], consumer["peer_out"] = str(cout), str(pout)
    (work / "producer.json").write_text(json.dumps(producer))
    (work / "consumer.json").write_text(json.dumps(consumer))
    # each engine on a core of its own (as two engines on one host are deployed): bound to the
    # same cores, a consumer stepping while it waits for a receipt starves the producer's stores
    env = engine_env(KVGATE_TEST_STORE_DELAY_FILE=str(work / "store_delay"))
    ncpu = len(os.sched_getaffinity(0))
    penv = {**env, "VLLM_CPU_OMP_THREADS_BIND": "0"} if ncpu >= 2 else env
    cenv = {**env, "VLLM_CPU_OMP_THREADS_BIND": str(ncpu - 1)} if ncpu >= 2 else env
    plog, clog = open(work / "producer.log", "w"), open(work / "consumer.log", "w")
    prod = subprocess.Popen(
        [PYTHON, "-m", "tests.engine.test_disagg", str(work / "producer.json"), str(pout)], env=penv, cwd=root,
        stdout=plog, stderr=subprocess.STDOUT, start_new_session=True,  # its own group: killed with its engine
    )
    pid_file.write_text(str(prod.pid))
    try:
        cons = subprocess.run(
            [PYTHON, "-m", "tests.engine.test_disagg", str(work / "consumer.json"), str(cout)], env=cenv, cwd=root,
            stdout=clog, stderr=subprocess.STDOUT, timeout=540,
        )
    finally:
        if prod.poll() is None:
            os.killpg(prod.pid, signal.SIGKILL)
        prod.wait(30)
        plog.close()
        clog.close()
    if cons.returncode != 0:
        raise AssertionError(f"consumer failed ({cons.returncode}):\n{(work / 'consumer.log').read_text()[-6000:]}")

    def read(p: Path) -> dict:
        return {d["name"]: d for d in map(json.loads, p.read_text().splitlines())} if p.exists() else {}

    return read(pout), read(cout), prod.returncode


async def _denials(settings: dict) -> list[dict]:
    from gateway.config import Settings
    from gateway.services.runtime import open_runtime

    rt = await open_runtime(Settings(**settings))
    try:
        return [
            {"details": json.loads(d) if isinstance(d := r.event.details, str) else d, "tenant": r.event.target.tenant}
            async for r in rt.audit.store.iter_records() if r.event.action == "authz.denied"
        ]
    finally:
        await rt.aclose()


@pytest.fixture(scope="module")
def disagg(tmp_path_factory: pytest.TempPathFactory):
    import shutil

    from tests.engine.engine_env import require_vllm
    from tests.engine.engine_steps import _ids, _setup
    from tests.engine.tiny_model import build_tiny_llama
    from tests.support.redis_server import Server

    require_vllm()
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed")
    work = tmp_path_factory.mktemp("vllm-disagg")
    model_dir = build_tiny_llama(work / "model")
    redis = Server()
    redis.start()
    try:
        assert redis.proc is not None
        settings = dict(
            state_dir=str(work / "state"), tiers=["redis"], redis_url=redis.url, redis_prefix="kvgate-disagg:",
            chunk_tokens=CHUNK, cpu_threads=1,
        )
        caps = asyncio.run(_setup(settings))
        ids = {name: _ids(model_dir, n, seed) for seed, (name, n) in enumerate(LENGTHS.items(), start=11)}

        # load_policy is left out: a kv_consumer's default is to load every hit (the tiny model
        # would recompute them under adaptive), so the consumer's loads below test that rule too
        def ktc(role: str, trace: str, **extra: Any) -> dict:
            return {
                "kv_connector": "DelayedStoreConnector" if role == "kv_producer" else "KvgateConnector",
                "kv_connector_module_path": "tests.engine.test_disagg" if role == "kv_producer" else "gateway.vllm.connector",
                "kv_role": role, "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "kvgate_settings": settings, "trace_path": str(work / trace), "model_name": MODEL_NAME, **extra,
                },
            }

        base = {"model": str(model_dir), "caps": caps}
        # the two engines share two cores, and a waiting consumer keeps its engine stepping: the
        # producer's stores run at the engine's own priority (store_nice 0) so they are not starved
        producer = {**base, "kv_transfer_config": ktc("kv_producer", "producer.trace", store_nice=0), "steps": [
            {"op": "wait", "for": "go"},
            *({"op": "gen", "name": n, "ids": ids[n], "cap": "A", "max_tokens": 1, "delay_s": 2} for n in ("P1", "P2", "P3")),
            {"op": "gen", "name": "S", "ids": ids["S"], "cap": "A", "max_tokens": 1, "delay_s": 0},
            {"op": "settle"}, {"op": "mark", "name": "S_settled"},
            {"op": "gen", "name": "K", "ids": ids["K"], "cap": "A", "max_tokens": 1, "delay_s": 600},
            {"op": "sleep", "s": 600},  # killed before this ends
        ]}
        pid = redis.proc.pid
        consumer = {**base, "kv_transfer_config": ktc("kv_consumer", "consumer.trace", handoff_wait_s=WAIT_S), "steps": [
            *({"op": "gen", "name": f"base_{n}", "ids": ids[n], "max_tokens": 8} for n in LENGTHS),
            {"op": "mark", "name": "go"},
            *({"op": "gen", "name": f"pd_{n}", "ids": ids[n], "cap": "A", "receipt_from": n, "max_tokens": 8}
              for n in ("P1", "P2", "P3")),
            {"op": "gen", "name": "B_P2", "ids": ids["P2"], "cap": "B", "receipt_from": "P2", "max_tokens": 8},
            {"op": "wait", "for": "S_settled"},
            {"op": "signal", "pid": pid, "sig": "SIGSTOP"},
            {"op": "gen", "name": "pd_S", "ids": ids["S"], "cap": "A", "receipt_from": "S", "max_tokens": 8},
            {"op": "signal", "pid": pid, "sig": "SIGCONT"},
            {"op": "wait", "for": "K"},
            {"op": "kill_peer", "pid_file": str(work / "producer.pid")},
            {"op": "gen", "name": "pd_K", "ids": ids["K"], "cap": "A", "receipt_from": "K", "max_tokens": 8},
            {"op": "gen", "name": "again_K", "ids": ids["K"], "cap": "A", "max_tokens": 8},
        ]}
        try:
            prod, cons, prod_rc = _run_pair(work, producer, consumer)
        finally:
            if redis.proc is not None and redis.proc.poll() is None:
                os.kill(redis.proc.pid, signal.SIGCONT)  # never leave it stopped
        trace = {
            side: [json.loads(x) for x in (work / f"{side}.trace").read_text().splitlines()]
            for side in ("producer", "consumer")
        }
        yield {"p": prod, "c": cons, "prod_rc": prod_rc, "trace": trace, "ids": ids,
               "denials": asyncio.run(_denials(settings))}
    finally:
        redis.kill()


def _events(d: dict, side: str, event: str, req: str) -> list[dict]:
    """The trace lines of one request (the engine's request id is the offline LLM's plus a suffix)."""
    return [e for e in d["trace"][side] if e["event"] == event and str(e.get("req", "")).split("-")[0] == req]


@pytest.mark.parametrize("name", ["P1", "P2", "P3"])
def test_disagg_outputs_equal_a_single_engine_and_the_consumer_computes_at_most_one_block(disagg, name):
    p, c, n = disagg["p"][name], disagg["c"][f"pd_{name}"], LENGTHS[name]
    assert c["tokens"] == disagg["c"][f"base_{name}"]["tokens"]
    assert p["tokens"] == c["tokens"][:1]  # the producer's one token is the decode's first
    receipt = p["kv"]["kvgate_receipt"]
    assert receipt["tokens"] == n // BLOCK * BLOCK and receipt["chunks"] == -(-receipt["tokens"] // CHUNK)
    loadable = (n - 1) // BLOCK * BLOCK
    assert c["cached"] == loadable and n - c["cached"] <= BLOCK  # vLLM's own count of loaded tokens
    (handoff,) = _events(disagg, "consumer", "handoff", c["req"])
    assert handoff["reason"] == "" and handoff["hit_tokens"] >= loadable
    (decision,) = _events(disagg, "consumer", "decision", c["req"])
    assert decision["reason"] == "always" and decision["tokens"] == loadable  # a consumer's default policy
    (load,) = _events(disagg, "consumer", "load", c["req"])
    assert load["loaded_tokens"] == loadable and load["failed_blocks"] == 0
    assert not _events(disagg, "consumer", "store_submit", c["req"])  # a consumer does not store


def test_disagg_consumer_waits_for_a_store_in_flight_without_stalling(disagg):
    """P1's store is held back 2 s on the producer: the consumer asked, waited and then loaded."""
    c = disagg["c"]["pd_P1"]
    assert _events(disagg, "consumer", "handoff_wait", c["req"])
    (handoff,) = _events(disagg, "consumer", "handoff", c["req"])
    assert 200 < handoff["ms"] < WAIT_S * 1e3 and handoff["reason"] == ""


def test_disagg_producer_does_not_load_and_stores_what_its_receipt_names(disagg):
    for name in ("P1", "P2", "P3", "S"):
        req = disagg["p"][name]["req"]
        assert not _events(disagg, "producer", "lookup", req) and not _events(disagg, "producer", "load", req)
        assert _events(disagg, "producer", "receipt", req)
        assert [s["stored_chunks"] for s in _events(disagg, "producer", "store", req)] == [
            disagg["p"][name]["kv"]["kvgate_receipt"]["chunks"]
        ]


def test_disagg_a_receipt_is_not_a_capability(disagg):
    """Tenant B's request carrying A's receipt of P2: nothing loaded, the right answer, a denial
    audited; A's own request with the same receipt (pd_P2) is the positive control."""
    b = disagg["c"]["B_P2"]
    assert b["cached"] == 0 and b["tokens"] == disagg["c"]["base_P2"]["tokens"]
    (handoff,) = _events(disagg, "consumer", "handoff", b["req"])
    assert handoff["reason"] == "receipt_other_tenant"
    assert not _events(disagg, "consumer", "load", b["req"])
    denied = [d for d in disagg["denials"] if d["details"].get("op") == "handoff"]
    assert len(denied) == 1 and denied[0]["tenant"] == "globex"
    assert denied[0]["details"]["reason"] == "receipt_other_tenant"
    assert disagg["c"]["pd_P2"]["cached"] > 0


def test_disagg_a_stalled_shared_tier_is_waited_for_boundedly_then_recomputed(disagg):
    c = disagg["c"]["pd_S"]
    assert c["tokens"] == disagg["c"]["base_S"]["tokens"] and c["cached"] == 0
    (handoff,) = _events(disagg, "consumer", "handoff", c["req"])
    assert handoff["reason"] == "receipt_late" and WAIT_S * 1e3 <= handoff["ms"] < WAIT_S * 1e3 + 2000
    assert c["s"] < WAIT_S + 20


def test_disagg_producer_killed_mid_store_the_consumer_recomputes(disagg):
    assert disagg["prod_rc"] == -signal.SIGKILL
    assert not [e for e in _events(disagg, "producer", "store", disagg["p"]["K"]["req"]) if e["stored_chunks"]]
    base = disagg["c"]["base_K"]["tokens"]
    c = disagg["c"]["pd_K"]
    (handoff,) = _events(disagg, "consumer", "handoff", c["req"])
    assert handoff["reason"] == "receipt_late" and c["cached"] == 0 and c["tokens"] == base
    again = disagg["c"]["again_K"]  # the next request for the prompt: still correct
    assert again["tokens"] == base and again["cached"] == 0


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
