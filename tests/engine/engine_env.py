"""Shared set-up of the vLLM tests: the vllm check, the tiny model, subprocess environment."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

__all__ = ["cleanup_redis", "engine_env", "redis_or_fail", "require_vllm"]

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
