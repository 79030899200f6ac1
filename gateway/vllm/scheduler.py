"""The connector's scheduler side: lookups, load and store plans, finished requests.

Pure bookkeeping on ``ledger.SchedulerLedger``'s rules (which loads and stores a step carries, where a
failed load cuts a store): no vLLM, no torch, no I/O but the lookup, a function handed in. What vLLM
passes in is read by attribute (``request_view``, ``step_requests``), so tests use plain dataclasses:
    matched_tokens(request, computed)   get_num_new_matched_tokens: a lookup of the prompt's full blocks,
                                        loadable up to the block before its last token (a hit: what
                                        ``policy`` loads); 0 with no capability (no lookup) or on a
                                        refusal, outage or timeout (a counted, logged miss)
    allocated(request, block_ids, n)    update_state_after_alloc: the blocks a hit loads into
    build(steps)                        build_connector_meta: per request one load and one store
    load_errors(invalid_block_ids)      update_connector_output: blocks whose load failed
    finish(req_id, params)              request_finished: kv_transfer_params {"kvgate": ...}; a producer's receipt
With a receipt (``handoff``), ``matched_tokens`` answers None (ask again) until its store is visible to
the request's own capability, at most the hand-off wait; another tenant's loads nothing, audited (``deny``).
A published prefix's warm-up (``kvgate_warm_up``: the prefix id, beside the scope's write capability)
reports the prompt's whole chunks (``report``) before its lookup, once per request; its store follows
the ordinary path, and the server takes only the chunks that report recorded. A request may name
its own load policy (``kvgate_load_policy``), which the tenant middleware never passes on."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args

from gateway.errors import GatewayError
from gateway.vllm.counters import OK, ConnectorCounters
from gateway.vllm.handoff import OTHER_OWNER, RECEIPT_PARAM, HandoffWaits, Receipt, check, epoch_of, owner_tag
from gateway.vllm.ledger import LoadOp, SchedulerLedger, StepRequest, StoreOp
from gateway.vllm.logs import RateLimitedLogger, Tracer, miss_reason
from gateway.vllm.policy import LoadPolicy, PolicyMode
from tenancy.errors import CapabilityDenied

__all__ = [
    "CAPABILITY_PARAM", "WARM_PARAM", "LookupFn", "ReportFn", "RequestView", "SchedulerSide", "capability_of",
    "request_view", "step_requests", "warm_up_of",
]

log = logging.getLogger("kvgate.vllm")
CAPABILITY_PARAM = "kvgate_capability"
WARM_PARAM = "kvgate_warm_up"  # a published prefix's id: this request is its warm-up
# this request's load_policy in place of the engine's; the tenant middleware drops it from a
# client's body, so only a caller that talks to the engine directly (a benchmark) sets it
POLICY_PARAM = "kvgate_load_policy"
MAX_CAPABILITY_CHARS = 8192
_PREFIX_ID = re.compile(r"[0-9a-f]{24}")

#: (capability, block-aligned prompt prefix) -> (hit tokens, degraded reason or ""); may raise
#: GatewayError or ValueError (refused, expired, unreachable: a miss)
LookupFn = Callable[[str, Sequence[int]], tuple[int, str]]
#: (capability, prefix id, prompt) -> chunks the server recorded; may raise GatewayError or ValueError
ReportFn = Callable[[str, str, Sequence[int]], int]


def capability_of(kv_transfer_params: Any) -> str | None:
    """The request's capability from its ``kv_transfer_params`` (set by the tenant middleware)."""
    cap = kv_transfer_params.get(CAPABILITY_PARAM) if isinstance(kv_transfer_params, Mapping) else None
    return cap if isinstance(cap, str) and 0 < len(cap) <= MAX_CAPABILITY_CHARS else None


def warm_up_of(kv_transfer_params: Any) -> str | None:
    """The published prefix a request warms up (its id), where it says so."""
    warm = kv_transfer_params.get(WARM_PARAM) if isinstance(kv_transfer_params, Mapping) else None
    return warm if isinstance(warm, str) and _PREFIX_ID.fullmatch(warm) else None


