"""The connector's bookkeeping without vLLM (gateway/vllm/ledger.py): a failed load never feeds a
store, on the scheduler side (reported load errors) and on the worker side (same step)."""

from __future__ import annotations

import pytest

from gateway.vllm.ledger import SchedulerLedger, StepRequest, StoreOp, WorkerLedger

CHUNK, BLOCK = 64, 16
PROMPT = list(range(1000, 1000 + 320))  # 5 full chunks; a load may fill 19 of its 20 blocks (one token left)


def _ledgers() -> tuple[SchedulerLedger, WorkerLedger]:
    return SchedulerLedger(CHUNK, BLOCK), WorkerLedger(CHUNK, BLOCK)


def _hit_and_schedule(s: SchedulerLedger, req: str = "r1", hit: int = 256, blocks: list[int] | None = None):
    blocks = blocks if blocks is not None else list(range(100, 120))
    assert (s.lookup_limit(len(PROMPT)), s.load_limit(len(PROMPT))) == (320, 304)
    s.looked_up(req, 0)
    s.allocated(req, "cap", PROMPT, blocks, hit)
    # the whole rest of the prompt is computed in the same step as the load
    return s.build([StepRequest(req, hit, len(PROMPT) - hit, blocks, new=True)])


def test_a_hit_shorter_than_the_prompt_loads_and_stores_in_the_same_step():
    s, _ = _ledgers()
    loads, stores = _hit_and_schedule(s)
    assert [(op.req_id, len(op.tokens), op.skip_blocks) for op in loads] == [("r1", 256, 0)]
    assert [(op.req_id, len(op.tokens), len(op.block_ids)) for op in stores] == [("r1", 320, 20)]


def test_worker_stores_everything_after_a_load_that_succeeded():
    s, w = _ledgers()
    _, (store,) = _hit_and_schedule(s)
    w.new_step()
    assert w.load_failed("r1", store.block_ids, 16, 16) == set()  # loaded all 16 blocks
    assert w.store_cut(store) == 320  # positive control: the store goes ahead whole


@pytest.mark.parametrize("first_failed_block,cut", [(0, 0), (3, 0), (4, 64), (5, 64), (9, 128), (15, 192)])
def test_worker_cuts_the_same_step_store_before_the_first_failed_block(first_failed_block, cut):
    s, w = _ledgers()
    (load,), (store,) = _hit_and_schedule(s)
    w.new_step()
    failed = w.load_failed("r1", load.block_ids, first_failed_block, 16)
    assert failed == set(load.block_ids[first_failed_block:16])
    assert w.store_cut(store) == cut  # whole chunks before the failure only


def test_worker_remembers_a_request_failure_across_steps_and_new_blocks():
    """Chunked prefill or a preemption: the store comes in a later step, maybe on other blocks."""
    _, w = _ledgers()
    w.new_step()
    w.load_failed("r1", list(range(100, 116)), 6, 16)
    w.new_step()  # a later step: the per-step block set is empty again
    later = StoreOp("r1", "cap", PROMPT, list(range(200, 220)))  # resumed on other blocks
    assert w.store_cut(later) == 64  # still cut at token 96 -> chunk 1
    other = StoreOp("r2", "cap", PROMPT, list(range(300, 320)))
    assert w.store_cut(other) == 320  # another request is not affected
    w.finished({"r1"})
    assert w.store_cut(later) == 320  # forgotten once the request finished


def test_a_block_that_failed_for_one_request_cuts_another_sharing_it():
    """vLLM's prefix cache can hand one loaded block to two requests in the same step."""
    _, w = _ledgers()
    w.new_step()
    w.load_failed("r1", list(range(100, 116)), 8, 16)  # blocks 108.. failed
    sharer = StoreOp("r2", "cap", PROMPT, [*range(100, 110), *range(400, 410)])
    assert w.store_cut(sharer) == 128  # block index 8 = token 128
    w.new_step()
    assert w.store_cut(sharer) == 320  # next step, recomputed: fine for r2


def test_scheduler_stores_nothing_of_blocks_reported_as_load_errors():
    """Chunked prefill: the load is in step 1, the prompt's last chunk (and so the store) in step
    2; vLLM reported the failed blocks in between."""
    s, _ = _ledgers()
    blocks = list(range(100, 120))
    s.looked_up("r1", 0)
    s.allocated("r1", "cap", PROMPT, blocks, 256)
    loads, stores = s.build([StepRequest("r1", 256, 32, blocks, new=True)])
    assert loads and not stores
    assert s.load_errors({blocks[5], blocks[6], 999}) == {"r1"}
    loads, stores = s.build([StepRequest("r1", 80, 240, [])])  # vLLM recomputes from block 5
    assert not loads and not stores  # nothing from chunk 1 (token 64) on; chunk 0 is stored already


