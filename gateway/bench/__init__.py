"""`kvgate bench`: kvgate's throughput, latency, isolation and workloads beside ceilings measured in
the same run and beside LMCache on the same bytes.

Benchmark code lives only in this package: nothing in the product imports it, and the CLI imports
it lazily, after checking the ``bench`` extra (scipy; matplotlib for the plots). Its two
baselines, a plaintext data path and a shared cache without isolation, are built in
:mod:`gateway.bench.baselines` and nowhere else.

Modules: ``run`` (the command: throughput beside its ceilings, the table), ``ceilings``
(AES-256-GCM, memcpy, ``single_pass``), ``suite`` (tenants, lookups, workloads, attacks),
``peers`` (LMCache side by side, through ``scripts/lmcache_runner.py`` in its own venv), ``net``
(Redis and REST beside raw clients), ``attack`` (the prefix-cache timing attack), ``workloads``
(LMCache's benchmark shapes), ``plots`` (PNG and Markdown), ``pack`` (pack/unpack kernels beside a
copy), ``baselines``. Attributes are loaded on first use, so ``import gateway.bench.pack`` (a
device check) does not need scipy."""

from __future__ import annotations

from typing import Any

__all__ = ["GEOMETRY", "MODEL", "run_bench"]


def __getattr__(name: str) -> Any:
    if name == "run_bench":
        from gateway.bench.run import run_bench

        return run_bench
    if name in ("GEOMETRY", "MODEL"):
        from gateway.bench import common

        return getattr(common, name)
    raise AttributeError(f"module 'gateway.bench' has no attribute {name!r}")
