"""The connector's scheduler side: lookups, load and store plans, finished requests.

Pure bookkeeping: no vLLM, no torch, no I/O of its own; the one call out is the lookup, a function
handed in. What vLLM passes in is read by attribute (``request_view``, ``step_requests``), so a
test drives it with plain dataclasses of the same shape:
    matched_tokens(request, computed)   get_num_new_matched_tokens: a lookup of the prompt's full
                                        blocks, loadable up to the block before its last token; no
                                        capability: 0, no lookup; refused, outage or timeout: 0
                                        (a counted, logged miss)
    allocated(request, block_ids, n)    update_state_after_alloc: the blocks a hit loads into
    build(steps)                        build_connector_meta: per request one load and one store
    load_errors(invalid_block_ids)      update_connector_output: blocks whose load failed
    finished(req_id)                    request_finished: kv_transfer_params {"kvgate": ...} out
The rules (which loads and stores a step carries, where a failed load cuts a store) are
``ledger.SchedulerLedger``'s."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError
from gateway.vllm.counters import OK, ConnectorCounters
from gateway.vllm.ledger import LoadOp, SchedulerLedger, StepRequest, StoreOp
from gateway.vllm.logs import RateLimitedLogger, Tracer, miss_reason

__all__ = ["CAPABILITY_PARAM", "LookupFn", "RequestView", "SchedulerSide", "capability_of", "request_view", "step_requests"]

log = logging.getLogger("kvgate.vllm")
CAPABILITY_PARAM = "kvgate_capability"
MAX_CAPABILITY_CHARS = 8192

#: (capability, block-aligned prompt prefix) -> (hit tokens, degraded reason or ""); may raise
#: GatewayError or ValueError (refused, expired, unreachable: a miss)
LookupFn = Callable[[str, Sequence[int]], tuple[int, str]]


def capability_of(kv_transfer_params: Any) -> str | None:
    """The request's capability from its ``kv_transfer_params`` (set by the tenant middleware)."""
    cap = kv_transfer_params.get(CAPABILITY_PARAM) if isinstance(kv_transfer_params, Mapping) else None
    return cap if isinstance(cap, str) and 0 < len(cap) <= MAX_CAPABILITY_CHARS else None


@dataclass(frozen=True)
class RequestView:
    """What the scheduler side reads of a vLLM ``Request``."""

    req_id: str
    prompt: list[int]
    capability: str | None


def request_view(request: Any) -> RequestView:
    """A vLLM ``Request`` (request_id, prompt_token_ids, kv_transfer_params) as a RequestView."""
    return RequestView(
        request.request_id, list(request.prompt_token_ids or []),
        capability_of(getattr(request, "kv_transfer_params", None)),
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
        trace: Tracer | None = None, lookup_log_interval_s: float = 10.0,
    ) -> None:
        self.ledger = SchedulerLedger(chunk_tokens, block_size)
        self.block = block_size
        self._lookup = lookup
        self.stats = ConnectorCounters() if stats is None else stats
        self._trace = trace or Tracer(None)
        # an outage degrades every lookup: say so, not each one
        self._lookup_log = RateLimitedLogger(log, interval_s=lookup_log_interval_s)
        self._mismatch_said = False

    def matched_tokens(self, req: RequestView, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that kvgate can load (whole blocks)."""
        if req.capability is None or not req.prompt:
            return 0
        limit = self.ledger.lookup_limit(len(req.prompt))
        loadable = self.ledger.load_limit(len(req.prompt))
        if loadable <= num_computed_tokens:  # vLLM's own cache has all it could load: no lookup
            self.ledger.looked_up(req.req_id, num_computed_tokens)
            return 0
        t0 = time.perf_counter()
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
        return max(0, min(hit, loadable) - num_computed_tokens)

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
        hit = self.ledger.finished(req_id)
        return None if hit is None else {"kvgate": {"hit_tokens": hit}}
