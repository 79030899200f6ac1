"""Load or recompute: how many of a hit's tokens the scheduler side loads, from measured costs.

    LoadEstimator     a load's time as ``latency + tokens x cost``: a weighted least-squares fit over
                      one path's (mode's) recent measured loads, newest weighing most; its residuals' spread.
                      Two per path: the whole load, and its lead (the time before the forward can
                      use any of it: the fetch of every chunk and the opening of their first layers)
    PrefillEstimator  this engine's step time as ``a + b x tokens + c x attention`` (query x context
                      pairs), fit over its recent steps that carried no load
    LoadPolicy        per hit, the prefix to load (none, whole chunks, or all of it) with the least
                      expected time to first token: its lead, then the rest of its load (behind those in
                      flight) beside the compute of the prompt's rest, combined by a learned ``overlap``;
                      ``always`` loads all, ``recompute`` none
    LoadTimings       the worker side's ``Tracer`` that also keeps each load's measured time for the
                      scheduler side (vLLM carries it back as worker metadata)
Cold start: a hit loads until both estimators have a measurement. While the policy recomputes, a
probe loads one chunk of a hit now and then, within ``probe_budget``, so that a tier that recovers
is seen again. The model's terms, the overlap and the probes' schedule: docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.vllm.logs import Tracer

__all__ = [
    "Decision", "LoadEstimator", "LoadPolicy", "LoadSample", "LoadTimings", "PolicyMode", "PrefillEstimator",
    "StepWork", "step_work",
]

PolicyMode = Literal["always", "adaptive", "recompute"]
Clock = Callable[[], float]
Fit = tuple[float, float, float] | None  # a LoadEstimator's (latency ms, ms per token, spread ms)


@dataclass(frozen=True)
class LoadSample:
    """One load a worker ran: the tokens it fetched (or tried to), how long it took, its outcome,
    and of its time the lead: until the forward could use the first of it. A load that ends
    before the forward starts is all lead; a layer-wise load's lead ends when its first layer is
    in place (every chunk fetched by then). 0 where the worker does not say."""

    req_id: str
    tokens: int
    ms: float
    ok: bool = True
    lead_ms: float = 0.0


@dataclass(frozen=True)
class StepWork:
    """What one engine step computed: tokens, attention pairs (query x context), and whether it
    carried a load (its time then includes the load's)."""

    tokens: int
    attention: float
    loads: bool = False


def attention_pairs(n: int, context: int) -> float:
    """Query x key pairs of computing ``n`` tokens after ``context`` tokens (causal)."""
    return n * context + n * (n + 1) / 2


def step_work(scheduler_output: Any, loads: bool = False) -> StepWork:
    """vLLM's ``SchedulerOutput`` as the work the step computes (every request it scheduled)."""
    n_sched: dict[str, int] = scheduler_output.num_scheduled_tokens
    tokens, attn = 0, 0.0
    for new in scheduler_output.scheduled_new_reqs:
        n = n_sched.get(new.req_id, 0)
        tokens, attn = tokens + n, attn + attention_pairs(n, new.num_computed_tokens)
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        n = n_sched.get(req_id, 0)
        tokens, attn = tokens + n, attn + attention_pairs(n, cached.num_computed_tokens[i])
    return StepWork(tokens, attn, loads)


def _weights(times: Sequence[float], now: float, half_life_s: float, half_life_n: float) -> list[float]:
    """Newest last: a sample's weight halves every ``half_life_s`` of age and every
    ``half_life_n`` newer samples."""
    last = len(times) - 1
    return [0.5 ** (max(0.0, now - t) / half_life_s + (last - i) / half_life_n) for i, t in enumerate(times)]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None if (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    tiny = 1e-9 * max(abs(a[i][i]) for i in range(n))
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= tiny:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _nonneg_fit(xs: Sequence[Sequence[float]], ys: Sequence[float], ws: Sequence[float]) -> list[float]:
    """Weighted least squares ``y ~ x . coef`` with every coefficient >= 0: a feature whose
    coefficient comes out negative (or that the samples cannot tell apart) is dropped, the last
    ones first, and the fit repeated without it."""
    k = len(xs[0])
    active = list(range(k))
    while active:
        scale = [max(1e-12, max(abs(x[j]) for x in xs)) for j in active]
        ata = [[0.0] * len(active) for _ in active]
        aty = [0.0] * len(active)
        for x, y, w in zip(xs, ys, ws, strict=True):
            v = [x[j] / s for j, s in zip(active, scale, strict=True)]
            for p in range(len(active)):
                aty[p] += w * v[p] * y
                for q in range(len(active)):
                    ata[p][q] += w * v[p] * v[q]
        sol = _solve(ata, aty)
        if sol is not None and all(c >= 0 for c in sol):
            coef = [0.0] * k
            for j, c, s in zip(active, sol, scale, strict=True):
                coef[j] = c / s
            return coef
        negative = [p for p, c in enumerate(sol) if c < 0] if sol is not None else []
        active.pop(negative[-1] if negative else len(active) - 1)
    return [0.0] * k


class LoadEstimator:
    """A path's load time (ms) as ``latency + tokens x ms_per_token``, from its recent loads."""

    def __init__(self, *, window: int = 32, half_life_s: float = 5.0, half_life_n: float = 6.0,
                 clock: Clock = time.monotonic) -> None:
        self._samples: deque[tuple[float, int, float]] = deque(maxlen=window)  # (t, tokens, ms)
        self.half_life_s, self.half_life_n = half_life_s, half_life_n
        self._clock = clock
        self._off = 0  # the last load's direction off its prediction (1 slower, -1 faster)

    def observe(self, tokens: int, ms: float) -> int:
        """Add a measured load. Returns 1 (-1) where it took over twice (under half) the time
        predicted; a second such load in a row in the same direction is a change of the path:
        the fit then starts again from those two."""
        if not (tokens > 0 and ms >= 0 and math.isfinite(ms)):
            return 0
        pred = self.predict(tokens)
        off = 0 if pred is None or pred <= 0 else 1 if ms > 2 * pred else -1 if ms < pred / 2 else 0
        self._samples.append((self._clock(), tokens, ms))
        if off and off == self._off:
            for _ in range(len(self._samples) - 2):
                self._samples.popleft()
            self._off = 0
        else:
            self._off = off
        return off

    @property
    def count(self) -> int:
        return len(self._samples)

    def age_s(self) -> float:
        """Seconds since the newest measurement (infinite with none)."""
        return self._clock() - self._samples[-1][0] if self._samples else math.inf

    def fit(self) -> tuple[float, float, float] | None:
        """(latency ms, ms per token, spread ms), or None with no measurement. With loads of one
        size only the latency cannot be told apart: it is folded into the per-token cost."""
        if not self._samples:
            return None
        ts, ns, ms = zip(*self._samples, strict=True)
        ws = _weights(ts, self._clock(), self.half_life_s, self.half_life_n)
        lat, per = _nonneg_fit([(1.0, float(n)) for n in ns], ms, ws)
        if per <= 0:  # one size, or slower for less: all of it per token
            lat, per = 0.0, sum(w * m for w, m in zip(ws, ms, strict=True)) / sum(w * n for w, n in zip(ws, ns, strict=True))
        resid = sum(w * (m - lat - per * n) ** 2 for w, m, n in zip(ws, ms, ns, strict=True)) / sum(ws)
        return lat, per, math.sqrt(resid)

    def predict(self, tokens: int) -> float | None:
        f = self.fit()
        return None if f is None else f[0] + f[1] * tokens


class PrefillEstimator:
    """This engine's step time (ms) from the work of its recent steps without loads."""

    def __init__(self, *, window: int = 64, half_life_s: float = 60.0, half_life_n: float = 24.0,
                 clock: Clock = time.monotonic) -> None:
        self._samples: deque[tuple[float, int, float, float]] = deque(maxlen=window)  # (t, tokens, attn, ms)
        self.half_life_s, self.half_life_n = half_life_s, half_life_n
        self._clock = clock
        self._coef: tuple[float, float, float] | None = None

    def observe(self, work: StepWork, ms: float) -> None:
        if work.loads or work.tokens <= 0 or not (ms >= 0 and math.isfinite(ms)):
            return
        self._samples.append((self._clock(), work.tokens, work.attention, ms))
        self._coef = None

    @property
    def count(self) -> int:
        return len(self._samples)

    def fit(self) -> tuple[float, float, float] | None:
        """(ms per step, ms per token, ms per attention pair), or None with no measurement."""
        if not self._samples:
            return None
        if self._coef is None:
            ts, ns, attn, ms = zip(*self._samples, strict=True)
            ws = _weights(ts, self._clock(), self.half_life_s, self.half_life_n)
            a, b, c = _nonneg_fit([(1.0, float(n), x) for n, x in zip(ns, attn, strict=True)], ms, ws)
            if b == 0 and c == 0:  # one size of step only: its time is all per token
                a, b = 0.0, sum(w * m for w, m in zip(ws, ms, strict=True)) / sum(w * n for w, n in zip(ws, ns, strict=True))
            self._coef = (a, b, c)
        return self._coef

    def compute_ms(self, n: int, context: int) -> float | None:
        """The time computing ``n`` prompt tokens after ``context`` adds to a step."""
        f = self.fit()
        return None if f is None else f[1] * n + f[2] * attention_pairs(n, context)


@dataclass(frozen=True)
class Decision:
    tokens: int  # hit tokens to load (beyond what the engine computed itself)
    reason: str  # always, recompute, cold_load, cold_prefill, probe, load_faster, prefix_faster, recompute_faster
    load_ms: float | None = None  # expected load time of the whole hit (behind the loads in flight)
    load_spread_ms: float | None = None
    recompute_ms: float | None = None  # expected time to compute the hit's tokens instead
    ttft_ms: float | None = None  # expected load plus compute of the prompt, for the tokens chosen
    lead_ms: float | None = None  # of load_ms, the part the forward waits for before it can use any

    def trace_fields(self) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 3)

        return {"tokens": self.tokens, "reason": self.reason, "est_load_ms": r(self.load_ms),
                "est_load_spread_ms": r(self.load_spread_ms), "est_recompute_ms": r(self.recompute_ms),
                "est_ttft_ms": r(self.ttft_ms), "est_lead_ms": r(self.lead_ms)}


class LoadPolicy:
    """The decision and the measurements it is made from (one per scheduler side)."""

    def __init__(
        self, mode: PolicyMode, chunk_tokens: int, path: str = "", *, probe_s: float = 1.0, probe_max_s: float = 8.0,
        probe_budget: float = 0.05, clock: Clock = time.monotonic,
    ) -> None:
        self.mode, self.chunk, self.path = mode, chunk_tokens, path
        self._clock = clock
        self.loads: dict[str, LoadEstimator] = {}
        self.leads: dict[str, LoadEstimator] = {}
        self.prefill = PrefillEstimator(clock=clock)
        self.in_flight: dict[str, int] = {}  # req id -> tokens decided to load, not yet reported
        self.probe_s, self.probe_max_s = probe_s, probe_max_s
        self._probe_every = probe_s
        self._last_probe = -math.inf
        self._doubt = False  # a load ran under half its predicted time: probe again at once
        self.probe_budget = probe_budget
        self._credit_ms = 0.0  # what probes may still add: probe_budget x recompute time, less probes' cost
        self._steps: deque[tuple[float, StepWork]] = deque(maxlen=8)  # built, output not yet seen
        self._last_end = -math.inf
        self.overlap = 1.0  # the share of the shorter of load and compute a step adds (1 until measured)
        self.overlap_samples = 0

    def load_estimator(self, path: str | None = None) -> LoadEstimator:
        """The path's whole loads."""
        return self._estimator(self.loads, path)

    def lead_estimator(self, path: str | None = None) -> LoadEstimator:
        """The path's loads' leads: the part of a load that no compute of the step hides."""
        return self._estimator(self.leads, path)

    def _estimator(self, table: dict[str, LoadEstimator], path: str | None) -> LoadEstimator:
        key = self.path if path is None else path
        est = table.get(key)
        if est is None:
            est = table[key] = LoadEstimator(clock=self._clock)
        return est

    # -- the decision -------------------------------------------------------------------------
    def decide(self, req_id: str, prompt_len: int, computed: int, hit: int, mode: PolicyMode | None = None) -> Decision:
        """Of ``hit`` tokens after the ``computed`` the engine has, how many to load (``mode``: the
        request's own, in place of the engine's)."""
        self.in_flight.pop(req_id, None)  # asked again (not allocated last time): decided anew
        # each fit once per decision (the clock, which weighs the samples, stands still in it)
        fits = self.load_estimator().fit(), self.lead_estimator().fit()
        d = self._decide(req_id, prompt_len, computed, hit, mode or self.mode, fits)
        if fits[1] is not None and d.load_ms is not None:
            lead = fits[1][0] + fits[1][1] * (hit + sum(self.in_flight.values()))
            d = dataclasses.replace(d, lead_ms=min(lead, d.load_ms))
        if d.tokens > 0:
            self.in_flight[req_id] = d.tokens
        return d

    def _decide(self, req_id: str, prompt_len: int, computed: int, hit: int, mode: PolicyMode, fits: tuple[Fit, Fit]) -> Decision:
        if hit <= 0 or mode == "recompute":
            return Decision(0, "recompute")
        est = self.load_estimator()
        (load_fit, lead_fit), queued = fits, sum(self.in_flight.values())
        full = computed + hit
        c0, c_full = self.prefill.compute_ms(prompt_len - computed, computed), self.prefill.compute_ms(prompt_len - full, full)
        recompute = None if c0 is None or c_full is None else c0 - c_full
        load = spread = None
        if load_fit is not None:
            load, spread = load_fit[0] + load_fit[1] * (hit + queued), load_fit[2]
        if mode == "always":
            whole = None if load is None or c_full is None else self._expect(load_fit, lead_fit, hit + queued, c_full)
            return Decision(hit, "always", load, spread, recompute, whole)
        if load_fit is None:
            return Decision(hit, "cold_load", load, spread, recompute)
        if c0 is None:
            return Decision(hit, "cold_prefill", load, spread, recompute)

        def ttft(k: int) -> float:  # load k hit tokens (behind those queued), compute the rest
            rest = self.prefill.compute_ms(prompt_len - computed - k, computed + k) or 0.0
            return self._expect(load_fit, lead_fit, k + queued, rest)

        best, best_ms = 0, c0
        ends = sorted({*range(self.chunk - computed % self.chunk, hit, self.chunk), hit})
        for k in ends:  # a prefix ends on a chunk boundary (or the hit's end)
            ms = ttft(k)
            if ms < best_ms:
                best, best_ms = k, ms
        now = self._clock()
        if best == 0:
            self._credit_ms += self.probe_budget * (recompute or 0.0)
            k = ends[0]
            ms = ttft(k)
            due = est.age_s() >= self._probe_every and now - self._last_probe >= self._probe_every
            if self._doubt or (due and ms - best_ms <= self._credit_ms):
                self._last_probe, self._doubt = now, False
                self._probe_every = min(self.probe_max_s, self._probe_every * 2)
                self._credit_ms = max(0.0, self._credit_ms - (ms - best_ms))
                return Decision(k, "probe", load, spread, recompute, ms)
            return Decision(0, "recompute_faster", load, spread, recompute, best_ms)
        self._probe_every = self.probe_s
        return Decision(best, "load_faster" if best == hit else "prefix_faster", load, spread, recompute, best_ms)

    def _expect(self, load_fit: Fit, lead_fit: Fit, tokens: int, compute_ms: float) -> float:
        """The expected time of a step that loads ``tokens`` and computes ``compute_ms``: the
        load's lead first (the forward waits for it), then the rest of the load beside the
        compute."""
        if load_fit is None:
            return compute_ms
        load = load_fit[0] + load_fit[1] * tokens
        lead = 0.0 if lead_fit is None else min(load, lead_fit[0] + lead_fit[1] * tokens)
        return lead + self._together(load - lead, compute_ms)

    def _together(self, load_ms: float, compute_ms: float) -> float:
        """A step's expected time for a load and a compute: the longer, and the share of the
        shorter that the step does not hide."""
        return max(load_ms, compute_ms) + self.overlap * min(load_ms, compute_ms)

    # -- measurements -------------------------------------------------------------------------
    def step_built(self, work: StepWork) -> None:
        """build_connector_meta: a step that the engine runs next."""
        if work.tokens > 0:
            self._steps.append((self._clock(), work))

    def step_ended(self, samples: Iterable[LoadSample] = ()) -> None:
        """update_connector_output: the oldest built step ended, with the workers' loads. Its
        time runs from when it could start (built, and the step before it ended) to now."""
        now = self._clock()
        samples = list(samples)
        if self._steps:
            built, work = self._steps.popleft()
            ms = (now - max(built, self._last_end)) * 1e3
            if work.loads:
                self._learn_overlap(work, ms, samples)
            else:
                self.prefill.observe(work, ms)
        self._last_end = now
        self.loads_ended(samples)

    def _learn_overlap(self, work: StepWork, ms: float, samples: list[LoadSample]) -> None:
        """From a step that carried loads: how much of the shorter of its load past the lead (each
        request's loads one after another; a request's workers side by side) and its predicted
        compute it added beyond the lead and the longer. Steps where the shorter is under a tenth
        of the step tell nothing."""
        per_req: dict[str, tuple[float, float]] = {}
        for s in samples:
            was = per_req.get(s.req_id, (0.0, 0.0))
            per_req[s.req_id] = (max(was[0], s.ms), max(was[1], min(s.ms, s.lead_ms)))
        load, lead, fit = sum(v[0] for v in per_req.values()), sum(v[1] for v in per_req.values()), self.prefill.fit()
        if load <= 0 or fit is None:
            return
        compute = fit[0] + fit[1] * work.tokens + fit[2] * work.attention
        short, long = min(load - lead, compute), max(load - lead, compute)
        if short < 0.1 * ms:
            return
        share = min(1.0, max(0.0, (ms - lead - long) / short))
        self.overlap = share if self.overlap_samples == 0 else 0.7 * self.overlap + 0.3 * share
        self.overlap_samples += 1

    def loads_ended(self, samples: Iterable[LoadSample]) -> None:
        """The workers' loads. A load that failed (a tier past its deadline, a chunk gone) cost
        its time and then the recompute of what it was to load: that is its measurement."""
        est, leads = self.load_estimator(), self.lead_estimator()
        for s in samples:
            self.in_flight.pop(s.req_id, None)
            # a failed load held the forward back to its end: all of it, and the recompute, is lead
            ms = s.ms if s.ok else s.ms + (self.prefill.compute_ms(s.tokens, 0) or 0.0)
            leads.observe(s.tokens, min(ms, s.lead_ms) if s.ok else ms)
            if est.observe(s.tokens, ms) < 0:
                self._doubt, self._probe_every = True, self.probe_s

    def finished(self, req_id: str) -> None:
        self.in_flight.pop(req_id, None)


class LoadTimings(Tracer):
    """The worker side's tracer: every line as ``Tracer`` writes it, and each ``load`` line's
    tokens and time kept for ``take`` (the scheduler side's load measurements)."""

    def __init__(self, path: str | None) -> None:
        super().__init__(path)
        self._lock = threading.Lock()
        self._samples: list[LoadSample] = []

    def __call__(self, event: str, **fields: Any) -> None:
        if event == "load":
            failed = bool(fields.get("failed_blocks"))
            tokens = int(fields.get("tokens" if failed else "loaded_tokens") or 0)
            ms = float(fields.get("ms", 0.0))  # a load that says no lead ran whole before the forward
            sample = LoadSample(str(fields.get("req", "")), tokens, ms, not failed, float(fields.get("lead_ms", ms)))
            with self._lock:
                self._samples.append(sample)
        super().__call__(event, **fields)

    def take(self) -> list[LoadSample]:
        with self._lock:
            out, self._samples = self._samples, []
        return out
