"""Plots and the Markdown report of a `kvgate bench` JSON file.

    python -m gateway.bench.plots bench-results/bench.json --out bench-results [--docs docs]

Writes ``throughput.png``, ``concurrency.png``, ``lmcache.png``, ``attack.png`` and ``bench.md`` to
``--out``; with ``--docs``, also the PNGs to ``docs/img/`` (small, for the README) and
``docs/bench.md``. matplotlib is imported only here (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

__all__ = ["main", "markdown", "write_plots"]

PLOTS = ("throughput.png", "concurrency.png", "lmcache.png", "attack.png")
PEERS_NOTE = (
    "How the peer runs: `kvgate bench` first runs `scripts/lmcache_runner.py` (outside every package, started "
    "with `python -I`) in LMCache's own environment, named by `--lmcache-python` / `KVGATE_BENCH_LMCACHE_PYTHON` "
    "(default `.venv-lmcache/bin/python` under the current directory; `--lmcache-runner` / "
    "`KVGATE_BENCH_LMCACHE_RUNNER`, default `scripts/lmcache_runner.py`). A peer that fails to run fails the "
    "command (exit 2, with its error); `--no-peers` skips peers on purpose; an environment neither named nor at its "
    "default place is skipped with a note (`make bench` names it). LMCache's L1 (`l1-dram`) is measured on the same "
    "chunk sizes and the same bytes as kvgate's memory tier (as many distinct buffers, one torch thread), and "
    "kvgate's encrypted memory-tier figures stand beside it as well as beside `single_pass`."
)


def _mib(b: int) -> str:
    return f"{b / 2**20:.0f} MiB"


def write_plots(data: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []

    # 1. throughput per configuration beside its ceiling (one thread)
    rows = [r for r in data["results"] if r["threads"] == 1]
    if rows:
        fig, ax = plt.subplots(figsize=(9, 4.2), dpi=80)
        labels = [f"{r['op']} {r['tier']}\n{'enc' if r['encrypted'] else 'plain'} {_mib(r['chunk_bytes'])}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["gbps"] for r in rows], 0.4, label="kvgate")
        ax.bar([i + 0.2 for i in x], [r["ceiling"]["gbps"] for r in rows], 0.4, label="ceiling (same run)", alpha=0.6)
        ax.set_xticks(list(x), labels, rotation=90, fontsize=6)
        ax.set_ylabel("GB/s")
        ax.set_title("kvgate store/load throughput beside its ceiling (1 thread, medians)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "throughput.png")
        fig.savefig(paths[-1])
        plt.close(fig)

    # 2. concurrent tenants: aggregate GB/s and fairness
    conc = data.get("concurrency") or []
    if conc:
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=80)
        n = [c["tenants"] for c in conc]
        for op in ("store", "load"):
            ax.plot(n, [c[op]["aggregate_gbps"] for c in conc], marker="o", label=f"{op} aggregate GB/s")
        ax.set_xlabel("concurrent tenants")
        ax.set_ylabel("GB/s (aggregate)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(i) for i in n])
        ax2 = ax.twinx()
        for op in ("store", "load"):
            ax2.plot(n, [c[op]["jain_fairness"] for c in conc], ls="--", marker="x", label=f"{op} Jain fairness")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("Jain's fairness index")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower left")
        ax.set_title("Concurrent tenants (memory tier, encrypted, 2 MiB chunks)")
        fig.tight_layout()
        paths.append(out / "concurrency.png")
        fig.savefig(paths[-1])
        plt.close(fig)

    # 3. kvgate beside LMCache
    comp = data.get("comparisons") or []
    if comp:
        fig, ax = plt.subplots(figsize=(9, 4.2), dpi=80)
        labels = [c["figure"].split(" [")[0] + "\n" + c["peer_path"].split("/", 1)[-1] for c in comp]
        x = range(len(comp))
        ax.bar([i - 0.2 for i in x], [c["kvgate"] for c in comp], 0.4, label="kvgate")
        ax.bar([i + 0.2 for i in x], [c["peer_value"] for c in comp], 0.4, label="LMCache 0.5.6 (path below each bar)")
        ax.set_xticks(list(x), labels, rotation=90, fontsize=6)
        ax.set_ylabel("GB/s")
        ax.set_title("kvgate vs LMCache on the same chunks (1 thread, medians)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "lmcache.png")
        fig.savefig(paths[-1])
        plt.close(fig)

    # 4. attack p-values
    att = data.get("attacks") or []
    if att:
        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=80)
        ax.bar([a["target"] for a in att], [max(a["p_value"], 1e-300) for a in att], color=["tab:red", "tab:green", "tab:gray"][: len(att)])
        ax.axhline(0.01, color="k", ls="--", lw=1, label="p = 0.01")
        ax.set_yscale("log")
        ax.set_ylabel("KS p-value (one-sided, log)")
        ax.set_title(f"Prefix-cache timing attack ({att[0]['samples']} hit + {att[0]['samples']} miss samples)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "attack.png")
        fig.savefig(paths[-1])
        plt.close(fig)
    return paths


def markdown(data: dict[str, Any], *, img_prefix: str = "", command: str = "make bench") -> str:
    m = data.get("machine", {})
    lines = [
        "## Performance", "",
        (
            f"Made by `{command}` on {m.get('platform', '?')}, {m.get('cpus', '?')} CPUs, Python {m.get('python', '?')}, "
            f"torch {m.get('torch', '?')}; medians of {data.get('reps', '?')} repetitions. Every figure stands beside a "
            "ceiling measured in the same run on the same bytes (AES-256-GCM `encrypt_into`, memory copy, raw redis-py, "
            "a raw loopback socket). Encrypted memory-tier results also stand beside `single_pass` = "
            "min(AES-256-GCM, memory copy) over the same bytes and threads: one pass over the bytes with the "
            "encryption fused into it."
        ), "",
        "### Throughput", "",
        "| op | tier | encrypted | chunk | threads | GB/s | ceiling | ceiling GB/s | fraction | single_pass GB/s | vs single_pass |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["results"]:
        c = r["ceiling"]
        frac = r["gbps"] / c["gbps"] if c["gbps"] else 0.0
        sp = r.get("single_pass")
        sp_cols = f"{sp['gbps']:.2f} | {sp['ratio']:.2f}" if sp else " | "
        lines.append(f"| {r['op']} | {r['tier']} | {'yes' if r['encrypted'] else 'no'} | {_mib(r['chunk_bytes'])} | "
                     f"{r['threads']} | {r['gbps']:.2f} | {c['name']} | {c['gbps']:.2f} | {frac:.2f} | {sp_cols} |")
    lines += ["", f"![throughput]({img_prefix}throughput.png)", "", "### Lookup latency (32K-token prefix, 128 chunks)", "",
              "| tier | p50 ms | p99 ms |", "| --- | --- | --- |"]
    for t, v in data.get("latency", {}).get("lookup_ms_by_tier", {}).items():
        lines.append(f"| {t} | {v['p50']} | {v['p99']} |")
    fast = data.get("fast_paths") or []
    if fast:  # docs/server.md, "Raw paths": each kept only where the public route costs 10% more
        lines += ["", "### Fast paths beside the public routes (same run, loopback TCP)", "",
                  "| figure | side | chunk | fast | public | speedup | CPU ratio | kept |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for f in fast:
            chunk = _mib(f["chunk_bytes"]) if f["chunk_bytes"] else ""
            lines.append(f"| {f['figure']} | {f['side']} | {chunk} | {f['fast']} | {f['public']} | {f['speedup']:.2f} | "
                         f"{f.get('cpu_ratio', '')} | {'yes' if f['keep'] else 'no'} |")
    conc = data.get("concurrency") or []
    if conc:
        lines += ["", "### Concurrent tenants", "",
                  "| tenants | store GB/s | store fairness | load GB/s | load fairness |", "| --- | --- | --- | --- | --- |"]
        for c in conc:
            lines.append(f"| {c['tenants']} | {c['store']['aggregate_gbps']} | {c['store']['jain_fairness']} | "
                         f"{c['load']['aggregate_gbps']} | {c['load']['jain_fairness']} |")
        lines += ["", f"![concurrency]({img_prefix}concurrency.png)"]
    lines += ["", "### kvgate beside LMCache", "", PEERS_NOTE, ""]
    lm = data.get("lmcache", {})
    if lm.get("skipped"):
        lines.append(f"LMCache skipped: {lm['skipped']}")
    else:
        lines += [(f"LMCache {lm.get('lmcache_version', '?')}, path `{lm.get('path', '?')}` (its multiprocess-mode "
                   "StorageManager on CPU; each row names the L1/L2 adapter used). Ratio = kvgate / LMCache."), "",
                  ("Notes: LMCache's L1 objects are references, so its memory figures include the copy in and out; "
                       "its `fs` store time runs until its background L2 write completes; buffered `fs` loads may be served "
                       "from the page cache, `fs-odirect` is not; kvgate's disk tier writes with fsync. kvgate encrypts "
                       "with AES-256-GCM everywhere; LMCache's `aesgcm` serde (AES-256 here) covers L2 only."), "",
                  "| figure | kvgate GB/s | LMCache GB/s | ratio | single_pass GB/s |", "| --- | --- | --- | --- | --- |"]
        for c in data.get("comparisons", []):
            sp = c.get("single_pass_gbps")
            lines.append(f"| {c['figure']} | {c['kvgate']:.2f} | {c['peer_value']:.2f} | {c['ratio']:.2f} | "
                         f"{'' if sp is None else f'{sp:.2f}'} |")
        lines += ["", f"![lmcache]({img_prefix}lmcache.png)"]
    att = data.get("attacks") or []
    if att:
        lines += ["", "### Prefix-cache timing attack", "",
                  ("As Gu et al. (ICML 2025) audit APIs: hit and miss probes in shuffled order, 95% shared prefix, "
                   "one-sided two-sample KS test on lookup+load latency."), "",
                  "| target | p-value | samples | hit median ms | miss median ms | direct hits |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for a in att:
            lines.append(f"| {a['target']} | {a['p_value']:.3g} | {a['samples']}+{a['samples']} | {a['hit_median_ms']} | "
                         f"{a['miss_median_ms']} | {a['direct_hits']} |")
        lines += ["", f"![attack]({img_prefix}attack.png)"]
    w = data.get("workloads")
    if w:
        g = w["geometry"]
        lines += ["", "### Workloads (LMCache benchmark shapes)", "",
                  (f"Synthetic KV of {g['model']} ({g['layers']} layers x {g['kv_heads']} KV heads x {g['head_size']}, "
                   f"{g['dtype']}), chunks of {g['chunk_tokens']} tokens."), "",
                  "| workload | tenant | requests | prompt tokens | hit ratio | MB loaded | MB stored | seconds |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for t in w["tenants"]:
            lines.append(f"| {t['workload']} | {t['tenant']} | {t['requests']} | {t['prompt_tokens']} | {t['hit_ratio']} | "
                         f"{t['bytes_loaded'] / 1e6:.1f} | {t['bytes_stored'] / 1e6:.1f} | {t['seconds']} |")
        lines += ["", "Eviction flood (tenant B writes many times the memory tier while A re-reads its working set):", "",
                  "| per-tenant quota | tier capacity | A's hit ratio | B bytes written | evictions |", "| --- | --- | --- | --- | --- |"]
        for f in w["eviction_flood"]:
            q = _mib(f["quota_bytes"]) if f["quota_bytes"] else "none"
            lines.append(f"| {q} | {_mib(f['capacity_bytes'])} | {f['tenant_a_hit_ratio']} | "
                         f"{f['tenant_b_bytes_written'] / 1e6:.0f} MB | {f['evictions']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="plots and Markdown for a kvgate bench JSON file")
    ap.add_argument("json_path", type=Path)
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--docs", type=Path, default=None, help="also write docs/bench.md and docs/img/*.png here")
    ap.add_argument("--command", default="make bench")
    args = ap.parse_args(argv)
    data = json.loads(args.json_path.read_text())
    pngs = write_plots(data, args.out)
    (args.out / "bench.md").write_text(markdown(data, command=args.command))
    if args.docs is not None:
        img = args.docs / "img"
        img.mkdir(parents=True, exist_ok=True)
        for p in pngs:
            shutil.copyfile(p, img / p.name)
        (args.docs / "bench.md").write_text(markdown(data, img_prefix="img/", command=args.command))
    print(f"wrote {len(pngs)} plots and bench.md to {args.out}" + (f" and {args.docs}" if args.docs else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
