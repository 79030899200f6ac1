"""The connector's scheduler side (gateway/vllm/scheduler.py) without vLLM: what vLLM hands the
hooks is built here as plain dataclasses of the same shape (``Request``, ``SchedulerOutput`` with
its new and cached request data, ``KVConnectorOutput``), and the lookup is a plain function."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from gateway.errors import AccessDenied
from gateway.vllm.errors import GatewayTimeout
from gateway.vllm.logs import Tracer
from gateway.vllm.scheduler import (
    CAPABILITY_PARAM,
    RequestView,
    SchedulerSide,
    capability_of,
    request_view,
    step_requests,
)

CHUNK, BLOCK = 64, 16
PROMPT = list(range(1000, 1320))  # 5 full chunks (20 blocks); a load may fill 19 blocks (one token is left to compute)


# -- vLLM's shapes, as plain dataclasses ------------------------------------------------------
@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int] | None
    kv_transfer_params: dict | None = None


@dataclass
class NewRequestData:
    req_id: str
    num_computed_tokens: int
    block_ids: tuple[list[int], ...]


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)


class Lookups:
    """The lookup seam: answers ``hit`` tokens (or raises ``error``) and records each call."""

    def __init__(self, hit: int = 256, degraded: str = "", error: Exception | None = None) -> None:
        self.hit, self.degraded, self.error = hit, degraded, error
        self.calls: list[tuple[str, int]] = []

    def __call__(self, cap: str, tokens: Sequence[int]) -> tuple[int, str]:
        self.calls.append((cap, len(tokens)))
        if self.error is not None:
            raise self.error
        return min(self.hit, len(tokens)), self.degraded


def _req(rid: str = "r1", cap: str | None = "cap-A", prompt: list[int] | None = None) -> Request:
    return Request(rid, PROMPT if prompt is None else prompt, {CAPABILITY_PARAM: cap} if cap else {})


def _side(lookups: Lookups, tmp_path=None) -> SchedulerSide:
    trace = Tracer(str(tmp_path / "trace.jsonl")) if tmp_path is not None else None
    return SchedulerSide(CHUNK, BLOCK, lookups, trace=trace)


def _first_step(side: SchedulerSide, rid: str, hit: int, blocks: list[int]) -> tuple[list, list]:
    out = SchedulerOutput([NewRequestData(rid, hit, (blocks,))], num_scheduled_tokens={rid: len(PROMPT) - hit})
    return side.build(step_requests(out, side.tracked))


# -- capability -------------------------------------------------------------------------------
def test_capability_is_read_only_from_kv_transfer_params():
    assert capability_of({CAPABILITY_PARAM: "c"}) == "c"
    for bad in (None, "c", {CAPABILITY_PARAM: 7}, {CAPABILITY_PARAM: ""}, {CAPABILITY_PARAM: "x" * 8193}, {"other": "c"}):
        assert capability_of(bad) is None
    assert request_view(_req()) == RequestView("r1", PROMPT, "cap-A")
    assert request_view(Request("r2", None)) == RequestView("r2", [], None)


def test_a_request_without_capability_is_neither_looked_up_nor_tracked():
    lookups = Lookups()
    side = _side(lookups)
    assert side.matched_tokens(request_view(_req(cap=None)), 0) == 0
    side.allocated(request_view(_req(cap=None)), list(range(20)), 0)
    assert lookups.calls == [] and not side.tracked("r1")
    # positive control: the same request with a capability is looked up (its full blocks)
    assert side.matched_tokens(request_view(_req()), 0) == 256
    assert lookups.calls == [("cap-A", 320)]


@pytest.mark.parametrize("hit,computed,expected", [(256, 0, 256), (250, 0, 240), (256, 32, 224), (0, 0, 0), (16, 32, 0)])
def test_matched_tokens_are_whole_blocks_beyond_what_the_engine_computed(hit, computed, expected):
    side = _side(Lookups(hit=hit))
    assert side.matched_tokens(request_view(_req()), computed) == expected


def test_no_lookup_when_the_engine_already_computed_every_block_worth_loading():
    lookups = Lookups(hit=320)
    side = _side(lookups)
    assert side.matched_tokens(request_view(_req()), 304) == 0  # all but the last block: nothing to load
    assert side.matched_tokens(request_view(_req(prompt=PROMPT[:16])), 0) == 0  # one block: nothing to load
    assert lookups.calls == []
    # positive control: a partial chunk's blocks are worth a lookup (and a load)
    assert side.matched_tokens(request_view(_req()), 256) == 48
    assert side.matched_tokens(request_view(_req(prompt=PROMPT[:64])), 0) == 48
    assert lookups.calls == [("cap-A", 320), ("cap-A", 64)]


@pytest.mark.parametrize("error,reason", [
    (AccessDenied("expired"), "denied"), (GatewayTimeout("slow"), "gateway_timeout"), (ValueError("bad"), "invalid_request"),
])
def test_a_failed_lookup_is_a_counted_miss_never_an_error(error, reason, caplog, tmp_path):
    side = _side(Lookups(error=error), tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvgate.vllm"):
        assert side.matched_tokens(request_view(_req()), 0) == 0
    assert side.stats.get("lookup", reason) == 1
    assert reason in caplog.text
    (line,) = (tmp_path / "trace.jsonl").read_text().splitlines()
    assert json.loads(line) | {"t": 0, "pid": 0, "ms": 0} == {
        "event": "lookup", "req": "r1", "hit_tokens": 0, "reason": reason, "t": 0, "pid": 0, "ms": 0,
    }


def test_a_degraded_lookup_is_counted_with_its_reason():
    side = _side(Lookups(hit=128, degraded="tier_timeout"))
    assert side.matched_tokens(request_view(_req()), 0) == 128
    assert side.stats.failures() == {("lookup", "tier_timeout"): 1}


def test_a_capability_from_other_state_is_said_once_at_error(caplog):
    side = _side(Lookups(error=AccessDenied("bad tag")))
    with caplog.at_level(logging.ERROR, logger="kvgate.vllm"):
        for rid in ("r1", "r2", "r3"):
            side.matched_tokens(request_view(_req(rid)), 0)
    said = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 1 and "KVGATE_DATABASE_URL" in said[0].getMessage()
    # a plain refusal (expired) is not that mistake
    caplog.clear()
    other = _side(Lookups(error=AccessDenied("expired")))
    with caplog.at_level(logging.ERROR, logger="kvgate.vllm"):
        other.matched_tokens(request_view(_req()), 0)
    assert not [r for r in caplog.records if r.levelno == logging.ERROR]


# -- a request's life: lookup, allocation, steps, finish --------------------------------------
def test_a_hit_loads_once_and_stores_the_full_chunks_once():
    side = _side(Lookups(hit=256))
    view = request_view(_req())
    hit = side.matched_tokens(view, 0)
    blocks = list(range(100, 120))
    side.allocated(view, blocks, hit)
    loads, stores = _first_step(side, "r1", hit, blocks)
    assert [(op.req_id, op.capability, len(op.tokens), op.block_ids, op.skip_blocks) for op in loads] == [
        ("r1", "cap-A", 256, blocks, 0)
    ]
    assert [(len(op.tokens), op.block_ids) for op in stores] == [(320, blocks)]
    # the next decode step carries neither again
    out = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["r1"], [len(PROMPT)], [None]), num_scheduled_tokens={"r1": 1}
    )
    assert side.build(step_requests(out, side.tracked)) == ([], [])
    assert side.finished("r1") == {"kvgate": {"hit_tokens": 256}}
    assert side.finished("r1") is None and not side.tracked("r1")


def test_a_full_hit_is_not_stored_again():
    prompt = PROMPT[:257]  # the lookup may hit every full chunk
    side = _side(Lookups(hit=256))
    view = request_view(_req(prompt=prompt))
    side.allocated(view, list(range(17)), side.matched_tokens(view, 0))
    out = SchedulerOutput([NewRequestData("r1", 256, (list(range(17)),))], num_scheduled_tokens={"r1": 1})
    loads, stores = side.build(step_requests(out, side.tracked))
    assert len(loads) == 1 and stores == []


@pytest.mark.parametrize("local,lookup_hit,stored", [
    (288, 0, False),  # vLLM's own prefix cache supplied every full block: no lookup, no store
    (0, 0, True),  # positive control: a miss everywhere stores the full blocks
    (64, 0, True),  # vLLM had only the first chunk
])
def test_no_store_when_vllms_own_cache_supplied_every_full_block(local, lookup_hit, stored):
    prompt = PROMPT[:300]  # 18 full blocks (4 chunks and 32 tokens); a lookup may hit all of them
    lookups = Lookups(hit=lookup_hit)
    side = _side(lookups)
    view = request_view(_req(prompt=prompt))
    external = side.matched_tokens(view, local)
    assert external == 0 and lookups.calls == ([] if local == 288 else [("cap-A", 288)])
    side.allocated(view, list(range(19)), external)
    out = SchedulerOutput([NewRequestData("r1", local, (list(range(19)),))], num_scheduled_tokens={"r1": 300 - local})
    loads, stores = side.build(step_requests(out, side.tracked))
    assert loads == [] and [len(op.tokens) for op in stores] == ([288] if stored else [])


def test_no_store_when_the_lookup_found_every_full_block_but_nothing_was_loaded():
    """The lookup found all 18 full blocks, vLLM's cache had 3 chunks of them and chose to compute
    the rest itself (no external tokens): kvgate holds every full block, nothing to gather."""
    prompt = PROMPT[:300]
    side = _side(Lookups(hit=288))
    view = request_view(_req(prompt=prompt))
    assert side.matched_tokens(view, 192) == 96
    side.allocated(view, list(range(19)), 0)  # vLLM loads nothing
    out = SchedulerOutput([NewRequestData("r1", 192, (list(range(19)),))], num_scheduled_tokens={"r1": 108})
    assert side.build(step_requests(out, side.tracked)) == ([], [])
    assert side.finished("r1") == {"kvgate": {"hit_tokens": 0}}  # nothing came from kvgate


def test_chunked_prefill_stores_when_the_last_full_chunk_is_computed():
    side = _side(Lookups(hit=0))
    view = request_view(_req())
    side.matched_tokens(view, 0)
    side.allocated(view, [], 0)
    out = SchedulerOutput([NewRequestData("r1", 0, (list(range(8)),))], num_scheduled_tokens={"r1": 128})
    assert side.build(step_requests(out, side.tracked)) == ([], [])  # 128 of 320 computed
    out = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["r1"], [128], [(list(range(8, 20)),)]), num_scheduled_tokens={"r1": 192}
    )
    loads, (store,) = side.build(step_requests(out, side.tracked))
    assert loads == [] and len(store.tokens) == 320 and store.block_ids == list(range(20))


def _resumed_store(reported: set[int]) -> list:
    side = _side(Lookups(hit=256))
    view = request_view(_req())
    blocks = list(range(100, 120))
    side.allocated(view, blocks, side.matched_tokens(view, 0))
    out = SchedulerOutput([NewRequestData("r1", 256, (blocks,))], num_scheduled_tokens={"r1": 32})
    (_load,), stores = side.build(step_requests(out, side.tracked))  # a partial step: no store yet
    assert stores == []
    assert side.load_errors(reported) == ({"r1"} if reported else set())
    resumed = list(range(300, 320))  # preempted, then resumed on other blocks from token 0
    out = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["r1"], [0], [(resumed,)], {"r1"}), num_scheduled_tokens={"r1": 320}
    )
    _, stores = side.build(step_requests(out, side.tracked))
    return stores


def test_reported_load_errors_cut_a_later_store_after_preemption():
    """The scheduler learns failed blocks one step late; the request, resumed on new blocks,
    stores nothing from the first failed chunk on (the chunks before it were the hit: stored)."""
    assert _resumed_store({109}) == []  # block 9 (tokens 144..159) failed
    (store,) = _resumed_store(set())  # positive control: no failure, the full chunks are stored
    assert len(store.tokens) == 320 and store.block_ids == list(range(300, 320))


def test_untracked_requests_are_left_out_of_the_step():
    side = _side(Lookups())
    out = SchedulerOutput(
        [NewRequestData("stranger", 0, ([1, 2],))], CachedRequestData(["other"], [0], [([3],)]),
        {"stranger": 32, "other": 32},
    )
    assert step_requests(out, side.tracked) == [] and side.build([]) == ([], [])


def test_the_scheduler_side_imports_neither_vllm_nor_torch():
    code = "import sys, gateway.vllm.scheduler; print(sorted(m for m in ('torch', 'vllm', 'sqlalchemy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
