"""What the kvgate connector costs a prefill by being there: capless prompts (no capability, so no
lookup and no store) in engines with and without it, one engine after another.

    python -m scripts.bench_e2e.presence OUT_DIR [LENGTH] [VARIANTS]

``VARIANTS`` (comma-separated, default ``none,emb,emb-mem,none``): ``none`` no connector; ``emb``
kvgate embedded as bench-e2e runs it (memory and Redis tiers, a 3 GiB arena); ``emb-mem`` the
memory tier alone with a 256 MiB arena. Each engine: two warm-ups, then six prompts of ``LENGTH``
tokens (default 4,096), each a fresh one. Writes ``OUT_DIR/presence.json`` (TTFT ms per engine, in
order) and prints each engine's median. ``none`` twice brackets the drift of the machine."""

from __future__ import annotations

import asyncio
import json
import secrets
import statistics
import sys
from pathlib import Path
from typing import Any

from scripts.bench_e2e.model import SIZES, build_llama
from scripts.bench_e2e.run import Config, engine_env, run_engine
from scripts.bench_e2e.systems import CAP_TTL, _connector, _embedded_caps


def _gen(name: str, n: int, seed: int, kind: str, out_tokens: int) -> dict[str, Any]:
    req = {"parts": [[n, seed]], "cap": None, "salt": None, "tag": {"kind": kind, "i": seed}}
    return {"op": "gen", "name": name, "max_tokens": out_tokens, "reqs": [req]}


def main(argv: list[str]) -> None:
    work = Path(argv[0])
    length = int(argv[1]) if len(argv) > 1 else 4096
    variants = argv[2].split(",") if len(argv) > 2 else ["none", "emb", "emb-mem", "none"]
    work.mkdir(parents=True, exist_ok=True)
    cfg = Config()
    model = build_llama(work / "model", SIZES["full"])
    max_len = length + cfg.out_tokens + 64
    engine = {"block_size": cfg.block_size, "dtype": cfg.dtype, "max_model_len": max_len, "max_num_seqs": 8,
              "max_num_batched_tokens": max_len}
    steps = [_gen("warmup", 128, 1, "warmup", 2), _gen("warmup", length, 7, "warmup", 2)]
    steps += [_gen(f"capless {i}", length, 900 + i, "capless", cfg.out_tokens) for i in range(6)]
    out: dict[str, list[int]] = {}
    for k, variant in enumerate(variants):
        ktc = None
        if variant.startswith("emb"):
            full = variant == "emb"
            settings = {"state_dir": str(work / f"state{k}"), "tiers": ["memory", "redis"] if full else ["memory"],
                        "redis_url": cfg.redis_url, "redis_prefix": f"kvgate-presence-{secrets.token_hex(4)}:",
                        "chunk_tokens": cfg.chunk_tokens, "memory_bytes": (3 << 30) if full else (256 << 20),
                        "capability_max_ttl_s": CAP_TTL}
            asyncio.run(_embedded_caps(settings, ["acme"]))
            ktc = _connector({"kvgate_settings": settings, "model_name": "bench-llama"})
        plan = {"model": str(model), "engine": engine, "kv_transfer_config": ktc, "caps": {}, "flush": {}, "steps": steps}
        rows = run_engine(plan, work / f"{k}-{variant}", engine_env({}, cfg), cfg.engine_timeout_s)
        ttft = [round(r["ttft_s"] * 1e3) for r in rows if (r.get("tag") or {}).get("kind") == "capless"]
        out[f"{k}-{variant}"] = ttft
        print(f"{variant}: {ttft}, median {statistics.median(ttft)} ms", flush=True)
    (work / "presence.json").write_text(json.dumps({"length": length, "ttft_ms": out}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
