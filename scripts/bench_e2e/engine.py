"""One engine lifetime of the end-to-end benchmark: an offline vLLM ``LLM`` driven through a plan.

    python -m scripts.bench_e2e.engine plan.json results.json

Run in its own process from .venv-vllm (LMCache's system: from LMCache's environment; vLLM
spawns its engine core and worker processes, so it needs the ``__main__`` guard); the runner
starts it, waits for it and stops it by process id. Plan: the model, the engine flags (the same
for every system), the KV transfer config (or none), the capabilities by name and the steps:
``gen`` (one batch of requests, greedy, EOS ignored; per request the output ids, vLLM's
``num_cached_tokens``, the connector's ``kv_transfer_params``, vLLM's first and last token times
and each token's wall-clock arrival), ``flush`` (drop
what the system cached, so memory holds one prompt set at a time), ``settle`` (wait until every
store the connector submitted has ended, so a hit measures a load, not a race with the store
before it; the wait goes into the next row as ``settled_s``). Design notes: docs/architecture.md,
section 5.

Lockstep (``KVGATE_E2E_LOCKSTEP=R,W``, two inherited pipe descriptors; interleave.py): the engine
says ``ready`` on W once it is up, then runs one turn (``turns``) for each ``go`` it reads on R,
answering ``done``, and exits once R closes. Every system's engine is then up at once and the
runner takes their requests in turns."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from scripts.bench_e2e.model import prompt_ids


def _ids(parts: list[list[int]]) -> list[int]:
    out: list[int] = []
    for n, seed in parts:
        out += prompt_ids(n, seed)
    return out


def _flush(plan: dict[str, Any]) -> None:
    flush = plan.get("flush") or {}
    if flush.get("redis_url"):
        import redis

        r = redis.Redis.from_url(flush["redis_url"])
        try:
            keys = list(r.scan_iter(match=flush["redis_prefix"] + "*", count=1000))
            for i in range(0, len(keys), 1000):
                r.delete(*keys[i : i + 1000])
        finally:
            r.close()
    if flush.get("dir"):
        for child in Path(flush["dir"]).iterdir():
            shutil.rmtree(child, ignore_errors=True)


def _settle(plan: dict[str, Any], timeout_s: float = 300.0) -> float:
    """Seconds waited until the connector's trace shows every submitted store ended (only
    kvgate's connector keeps one; the other systems' environments need not have kvgate)."""
    cfg = (plan.get("kv_transfer_config") or {}).get("kv_connector_extra_config") or {}
    if not cfg.get("trace_path"):
        return 0.0
    from gateway.vllm.logs import wait_for_stores

    return wait_for_stores(cfg["trace_path"], timeout_s)


def _gen(llm: Any, plan: dict[str, Any], step: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, params = [], []
    for req in step["reqs"]:
        tp = TokensPrompt(prompt_token_ids=_ids(req["parts"]))
        if req.get("salt"):
            tp["cache_salt"] = req["salt"]
        prompts.append(tp)
        cap = plan["caps"].get(req.get("cap") or "")  # systems without kvgate have none
        kv = {"kvgate_capability": cap} if cap else {}
        if req.get("policy"):  # the sweep: this request's load_policy in place of the engine's
            kv["kvgate_load_policy"] = req["policy"]
        params.append(SamplingParams(
            temperature=0, max_tokens=step.get("max_tokens", 1), ignore_eos=True,
            extra_args={"kv_transfer_params": kv},
        ))
    engine = llm.llm_engine
    ids = [f"{step['name']}/{n}" for n in range(len(prompts))]
    t0_wall, t0 = time.time(), time.perf_counter()
    for rid, prompt, param in zip(ids, prompts, params):
        engine.add_request(rid, prompt, param)
    outs, token_t = _drive(engine, ids)
    wall = time.perf_counter() - t0
    results = []
    for req, rid in zip(step["reqs"], ids):
        out = outs[rid]
        m = out.metrics
        results.append({
            "name": step["name"], "tag": req.get("tag"), "tokens": list(out.outputs[0].token_ids),
            "prompt_tokens": len(out.prompt_token_ids or []), "cached": out.num_cached_tokens,
            "kv": out.kv_transfer_params, "batch_wall_s": wall,
            "ttft_s": getattr(m, "first_token_latency", None),
            "first_token_ts": getattr(m, "first_token_ts", None), "last_token_ts": getattr(m, "last_token_ts", None),
            "generated": getattr(m, "num_generation_tokens", None),
            # each token's wall-clock time as this process got it (the clock of the connector's trace)
            "batch_t0": t0_wall, "token_t": token_t[rid],
        })
    return results


def _drive(engine: Any, ids: list[str]) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Step the engine until every request in ``ids`` has finished, as ``LLM.generate`` does, but
    with each request's output after every step (vLLM's default cumulative outputs; ``generate``
    asks for the final one only), so each token gets the time at which it arrived."""
    outs: dict[str, Any] = {}
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.time()
            got = times[out.request_id]
            got.extend([now] * (len(out.outputs[0].token_ids) - len(got)))
            if out.finished:
                outs[out.request_id] = out
    return outs, times