def test_scheduler_positive_control_without_load_errors():
    s, _ = _ledgers()
    blocks = list(range(100, 120))
    s.looked_up("r1", 0)
    s.allocated("r1", "cap", PROMPT, blocks, 256)
    s.build([StepRequest("r1", 256, 32, blocks, new=True)])
    assert s.load_errors({999}) == set()  # another request's block
    _, stores = s.build([StepRequest("r1", 288, 32, [])])
    assert [(len(op.tokens), op.block_ids) for op in stores] == [(320, blocks)]


def test_scheduler_load_error_after_the_store_changes_nothing_later():
    s, _ = _ledgers()
    _, stores = _hit_and_schedule(s)
    assert stores
    s.load_errors({100})
    assert s.build([StepRequest("r1", 320, 1, [])]) == ([], [])  # never a second store
    assert s.finished("r1") == 256
    assert not s.tracked("r1")


@pytest.mark.parametrize("hit,stored", [(288, None), (256, 288)])
def test_no_store_when_the_hit_covers_every_full_block(hit, stored):
    """300 tokens: 18 full blocks (4 chunks and a 32-token tail). A hit of all 18 stores nothing;
    positive control: a hit of the 4 chunks alone stores the prompt again, tail included."""
    s, _ = _ledgers()
    prompt = PROMPT[:300]
    s.looked_up("r1", 0, hit)
    s.allocated("r1", "cap", prompt, list(range(19)), hit)
    loads, stores = s.build([StepRequest("r1", hit, 300 - hit, list(range(19)), new=True)])
    assert [(len(op.tokens), op.load_tokens) for op in loads] == [(hit, hit)]
    assert [len(op.tokens) for op in stores] == ([] if stored is None else [stored])


def test_a_prompt_of_whole_chunks_loads_all_but_its_last_block():
    """The stored prompt is 5 whole chunks (320 tokens); vLLM must compute the last token, so a
    load retrieves all 5 chunks (as stored: the same hashes) and fills 19 of the 20 blocks. The
    engine recomputes one block, not one chunk; nothing is stored again."""
    s, _ = _ledgers()
    s.looked_up("r1", 0, 320)  # the lookup found everything stored
    s.allocated("r1", "cap", PROMPT, list(range(100, 120)), s.load_limit(len(PROMPT)))
    loads, stores = s.build([StepRequest("r1", 304, 16, list(range(100, 120)), new=True)])
    assert [(len(op.tokens), op.load_tokens, op.skip_blocks) for op in loads] == [(320, 304, 0)]
    assert stores == []
    assert s.finished("r1") == 304


def test_a_store_takes_the_partial_last_chunk_unless_a_load_failed():
    s, w = _ledgers()
    prompt = PROMPT[:300]  # 18 full blocks: 4 chunks and 32 tokens
    s.looked_up("r1", 0)
    s.allocated("r1", "cap", prompt, list(range(19)), 0)
    _, (store,) = s.build([StepRequest("r1", 0, 300, list(range(19)), new=True)])
    assert (len(store.tokens), len(store.block_ids)) == (288, 18)
    w.new_step()
    assert w.store_cut(store) == 288  # whole: the tail goes in as a partial chunk
    w.load_failed("r1", store.block_ids, 17, 18)  # the tail's second block failed to load
    assert w.store_cut(store) == 256  # a cut is to whole chunks before the failure


def test_resumed_request_takes_its_new_blocks():
    s, _ = _ledgers()
    s.looked_up("r1", 0)
    s.allocated("r1", "cap", PROMPT, [], 0)  # a miss
    assert s.build([StepRequest("r1", 0, 100, list(range(7)), new=True)]) == ([], [])
    # preempted, resumed on other blocks, computes the rest
    _, stores = s.build([StepRequest("r1", 0, 320, list(range(50, 70)), resumed=True)])
    assert stores[0].block_ids == list(range(50, 70))


def test_chunk_must_be_a_multiple_of_the_block():
    with pytest.raises(ValueError):
        SchedulerLedger(60, 16)


@pytest.mark.parametrize("found,skip", [(0, 0), (64, 64), (208, 192), (320, 320)])
def test_a_store_skips_the_whole_chunks_its_lookup_found(found, skip):
    """What the lookup found is stored already: the store starts after its whole chunks."""
    s = SchedulerLedger(CHUNK, BLOCK)
    s.looked_up("r1", 0, found)
    s.allocated("r1", "cap", PROMPT, list(range(100, 120)), 0)  # recomputed (say, the policy's choice)
    _, stores = s.build([StepRequest("r1", 0, len(PROMPT), list(range(100, 120)), new=True)])
    if found == 320:
        assert stores == []  # everything is there: no store at all
        return
    assert [(len(op.tokens), op.skip_tokens) for op in stores] == [(320, skip)]


def test_a_hand_off_store_takes_every_chunk_even_those_found():
    s = SchedulerLedger(CHUNK, BLOCK, handoff=True)
    s.looked_up("r1", 0, 128)
    s.allocated("r1", "cap", PROMPT, list(range(100, 120)), 0)
    _, (store,) = s.build([StepRequest("r1", 0, len(PROMPT), list(range(100, 120)), new=True)])
    assert (len(store.tokens), store.skip_tokens) == (320, 0)
