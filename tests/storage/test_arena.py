"""The memory tier's arena: allocation, fragmentation, leases, bounded memory, and a
state machine for "no extent is ever shared by two live envelopes, and a held view never changes"."""

from __future__ import annotations

import gc
import itertools
import resource
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storage import ChunkKey, ChunkNotFound, MemoryTier, TierFull
from storage.arena import ALIGN, Arena

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """The memory tier never awaits: drive a coroutine to its end without a loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    raise AssertionError("the memory tier awaited")


def k(i: int, owner: str = "aa", group: str = "bb") -> ChunkKey:
    return ChunkKey(owner, group, f"{i:064x}")


def test_alloc_free_coalesces_back_to_one_hole() -> None:
    arena = Arena(1 << 20)
    exts = [arena.alloc(n) for n in (1, 100, 4096, 70_000, 3)]
    spans = sorted((e.offset, e.offset + e.span) for e in exts)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # disjoint
    assert all(e.offset % ALIGN == 0 for e in exts)
    for e in exts[::2] + exts[1::2]:
        arena.release(e)
    s = arena.stats()
    assert s.free_bytes == s.largest_hole == arena.size and s.extents == 0 and s.overflow == 0


def test_fragmentation_under_mixed_sizes_is_compacted_not_refused() -> None:
    arena = Arena(64 * 4096)
    small = [arena.alloc(4096) for _ in range(64)]
    for i, e in enumerate(small):
        arena.array(e)[:] = i
        if i % 2:
            arena.release(e)  # 32 holes of 4 KiB: half the region free, no hole over 4 KiB
    assert arena.stats().largest_hole == 4096
    big = arena.alloc(16 * 4096)
    assert big.offset >= 0 and arena.stats().compactions == 1 and arena.stats().overflow == 0
    for i, e in enumerate(small[::2]):  # moved extents kept their bytes
        assert (arena.array(e) == 2 * i).all()


def test_leased_extent_is_neither_moved_nor_reused() -> None:
    arena = Arena(8 * 4096)
    a, b = arena.alloc(4096), arena.alloc(4096)
    arena.array(b)[:] = 7
    view = arena.lease(b)
    derived = np.frombuffer(view, dtype=np.uint8)[10:20]  # a reader's slice keeps the lease too
    del view
    arena.release(a)
    arena.release(b)  # the owner lets go while a reader holds it: a zombie
    assert arena.stats().zombie_bytes == 4096
    for _ in range(7):
        arena.array(arena.alloc(4096))[:] = 1
    arena.compact()
    assert (derived == 7).all()
    del derived
    gc.collect()
    arena.sweep()
    assert arena.stats().zombie_bytes == 0


def test_overflow_when_readers_pin_the_region_and_memory_stays_bounded() -> None:
    tier = MemoryTier(4 * 4096)
    held = []
    for i in range(40):
        run(tier.put(k(i), bytes([i]) * 4096))
        held.append(run(tier.get(k(i))).data)  # every envelope read and kept: nothing reusable
        assert tier.used_bytes <= 4 * 4096
    s = tier.stats()
    assert s.arena is not None and s.arena.overflow > 0 and s.chunks == 4
    assert [v[0] for v in held] == list(range(40))  # nobody's view was overwritten
    held.clear()
    gc.collect()
    run(tier.put(k(99), bytes(4096)))
    assert tier.stats().arena.zombie_bytes == 0  # type: ignore[union-attr]


def test_steady_state_put_does_not_fault_pages() -> None:
    tier = MemoryTier(8 << 20, prefault=True)
    data = bytes(2 << 20)
    for i in range(3):
        run(tier.put(k(i), data))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(3, 40):
        run(tier.put(k(i), data))  # each evicts the oldest and reuses its extent
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 64, faults  # 37 x 2 MiB into fresh memory would be ~19k faults


async def test_reserve_commit_abort_and_a_clear_cancels_a_seal_in_flight() -> None:
    tier = MemoryTier(10_000)
    res = tier.reserve(k(1), 100)
    res.view[:] = b"x" * 100
    assert not await tier.contains(k(1))
    assert tier.commit(res) and bytes((await tier.get(k(1))).data) == b"x" * 100
    with pytest.raises(ValueError):
        tier.commit(res)
    other = tier.reserve(k(2), 50)
    tier.abort(other)
    assert not await tier.contains(k(2)) and tier.stats().reservations == 0
    late = tier.reserve(k(3, group="cc"), 60)
    await tier.delete_group("cc")  # a namespace clear while the seal runs
    late.view[:] = b"y" * 60
    assert not tier.commit(late) and not await tier.contains(k(3, group="cc"))
    with pytest.raises(ChunkNotFound):
        await tier.get(k(3, group="cc"))
    run(tier.pin(k(1)))
    with pytest.raises(TierFull):
        tier.reserve(k(4), 9_950)  # only the pinned chunk could make room
    assert tier.used_bytes == 100 and tier._index.reserved == 0


def test_reserve_honours_owner_quota() -> None:
    tier = MemoryTier(1000, owner_quota_bytes=500)
    run(tier.put(k(1, owner="0a"), bytes(400)))
    for i in range(5):
        res = tier.reserve(k(10 + i, owner="0b"), 300)
        assert tier.commit(res)
    assert run(tier.contains(k(1, owner="0a")))  # the flooding owner paid with its own chunks


class ArenaMachine(RuleBasedStateMachine):
    """Random puts, reservations, reads held and dropped, pins, deletes and compactions."""

    def __init__(self) -> None:
        super().__init__()
        self.tier = MemoryTier(2 * 4096 - 500, owner_quota_bytes=5000)
        self.held: list[tuple[memoryview, bytes]] = []
        self.pending: list[tuple[Any, bytes]] = []
        self.fill = 0

    def _next(self, size: int) -> bytes:
        self.fill = (self.fill + 1) % 251
        return bytes([self.fill]) * size

    @rule(i=st.integers(0, 7), size=st.integers(0, 2500))
    def put(self, i: int, size: int) -> None:
        try:
            run(self.tier.put(k(i, owner="0a" if i % 2 else "0b"), self._next(size)))
        except TierFull:
            pass

    @rule(i=st.integers(0, 7), size=st.integers(0, 2500))
    def reserve(self, i: int, size: int) -> None:
        try:
            res = self.tier.reserve(k(i, owner="0a" if i % 2 else "0b"), size)
        except TierFull:
            return
        data = self._next(size)
        res.view[:] = data
        self.pending.append((res, data))

    @precondition(lambda self: self.pending)
    @rule(j=st.integers(0, 10), commit=st.booleans())
    def finish(self, j: int, commit: bool) -> None:
        res, _ = self.pending.pop(j % len(self.pending))
        if commit:
            self.tier.commit(res)
        else:
            self.tier.abort(res)

    @rule(i=st.integers(0, 7))
    def get(self, i: int) -> None:
        try:
            view = run(self.tier.get(k(i, owner="0a" if i % 2 else "0b"))).data
        except ChunkNotFound:
            return
        self.held.append((view, bytes(view)))

    @precondition(lambda self: self.held)
    @rule(j=st.integers(0, 10))
    def drop_view(self, j: int) -> None:
        self.held.pop(j % len(self.held))
        gc.collect()

    @rule(i=st.integers(0, 7), pin=st.booleans())
    def pin(self, i: int, pin: bool) -> None:
        key = k(i, owner="0a" if i % 2 else "0b")
        if pin:
            try:
                run(self.tier.pin(key))
            except ChunkNotFound:
                pass
        else:
            run(self.tier.unpin(key))

    @rule(i=st.integers(0, 7))
    def delete(self, i: int) -> None:
        run(self.tier.delete(k(i, owner="0a" if i % 2 else "0b")))

    @rule()
    def compact(self) -> None:
        self.tier.arena.compact()

    @invariant()
    def held_views_never_change(self) -> None:
        for view, snapshot in self.held:
            assert bytes(view) == snapshot

    @invariant()
    def no_extent_shared(self) -> None:
        arena = self.tier.arena
        live = list(self.tier._data.values()) + [r.extent for r, _ in self.pending]
        assert len({id(e) for e in live}) == len(live)
        spans = sorted((e.offset, e.offset + e.span) for e in arena.region_extents())
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert not spans or (spans[0][0] >= 0 and spans[-1][1] <= arena.size)
        region = {id(e) for e in arena.region_extents()}
        assert all(id(e) in region for e in live if e.offset >= 0)

    @invariant()
    def budget_kept(self) -> None:
        assert self.tier.used_bytes + self.tier._index.reserved <= self.tier._index.capacity  # type: ignore[operator]


ArenaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
TestArenaMachine = ArenaMachine.TestCase
