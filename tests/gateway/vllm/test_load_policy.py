"""The load policy (gateway/vllm/policy.py) without vLLM: its estimators fed measured-looking
samples on a clock the test moves, and the decision it makes from them, through the scheduler
side where the decision is traced and counted."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.vllm.counters import ConnectorCounters
from gateway.vllm.logs import Tracer
from gateway.vllm.policy import (
    LoadEstimator,
    LoadPolicy,
    LoadSample,
    LoadTimings,
    PrefillEstimator,
    StepWork,
    attention_pairs,
)
from gateway.vllm.scheduler import CAPABILITY_PARAM, RequestView, SchedulerSide

CHUNK = 256


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _policy(mode: str = "adaptive", clock: Clock | None = None, probe_budget: float = 0.05) -> tuple[LoadPolicy, Clock]:
    clock = clock or Clock()
    return LoadPolicy(mode, CHUNK, "embedded", clock=clock, probe_budget=probe_budget), clock  # type: ignore[arg-type]


def _learn_prefill(policy: LoadPolicy, clock: Clock, per_token_ms: float = 0.01, per_pair_ms: float = 1e-6) -> None:
    """Steps of several sizes (prefills and decodes) timed as the engine would report them."""
    for n, ctx in ((1, 500), (4, 900), (512, 0), (1024, 0), (2048, 0), (1, 2000), (256, 1024), (3000, 0)):
        work = StepWork(n, attention_pairs(n, ctx))
        policy.step_built(work)
        clock.t += (2.0 + per_token_ms * n + per_pair_ms * work.attention) / 1e3
        policy.step_ended()


def _learn_loads(policy: LoadPolicy, clock: Clock, ms_per_token: float, latency_ms: float = 1.0, n: int = 6) -> None:
    for i in range(n):
        tokens = 512 * (1 + i % 4)
        clock.t += 0.2
        policy.loads_ended([LoadSample(f"m{i}", tokens, latency_ms + ms_per_token * tokens)])


# -- estimators -------------------------------------------------------------------------------
def test_load_policy_load_estimator_recovers_latency_and_throughput():
    clock = Clock()
    est = LoadEstimator(clock=clock)
    assert est.fit() is None and est.predict(100) is None and est.age_s() == math.inf
    for tokens in (256, 1024, 512, 2048, 768):
        clock.t += 0.1
        est.observe(tokens, 3.0 + 0.02 * tokens)
    lat, per, spread = est.fit()  # type: ignore[misc]
    assert lat == pytest.approx(3.0, rel=1e-6) and per == pytest.approx(0.02, rel=1e-6)
    assert spread == pytest.approx(0.0, abs=1e-6)
    assert est.predict(4096) == pytest.approx(3.0 + 0.02 * 4096)


def test_load_policy_load_estimator_of_one_size_folds_latency_into_throughput():
    clock = Clock()
    est = LoadEstimator(clock=clock)
    for ms in (10.0, 12.0, 11.0):
        est.observe(512, ms)
    lat, per, spread = est.fit()  # type: ignore[misc]
    assert lat == 0.0 and 512 * per == pytest.approx(11.0, rel=0.1) and spread > 0


def test_load_policy_load_estimator_ignores_nonsense():
    est = LoadEstimator(clock=Clock())
    for tokens, ms in ((0, 5.0), (-3, 5.0), (512, float("nan")), (512, -1.0), (512, float("inf"))):
        est.observe(tokens, ms)
    assert est.count == 0


def test_load_policy_prefill_estimator_learns_context_dependence_and_skips_load_steps():
    clock = Clock()
    policy, _ = _policy(clock=clock)
    _learn_prefill(policy, clock, per_token_ms=0.01, per_pair_ms=1e-6)
    # a step that carried a load is slow for its load's sake: not a prefill measurement
    policy.step_built(StepWork(512, attention_pairs(512, 0), loads=True))
    clock.t += 0.5
    policy.step_ended()
    a, b, c = policy.prefill.fit()  # type: ignore[misc]
    assert a == pytest.approx(2.0, rel=1e-3)
    assert b == pytest.approx(0.01, rel=1e-3) and c == pytest.approx(1e-6, rel=1e-3)
    # the same tokens cost more after a longer context
    long, short = policy.prefill.compute_ms(512, 4096), policy.prefill.compute_ms(512, 0)
    assert long is not None and short is not None and long > short


def test_load_policy_prefill_estimator_of_one_step_size():
    clock = Clock()
    est = PrefillEstimator(clock=clock)
    assert est.compute_ms(100, 0) is None
    est.observe(StepWork(1000, attention_pairs(1000, 0)), 40.0)
    assert est.compute_ms(1000, 0) == pytest.approx(40.0)


def test_load_policy_step_time_runs_from_when_the_step_could_start():
    """Steps built ahead (asynchronous scheduling) are timed from the end of the one before."""
    clock = Clock()
    policy, _ = _policy(clock=clock)
    policy.step_built(StepWork(100, attention_pairs(100, 0)))
    clock.t += 0.001
    policy.step_built(StepWork(100, attention_pairs(100, 0)))  # built while the first runs
    clock.t += 0.010
    policy.step_ended()  # the first: 11 ms
    clock.t += 0.010
    policy.step_ended()  # the second: 10 ms (it started when the first ended)
    assert policy.prefill.count == 2
    assert policy.prefill.compute_ms(100, 0) == pytest.approx(10.5, rel=0.05)


# -- the decision -----------------------------------------------------------------------------
def test_load_policy_cold_start_loads_until_both_costs_are_measured():
    policy, clock = _policy()
    d = policy.decide("r1", 4097, 0, 4096)
    assert (d.tokens, d.reason) == (4096, "cold_load")
    _learn_loads(policy, clock, ms_per_token=1.0)  # far slower than any prefill
    d = policy.decide("r2", 4097, 0, 4096)
    assert (d.tokens, d.reason) == (4096, "cold_prefill") and d.load_ms is not None
    _learn_prefill(policy, clock)
    d = policy.decide("r3", 4097, 0, 4096)
    assert (d.tokens, d.reason) == (0, "recompute_faster")


def test_load_policy_loads_where_loading_is_faster_and_recomputes_where_it_is_slower():
    policy, clock = _policy()
    _learn_prefill(policy, clock, per_token_ms=0.01)  # 10 ms per 1K tokens (+ attention)
    _learn_loads(policy, clock, ms_per_token=0.001)  # 1 ms per 1K tokens
    fast = policy.decide("r1", 8193, 0, 8192)
    assert (fast.tokens, fast.reason) == (8192, "load_faster")
    assert fast.load_ms < fast.recompute_ms  # type: ignore[operator]
    policy.finished("r1")
    slow, clock2 = _policy()
    _learn_prefill(slow, clock2, per_token_ms=0.01)
    _learn_loads(slow, clock2, ms_per_token=0.5)
    d = slow.decide("r1", 8193, 0, 8192)
    assert (d.tokens, d.reason) == (0, "recompute_faster")
    assert d.load_ms > d.recompute_ms  # type: ignore[operator]
    assert d.ttft_ms == pytest.approx(slow.prefill.compute_ms(8193, 0))


def test_load_policy_always_and_recompute_modes():
    always, clock = _policy("always")
    _learn_prefill(always, clock)
    _learn_loads(always, clock, ms_per_token=5.0)
    d = always.decide("r1", 1025, 0, 1024)
    assert (d.tokens, d.reason) == (1024, "always") and d.load_ms > d.recompute_ms  # type: ignore[operator]
    never, _ = _policy("recompute")
    assert never.decide("r1", 1025, 0, 1024).tokens == 0


def test_load_policy_sudden_slowdown_moves_the_decision_within_seconds():
    policy, clock = _policy()
    _learn_prefill(policy, clock)
    _learn_loads(policy, clock, ms_per_token=0.001, n=20)
    assert policy.decide("a", 4097, 0, 4096).reason == "load_faster"
    policy.finished("a")
    # the tier slows down a hundredfold: the loads already decided come back slow
    for i in range(3):
        clock.t += 0.5
        policy.loads_ended([LoadSample(f"s{i}", 4096, 4096 * 0.1)])
    d = policy.decide("b", 4097, 0, 4096)
    assert (d.tokens, d.reason) == (0, "recompute_faster")


def test_load_policy_recovery_is_found_by_a_probe():
    policy, clock = _policy(probe_budget=10.0)
    _learn_prefill(policy, clock)
    _learn_loads(policy, clock, ms_per_token=0.5)
    assert policy.decide("a", 4097, 0, 4096).reason == "recompute_faster"
    clock.t += policy.probe_s  # no load measured for a while: one chunk is loaded to measure it
    probe = policy.decide("b", 4097, 0, 4096)
    assert (probe.tokens, probe.reason) == (CHUNK, "probe")
    assert policy.decide("c", 4097, 0, 4096).reason == "recompute_faster"  # one probe per interval
    # the tier recovered: the probe's load comes back fast, a second probe confirms it
    policy.loads_ended([LoadSample("b", CHUNK, CHUNK * 0.0005)])
    clock.t += 0.1
    again = policy.decide("d", 4097, 0, 4096)
    assert (again.tokens, again.reason) == (CHUNK, "probe")
    clock.t += 0.1
    policy.loads_ended([LoadSample("d", CHUNK, CHUNK * 0.0005)])
    d = policy.decide("e", 4097, 0, 4096)
    assert (d.tokens, d.reason) == (4096, "load_faster")


def test_load_policy_probes_back_off_while_recompute_keeps_winning():
    policy, clock = _policy(probe_budget=10.0)
    _learn_prefill(policy, clock)
    _learn_loads(policy, clock, ms_per_token=0.5)
    times = []
    for i in range(40):
        clock.t += 0.25
        d = policy.decide(f"r{i}", 4097, 0, 4096)
        if d.reason == "probe":
            times.append(clock.t)
            policy.loads_ended([LoadSample(f"r{i}", CHUNK, CHUNK * 0.5)])  # still slow
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(times) >= 2 and gaps == sorted(gaps) and gaps[-1] > gaps[0]
    assert max(gaps) <= policy.probe_max_s + 0.25


def test_load_policy_a_wrong_estimate_corrects_itself():
    """A load predicted fast that ran slow: its measurement moves the next prediction to it."""
    policy, clock = _policy()
    _learn_prefill(policy, clock, per_token_ms=0.01)
    _learn_loads(policy, clock, ms_per_token=0.001)
    d = policy.decide("a", 4097, 0, 4096)
    assert d.tokens == 4096 and d.load_ms is not None
    observed = d.load_ms * 20
    clock.t += 0.1
    policy.loads_ended([LoadSample("a", 4096, observed)])
    after = policy.decide("b", 4097, 0, 4096)
    assert after.load_ms > d.load_ms * 3  # type: ignore[operator]
    clock.t += 0.1
    policy.loads_ended([LoadSample("b", 4096, observed)])
    clock.t += 0.1
    assert policy.decide("c", 4097, 0, 4096).load_ms == pytest.approx(observed, rel=0.35)


def test_load_policy_loads_in_flight_count_against_a_new_load():
    policy, clock = _policy()
    _learn_prefill(policy, clock, per_token_ms=0.01)
    _learn_loads(policy, clock, ms_per_token=0.004)
    first = policy.decide("a", 4097, 0, 4096)
    assert first.reason == "load_faster"
    queued = [policy.decide(f"q{i}", 4097, 0, 4096) for i in range(6)]
    assert queued[1].load_ms > first.load_ms  # type: ignore[operator]
    assert queued[-1].reason == "recompute_faster"  # behind the others, recompute is sooner
    for i, q in enumerate(queued):  # the queued loads report back: the queue empties
        if q.tokens:
            policy.loads_ended([LoadSample(f"q{i}", q.tokens, 0.004 * q.tokens)])
    policy.loads_ended([LoadSample("a", 4096, 0.004 * 4096)])
    assert policy.decide("b", 4097, 0, 4096).load_ms == pytest.approx(first.load_ms, rel=0.2)


def test_load_policy_probes_cost_at_most_their_budget_of_recompute_time():
    """Probes on a link that stays slow add at most ``probe_budget`` of the time recomputing
    took (and one probe), and they still happen."""
    policy, clock = _policy(probe_budget=0.05)
    _learn_prefill(policy, clock, per_token_ms=0.05)
    _learn_loads(policy, clock, ms_per_token=0.1)
    recompute = extra = 0.0
    probes = 0
    for i in range(400):
        clock.t += 1.0
        d = policy.decide(f"r{i}", 4097, 0, 4096)
        best = policy.prefill.compute_ms(4097, 0)
        assert best is not None and d.recompute_ms is not None and d.ttft_ms is not None
        recompute += d.recompute_ms
        if d.reason == "probe":
            probes += 1
            extra += d.ttft_ms - best
            policy.loads_ended([LoadSample(f"r{i}", d.tokens, 0.1 * d.tokens)])  # still slow
        else:
            assert d.reason == "recompute_faster"
    one = extra / max(1, probes)
    assert probes >= 3 and extra <= 0.05 * recompute + one


def test_load_policy_prefixes_end_on_chunk_boundaries():
    policy, clock = _policy(probe_budget=10.0)
    _learn_prefill(policy, clock)
    _learn_loads(policy, clock, ms_per_token=0.5)
    clock.t += policy.probe_s
    probe = policy.decide("a", 2049, 64, 1984)  # the engine holds 64 tokens itself
    assert probe.reason == "probe" and (64 + probe.tokens) % CHUNK == 0


# -- through the scheduler side: traced and counted ---------------------------------------------
def test_load_policy_decision_is_traced_and_counted(tmp_path):
    path = tmp_path / "trace.jsonl"
    clock = Clock()
    policy = LoadPolicy("adaptive", CHUNK, "embedded", clock=clock)
    _learn_prefill(policy, clock)
    _learn_loads(policy, clock, ms_per_token=0.5)
    stats = ConnectorCounters()
    side = SchedulerSide(CHUNK, 16, lambda cap, toks: (len(toks), ""), stats=stats, trace=Tracer(str(path)),
                         policy=policy)
    prompt = list(range(2049))
    req = RequestView("r1", prompt, "cap")
    assert side.matched_tokens(req, 0) == 0  # recompute: vLLM allocates no external tokens
    side.allocated(req, [], 0)
    events = [json.loads(line) for line in path.read_text().splitlines()]
    d = next(e for e in events if e["event"] == "decision")
    assert d["req"] == "r1" and d["hit_tokens"] == 2048 and d["tokens"] == 0 and d["reason"] == "recompute_faster"
    assert d["est_load_ms"] > d["est_recompute_ms"] > 0 and 0 <= d["est_lead_ms"] <= d["est_load_ms"]
    assert stats.get("decision", "recompute_faster") == 1 and stats.tokens_of("declined") == 2048
    assert ("decision", "recompute_faster") not in stats.failures()
    assert side.finished("r1") == {"kvgate": {"hit_tokens": 0}}
    # a capability-less request is no decision
    assert side.matched_tokens(RequestView("r2", prompt, None), 0) == 0 and stats.get("decision", "probe") == 0
    assert CAPABILITY_PARAM


def test_load_policy_a_request_may_name_its_own_and_the_middleware_drops_it_from_a_client():
    """``kvgate_load_policy`` in a request's kv_transfer_params decides in place of the engine's
    policy (a benchmark compares the policies on one engine), and only there: a tenant's request
    that names one through the tenant middleware has it removed."""
    from gateway.vllm.scheduler import POLICY_PARAM, load_policy_of, request_view

    clock = Clock()
    policy = LoadPolicy("adaptive", CHUNK, "embedded", clock=clock)
    _learn_prefill(policy, clock)
    _learn_loads(policy, clock, ms_per_token=0.5)  # loading is slower: adaptive recomputes
    side = SchedulerSide(CHUNK, 16, lambda cap, toks: (len(toks), ""), policy=policy)
    prompt = list(range(2049))

    @dataclass
    class Req:
        request_id: str
        prompt_token_ids: list[int]
        kv_transfer_params: dict[str, Any]

    def matched(req_id: str, mode: str | None) -> int:
        params = {CAPABILITY_PARAM: "cap", **({POLICY_PARAM: mode} if mode else {})}
        return side.matched_tokens(request_view(Req(req_id, prompt, params)), 0)

    assert matched("engine", None) == 0  # the control: the engine's adaptive policy recomputes
    assert matched("always", "always") == 2048
    assert matched("adaptive", "adaptive") == 0
    assert matched("recompute", "recompute") == 0
    assert matched("bogus", "sometimes") == 0  # not a policy: the engine's
    assert load_policy_of({POLICY_PARAM: "always"}) == "always" and load_policy_of({POLICY_PARAM: 1}) is None
    always = LoadPolicy("always", CHUNK, "embedded", clock=clock)
    side = SchedulerSide(CHUNK, 16, lambda cap, toks: (len(toks), ""), policy=always)
    assert matched("engine", None) == 2048 and matched("recompute", "recompute") == 0


def test_load_policy_prefix_load_retrieves_only_its_chunks():
    clock = Clock()
    policy = LoadPolicy("adaptive", CHUNK, "embedded", clock=clock, probe_budget=10.0)
    _learn_prefill(policy, clock)
    _learn_loads(policy, clock, ms_per_token=0.5)
    clock.t += policy.probe_s
    side = SchedulerSide(CHUNK, 16, lambda cap, toks: (len(toks), ""), policy=policy)
    prompt = list(range(2049))
    req = RequestView("r1", prompt, "cap")
    n = side.matched_tokens(req, 0)
    assert n == CHUNK
    side.allocated(req, list(range(129)), n)
    from gateway.vllm.ledger import StepRequest

    loads, _ = side.build([StepRequest("r1", 0, 2049 - n, list(range(129)), new=True)])
    assert len(loads) == 1 and len(loads[0].tokens) == CHUNK and loads[0].load_tokens == CHUNK


def test_load_policy_worker_load_timings_reach_the_policy(tmp_path):
    """The worker side's tracer keeps each load's time; the scheduler side learns from them."""
    timings = LoadTimings(str(tmp_path / "w.jsonl"))
    timings("load", req="r1", tokens=1024, loaded_tokens=1024, failed_blocks=0, ms=12.5, lead_ms=4.0)
    timings("load", req="r2", tokens=2048, loaded_tokens=0, failed_blocks=64, ms=30000.0, reason="gateway_timeout")
    timings("store", req="r1", tokens=1024, ms=3.0)
    samples = timings.take()
    # a load line without a lead ran whole before the forward: all of it is lead
    assert samples == [LoadSample("r1", 1024, 12.5, True, 4.0), LoadSample("r2", 2048, 30000.0, False, 30000.0)]
    assert timings.take() == []
    assert len((tmp_path / "w.jsonl").read_text().splitlines()) == 3  # the trace is written as before
    policy, clock = _policy()
    policy.decide("r1", 2049, 0, 1024)
    policy.step_built(StepWork(1025, attention_pairs(1025, 1024), loads=True))
    clock.t += 0.05
    policy.step_ended(samples)
    assert policy.in_flight == {} and policy.load_estimator().count == 2 and policy.prefill.count == 0


def _load_steps(policy: LoadPolicy, clock: Clock, hidden: bool, n: int = 6, lead_share: float = 0.0) -> None:
    """Steps that each load 3072 tokens and compute the prompt's last 1025, timed as a step that
    runs them side by side (``hidden``) or one after the other would be; ``lead_share`` of each
    load comes before the forward can start (its fetch), in both."""
    fit = policy.prefill.fit()
    assert fit is not None
    for i in range(n):
        work = StepWork(1025, attention_pairs(1025, 3072), loads=True)
        compute = fit[0] + fit[1] * work.tokens + fit[2] * work.attention
        load = 0.02 * 3072
        lead = lead_share * load
        policy.step_built(work)
        clock.t += (lead + (max(compute, load - lead) if hidden else compute + load - lead)) / 1e3
        policy.step_ended([LoadSample(f"l{i}", 3072, load, lead_ms=lead)])


def test_load_policy_overlap_of_load_and_compute_is_learned_and_picks_a_prefix():
    policy, clock = _policy()
    _learn_prefill(policy, clock, per_token_ms=0.01, per_pair_ms=1e-6)
    _learn_loads(policy, clock, ms_per_token=0.02, latency_ms=0.0)
    assert policy.overlap == 1.0 and policy.decide("a", 4097, 0, 4096).reason == "recompute_faster"
    policy.finished("a")
    _load_steps(policy, clock, hidden=True)
    assert policy.overlap == pytest.approx(0.0, abs=0.02) and policy.overlap_samples == 6
    d = policy.decide("b", 4097, 0, 4096)
    assert d.reason == "prefix_faster" and 0 < d.tokens < 4096 and d.tokens % CHUNK == 0, d
    assert d.ttft_ms < policy.prefill.compute_ms(4097, 0)  # type: ignore[operator]
    # the prefix balances the two: its load and the compute of the rest take about as long
    load = 0.02 * d.tokens
    rest = policy.prefill.compute_ms(4097 - d.tokens, d.tokens)
    assert rest is not None and abs(load - rest) <= 0.02 * CHUNK + 1.0


def test_load_policy_loads_one_after_compute_keep_the_overlap_at_one():
    policy, clock = _policy()
    _learn_prefill(policy, clock, per_token_ms=0.01, per_pair_ms=1e-6)
    _learn_loads(policy, clock, ms_per_token=0.02, latency_ms=0.0)
    _load_steps(policy, clock, hidden=False)
    assert policy.overlap == pytest.approx(1.0, abs=0.02)
    assert policy.decide("b", 4097, 0, 4096).reason == "recompute_faster"


def test_load_policy_a_failed_load_costs_its_time_and_the_recompute():
    """A load that ran into a tier's deadline after 300 ms loaded nothing: the request waited and
    then computed it all. Measured so, a path whose loads fail is not chosen again."""
    policy, clock = _policy()
    _learn_prefill(policy, clock, per_token_ms=0.1)
    assert policy.decide("a", 1025, 0, 1024).reason == "cold_load"
    clock.t += 0.5
    policy.loads_ended([LoadSample("a", 1024, 60.0, ok=False)])  # faster than computing 1024 (~100 ms)
    d = policy.decide("b", 1025, 0, 1024)
    assert d.reason == "recompute_faster" and d.load_ms > 60.0 + 100.0  # type: ignore[operator]


def test_load_policy_a_load_whose_lead_nothing_hides_is_not_taken_for_a_prefix():
    """A slow link: most of each load is its fetch, which the forward waits for (the lead); only
    the opening of the layers runs beside the compute. Steps that show the part past the lead
    hidden teach an overlap of 0, and still no prefix is loaded: its fetch alone outlasts the
    compute it saves. The control: the same loads with no lead pick a prefix."""
    policy, clock = _policy()
    _learn_prefill(policy, clock, per_token_ms=0.01, per_pair_ms=1e-6)
    _load_steps(policy, clock, hidden=True, lead_share=0.7)
    assert policy.overlap == pytest.approx(0.0, abs=0.02) and policy.overlap_samples == 6
    lead = policy.lead_estimator().predict(4096)
    assert lead == pytest.approx(0.7 * 0.02 * 4096, rel=0.01)
    d = policy.decide("b", 4097, 0, 4096)
    assert (d.tokens, d.reason) == (0, "recompute_faster"), d
    control, clock2 = _policy()
    _learn_prefill(control, clock2, per_token_ms=0.01, per_pair_ms=1e-6)
    _load_steps(control, clock2, hidden=True, lead_share=0.0)
    d = control.decide("b", 4097, 0, 4096)
    assert d.reason == "prefix_faster" and 0 < d.tokens < 4096, d


def test_load_policy_a_fast_load_with_a_lead_still_loads_it_all():
    """A fast link: the lead (fetch) is small against the compute it saves, so the whole hit loads,
    and the expected time counts the lead before the compute of the prompt's last token."""
    policy, clock = _policy()
    _learn_prefill(policy, clock, per_token_ms=0.01, per_pair_ms=1e-6)
    for i in range(6):
        tokens = 512 * (1 + i % 4)
        clock.t += 0.2
        policy.loads_ended([LoadSample(f"m{i}", tokens, 0.001 * tokens, lead_ms=0.0005 * tokens)])
    d = policy.decide("a", 4097, 0, 4096)
    assert (d.tokens, d.reason) == (4096, "load_faster")
    rest = policy.prefill.compute_ms(1, 4096)
    assert rest is not None and d.ttft_ms == pytest.approx(0.0005 * 4096 + max(0.0005 * 4096, rest) + min(0.0005 * 4096, rest))


def test_load_policy_a_failed_load_is_all_lead():
    """A load that failed held the forward back until it ended: its time and the recompute after
    it are lead, whatever the worker measured as its first layer."""
    policy, clock = _policy()
    _learn_prefill(policy, clock, per_token_ms=0.1)
    policy.loads_ended([LoadSample("a", 1024, 60.0, ok=False, lead_ms=1.0)])
    assert policy.lead_estimator().predict(1024) == pytest.approx(policy.load_estimator().predict(1024))