def turns(steps: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The plan's steps in turns: each turn one ``gen`` and the steps after it up to the next
    (a settle after a miss, a flush after a hit); steps before the first gen open the first turn."""
    out: list[list[dict[str, Any]]] = []
    lead: list[dict[str, Any]] = []
    for step in steps:
        if step["op"] == "gen":
            out.append([*lead, step])
            lead = []
        elif out:
            out[-1].append(step)
        else:
            lead.append(step)
    if lead:
        out.append(lead)
    return out


def main(plan_path: str, out_path: str) -> None:
    lockstep = os.environ.get("KVGATE_E2E_LOCKSTEP")
    fds = [int(x) for x in lockstep.split(",")] if lockstep else []
    for fd in fds:  # vLLM's own processes do not inherit them: the runner sees this one's exit
        os.set_inheritable(fd, False)
    from vllm import LLM

    plan = json.loads(Path(plan_path).read_text())
    flags = plan["engine"]
    llm = LLM(
        model=plan["model"], enforce_eager=True, block_size=flags["block_size"], dtype=flags["dtype"],
        enable_prefix_caching=False, max_model_len=flags["max_model_len"],
        max_num_batched_tokens=flags["max_num_batched_tokens"], max_num_seqs=flags["max_num_seqs"],
        kv_transfer_config=plan.get("kv_transfer_config"), seed=0, disable_log_stats=False,
    )
    results: list[dict[str, Any]] = []
    settled: float | None = None
    with open(out_path, "w", encoding="utf-8") as out:

        def run(step: dict[str, Any]) -> None:
            nonlocal settled
            if step["op"] == "flush":
                _flush(plan)
                return
            if step["op"] == "settle":
                settled = _settle(plan)
                return
            for row in _gen(llm, plan, step):
                if settled is not None:
                    row["settled_s"] = round(settled, 3)
                out.write(json.dumps(row) + "\n")  # one line a request, so a crash keeps what ran
                out.flush()
                results.append(row)
            settled = None
            print(f"step {step['name']}: {results[-1]['ttft_s']}", file=sys.stderr, flush=True)

        if not fds:
            for step in plan["steps"]:
                run(step)
            return
        with os.fdopen(fds[0], "rb", buffering=0) as cmd, os.fdopen(fds[1], "wb", buffering=0) as reply:
            reply.write(b"ready\n")
            for turn in turns(plan["steps"]):
                if _line(cmd) != b"go":
                    return
                for step in turn:
                    run(step)
                reply.write(b"done\n")
            _line(cmd)  # up, idle, until the runner ends every engine at once


def _line(f: Any) -> bytes:
    """One line from an unbuffered pipe (b"" at its end)."""
    got = bytearray()
    while (b := f.read(1)) and b != b"\n":
        got += b
    return bytes(got)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
