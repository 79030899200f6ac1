"""Shared set-up of the vLLM tests: the vllm check, the tiny model, subprocess environment, and
vLLM's OpenAI server with the tenant middleware and the connector in remote mode.

The tests' connectors name ``load_policy: always``: the tiny model prefills a prompt faster than
a tier loads it, so the default (adaptive) would recompute the hits these tests load on purpose;
tests/engine/test_load_policy.py runs adaptive."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

__all__ = ["cleanup_redis", "engine_env", "openai_server", "redis_or_fail", "remote_connector", "require_vllm"]

ROOT = Path(__file__).resolve().parents[2]


def require_vllm() -> None:
    """Skip without vLLM locally; fail under CI=true (the vLLM suite must not pass by skipping)."""
    if importlib.util.find_spec("vllm") is None:
        msg = "vllm is not installed in this interpreter (make vllm-setup; run from .venv-vllm)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)


def redis_or_fail() -> str:
    from tests.support.services import REDIS_URL, _need

    _need("Redis", REDIS_URL, 6379)
    return REDIS_URL


def cleanup_redis(url: str, prefix: str) -> None:
    import redis

    r = redis.Redis.from_url(url)
    try:
        keys = list(r.scan_iter(match=prefix + "*", count=1000))
        if keys:
            r.delete(*keys)
    finally:
        r.close()


def engine_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


PYTHON = sys.executable


def remote_connector(remote_url: str, chunk_tokens: int, trace: Path, **extra: Any) -> dict[str, Any]:
    """The kvgate connector's ``--kv-transfer-config`` in remote mode (the token comes from the
    environment), for the tiny model."""
    return {
        "kv_connector": "KvgateConnector", "kv_connector_module_path": "gateway.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "mode": "remote", "remote_url": remote_url, "chunk_tokens": chunk_tokens, "trace_path": str(trace),
            "model_name": "tiny-llama", "load_policy": "always", **extra,
        },
    }


@contextmanager
def openai_server(
    work: Path, model_dir: Path, ktc: dict[str, Any], env: dict[str, str], *, prefix_caching: bool, start_s: float = 300,
) -> Iterator[str]:
    """``python -m vllm.entrypoints.openai.api_server`` on a free port, serving ``model_dir`` as
    "tiny" with the tenant middleware and ``ktc``; yields its URL once ``/health`` answers, and
    stops it by its process id on exit. Its log is ``work/vllm.log``: a server that exits or
    does not answer within ``start_s`` fails the test with the log's tail."""
    import httpx

    from tests.support.services import free_port

    port = free_port()
    cmd = [
        PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--enforce-eager", "--block-size", "32", "--dtype", "float32", "--max-model-len", "1024",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
        "--served-model-name", "tiny", "--middleware", "gateway.vllm.middleware.KvgateMiddleware",
        "--kv-transfer-config", json.dumps(ktc),
    ]
    log_path = work / "vllm.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + start_s
            while True:
                if proc.poll() is not None:
                    raise AssertionError("vLLM server exited:\n" + log_path.read_text()[-6000:])
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError("vLLM server did not start:\n" + log_path.read_text()[-6000:])
                time.sleep(1)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
