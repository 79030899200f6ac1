"""The connector's bookkeeping, without vLLM: which loads and stores a step carries, and which
KV a store may take ("A cache never makes an answer wrong", docs/architecture.md, section 1).

    SchedulerLedger   per request: capability, prompt, blocks, hit; decides per step the load
                      (once, where a lookup hit) and the store (once, when the prompt's full
                      blocks are computed, and only if some are neither in kvgate nor from
                      vLLM's own prefix cache); learns load failures back from the workers'
                      ``invalid_block_ids`` and never lets that request store from the first
                      failed block on.
    WorkerLedger      per step: the blocks whose load failed here; per request: where its first
                      failed load began. ``store_cut`` trims a store to the chunks before both.

A store takes every full block of the prompt after the whole chunks its lookup found, a load only
those before its last token. A store
never takes a block at or after a failed load, nor KV computed over it in the same step (attention
is causal). Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["LoadOp", "SchedulerLedger", "StepRequest", "StoreOp", "WorkerLedger"]


@dataclass(frozen=True)
class LoadOp:
    req_id: str
    capability: str
    tokens: list[int]  # the stored prefix to retrieve (chunks as the store cut them)
    block_ids: list[int]  # the request's blocks, from block 0
    skip_blocks: int = 0  # leading blocks the engine computed itself (never written)
    upto: int | None = None  # tokens to load into the engine (whole blocks); None: all of ``tokens``

    @property
    def load_tokens(self) -> int:
        """Tokens the engine expects loaded: a block-aligned prefix of ``tokens``."""
        return len(self.tokens) if self.upto is None else min(self.upto, len(self.tokens))


@dataclass(frozen=True)
class StoreOp:
    req_id: str
    capability: str
    tokens: list[int]  # block-aligned prefix to store (its last chunk may be partial)
    block_ids: list[int]  # its blocks, one per ``block_size`` tokens
    store_id: str = ""  # a producer's hand-off store (the worker reports when it is durable)
    skip_tokens: int = 0  # leading whole chunks kvgate holds (its lookup found them): not gathered, not sealed


@dataclass(frozen=True)
class StepRequest:
    """One request as a scheduler step sees it (vLLM's new or cached request data, flattened)."""

    req_id: str
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int  # in this step
    block_ids: Sequence[int] = ()  # new: all blocks; cached: blocks added this step
    new: bool = False
    resumed: bool = False  # after preemption: ``block_ids`` replaces the old list


@dataclass
class _Request:
    capability: str
    prompt: list[int]
    store_tokens: int  # full blocks of the prompt; lowered (to whole chunks) by a failed load
    block_ids: list[int] = field(default_factory=list)
    hit_tokens: int = 0
    covered: int = 0  # leading tokens kvgate holds (the lookup said so) or vLLM's cache supplied
    found: int = 0  # leading tokens kvgate's lookup found (its own or a published scope's chunks)
    stored: bool = False
    store_id: str = ""  # the hand-off store's id, once it is built
    load: tuple[int, int, list[int], int] | None = None  # (retrieve, load tokens, block ids, skip blocks), once


class SchedulerLedger:
    def __init__(self, chunk_tokens: int, block_size: int, *, stores: bool = True, handoff: bool = False) -> None:
        """``stores``: requests store at all (not a kv_consumer's); ``handoff``: a producer's, each
        store takes every full block of the prompt (the decode side loads them from the shared
        tier, whatever this engine's own cache held) and gets a store id."""
        if chunk_tokens <= 0 or block_size <= 0 or chunk_tokens % block_size:
            raise ValueError("chunk_tokens must be a positive multiple of block_size")
        self.chunk, self.block = chunk_tokens, block_size
        self.stores, self.handoff = stores, handoff
        self._reqs: dict[str, _Request] = {}
        # at the last lookup: (tokens the engine had computed, tokens kvgate said it holds)
        self._local: dict[str, tuple[int, int]] = {}
        self.failed_loads = 0  # requests that learned of a failed load (for the trace and tests)

    # -- lookup and allocation ----------------------------------------------------------------
    def lookup_limit(self, prompt_len: int) -> int:
        """The prefix a lookup asks for: the prompt's full blocks, as a store takes them."""
        return prompt_len // self.block * self.block

    def load_limit(self, prompt_len: int) -> int:
        """The most a load may fill: whole blocks before the prompt's last token (vLLM computes
        at least that one)."""
        return (prompt_len - 1) // self.block * self.block if prompt_len > 0 else 0

    def looked_up(self, req_id: str, num_computed_tokens: int, hit_tokens: int = 0) -> None:
        """Before allocation: vLLM's own cache had ``num_computed_tokens``; kvgate's lookup found
        ``hit_tokens`` (0 when it was not asked)."""
        self._local[req_id] = (num_computed_tokens, hit_tokens)

    def allocated(
        self, req_id: str, capability: str, prompt: Sequence[int], block_ids: Sequence[int], num_external: int
    ) -> None:
        """After vLLM allocated blocks; ``num_external`` tokens come from kvgate (a load)."""
        req = self._reqs.get(req_id)
        if req is None:
            store = self.lookup_limit(len(prompt)) if self.stores else 0
            req = self._reqs[req_id] = _Request(capability, list(prompt), store)
        local, found = self._local.pop(req_id, (0, 0))
        req.covered = max(local, found)
        req.found = found
        if num_external > 0:
            total = local + num_external
            req.hit_tokens = total
            # retrieve the chunks as stored that ``total`` reaches into (all the lookup found
            # for a whole hit, fewer for a prefix of it), load ``total`` of them
            retrieve = max(total, min(found, -(-total // self.chunk) * self.chunk))
            req.load = (retrieve, total, list(block_ids), local // self.block)

    # -- one step -----------------------------------------------------------------------------
    def build(self, step: Iterable[StepRequest]) -> tuple[list[LoadOp], list[StoreOp]]:
        loads: list[LoadOp] = []
        stores: list[StoreOp] = []
        for s in step:
            req = self._reqs.get(s.req_id)
            if req is None:
                continue
            if s.new or s.resumed:
                req.block_ids = list(s.block_ids)
            else:
                req.block_ids.extend(s.block_ids)
            if req.load is not None:
                retrieve, total, block_ids, skip = req.load
                req.load = None
                loads.append(LoadOp(s.req_id, req.capability, req.prompt[:retrieve], block_ids, skip, upto=total))
            done = s.num_computed_tokens + s.num_scheduled_tokens
            if not req.stored and req.store_tokens and done >= req.store_tokens:
                req.stored = True
                if self.handoff or max(req.hit_tokens, req.covered) < req.store_tokens:  # else nothing new
                    n = req.store_tokens // self.block
                    req.store_id = secrets.token_hex(16) if self.handoff else ""
                    # what the lookup found is stored already: a store seals only the chunks after
                    # it (a hand-off's receipt counts every chunk, so it takes them all)
                    skip = 0 if self.handoff else min(req.found, req.store_tokens) // self.chunk * self.chunk
                    stores.append(StoreOp(
                        s.req_id, req.capability, req.prompt[: req.store_tokens], req.block_ids[:n], req.store_id,
                        skip,
                    ))
        return loads, stores

    def load_errors(self, invalid_block_ids: Iterable[int]) -> set[str]:
        """Blocks the workers reported as failed loads (vLLM's ``invalid_block_ids``): every
        request holding one stores nothing from its first failed block on. Returns those ids."""
        bad = set(invalid_block_ids)
        hit: set[str] = set()
        if not bad:
            return hit
        for req_id, req in self._reqs.items():
            first = next((i for i, b in enumerate(req.block_ids) if b in bad), None)
            if first is None:
                continue
            cut = first * self.block // self.chunk * self.chunk
            if cut < req.store_tokens:
                req.store_tokens = cut
                self.failed_loads += 1
                hit.add(req_id)
        return hit

    def handoff_store(self, req_id: str) -> tuple[str, str, int] | None:
        """(store id, capability, tokens) of the request's hand-off store, if one was built."""
        req = self._reqs.get(req_id)
        return None if req is None or not req.store_id else (req.store_id, req.capability, req.store_tokens)

    def finished(self, req_id: str) -> int | None:
        """Forget the request; its hit tokens (None if kvgate never tracked it)."""
        self._local.pop(req_id, None)
        req = self._reqs.pop(req_id, None)
        return None if req is None else req.hit_tokens

    def tracked(self, req_id: str) -> bool:
        return req_id in self._reqs


class WorkerLedger:
    """The worker's memory of failed loads: within a step (by block) and per request (by
    token position, which survives a preemption that hands the request new blocks)."""

    def __init__(self, chunk_tokens: int, block_size: int) -> None:
        self.chunk, self.block = chunk_tokens, block_size
        self._step_failed: set[int] = set()
        self._failed_from: dict[str, int] = {}  # req id -> first token whose load failed

    def new_step(self) -> None:
        self._step_failed = set()

    def load_failed(self, req_id: str, block_ids: Sequence[int], first_failed: int, end: int) -> set[int]:
        """Blocks ``block_ids[first_failed:end]`` of ``req_id`` did not load; returns them."""
        failed = set(block_ids[first_failed:end])
        if failed:
            self._step_failed |= failed
            token = first_failed * self.block
            self._failed_from[req_id] = min(token, self._failed_from.get(req_id, token))
        return failed

    def store_cut(self, op: StoreOp) -> int:
        """How many leading tokens of ``op`` may be stored: all of them (a partial last chunk
        included) when no load of theirs failed, else the chunks wholly before the request's
        first failed load and before any block that failed to load in this step."""
        limit = min(len(op.tokens), self._failed_from.get(op.req_id, len(op.tokens)))
        for i, b in enumerate(op.block_ids):
            if b in self._step_failed:
                limit = min(limit, i * self.block)
                break
        return limit if limit == len(op.tokens) else limit // self.chunk * self.chunk

    def finished(self, req_ids: Iterable[str]) -> None:
        for r in req_ids:
            self._failed_from.pop(r, None)
