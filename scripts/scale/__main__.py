"""``python -m scripts.scale --out FILE.json [--quick] [--docs]``: the whole scale run, then its tables.

The embedded figures run in a child process of their own (its resident memory is theirs), the
served and audit figures each in a Postgres database created for them and dropped after, the
Redis clears on a redis-server started on a port of its own. ``--quick`` runs small sizes, two
worker levels and short windows (checks the harness); ``--docs`` writes docs/runs.md's Scale
section and docs/runs-data/scale.json (``scripts.scale.render``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scripts.scale import ENVELOPE_BYTES, LOOKUP_CHUNKS
from scripts.scale.render import markdown, write_docs

FULL: dict[str, Any] = {
    "sizes": [10**3, 10**4, 10**5, 10**6], "lookup_reps": 500, "clear_sizes": [10**3, 10**4, 10**5, 10**6],
    "redis_sizes": [10**3, 10**4, 10**5], "clear_reps": 3, "served_sizes": [10**3, 10**4, 10**5, 10**6],
    "served_reps": 300, "workers": [1, 4, 16, 64], "worker_seconds": 15.0, "audit_seconds": 30.0,
}
QUICK: dict[str, Any] = {
    "sizes": [10**3, 10**4], "lookup_reps": 100, "clear_sizes": [10**3, 10**4], "redis_sizes": [10**3],
    "clear_reps": 1, "served_sizes": [10**3, 10**4], "served_reps": 100, "workers": [1, 4], "worker_seconds": 2.0,
    "audit_seconds": 3.0,
}
REPO = Path(__file__).resolve().parents[2]


def _machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal"))
    except (OSError, StopIteration):
        mem = 0
    return (f"{os.cpu_count()} CPUs ({model or platform.processor() or platform.machine()}), "
            f"{mem / 2**20:.0f} GiB, {platform.system()}, Python {platform.python_version()}")


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True, check=True)
        return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _embedded(cfg: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "scripts.scale.embedded", "--sizes", *map(str, cfg["sizes"]),
           "--reps", str(cfg["lookup_reps"]), "--clear-sizes", *map(str, cfg["clear_sizes"]),
           "--redis-sizes", *map(str, cfg["redis_sizes"]), "--clear-reps", str(cfg["clear_reps"])]
    done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"the embedded figures failed (exit {done.returncode})")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run(cfg: dict[str, Any], command: str) -> dict[str, Any]:
    from scripts.scale.auditrate import audit_figures
    from scripts.scale.served import LOAD_BYTES, LOAD_CHUNKS, served_figures
    from tests.support.services import scratch_database

    t0 = time.perf_counter()
    data: dict[str, Any] = {"meta": {
        "date": time.strftime("%Y-%m-%d"), "commit": _commit(), "command": command, "machine": _machine(),
        "config": {**cfg, "envelope_bytes": ENVELOPE_BYTES, "lookup_chunks": LOOKUP_CHUNKS, "load_chunks": LOAD_CHUNKS,
                   "load_bytes": LOAD_BYTES},
    }}
    data["embedded"] = _embedded(cfg)
    with scratch_database("kvgate_scale") as url:
        data["served"] = served_figures(url, cfg["served_sizes"], cfg["served_reps"], cfg["workers"], cfg["worker_seconds"])
    with scratch_database("kvgate_scale_audit") as url:
        data["audit"] = asyncio.run(audit_figures(url, cfg["audit_seconds"]))
    data["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    return data


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scripts.scale", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="where the JSON goes")
    p.add_argument("--quick", action="store_true", help="small sizes and short windows: checks the harness")
    p.add_argument("--docs", action="store_true", help="also write docs/runs.md's Scale section and docs/runs-data/scale.json")
    args = p.parse_args(argv)
    command = "python -m scripts.scale" + (" --quick" if args.quick else "")
    data = run(QUICK if args.quick else FULL, command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    if args.docs:
        write_docs(data, source=args.out)
    print(markdown(data), end="")
    print(f"({data['meta']['seconds']:.0f} s; JSON: {args.out})", file=sys.stderr)


if __name__ == "__main__":
    main()
