"""bench-e2e's bandwidth sweep (scripts/bench_e2e/sweep.py) without engines: its command line,
its plan and the list it makes of raw rows (the engines' part runs in ``make bench-e2e``)."""

from __future__ import annotations

import pytest

from scripts.bench_e2e import sweep
from scripts.bench_e2e.run import Config, parse


def _run(gbps: float, ttft: dict[str, list[float]], loaded: dict[str, bool], n: int = 1024) -> dict:
    """One bandwidth's engine: a miss, then each policy's hits of ``n`` tokens (``ttft``, ms)."""
    rows = [{"tag": {"kind": "miss", "length": n, "i": 0}, "ttft_s": 9.0, "cached": 0}]
    for policy, values in ttft.items():
        rows += [{"tag": {"kind": "hit", "length": n, "i": i, "policy": policy}, "ttft_s": v / 1e3,
                  "cached": n - 32 if loaded[policy] else 0} for i, v in enumerate(values)]
    return {"gbps": gbps, "policies": list(ttft), "rows": rows}


def _raw() -> dict:
    slow = _run(0.05, {"always": [900.0, 1000.0, 950.0], "recompute": [300.0, 310.0, 305.0], "adaptive": [900.0, 312.0, 306.0]},
                {"always": True, "recompute": False, "adaptive": False})
    fast = _run(5.0, {"always": [100.0, 110.0, 105.0], "recompute": [300.0, 300.0, 300.0], "adaptive": [104.0, 106.0, 300.0]},
                {"always": True, "recompute": False, "adaptive": True})
    return {"config": {"gbps": [0.05, 5.0], "lengths": [1024], "reps": 3}, "failed": {}, "runs": [slow, fast]}


def test_load_policy_sweep_list_has_the_medians_of_every_policy_from_one_engine():
    out = sweep.analyze(_raw())
    assert [(r["gbps"], r["length"]) for r in out] == [(0.05, 1024), (5.0, 1024)]
    slow, fast = out
    assert (slow["always_load_ms"], slow["always_recompute_ms"], slow["adaptive_ms"]) == (950.0, 305.0, 312.0)
    assert slow["adaptive_vs_best"] == pytest.approx(312 / 305, abs=1e-3) and slow["adaptive_loaded"] == 0
    assert (fast["always_load_ms"], fast["always_recompute_ms"], fast["adaptive_ms"], fast["adaptive_loaded"]) == (105.0, 300.0, 106.0, 3)
    assert "| 0.05 | 1024 | 950 | 305 | 312 |" in sweep.markdown(out)


def test_load_policy_sweep_without_a_policy_has_no_column_for_it():
    raw = _raw()
    for run_ in raw["runs"]:
        run_["rows"] = [r for r in run_["rows"] if r["tag"].get("policy") != "recompute"]
    slow, _ = sweep.analyze(raw)
    assert "always_recompute_ms" not in slow and slow["adaptive_vs_best"] == pytest.approx(312 / 950, abs=1e-3)
    raw["runs"] = raw["runs"][1:]  # a bandwidth whose engine failed: no row
    assert [r["gbps"] for r in sweep.analyze(raw)] == [5.0]


def test_load_policy_sweep_command_line_and_plan():
    cfg, a = parse(["--sweep-only", "--quick", "--sweep-gbps", "0.1,2", "--sweep-lengths", "512"])
    sc = sweep.config(a)
    assert sc is not None and sc.gbps == [0.1, 2.0] and sc.lengths == [512] and sc.policies == list(sweep.POLICIES)
    plan = sweep.steps(sc, cfg)
    kinds = [s["reqs"][0]["tag"]["kind"] if s["op"] == "gen" else s["op"] for s in plan]
    # every hit follows a prefill of its prompt: the miss that stored it, or the same prompt sent
    # without a capability (no lookup, no store)
    rep = ["miss", "settle", "hit", "level", "settle", "hit", "level", "settle", "hit", "flush"]
    assert kinds == ["warmup", "warmup", *(rep * sc.reps)]
    levels = [s["reqs"][0] for s in plan if s["op"] == "gen" and s["reqs"][0]["tag"]["kind"] == "level"]
    assert levels and all(r["cap"] is None and "policy" not in r for r in levels)
    hits = [s["reqs"][0] for s in plan if s["op"] == "gen" and s["reqs"][0]["tag"]["kind"] == "hit"]
    # every hit names its policy in the request; each policy goes first in turn
    assert all(h["policy"] == h["tag"]["policy"] for h in hits)
    orders = [[h["policy"] for h in hits if h["tag"]["i"] == i] for i in range(sc.reps)]
    assert orders[0] == ["always", "recompute", "adaptive"] and orders[1] == ["recompute", "always", "adaptive"]
    if sc.reps >= 3:
        assert orders[2] == ["adaptive", "always", "recompute"]
    assert {s["reqs"][0]["cap"] for s in plan if s["op"] == "gen" and s["reqs"][0]["tag"]["kind"] in ("miss", "hit")} == {sweep.TENANT}
    assert sweep.config(parse([])[1]) is None
    with pytest.raises(SystemExit):
        sweep.config(parse(["--sweep", "--sweep-policies", "sometimes"])[1])
    assert isinstance(cfg, Config)


