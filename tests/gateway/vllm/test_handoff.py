"""Prefill/decode hand-off without vLLM (gateway/vllm/handoff.py, the scheduler side's receipts
and waits, the ledger's producer stores). The engine tests are tests/engine/test_disagg.py."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import pytest

from gateway.vllm.handoff import (
    LATE,
    MALFORMED,
    OTHER_OWNER,
    RECEIPT_PARAM,
    STALE_EPOCH,
    HandoffStores,
    HandoffWaits,
    Receipt,
    ReceiptInvalid,
    check,
    owner_tag,
    roles,
)
from gateway.vllm.ledger import SchedulerLedger, StepRequest
from gateway.vllm.scheduler import RequestView, SchedulerSide
from tenancy.capabilities import CapabilityAuthority

CHUNK, BLOCK = 64, 16
PROMPT = list(range(1000, 1150))  # 150 tokens: 9 full blocks (144), a load may fill 144
AUTH = CapabilityAuthority({"k1": b"k" * 32}, current_kid="k1")
CAP_A = AUTH.mint("acme", "default", ["lookup", "get", "put"], 600)
CAP_A2 = AUTH.mint("acme", "default", ["lookup", "get"], 600)  # another mint, same tenant and namespace
CAP_B = AUTH.mint("globex", "default", ["lookup", "get", "put"], 600)
CAP_A_OTHER_NS = AUTH.mint("acme", "staging", ["lookup", "get", "put"], 600)


def test_roles_follow_kv_role():
    assert roles("kv_producer") == (False, True)
    assert roles("kv_producer", producer_loads=True) == (True, True)
    assert roles("kv_consumer") == (True, False)
    assert roles("kv_consumer", consumer_stores=True) == (True, True)
    assert roles("kv_both") == (True, True) and roles(None) == (True, True)


def test_owner_tag_binds_tenant_and_namespace_not_the_mint():
    assert owner_tag(CAP_A) == owner_tag(CAP_A2)
    assert owner_tag(CAP_A) != owner_tag(CAP_B)
    assert owner_tag(CAP_A) != owner_tag(CAP_A_OTHER_NS)


def _receipt(cap: str = CAP_A, epoch: int | None = 3, tokens: int = 144) -> dict:
    return Receipt("ab" * 16, owner_tag(cap), 3, tokens, epoch).params()


@pytest.mark.parametrize("doc", [
    None, "x", [], {}, {"store": "ab" * 16},
    {"store": "AB" * 16, "owner": "cd" * 16, "chunks": 1, "tokens": 16},  # not lowercase hex
    {"store": "ab" * 16, "owner": "cd" * 16, "chunks": 0, "tokens": 16},
    {"store": "ab" * 16, "owner": "cd" * 16, "chunks": 1, "tokens": True},
    {"store": "ab" * 16, "owner": "cd" * 16, "chunks": 1, "tokens": 16, "epoch": -1},
    {"store": "ab" * 16, "owner": "cd" * 16, "chunks": 1, "tokens": 16, "capability": CAP_A},  # unknown key
])
def test_a_malformed_receipt_is_refused_with_a_typed_error(doc):
    with pytest.raises(ReceiptInvalid):
        Receipt.parse(doc)
    assert check(doc, CAP_A, 3) == (None, MALFORMED)


def test_check_tells_own_other_and_stale_receipts_apart():
    receipt, why = check(_receipt(), CAP_A2, 3)  # positive control: same tenant, another mint
    assert why == "" and receipt is not None and receipt.tokens == 144
    assert check(_receipt(), CAP_B, 3) == (None, OTHER_OWNER)
    assert check(_receipt(), CAP_A_OTHER_NS, 3) == (None, OTHER_OWNER)
    assert check(_receipt(), CAP_A, 4) == (None, STALE_EPOCH)
    assert check(_receipt(epoch=None), CAP_A, 4)[1] == ""  # no epoch on one side: not compared
    assert check(_receipt(), "not a capability", 3) == (None, MALFORMED)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Lookups:
    """Lookups the test answers by hand: each submitted one is a pending future."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, list[int], Future]] = []

    def __call__(self, cap: str, tokens: Sequence[int]) -> Future:
        f: Future = Future()
        self.pending.append((cap, list(tokens), f))
        return f


