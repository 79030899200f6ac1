"""Audit events lost when a `kvgate serve` is killed -9 right after N admin actions.

    PYTHONPATH=$PWD .venv/bin/python scripts/audit_kill_loss.py [--code DIR] [--n 30] [--reps 3]
        [--delays 0,0.01,0.1] [--db sqlite,postgres] [--kind admin|denials]

Each run starts a fresh server (SQLite in a fresh state directory, or a throwaway Postgres
cluster of its own), sends N acknowledged admin actions over HTTP (alternating tenant create and
key rotate; or, with ``--kind denials``, N refused calls whose ``authz.denied`` events take the
batched data-plane path), waits the delay, kills the server with SIGKILL and counts acknowledged actions
without their event. ``--code`` is the checkout the server runs (default: this one), so the same
script measures any other commit: ``git archive <rev> | tar -x -C /tmp/rev`` then ``--code /tmp/rev``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.killed_server import ServeProcess, kill_after, logged, lost_and_order
from tests.support.postgres import ThrowawayPostgres


def one(code: Path, db: str, n: int, delay: float, pg: ThrowawayPostgres | None, kind: str) -> tuple[int, bool]:
    root = Path(tempfile.mkdtemp(prefix="kvgate-kill-"))
    try:
        url = pg.url if pg is not None else None
        server = ServeProcess(root / "state", url, code_root=code)
        server.start()
        try:
            acked = kill_after(server, n, delay, "k", kind)
        finally:
            server.stop()
        rows = asyncio.run(logged(url or f"sqlite+aiosqlite:///{root / 'state' / 'kvgate.db'}"))
        return lost_and_order(acked, rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--code", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--delays", default="0,0.01,0.1")
    ap.add_argument("--db", default="sqlite,postgres")
    ap.add_argument("--kind", default="admin", choices=["admin", "denials"])
    args = ap.parse_args()
    for db in args.db.split(","):
        for delay in (float(d) for d in args.delays.split(",")):
            lost: list[int] = []
            for _ in range(args.reps):
                pg = None
                if db == "postgres":
                    pg = ThrowawayPostgres()
                    pg.init()
                    pg.start()
                try:
                    got, _order = one(args.code, db, args.n, delay, pg, args.kind)
                    lost.append(got)
                finally:
                    if pg is not None:
                        pg.cleanup()
            print(f"{args.kind} {db:8s} delay {delay * 1000:5.0f} ms: lost {lost} of {args.n} per run", flush=True)


if __name__ == "__main__":
    main()
