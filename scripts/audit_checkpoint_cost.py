"""The cost of an audit checkpoint.

    PYTHONPATH=$PWD .venv/bin/python scripts/audit_checkpoint_cost.py [--leaves 1000000] [--db-rows 100000]

1. Tree math for a log of ``--leaves`` events: leaf hashes of 32-byte chain hashes, the compact
   range (audit.merkle.CompactRange) and its root, then one Ed25519 and one ECDSA P-256 signature
   (software keys; an HSM or KMS adds one round trip).
2. The real checkpointer on Postgres (a scratch database on 127.0.0.1:5432): ``--db-rows`` rows
   written, then the first checkpoint (reads every row, recomputes every chain hash, builds the
   tree, signs, writes the file and the audit.checkpoint event), then an incremental one after
   1,000 more rows (reads only those).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def tree(n: int) -> None:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    from audit.merkle import CompactRange, leaf_hash
    from audit.signing import AuditSigningKey

    data = [os.urandom(32) for _ in range(n)]
    t0 = time.perf_counter()
    cr = CompactRange()
    for d in data:
        cr.append(leaf_hash(d))
    root = cr.root()
    t1 = time.perf_counter()
    ed = AuditSigningKey.generate()
    p256 = ec.generate_private_key(ec.SECP256R1())
    t2 = time.perf_counter()
    ed.sign(root)
    t3 = time.perf_counter()
    p256.sign(root, ec.ECDSA(hashes.SHA256()))
    t4 = time.perf_counter()
    print(f"tree over {n:,} leaves: {t1 - t0:.2f} s ({n / (t1 - t0):,.0f} leaves/s); "
          f"sign Ed25519 {1e3 * (t3 - t2):.2f} ms, ECDSA P-256 {1e3 * (t4 - t3):.2f} ms", flush=True)


async def db(rows: int) -> None:
    from audit import AuditSigningKey, AuditWriter, create_audit_engine, create_audit_schema
    from audit.checkpoint import CheckpointDirectory
    from audit.checkpointer import Checkpointer
    from audit.types import Actor, AuditEvent, Target
    from tests.support.services import scratch_database

    with scratch_database("kvgate_cpcost") as url:
        engine = create_audit_engine(url)
        await create_audit_schema(engine)
        writer = AuditWriter(engine, spool_dir=tempfile.mkdtemp(), batch_size=5000, flush_interval=0.01)
        await writer.start()
        try:
            def ev(i: int) -> AuditEvent:
                return AuditEvent("authz.denied", "denied", Actor(subject=f"s{i}", tenant="t"), Target(tenant="t"),
                                  {"i": i})

            t0 = time.perf_counter()
            for i in range(rows):
                writer.emit(ev(i))
                if i % 20000 == 0:
                    await writer.flush(600)
            await writer.flush(600)
            t1 = time.perf_counter()
            cp = Checkpointer(writer.store, AuditSigningKey.generate(), CheckpointDirectory(tempfile.mkdtemp()),
                              sink=writer)
            first = await cp.checkpoint()
            t2 = time.perf_counter()
            for i in range(1000):
                writer.emit(ev(i))
            await writer.flush(60)
            t3 = time.perf_counter()
            second = await cp.checkpoint()
            t4 = time.perf_counter()
        finally:
            await writer.aclose()
            await engine.dispose()
    print(f"Postgres: wrote {rows:,} rows in {t1 - t0:.1f} s; first checkpoint ({first.tree_size:,} rows) "
          f"{t2 - t1:.2f} s = {(t2 - t1) / rows * 1e6:.1f} us/row; incremental checkpoint after 1,000 more "
          f"rows ({second.tree_size:,}) {1e3 * (t4 - t3):.0f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaves", type=int, default=1_000_000)
    ap.add_argument("--db-rows", type=int, default=100_000)
    args = ap.parse_args()
    tree(args.leaves)
    if args.db_rows:
        asyncio.run(db(args.db_rows))


if __name__ == "__main__":
    main()