def test_a_wait_polls_without_blocking_until_the_store_is_visible():
    clock, lookups = Clock(), Lookups()
    waits = HandoffWaits(lookups, wait_s=5.0, poll_s=0.1, clock=clock)
    assert waits.poll("r1", CAP_A, PROMPT[:144], 144) is None  # first lookup submitted
    assert len(lookups.pending) == 1 and lookups.pending[0][0] == CAP_A
    assert waits.poll("r1", CAP_A, PROMPT[:144], 144) is None  # still pending: no second lookup
    assert len(lookups.pending) == 1
    lookups.pending[0][2].set_result((64, ""))  # the store is half written
    clock.t += 0.05
    assert waits.poll("r1", CAP_A, PROMPT[:144], 144) is None  # not yet visible, not yet time to poll
    assert len(lookups.pending) == 1
    clock.t += 0.1
    assert waits.poll("r1", CAP_A, PROMPT[:144], 144) is None
    assert len(lookups.pending) == 2
    lookups.pending[1][2].set_result((144, ""))
    assert waits.poll("r1", CAP_A, PROMPT[:144], 144) == (144, "", "", pytest.approx(0.15))
    assert not waits.waiting("r1")


def test_a_late_receipt_ends_the_wait_with_what_was_visible():
    clock, lookups = Clock(), Lookups()
    waits = HandoffWaits(lookups, wait_s=1.0, poll_s=0.1, clock=clock)
    assert waits.poll("r1", CAP_A, PROMPT[:144], 144) is None
    lookups.pending[0][2].set_result((64, "tier_timeout"))
    clock.t += 0.5
    assert waits.poll("r1", CAP_A, PROMPT[:144], 144) is None
    clock.t += 0.6  # the second lookup never answers (a stalled tier)
    assert waits.poll("r1", CAP_A, PROMPT[:144], 144) == (64, LATE, "tier_timeout", pytest.approx(1.1))


def test_a_failing_lookup_is_not_visible_and_the_wait_stays_bounded():
    clock, lookups = Clock(), Lookups()
    waits = HandoffWaits(lookups, wait_s=0.3, poll_s=0.1, clock=clock)
    assert waits.poll("r1", CAP_A, PROMPT[:144], 144) is None
    lookups.pending[0][2].set_exception(ValueError("bad tokens"))
    clock.t += 0.31
    assert waits.poll("r1", CAP_A, PROMPT[:144], 144) == (0, LATE, "invalid_request", pytest.approx(0.31))


def test_handoff_stores_report_only_finished_requests_whose_store_ended():
    stores = HandoffStores()
    slow: Future = Future()
    stores.submitted("a", slow)
    stores.submitted("b", None)  # nothing was stored: its blocks need not wait
    assert stores.durable(set()) == set()  # vLLM has not finished them yet
    assert stores.durable({"a", "b", "other"}) == {"b"}
    assert stores.durable(set()) == set()
    slow.set_result(None)
    assert stores.durable(set()) == {"a"}  # remembered as finished at an earlier step
    assert len(stores) == 0


# -- the ledger and the scheduler side in a role ----------------------------------------------
def _built(ledger: SchedulerLedger, req_id: str, covered: int = 0) -> list:
    ledger.looked_up(req_id, covered, 0)
    ledger.allocated(req_id, CAP_A, PROMPT, list(range(10)), 0)
    return ledger.build([StepRequest(req_id, covered, len(PROMPT) - covered, list(range(10)), new=True)])[1]


def test_a_producer_stores_every_full_block_even_what_its_own_cache_held():
    plain = SchedulerLedger(CHUNK, BLOCK)
    assert _built(plain, "r", covered=144) == []  # kv_both: vLLM's cache held all: nothing new
    producer = SchedulerLedger(CHUNK, BLOCK, handoff=True)
    (op,) = _built(producer, "r", covered=144)
    assert len(op.tokens) == 144 and len(op.store_id) == 32  # the last chunk is partial (16 of 64)
    assert producer.handoff_store("r") == (op.store_id, CAP_A, 144)
    consumer = SchedulerLedger(CHUNK, BLOCK, stores=False)
    assert _built(consumer, "r") == []


def _side(**kw) -> tuple[SchedulerSide, list]:
    calls: list = []

    def lookup(cap: str, tokens: Sequence[int]) -> tuple[int, str]:
        calls.append(cap)
        return 144, ""

    return SchedulerSide(CHUNK, BLOCK, lookup, **kw), calls


def test_a_producer_returns_a_receipt_and_keeps_its_blocks_until_the_store_is_durable():
    side, calls = _side(loads=False, receipts=True)
    view = RequestView("r", PROMPT, CAP_A, epoch=7)
    assert side.matched_tokens(view, 0) == 0 and calls == []  # a producer does not load
    side.allocated(view, [], 0)
    (op,) = side.build([StepRequest("r", 0, len(PROMPT), list(range(10)), new=True)])[1]
    delay, params = side.finish("r", {"kvgate_capability": CAP_A, "kvgate_epoch": 7})
    assert delay is True
    receipt = Receipt.parse(params[RECEIPT_PARAM])
    assert (receipt.store_id, receipt.tokens, receipt.chunks, receipt.epoch) == (op.store_id, 144, 3, 7)
    assert receipt.owner == owner_tag(CAP_A)
    assert side.finish("unknown") == (False, None)


