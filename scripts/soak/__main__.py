"""``python -m scripts.soak``: the command line of the soak (``make soak SOAK_ARGS=...``); exits 1
when an invariant is broken or the run could not complete."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scripts.soak import faults
from scripts.soak.run import Config, run


def parse(argv: list[str]) -> Config:
    d = Config()
    p = argparse.ArgumentParser(prog="python -m scripts.soak", description=__doc__)
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load (default 600)")
    p.add_argument("--workers", type=int, default=d.workers, help="worker processes (default 16)")
    p.add_argument("--tenants", type=int, default=d.tenants, help="tenants (default: half the workers)")
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts per worker")
    p.add_argument("--tiers", default=",".join(d.tiers), help="the server's tiers, fastest first (default memory,redis)")
    p.add_argument("--memory-mib", type=int, default=d.memory_mib, help="memory tier size (small, so loads reach Redis)")
    p.add_argument("--fault-every", type=float, default=d.fault_every_s, help="seconds between faults")
    p.add_argument("--warmup", type=float, default=d.warmup_s, help="seconds before the first fault")
    p.add_argument("--faults", default=",".join(d.kinds), help=f"fault kinds, in order, cycled (of {', '.join(faults.KINDS)})")
    p.add_argument("--hold", action="append", default=[], metavar="KIND=S", help="how long a fault lasts, e.g. kek_outage=12")
    p.add_argument("--p99-bound", type=float, default=d.p99_bound_s, help="seconds: lookup and load p99 outside fault windows")
    p.add_argument("--rss-slope", type=float, default=d.rss_slope_mib_per_min, help="MiB/min: the server RSS trend allowed")
    p.add_argument("--rss-warmup", type=float, default=d.rss_warmup_s, help="seconds of each server process left out of the trend")
    p.add_argument("--checkpoint-every", type=float, default=d.checkpoint_every_s, help="seconds between the soak's checkpoints")
    p.add_argument("--kek-cache-ttl", type=float, default=d.kek_cache_ttl_s, help="KVGATE_KEK_CACHE_TTL_S of the server")
    p.add_argument("--think", type=float, default=d.think_s, help="seconds a worker waits between operations")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", type=Path, default=d.out, help="where report.json and summary.md go (default bench-results/soak)")
    p.add_argument("--keep", action="store_true", help="keep the working directory (worker logs, server state)")
    a = p.parse_args(argv)
    kinds = [k for k in a.faults.split(",") if k]
    unknown = [k for k in kinds if k not in faults.KINDS]
    if unknown:
        p.error(f"unknown fault kinds: {', '.join(unknown)}")
    holds = dict(d.holds)
    for h in a.hold:
        kind, _, secs = h.partition("=")
        if kind not in faults.KINDS or not secs:
            p.error(f"--hold takes KIND=SECONDS, got {h!r}")
        holds[kind] = float(secs)
    return Config(duration_s=a.duration, workers=a.workers, tenants=a.tenants, prompts=a.prompts,
                  tiers=[t for t in a.tiers.split(",") if t], memory_mib=a.memory_mib, fault_every_s=a.fault_every,
                  warmup_s=a.warmup, kinds=kinds, holds=holds, p99_bound_s=a.p99_bound, rss_slope_mib_per_min=a.rss_slope,
                  rss_warmup_s=a.rss_warmup, checkpoint_every_s=a.checkpoint_every, kek_cache_ttl_s=a.kek_cache_ttl,
                  think_s=a.think, seed=a.seed, out=a.out, keep=a.keep)


def main(argv: list[str] | None = None) -> int:
    cfg = parse(sys.argv[1:] if argv is None else argv)
    result = run(cfg)
    print((cfg.out / "summary.md").read_text())
    print(f"report: {cfg.out / 'report.json'}")
    return 0 if result.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