def load_policy_of(kv_transfer_params: Any) -> PolicyMode | None:
    """The request's own ``load_policy``, where it names one."""
    mode = kv_transfer_params.get(POLICY_PARAM) if isinstance(kv_transfer_params, Mapping) else None
    return mode if mode in get_args(PolicyMode) else None


@dataclass(frozen=True)
class RequestView:
    """What the scheduler side reads of a vLLM ``Request``."""

    req_id: str
    prompt: list[int]
    capability: str | None
    receipt: Any = None  # a producer's receipt, as the request carries it (not yet checked)
    epoch: int | None = None  # the namespace epoch the request's capability was minted at
    warm_up: str | None = None  # the published prefix this request warms up
    policy: PolicyMode | None = None  # the request's own load_policy (``POLICY_PARAM``)


def request_view(request: Any) -> RequestView:
    """A vLLM ``Request`` (request_id, prompt_token_ids, kv_transfer_params) as a RequestView."""
    params = getattr(request, "kv_transfer_params", None)
    receipt = params.get(RECEIPT_PARAM) if isinstance(params, Mapping) else None
    return RequestView(
        request.request_id, list(request.prompt_token_ids or []), capability_of(params), receipt, epoch_of(params),
        warm_up_of(params), load_policy_of(params),
    )


def step_requests(scheduler_output: Any, tracked: Callable[[str], bool]) -> list[StepRequest]:
    """vLLM's ``SchedulerOutput`` (new and cached requests of one step), flattened into the
    ledger's StepRequests for the requests ``tracked`` names (block ids of KV cache group 0)."""
    n_sched = scheduler_output.num_scheduled_tokens
    step = [
        StepRequest(new.req_id, new.num_computed_tokens, n_sched.get(new.req_id, 0), list(new.block_ids[0]), new=True)
        for new in scheduler_output.scheduled_new_reqs
        if tracked(new.req_id)
    ]
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        if not tracked(req_id):
            continue
        ids = cached.new_block_ids[i]
        step.append(StepRequest(
            req_id, cached.num_computed_tokens[i], n_sched.get(req_id, 0), list(ids[0]) if ids else [],
            resumed=req_id in cached.resumed_req_ids,
        ))
    return step