def test_kv_both_hands_off_nothing():
    side, _ = _side()
    view = RequestView("r", PROMPT, CAP_A)
    side.matched_tokens(view, 0)
    side.allocated(view, [], 0)
    side.build([StepRequest("r", 0, len(PROMPT), list(range(10)), new=True)])
    delay, params = side.finish("r")
    assert delay is False and RECEIPT_PARAM not in (params or {})


def test_a_consumer_waits_for_the_receipt_then_loads_with_its_own_capability():
    clock, lookups = Clock(), Lookups()
    denied: list = []
    side, calls = _side(stores=False, handoff=HandoffWaits(lookups, 5.0, 0.01, clock),
                        deny=lambda *a: denied.append(a))
    view = RequestView("r", PROMPT, CAP_A2, receipt=_receipt(), epoch=3)
    assert side.matched_tokens(view, 0) is None  # not visible yet: vLLM asks again
    assert lookups.pending[0][0] == CAP_A2  # the request's own capability, not the producer's
    lookups.pending[0][2].set_result((144, ""))
    assert side.matched_tokens(view, 0) == 144
    assert calls == [] and denied == []
    assert not [k for k in side.stats.failures() if k[0] in ("handoff", "lookup")]


def test_another_tenants_receipt_loads_nothing_and_is_denied():
    clock, lookups = Clock(), Lookups()
    denied: list = []
    side, calls = _side(stores=False, handoff=HandoffWaits(lookups, 5.0, 0.01, clock),
                        deny=lambda *a: denied.append(a))
    view = RequestView("rb", PROMPT, CAP_B, receipt=_receipt(CAP_A), epoch=3)
    assert side.matched_tokens(view, 0) == 0
    assert lookups.pending == [] and calls == []  # no wait, no lookup
    assert denied == [(CAP_B, "rb", OTHER_OWNER)]
    assert ("handoff", OTHER_OWNER) in side.stats.failures()


def test_a_stale_or_malformed_receipt_falls_back_to_an_ordinary_lookup():
    side, calls = _side(stores=False, handoff=HandoffWaits(Lookups(), 5.0, 0.01, Clock()))
    assert side.matched_tokens(RequestView("r1", PROMPT, CAP_A, receipt=_receipt(), epoch=4), 0) == 144
    assert side.matched_tokens(RequestView("r2", PROMPT, CAP_A, receipt={"store": 1}, epoch=4), 0) == 144
    assert calls == [CAP_A, CAP_A]
    fails = side.stats.failures()
    assert fails[("handoff", STALE_EPOCH)] == 1 and fails[("handoff", MALFORMED)] == 1


def test_a_handoff_store_ends_once_the_write_behind_copies_are_in():
    import asyncio

    from gateway.vllm.handoff import durable_store

    order: list[str] = []

    class Backend:
        def __init__(self, behind: bool) -> None:
            self.behind = behind

        def copies_behind(self) -> bool:
            return self.behind

        async def copies_written(self) -> None:
            order.append("copies")

    async def store() -> str:
        order.append("store")
        return "result"

    assert asyncio.run(durable_store(Backend(True), store())) == "result"
    assert order == ["store", "copies"]
    order.clear()
    assert asyncio.run(durable_store(Backend(False), store())) == "result"
    assert order == ["store"]


def test_a_refused_receipt_is_audited_in_the_gateways_log():
    from audit.types import AuditEvent
    from gateway.vllm.backend import LoopThread
    from gateway.vllm.handoff import audit_refused_receipt

    events: list[AuditEvent] = []

    class Audit:
        def emit(self, event: AuditEvent) -> None:
            events.append(event)

    class Runtime:
        audit = Audit()

    class Backend:
        runtime = Runtime()
        loop = LoopThread(5.0)

    Backend.loop.start()
    try:
        audit_refused_receipt(Backend(), CAP_B, "req-1", OTHER_OWNER)
        Backend.loop.call(_noop())  # the emit ran on the loop before this
    finally:
        Backend.loop.stop()
    (event,) = events
    assert (event.action, event.outcome, event.target.tenant, event.target.namespace) == (
        "authz.denied", "denied", "globex", "default",
    )
    assert event.details == {"op": "handoff", "reason": OTHER_OWNER, "request": "req-1"}


async def _noop() -> None:
    return None
