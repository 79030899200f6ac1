"""Drive one real vLLM engine (offline ``LLM``) with the kvgate connector through a list of steps.

    python -m tests.vllm.engine_run plan.json results.json

Run as a script (vLLM spawns its engine and worker processes, so it needs the ``__main__``
guard and its own process). Steps: ``gen`` (name, prompt ids, capability name or none,
max_tokens) and ``clear`` (Admin.clear of a tenant in this process, broadcast over Redis to the
engine's own gateway, then a fresh capability). Results: per gen step the output token ids,
vLLM's num_cached_tokens, the kv_transfer_params the connector returned and the wall time.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def _clear(settings: dict, tenant: str, namespace: str) -> str:
    from gateway.config import Settings
    from gateway.runtime import open_runtime

    rt = await open_runtime(Settings(**settings))
    try:
        await rt.admin.clear(tenant)
        return await rt.gateway.mint_capability(tenant, namespace, ["lookup", "get", "put"], 600)
    finally:
        await rt.aclose()


def main(plan_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    plan = json.load(open(plan_path))
    caps: dict = dict(plan["caps"])
    llm = LLM(
        model=plan["model"], enforce_eager=True, block_size=plan.get("block_size", 32),
        enable_prefix_caching=plan.get("prefix_caching", False), dtype="float32", max_model_len=1024,
        kv_transfer_config=plan["kv_transfer_config"], seed=0,
    )
    results = []
    for step in plan["steps"]:
        if step["op"] == "clear":
            caps[step["new_cap"]] = asyncio.run(_clear(plan["settings"], step["tenant"], "default"))
            results.append({"name": step.get("name", "clear"), "op": "clear"})
            continue
        params = {"kvgate_capability": caps[step["cap"]]} if step.get("cap") else {}
        sp = SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 8), extra_args={"kv_transfer_params": params})
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=step["ids"])], sp, use_tqdm=False)[0]
        results.append({
            "name": step["name"], "op": "gen", "s": time.perf_counter() - t0,
            "tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
            "kv": out.kv_transfer_params,
        })
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
