"""From the engines' rows and the connectors' traces to the figures of ``e2e.json``.

TTFT is vLLM's own ``first_token_latency`` of each request (arrival to first token, the
engine's request metrics); decode rate is (generated - 1) / (last token - first token). Output
identity compares a request's greedy tokens with the no-connector run of the same prompt. Load
GB/s is the kvgate connector's trace: bytes of KV loaded (tokens x bytes per token) over the
load's own time, for the loads of that prompt length's hits; store GB/s the same for the stores of
its misses (a store runs after the forward step that computed the KV, beside decoding), and a
miss's ``decode_vs_none`` its decode rate (during its own store) over no connector's: the ratio of
the two medians, and ``decode_vs_none_paired`` the median over prompts of each prompt's ratio to
no connector's decode of the same prompt (in an interleaved run, of the same round: a round's load
on the host cancels out); ``decode_vs_own_hit`` the median over prompts of each miss's decode rate over
its own system's hit of the same prompt (the same engine decoding the same tokens with no store
beside: what the store costs, without the spread between one engine process and another). With
``--paired-miss`` a miss's ``miss_vs_capless`` is the median, over its repetitions, of the TTFT of
the same prompt sent just before without a capability (no lookup, no store) over the miss's, and
``decode_vs_capless`` the median over prompts of the miss's decode rate over that request's: a store's
cost to decoding against the nearest control there is (the same engine, prompt and minute). With
each token's time (``token_t``) a miss's decode is also read step by step over its store's own
interval (``_in_store``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

__all__ = ["analyze", "quantile", "refused"]


def quantile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _summary(xs: list[float], nd: int = 1) -> dict[str, Any] | None:
    if not xs:
        return None
    return {"median": round(statistics.median(xs), nd), "p90": round(quantile(xs, 0.9), nd), "n": len(xs),
            "min": round(min(xs), nd), "max": round(max(xs), nd)}


def _med(xs: list[float], nd: int = 2) -> float | None:
    return round(statistics.median(xs), nd) if xs else None


def _ttft_ms(r: dict[str, Any]) -> float:
    return float(r["ttft_s"]) * 1e3


def _decode(r: dict[str, Any]) -> float | None:
    n, a, b = r.get("generated") or 0, r.get("first_token_ts"), r.get("last_token_ts")
    return (n - 1) / (b - a) if n > 1 and a and b and b > a else None


def _decode_of(rows: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """Each row's decode rate by ``(length, i)``, the rows that decoded."""
    return {(r["tag"]["length"], r["tag"]["i"]): d for r in rows if (d := _decode(r))}


def _paired_decode(rows: list[dict[str, Any]], base: dict[tuple[int, int], float]) -> float | None:
    """The median over prompts of each miss's decode rate over ``base``'s of the same prompt."""
    pairs = [d / b for r in rows if (d := _decode(r)) and (b := base.get((r["tag"]["length"], r["tag"]["i"])))]
    return round(statistics.median(pairs), 2) if pairs else None


def _store_window(row: dict[str, Any], stores: list[dict[str, Any]]) -> tuple[float, float] | None:
    """The wall-clock interval of the one store that began while ``row``'s batch ran (a store's
    trace line is written at its end, ``ms`` after it began), or None: no token times, no store, or
    more than one (a batch of several requests)."""
    times, t0 = row.get("token_t"), row.get("batch_t0")
    if not times or t0 is None:
        return None
    own = [(e["t"] - e["ms"] / 1e3, e["t"]) for e in stores
           if e.get("tokens") and "t" in e and t0 <= e["t"] - e["ms"] / 1e3 <= times[-1]]
    return own[0] if len(own) == 1 else None


def _steps(times: list[float], keep: Any) -> tuple[list[int], float | None]:
    """The decode steps ``i`` (token i-1 to token i, i >= 1) that ``keep(start, end)`` keeps, and
    their rate in tokens/s (None when none is kept)."""
    idx = [i for i in range(1, len(times)) if keep(times[i - 1], times[i])]
    return idx, _rate_at(times, idx)


def _rate_at(times: list[float] | None, idx: list[int]) -> float | None:
    """The decode rate over the steps ``idx`` of a request's token times (None: no such steps)."""
    if not times or not idx or idx[-1] >= len(times):
        return None
    span = sum(times[i] - times[i - 1] for i in idx)
    return len(idx) / span if span > 0 else None