def test_load_policy_sweep_proxy_holds_only_the_answers_when_asked():
    from tests.support.tcp_proxy import TcpProxy

    proxy = TcpProxy("127.0.0.1", 1, rate_bps=1e9)
    proxy._throttle(10_000_000, down=False)  # both directions held: the upload books the link's time
    assert proxy._free_at[False] > 0 and proxy._free_at[True] == 0
    proxy = TcpProxy("127.0.0.1", 1, rate_bps=1e9)
    proxy.throttle_up = False
    proxy._throttle(10_000_000, down=False)  # the client's writes pass at once
    proxy._throttle(10_000_000, down=True)  # the service's answers are held
    assert proxy._free_at[False] == 0 and proxy._free_at[True] > 0


def test_load_policy_sweep_hits_carry_their_decision_load_and_the_policy_before_them():
    """Each hit's row of the list says what the policy chose and what the load took: the n-th
    decision of the trace is the n-th hit's (a miss decides nothing), its load found by request."""
    rows = [{"tag": {"kind": "miss", "length": 1024, "i": 0}, "ttft_s": 9.0, "cached": 0}]
    order = ["recompute", "adaptive", "always"]
    rows += [{"tag": {"kind": "hit", "length": 1024, "i": 0, "policy": p}, "ttft_s": 0.1 + k / 10, "cached": 992 if p != "recompute" else 0}
             for k, p in enumerate(order)]
    decisions = [{"event": "decision", "req": "r-rec", "tokens": 0, "reason": "recompute"},
                 {"event": "decision", "req": "r-ada", "tokens": 992, "reason": "load_faster", "est_ttft_ms": 150.0,
                  "est_load_ms": 90.0, "est_lead_ms": 40.0, "est_recompute_ms": 900.0},
                 {"event": "decision", "req": "r-alw", "tokens": 992, "reason": "always"}]
    loads = [{"event": "load", "req": "r-ada", "ms": 88.0, "lead_ms": 35.0}, {"event": "load", "req": "r-alw", "ms": 91.0}]
    run_ = {"gbps": 1.0, "policies": order, "rows": rows, "decisions": decisions, "loads": loads}
    [row] = sweep.analyze({"config": {"gbps": [1.0], "lengths": [1024], "reps": 1}, "failed": {}, "runs": [run_]})
    rec, ada, alw = row["hits"]
    assert (rec["policy"], rec["after"], rec["reason"], rec["load_ms"]) == ("recompute", None, "recompute", None)
    assert (ada["policy"], ada["after"], ada["tokens"], ada["est_lead_ms"]) == ("adaptive", "recompute", 992, 40.0)
    assert (ada["load_ms"], ada["lead_ms"], ada["ttft_ms"]) == (88.0, 35.0, 200.0)
    assert (alw["after"], alw["load_ms"], alw["lead_ms"]) == ("adaptive", 91.0, 91.0)  # no lead said: all of it
    # a trace that does not line up with the hits is not guessed at
    run_["decisions"] = decisions[1:]
    [row] = sweep.analyze({"config": {"gbps": [1.0], "lengths": [1024], "reps": 1}, "failed": {}, "runs": [run_]})
    assert all(h["reason"] is None and h["load_ms"] is None for h in row["hits"])