class SchedulerSide:
    def __init__(
        self, chunk_tokens: int, block_size: int, lookup: LookupFn, *, stats: ConnectorCounters | None = None,
        trace: Tracer | None = None, lookup_log_interval_s: float = 10.0, policy: LoadPolicy | None = None,
        loads: bool = True, stores: bool = True, receipts: bool = False, handoff: HandoffWaits | None = None,
        deny: Callable[[str, str, str], None] | None = None, report: ReportFn | None = None,
    ) -> None:
        """``loads``/``stores``: the role's (``handoff.roles``); ``receipts``: a producer's,
        every store is a hand-off; ``handoff``: waits for receipts; ``deny(capability, req_id,
        reason)``: audits a refused receipt; ``report``: a warm-up's chunk report."""
        self.ledger = SchedulerLedger(chunk_tokens, block_size, stores=stores, handoff=receipts)
        self.loads, self.stores, self.receipts = loads, stores, receipts
        self.handoff = handoff
        self._deny = deny
        self.policy = LoadPolicy("always", chunk_tokens) if policy is None else policy
        self.block = block_size
        self._lookup = lookup
        self.stats = ConnectorCounters() if stats is None else stats
        self._trace = trace or Tracer(None)
        # an outage degrades every lookup: say so, not each one
        self._lookup_log = RateLimitedLogger(log, interval_s=lookup_log_interval_s)
        self._mismatch_said = False
        self._report = report
        self._reported: set[str] = set()  # warm-ups whose chunks were reported (once per request)

    def matched_tokens(self, req: RequestView, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that kvgate can load (whole blocks); None: not
        known yet (a receipt's store is not visible yet), vLLM asks again at a later step."""
        if req.capability is None or not req.prompt:
            return 0
        if req.warm_up is not None and self.stores:
            self._warm_up(req)
        if not self.loads:
            return 0
        limit = self.ledger.lookup_limit(len(req.prompt))
        loadable = self.ledger.load_limit(len(req.prompt))
        if loadable <= num_computed_tokens:  # vLLM's own cache has all it could load: no lookup
            self.ledger.looked_up(req.req_id, num_computed_tokens)
            return 0
        t0 = time.perf_counter()
        waited = self._receipt(req, limit) if req.receipt is not None and self.handoff is not None else False
        if waited is None:
            return None
        if isinstance(waited, tuple):
            hit, reason = waited
        else:
            try:
                hit, reason = self._lookup(req.capability, req.prompt[:limit])
            except (GatewayError, ValueError) as exc:  # refused, expired, unreachable: a miss
                hit, reason = 0, miss_reason(exc)
                self._state_mismatch(exc)
        self.stats.count("lookup", reason or OK)
        self.stats.tokens("lookup_hit", hit)
        if reason:
            self._lookup_log.warning("kvgate lookup for %s degraded to %d hit tokens: %s", req.req_id, hit, reason)
        self._trace("lookup", req=req.req_id, hit_tokens=hit, reason=reason, ms=(time.perf_counter() - t0) * 1e3)
        hit -= hit % self.block
        self.ledger.looked_up(req.req_id, num_computed_tokens, hit)
        n = max(0, min(hit, loadable) - num_computed_tokens)
        return self._decide(req, num_computed_tokens, n) if n else 0

    def _warm_up(self, req: RequestView) -> None:
        """Report the chunks a warm-up is about to store, once per request; a refusal or an
        outage is counted and logged (the server then takes none of its puts)."""
        if req.req_id in self._reported or req.capability is None or req.warm_up is None:
            return
        self._reported.add(req.req_id)
        if self._report is None:
            self.stats.count("warm_report", "unsupported")
            return
        try:
            recorded, reason = self._report(req.capability, req.warm_up, req.prompt), ""
        except (GatewayError, ValueError) as exc:
            recorded, reason = 0, miss_reason(exc)
            log.warning("kvgate warm-up report for prefix %s (%s) failed: %s", req.warm_up, req.req_id, reason)
        self.stats.count("warm_report", reason or OK)
        self._trace("warm_report", req=req.req_id, prefix=req.warm_up, recorded=recorded, reason=reason)

    def _decide(self, req: RequestView, num_computed_tokens: int, hit: int) -> int:
        """Of ``hit`` loadable tokens, those the policy loads; the choice traced and counted."""
        d = self.policy.decide(req.req_id, len(req.prompt), num_computed_tokens, hit, req.policy)
        self.stats.count("decision", d.reason)
        self.stats.tokens("declined", hit - d.tokens)
        self._trace("decision", req=req.req_id, hit_tokens=hit, **d.trace_fields())
        return d.tokens

    def _receipt(self, req: RequestView, limit: int) -> tuple[int, str] | bool | None:
        """A request that carries a receipt: None while its store is not visible (and the wait
        has time left), (hit, reason) once it is or the wait is over; False: the receipt is not
        waited for (malformed, stale epoch), an ordinary lookup follows; a receipt of another
        tenant: (0, its reason), nothing is loaded and the denial is audited."""
        assert self.handoff is not None and req.capability is not None
        receipt, why = check(req.receipt, req.capability, req.epoch)
        if receipt is None:
            self._handoff_outcome(req, why, 0, 0.0)
            if why != OTHER_OWNER:
                return False
            if self._deny is not None:
                self._deny(req.capability, req.req_id, why)
            return 0, why
        first = not self.handoff.waiting(req.req_id)
        got = self.handoff.poll(req.req_id, req.capability, req.prompt[:limit], min(receipt.tokens, limit))
        if got is None:
            if first:
                self._trace("handoff_wait", req=req.req_id, tokens=receipt.tokens, store=receipt.store_id)
            return None
        hit, late, lookup_reason, waited_s = got
        self._handoff_outcome(req, late, hit, waited_s, lookup_reason)
        return hit, lookup_reason

    def _handoff_outcome(self, req: RequestView, reason: str, hit: int, waited_s: float, detail: str = "") -> None:
        """Count, trace and (when it falls short) log what became of a request's receipt."""
        self.stats.count("handoff", reason or OK)
        self._trace("handoff", req=req.req_id, hit_tokens=hit, reason=reason, detail=detail, ms=waited_s * 1e3)
        if reason:
            self._lookup_log.warning(
                "kvgate hand-off for %s falls back to recompute (%s%s); %d tokens loadable",
                req.req_id, reason, f": {detail}" if detail else "", hit,
            )

    def _state_mismatch(self, exc: BaseException) -> None:
        """A capability whose MAC does not verify here was minted against other kvgate state:
        say so once, loudly, with the fix (every request of that deployment is a miss)."""
        if self._mismatch_said or getattr(exc, "reason", None) not in ("bad tag", "bad key id"):
            return
        self._mismatch_said = True
        log.error(
            "kvgate: a capability from this engine's requests does not verify against the connector's "
            "kvgate state, so every request is a miss. The connector (embedded mode) and whoever mints "
            "capabilities (the middleware or `kvgate serve`) must share one database and state directory "
            "(KVGATE_DATABASE_URL, KVGATE_STATE_DIR), or use remote mode."
        )

    def allocated(self, req: RequestView, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated blocks for ``req``; ``num_external_tokens`` of them come from kvgate."""
        if req.capability is None:
            return
        blocks = list(block_ids) if num_external_tokens > 0 else []
        self.ledger.allocated(req.req_id, req.capability, req.prompt, blocks, num_external_tokens)

    def tracked(self, req_id: str) -> bool:
        return self.ledger.tracked(req_id)

    def build(self, step: Iterable[StepRequest]) -> tuple[list[LoadOp], list[StoreOp]]:
        """This step's loads and stores (the connector metadata the workers receive)."""
        return self.ledger.build(step)

    def load_errors(self, invalid_block_ids: Iterable[int]) -> set[str]:
        """vLLM's report of the step: blocks whose load failed keep their requests from storing
        them (and anything after them) at any later step; the requests so cut."""
        bad = list(invalid_block_ids)
        hit = self.ledger.load_errors(bad)
        if hit:
            self._trace("load_errors_reported", reqs=sorted(hit), blocks=len(bad))
        return hit

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """Forget the request; the kv_transfer_params it returns (None if kvgate never tracked it)."""
        return self.finish(req_id)[1]

    def finish(self, req_id: str, kv_transfer_params: Any = None) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request: (whether its blocks wait for a hand-off store, the kv_transfer_params
        it returns, with a producer's receipt)."""
        if self.handoff is not None:
            self.handoff.forget(req_id)
        self._reported.discard(req_id)
        store = self.ledger.handoff_store(req_id) if self.receipts else None
        hit = self.ledger.finished(req_id)
        self.policy.finished(req_id)
        if hit is None:
            return False, None
        params: dict[str, Any] = {"kvgate": {"hit_tokens": hit}}
        if store is None:
            return False, params
        store_id, capability, tokens = store
        try:
            owner = owner_tag(capability)
        except CapabilityDenied:  # a token that does not parse stored nothing: no receipt
            return True, params
        receipt = Receipt(store_id, owner, -(-tokens // self.ledger.chunk), tokens, epoch_of(kv_transfer_params))
        params[RECEIPT_PARAM] = receipt.params()
        self._trace("receipt", req=req_id, store=store_id, tokens=tokens)
        return True, params