def _in_store(rows: list[dict[str, Any]], stores: list[dict[str, Any]],
              base: dict[tuple[int, int], list[float]]) -> dict[str, Any]:
    """Decode while a miss's own store runs, step by step: the steps that overlap the store's
    interval, their rate against (a) the same request's steps after the store ended (the same
    engine, prompt and moment; None where the store outlasted the decode) and (b) no connector's
    rate over the same steps of the same prompt; each the median over prompts of the prompts'
    ratios, with the median count of steps under the store."""
    vs_after, vs_none, counts = [], [], []
    for r in rows:
        window = _store_window(r, stores)
        if window is None:
            continue
        s0, s1 = window
        times = r["token_t"]
        idx, during = _steps(times, lambda a, b: b > s0 and a < s1)
        if during is None:
            continue
        counts.append(len(idx))
        _, after = _steps(times, lambda a, b: a >= s1)
        if after:
            vs_after.append(during / after)
        if none := _rate_at(base.get((r["tag"]["length"], r["tag"]["i"])), idx):
            vs_none.append(during / none)
    return {"decode_in_store_vs_after": _med(vs_after), "decode_in_store_vs_none": _med(vs_none),
            "store_steps": _med([float(c) for c in counts], 0)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def _gbps(events: list[dict[str, Any]], field: str, tokens: int, kvb: int) -> float | None:
    xs = [e[field] * kvb / (e["ms"] / 1e3) / 1e9 for e in events if e.get(field) == tokens and e["ms"] > 0]
    return _med(xs)


def _identical(rows: list[dict[str, Any]], base: dict[tuple[Any, ...], list[int]], key: str) -> str | None:
    pairs = [(r["tokens"], base.get(tuple(r["tag"][k] for k in key.split(",")))) for r in rows]
    pairs = [(t, b) for t, b in pairs if b is not None]
    return f"{sum(t == b for t, b in pairs)}/{len(pairs)}" if pairs else None


def refused(runs: dict[str, Any]) -> dict[str, int]:
    """Per system, the requests its connector's trace says kvgate refused (``denied``: a capability
    that expired or was never valid). Such a request is measured without kvgate: a run that has any
    says so in its report, and is not made the project's figures (``report.write_all``)."""
    out = {}
    for key, run in runs.items():
        reqs = {e.get("req") for e in run.get("trace", []) if e.get("reason") == "denied"}
        if reqs:
            out[key] = len(reqs)
    return out


def analyze(raw: dict[str, Any]) -> dict[str, Any]:
    meta, runs = raw["meta"], raw["runs"]
    cfg, kvb = meta["config"], meta["model"]["kv_bytes_per_token"]
    block = meta["engine"]["block_size"]  # hits are block-granular (gateway/vllm/ledger.py)
    base_rows = [r for r in runs.get("none", {}).get("rows", []) if r["tag"].get("kind") == "base"]
    base = {(r["tag"]["length"], r["tag"]["i"]): r["tokens"] for r in base_rows}
    base_ms = {L: statistics.median([_ttft_ms(r) for r in base_rows if r["tag"]["length"] == L])
               for L in cfg["lengths"] if any(r["tag"]["length"] == L for r in base_rows)}
    base_decode = {L: _med([d for r in base_rows if r["tag"]["length"] == L and (d := _decode(r))], 4) for L in base_ms}
    base_decode_of = _decode_of(base_rows)
    base_times = {(r["tag"]["length"], r["tag"]["i"]): r["token_t"] for r in base_rows if r.get("token_t")}
    rows, isolation, multi = [], [], {}
    for key, run in runs.items():
        by: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for r in run["rows"]:
            if "length" in r["tag"]:
                by[(r["tag"]["kind"], r["tag"]["length"])].append(r)
        loads = [e for e in run["trace"] if e["event"] == "load"]
        stores = [e for e in run["trace"] if e["event"] == "store"]
        for length in cfg["lengths"]:
            for kind in ("base",) if key == "none" else ("miss", "hit"):
                rs = by.get((kind, length), [])
                if not rs:
                    continue
                ttft = _summary([_ttft_ms(r) for r in rs])
                hit_tokens = (length - 1) // block * block  # a load fills every block before the last token
                stored_tokens = length // block * block  # a store takes every full block
                rows.append({
                    "system": key, "label": run["label"], "kind": kind, "length": length, "ttft_ms": ttft,
                    "speedup_vs_none": round(base_ms[length] / ttft["median"], 2) if length in base_ms and ttft else None,
                    "cached_tokens": _med([r["cached"] for r in rs], 0),
                    "decode_tok_s": _med([d for d in map(_decode, rs) if d]),
                    # a miss decodes while its own store runs (kvgate's is asynchronous): its rate
                    # over no connector's decode of the same prompts
                    "decode_vs_none": _ratio(_med([d for d in map(_decode, rs) if d], 4), base_decode.get(length))
                    if kind == "miss" else None,
                    "decode_vs_none_paired": _paired_decode(rs, base_decode_of) if kind == "miss" else None,
                    "decode_vs_own_hit": _paired_decode(rs, _decode_of(by.get(("hit", length), [])))
                    if kind == "miss" else None,
                    **(_in_store(rs, stores, base_times) if kind == "miss" else {}),
                    "identical_to_none": _identical(rs, base, "length,i") if kind != "base" else None,
                    "load_gbps": _gbps(loads, "loaded_tokens", hit_tokens, kvb) if kind == "hit" and loads else None,
                    "store_gbps": _gbps(stores, "tokens", stored_tokens, kvb) if kind == "miss" and stores else None,
                })
                if kind == "miss" and by.get(("capless", length)):
                    capless = {r["tag"]["i"]: _ttft_ms(r) for r in by[("capless", length)]}
                    paired = [capless[r["tag"]["i"]] / _ttft_ms(r) for r in rs if r["tag"]["i"] in capless]
                    rows[-1]["miss_vs_capless"] = round(statistics.median(paired), 3) if paired else None
                    # the same pair's decode: the miss's (under its store) over the capless one's
                    rows[-1]["decode_vs_capless"] = _paired_decode(rs, _decode_of(by[("capless", length)]))
        iso = [r for r in run["rows"] if r["tag"].get("kind") == "b_on_a"]
        if iso:
            length = iso[0]["tag"]["length"]
            own = [_ttft_ms(r) for r in by.get(("miss", length), [])]
            a_hit = by.get(("hit", length), [])
            b_ms = statistics.median([_ttft_ms(r) for r in iso])
            isolation.append({
                "system": key, "label": run["label"], "length": length,
                "a_on_a_ms": _med([_ttft_ms(r) for r in a_hit], 1), "a_on_a_cached": _med([r["cached"] for r in a_hit], 0),
                "b_on_a_ms": round(b_ms, 1), "b_on_a_cached": _med([r["cached"] for r in iso], 0),
                "own_miss_ms": _med(own, 1), "b_speedup_vs_own_miss": round(statistics.median(own) / b_ms, 2) if own else None,
                "b_identical_to_none": _identical(iso, base, "length,i"),
            })
        mt = [r for r in run["rows"] if r["tag"].get("kind") == "mt"]
        if mt:
            walls = {r["batch_wall_s"] for r in mt}  # one wall time a round
            per = {}
            for tenant in sorted({r["tag"]["tenant"] for r in mt}):
                rs = [r for r in mt if r["tag"]["tenant"] == tenant]
                warm = [r for r in rs if r["tag"]["q"] > 0]
                per[tenant] = {"ttft_ms_first": _med([_ttft_ms(r) for r in rs if r["tag"]["q"] == 0], 1),
                               "ttft_ms_later": _med([_ttft_ms(r) for r in warm], 1),
                               "cached_later": _med([r["cached"] for r in warm], 0)}
            multi[key] = {"label": run["label"], "requests": len(mt), "wall_s": round(sum(walls), 2),
                          "req_per_s": round(len(mt) / sum(walls), 3),
                          "prompt_tok_per_s": round(sum(r["prompt_tokens"] for r in mt) / sum(walls), 1),
                          "ttft_ms_later_median": _med([_ttft_ms(r) for r in mt if r["tag"]["q"] > 0], 1),
                          "per_tenant": per}
    mt_base = {(r["tag"]["tenant"], r["tag"]["q"]): r["tokens"] for r in runs.get("none", {}).get("rows", []) if r["tag"].get("kind") == "mt"}
    for key, m in multi.items():
        rs = [r for r in runs[key]["rows"] if r["tag"].get("kind") == "mt"]
        m["identical_to_none"] = _identical(rs, mt_base, "tenant,q") if key != "none" else None
    sys_meta = {k: {kk: v for kk, v in r.items() if kk not in ("rows", "trace")} for k, r in runs.items()}
    out = {"meta": {**meta, "systems": sys_meta, "refused": refused(runs)}, "ttft": rows, "isolation": isolation,
           "multi_tenant": multi}
    if raw.get("published"):  # the published-prefix workload (published.py)
        from scripts.bench_e2e.published import analyze as analyze_published

        out["published"] = analyze_published(raw["published"], cfg["chunk_tokens"])
    return out
