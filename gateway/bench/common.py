"""What every part of the bench shares: the model geometry and the median timer."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gateway.services.core import KVModel
from kernels.layouts import KVGeometry, KVLayout

__all__ = ["GEOMETRY", "MODEL", "median_time", "percentiles_ms"]

# Llama-3-8B: 32 layers, 8 KV heads, head size 128, fp16, block size 16 (16 tokens = 2 MiB)
GEOMETRY = KVGeometry(32, 8, 128, torch.float16, 16, KVLayout.KV_FIRST)
MODEL = KVModel("bench-llama-3-8b", GEOMETRY)


def median_time(fn: Callable[[], Any], reps: int) -> float:
    """Seconds, median of ``reps`` calls after one warm-up (page faults, caches, staging buffers)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    """``{"p50", "p99"}`` in milliseconds."""
    lat = sorted(seconds)
    return {"p50": round(lat[len(lat) // 2] * 1e3, 3), "p99": round(lat[int(len(lat) * 0.99)] * 1e3, 3)}
