"""Steps of the real-engine tests: prompts, one engine run in a subprocess, the gateway's state, the connector's trace."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

from tests.engine.engine_env import (
    PYTHON,
    engine_env,
)
from tests.engine.tiny_model import prompt_words


def _ids(model_dir: Path, n: int, seed: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(prompt_words(n, seed), add_special_tokens=False)["input_ids"]
    assert len(ids) == n
    return ids

def _run(plan: dict, workdir: Path, name: str) -> list[dict]:
    (workdir / f"{name}.json").write_text(json.dumps(plan))
    out = workdir / f"{name}.out.json"
    proc = subprocess.run(
        [PYTHON, "-m", "tests.engine.engine_run", str(workdir / f"{name}.json"), str(out)],
        env=engine_env(), cwd=str(Path(__file__).resolve().parents[2]), capture_output=True, text=True, timeout=400,
    )
    (workdir / f"{name}.log").write_text(proc.stdout + proc.stderr)  # what an operator would see
    if proc.returncode != 0:
        raise AssertionError(f"engine run {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())

async def _setup(settings: dict) -> dict[str, str]:
    from gateway.config import Settings
    from gateway.services import dbschema
    from gateway.services.runtime import open_runtime

    Path(settings["state_dir"]).mkdir(parents=True, exist_ok=True, mode=0o700)
    await asyncio.to_thread(dbschema.upgrade, Settings(**settings).db_url)
    rt = await open_runtime(Settings(**settings))
    try:
        caps = {}
        for tenant, name in (("acme", "A"), ("globex", "B")):
            await rt.admin.create_tenant(tenant)
            caps[name] = await rt.access.mint(tenant, "default", ["lookup", "get", "put"], 600)
        return caps
    finally:
        await rt.aclose()

def _trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
