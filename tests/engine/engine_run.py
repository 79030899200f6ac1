"""Drive one real vLLM engine (offline ``LLM``) with the kvgate connector through a list of steps.

    python -m tests.engine.engine_run plan.json results.json

Run as a script (vLLM spawns its engine and worker processes, so it needs the ``__main__``
guard and its own process). Steps: ``gen`` (name, prompt ids, capability name or none,
max_tokens; then it waits until the connector's trace shows every store it submitted ended,
unless ``settle`` is false), ``settle`` (that wait alone), ``clear`` (Admin.clear of a tenant
in this process, broadcast over Redis to the engine's own gateway, then a fresh capability) and
the faults below. Plan option ``num_blocks``: vLLM's KV cache size in blocks. Results: per gen
step the output token ids, vLLM's num_cached_tokens, the kv_transfer_params the connector
returned, the wall time and when generate returned (``t_end``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def _clear(settings: dict, tenant: str, namespace: str) -> str:
    from gateway.config import Settings
    from gateway.services.runtime import open_runtime

    rt = await open_runtime(Settings(**settings))
    try:
        await rt.admin.clear(tenant)
        return await rt.access.mint(tenant, namespace, ["lookup", "get", "put"], 600)
    finally:
        await rt.aclose()


def tiny_kv_model():
    """The KVModel the connector derives for tests.engine.tiny_model (its chunk keys): the CPU
    engine's caches are in vLLM's CPU layout, so its chunks are in the CPU chunk format."""
    import torch

    from gateway.services.core import KVModel
    from kernels.layouts import KVGeometry, KVLayout

    g = KVGeometry(num_layers=2, num_kv_heads=2, head_size=32, dtype=torch.float32, block_size=32,
                   layout=KVLayout.CPU)
    return KVModel("tiny-llama", g)


async def _tamper(settings: dict, tokens: list[int], chunk: int, how: str) -> None:
    """Fault injection from outside the engine, as an attacker or a failing tier would:
    ``flip``: flip a ciphertext bit of chunk ``chunk`` in every tier holding it (consistently);
    ``corrupt_head``: leave a Redis head that EXISTS but does not parse (a torn or foreign
    value), and delete every other tier's copy, so a lookup sees the chunk and its load fails."""
    from gateway.config import Settings
    from gateway.services.runtime import open_embedded
    from storage.types import ChunkNotFound
    rt = await open_embedded(Settings(**settings))
    try:
        keys = await rt.gateway.keys_for("acme", "default", tiny_kv_model(), tokens)
        for tier in rt.tiers.tiers:
            try:
                raw = bytearray((await tier.get(keys[chunk])).data)
            except ChunkNotFound:
                continue
            if how == "flip":
                raw[-20] ^= 0x80
                await tier.put(keys[chunk], raw)
            elif tier.name == "redis":
                await tier._redis.set(tier._layout.head(keys[chunk]), b"not a kvgate header")
            else:
                await tier.delete(keys[chunk])
    finally:
        await rt.aclose()


def _fault_tamper(plan: dict, step: dict) -> None:
    asyncio.run(_tamper(plan["settings"], step["ids"], step["chunk"], step.get("how", "flip")))


def _fault_kms(plan: dict, step: dict) -> None:
    import boto3

    s = plan["settings"]
    kms = boto3.client("kms", region_name=s["kms_region"], endpoint_url=s["kms_endpoint_url"])
    key = s["kms_key_id"].rsplit("/", 1)[-1]
    (kms.disable_key if step["op"] == "kms_disable" else kms.enable_key)(KeyId=key)


def _fault_sleep(plan: dict, step: dict) -> None:
    time.sleep(float(step["s"]))


def _fault_settle(plan: dict, step: dict) -> None:
    _settle_stores(plan)


_FAULTS = {"settle": _fault_settle, "tamper": _fault_tamper, "kms_disable": _fault_kms, "kms_enable": _fault_kms, "sleep": _fault_sleep}


def _stall_on_lookup(plan: dict, step: dict):
    """SIGSTOP the Redis server ``stall_redis_pid`` as soon as the connector's trace shows this
    request's lookup hit (so the load that follows meets a stalled tier), SIGCONT it after
    ``stall_s``. Returns the watcher thread."""
    import os
    import signal
    import threading

    trace = plan["kv_transfer_config"]["kv_connector_extra_config"]["trace_path"]
    start = os.path.getsize(trace) if os.path.exists(trace) else 0
    pid, hold = int(step["stall_redis_pid"]), float(step.get("stall_s", 1.0))

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with open(trace, "rb") as f:
                f.seek(start)
                if any(b'"event": "lookup"' in line and b'"hit_tokens": 0,' not in line for line in f):
                    break
            time.sleep(0.0001)
        else:
            return
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(hold)
        finally:
            os.kill(pid, signal.SIGCONT)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _settle_stores(plan: dict, timeout_s: float = 60.0) -> None:
    """Wait until every store the connector submitted has ended (its trace says so): stores are
    asynchronous, and the next step of a plan expects what the last one stored to be there."""
    from gateway.vllm.logs import wait_for_stores

    wait_for_stores(plan["kv_transfer_config"].get("kv_connector_extra_config", {}).get("trace_path"), timeout_s)


def main(plan_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    plan = json.load(open(plan_path))
    caps: dict = dict(plan["caps"])
    llm = LLM(
        model=plan["model"], enforce_eager=True, block_size=plan.get("block_size", 32),
        enable_prefix_caching=plan.get("prefix_caching", False), dtype="float32", max_model_len=1024,
        kv_transfer_config=plan["kv_transfer_config"], seed=0,
        num_gpu_blocks_override=plan.get("num_blocks"),  # a small cache: freed blocks are reused at once
    )
    results = []
    for step in plan["steps"]:
        if step["op"] in _FAULTS:
            _FAULTS[step["op"]](plan, step)
            results.append({"name": step.get("name", step["op"]), "op": step["op"]})
            continue
        stall = _stall_on_lookup(plan, step) if step.get("stall_redis_pid") else None
        if step["op"] == "clear":
            caps[step["new_cap"]] = asyncio.run(_clear(plan["settings"], step["tenant"], "default"))
            results.append({"name": step.get("name", "clear"), "op": "clear"})
            continue
        params = {"kvgate_capability": caps[step["cap"]]} if step.get("cap") else {}
        if step.get("policy"):  # this request's own load_policy
            params["kvgate_load_policy"] = step["policy"]
        sp = SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 8), extra_args={"kv_transfer_params": params})
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=step["ids"])], sp, use_tqdm=False)[0]
        t_end = time.time()
        if stall is not None:
            stall.join(30)
        if step.get("settle", True):
            _settle_stores(plan)
        results.append({
            "name": step["name"], "op": "gen", "s": time.perf_counter() - t0, "t_end": t_end, "req": out.request_id,
            "tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
            "kv": out.kv_transfer_params,
        })
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
