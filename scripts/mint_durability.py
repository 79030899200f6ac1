"""Capability mints against a real ``kvgate serve``: latency, throughput, and grants lost on kill -9.

    PYTHONPATH=$PWD .venv/bin/python scripts/mint_durability.py [--code DIR] [--db sqlite,postgres]
        [--callers 16] [--mints 1600] [--kill-n 40] [--delays 0,0.01,0.1] [--reps 3] [--json PATH]

For each database (SQLite in a fresh state directory; a fresh database on the Postgres at
127.0.0.1, fsync on): latency (``POST /v1/capabilities`` from one caller, then from ``--callers``
concurrent callers; p50 and p99 per caller, mints/s over the run); with ``--inprocess``, the same
two runs against the gateway core (no HTTP, no token checks) with mints per audit commit; kill -9
(``--reps`` fresh servers per delay; ``--kill-n`` mints, SIGKILL ``delay`` after the last
acknowledged one, then every acknowledged ``cap_id`` without its ``capability.mint`` row is
counted as lost).

``--code`` is the checkout the server runs (default: this one), so the same script can measure
another commit: ``git archive <rev> | tar -x -C /tmp/old`` then ``--code /tmp/old``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.killed_server import (
    Mint,
    ServeProcess,
    capability_mints,
    create_tenant,
    kill_after_mints,
    minted,
)


@contextmanager
def database(db: str) -> Iterator[tuple[Path, str | None, str]]:
    """(state dir, KVGATE_DATABASE_URL or None, URL to read the audit log from)."""
    root = Path(tempfile.mkdtemp(prefix="kvgate-mint-"))
    try:
        if db == "sqlite":
            yield root / "state", None, f"sqlite+aiosqlite:///{root / 'state' / 'kvgate.db'}"
            return
        from tests.support.services import scratch_database

        with scratch_database("kvgate_mint") as url:
            yield root / "state", url, url
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(mints: list[Mint], wall_s: float, callers: int) -> dict[str, float]:
    lat = [m.seconds * 1e3 for m in mints]
    return {
        "callers": callers, "mints": len(mints), "p50_ms": round(statistics.median(lat), 2),
        "p99_ms": round(_pct(lat, 0.99), 2), "mints_per_s": round(len(mints) / wall_s, 1),
    }


def latency(code: Path, db: str, callers: int, n: int) -> list[dict[str, float]]:
    out = []
    with database(db) as (state, url, _read):
        server = ServeProcess(state, url, code_root=code)
        server.start()
        try:
            asyncio.run(create_tenant(server, "bench"))
            asyncio.run(capability_mints(server, 4 * callers, "bench", callers))  # warm-up: JWKS, pools
            for c, count in ((1, max(50, n // 8)), (callers, n)):
                t0 = time.perf_counter()
                got = asyncio.run(capability_mints(server, count, "bench", c))
                out.append(_summary(got, time.perf_counter() - t0, c))
        finally:
            server.stop()
    return out


async def _inprocess(db: str, callers: int, n: int) -> list[dict[str, float]]:
    from tests.support.gw import gateway_runtime

    out = []
    with database(db) as (state, url, _read):
        async with gateway_runtime(state, url) as rt:
            await rt.admin.create_tenant("bench")
            await rt.gateway.mint_capability("bench", "default", ["get"])  # the namespace exists now
            store = rt.audit.store
            append = store.append
            commits = [0]

            async def counted(events: Any) -> Any:
                commits[0] += 1
                return await append(events)

            store.append = counted  # type: ignore[method-assign]
            for c, count in ((1, max(50, n // 8)), (callers, n)):
                left = iter(range(count))
                got: list[Mint] = []

                async def caller() -> None:
                    for _ in left:
                        t0 = time.perf_counter()
                        await rt.gateway.mint_capability("bench", "default", ["get"])
                        got.append(Mint("", time.perf_counter() - t0))

                commits[0] = 0
                t0 = time.perf_counter()
                await asyncio.gather(*(caller() for _ in range(c)))
                row = _summary(got, time.perf_counter() - t0, c)
                row["commits"] = commits[0]
                out.append(row)
    return out


def kill_loss(code: Path, db: str, n: int, delay_s: float, callers: int) -> int:
    with database(db) as (state, url, read_url):
        server = ServeProcess(state, url, code_root=code)
        server.start()
        try:
            acked = kill_after_mints(server, n, delay_s, "crash", callers)
        finally:
            server.stop()
        kept = asyncio.run(minted(read_url))
        return sum(1 for m in acked if m.cap_id not in kept)


def _revision(code: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--code", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--db", default="sqlite,postgres")
    ap.add_argument("--callers", type=int, default=16)
    ap.add_argument("--mints", type=int, default=1600, help="mints in the concurrent latency run")
    ap.add_argument("--kill-n", type=int, default=40)
    ap.add_argument("--delays", default="0,0.01,0.1")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--revision", help="the commit --code holds (default: asked of git there)")
    ap.add_argument("--inprocess", action="store_true", help="only the in-process runs (this checkout's code)")
    args = ap.parse_args()
    result: dict[str, object] = {
        "code": str(args.code), "revision": args.revision or _revision(args.code), "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0], "kill_n": args.kill_n, "callers": args.callers, "databases": {},
    }
    for db in args.db.split(","):
        if args.inprocess:
            rows = asyncio.run(_inprocess(db, args.callers, args.mints))
            for r in rows:
                print(f"{db:8s} in-process {r['callers']:3d} callers: p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  "
                      f"{r['mints_per_s']:8.1f} mints/s, {r['mints'] / max(1, r['commits']):.1f} mints per commit",
                      flush=True)
            result["databases"][db] = {"inprocess": rows}  # type: ignore[index]
            continue
        entry: dict[str, object] = {"latency": latency(args.code, db, args.callers, args.mints), "lost": {}}
        for row in entry["latency"]:  # type: ignore[union-attr]
            print(f"{db:8s} {row['callers']:3d} callers: p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms  "
                  f"{row['mints_per_s']:8.1f} mints/s ({row['mints']} mints)", flush=True)
        for delay in (float(d) for d in args.delays.split(",")):
            lost = [kill_loss(args.code, db, args.kill_n, delay, args.callers) for _ in range(args.reps)]
            entry["lost"][f"{delay * 1000:.0f}ms"] = lost  # type: ignore[index]
            print(f"{db:8s} kill -9 {delay * 1000:5.0f} ms after the last acknowledged mint: lost {lost} of "
                  f"{args.kill_n} per run", flush=True)
        result["databases"][db] = entry  # type: ignore[index]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
