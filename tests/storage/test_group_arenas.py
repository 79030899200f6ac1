"""MemoryTier with ``group_arenas``: each group's (namespace's) envelopes in a memfd of its own,
which a server hands to that namespace's workers to read envelopes from in place
(``gateway.server.shm``).

Tried as a reader holding one group's descriptor would try it, beside the positive control: the
group's own bytes are there, another group's never are; a view the server lent keeps its bytes
while the chunk is evicted and replaced; freed bytes go back to the system when trimmed, and a
deleted owner's at once."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from gateway.protocol.shmpages import prefault_behind
from gateway.server.shm import Regions
from storage import ChunkKey, MemoryTier
from storage.arena import Arena
from tests.support.memfd import PAGE, allocated_pages


def k(i: int, group: str, owner: str = "ee") -> ChunkKey:
    return ChunkKey(owner, group, f"{i:064x}")


def _resident(tier: MemoryTier, group: str) -> int:
    """Bytes of the group's arena with pages behind them."""
    return os.fstat(tier.group_arena(group).fd).st_blocks * 512


CAP = 8 << 20  # the budget of the trimming tests: eight envelopes of 1 MiB


async def _holding(n: int, seed: int) -> tuple[MemoryTier, bytes]:
    """A tier of budget CAP whose group "aa" (owner "dd") holds ``n`` envelopes of 1 MiB, and the
    envelope's bytes."""
    tier = MemoryTier(CAP, group_arenas=True)
    blob = np.random.default_rng(seed).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    for i in range(n):
        await tier.put(k(i, "aa", owner="dd"), blob)
    return tier, blob


def _mapped(arena: Arena) -> mmap.mmap:
    """What a worker maps: the arena, through a descriptor of its own."""
    fd = os.dup(arena.fd)
    try:
        return mmap.mmap(fd, arena.size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)


async def test_a_groups_arena_holds_its_envelopes_and_no_one_elses() -> None:
    tier = MemoryTier(4 << 20, group_arenas=True)
    mine, theirs = os.urandom(100_000), os.urandom(100_000)
    await tier.put(k(0, "aa"), mine)
    await tier.put(k(0, "cc"), theirs)
    a, c = _mapped(tier.group_arena("aa")), _mapped(tier.group_arena("cc"))
    got_mine, got_theirs = (await tier.get(k(0, "aa"))).data, (await tier.get(k(0, "cc"))).data
    at = tier.locate("aa", got_mine)
    assert at is not None and a[at : at + len(mine)] == mine  # the control: read in place
    assert a.find(theirs[:4096]) == -1 and c.find(mine[:4096]) == -1  # never the other group's
    assert tier.locate("aa", got_theirs) is None and tier.locate("cc", got_mine) is None
    assert tier.locate("aa", memoryview(bytearray(mine))) is None  # a copy is not in the arena
    assert tier.locate("aa", got_mine[1:]) is None  # nor is a slice of an extent
    fd = os.dup(tier.group_arena("aa").fd)  # the descriptor a worker gets cannot shrink or grow it
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, tier.group_arena("aa").size * 2)
    finally:
        os.close(fd)
    with pytest.raises(ValueError):
        MemoryTier(1 << 20).group_arena("aa")  # one arena for every group: none to hand out
    await tier.aclose()


async def test_a_lent_envelope_keeps_its_bytes_while_evicted_and_replaced_until_the_next_fetch() -> None:
    tier = MemoryTier(300_000, group_arenas=True)
    first = os.urandom(100_000)
    await tier.put(k(0, "aa"), first)
    regions = Regions(max_bytes=1 << 20, populate=False)
    peer = f"unix:uid={os.getuid()}:pid=1"
    region, fd = regions.create("acme", peer, 64 << 10)
    os.close(fd)
    hold = regions.hold(region.id, "acme", peer)  # a fetch lends the envelope in place
    assert hold is not None
    view = (await tier.get(k(0, "aa"))).data
    at = tier.locate("aa", view)
    region.leases.append(view)
    del view
    hold.release()
    worker = _mapped(tier.group_arena("aa"))
    await tier.delete(k(0, "aa"))
    for i in range(1, 4):  # the room is taken again, and more: nothing lands on the lent bytes
        await tier.put(k(i, "aa"), os.urandom(100_000))
    assert worker[at : at + len(first)] == first
    # the next fetch on the region: the worker is done with the load before, the extent is free
    hold = regions.hold(region.id, "acme", peer)
    assert hold is not None and region.leases == []
    hold.release()
    await tier.delete(k(1, "aa"))
    await tier.put(k(9, "aa"), b"\x00" * 100_000)
    assert tier.locate("aa", (await tier.get(k(9, "aa"))).data) is not None
    assert at in [tier.locate("aa", (await tier.get(k(j, "aa"))).data) for j in (2, 3, 9)]  # reused now
    regions.close()
    await tier.aclose()


async def test_freed_bytes_of_group_arenas_go_back_to_the_system_when_trimmed() -> None:
    tier, blob = await _holding(8, 1)
    assert _resident(tier, "aa") >= 8 << 20
    await tier.put(k(0, "cc"), blob)  # another owner's namespace evicts one: still resident (the control)
    assert _resident(tier, "aa") >= 8 << 20
    for i in range(1, 8):  # past the budget by more than an eighth: every arena's free holes are punched
        await tier.put(k(i, "cc"), blob)
    assert _resident(tier, "aa") < 8 << 20 and _resident(tier, "aa") + _resident(tier, "cc") <= CAP + CAP // 8 + (1 << 20)
    assert await tier.delete_owner("ee") > 0
    assert _resident(tier, "cc") < 1 << 20  # a deleted owner's ciphertext does not stay in memory
    for i in (20, 21):
        await tier.put(k(i, "aa", owner="dd"), blob)
    assert _resident(tier, "aa") >= 2 << 20
    assert await tier.delete_group("aa") == 2 and _resident(tier, "aa") < 1 << 20  # nor a deleted group's
    await tier.aclose()


async def test_a_store_that_evicts_its_own_groups_envelopes_seals_into_their_pages_still_resident() -> None:
    """Past the bound, the arenas of other groups are trimmed (the control) and the storing
    group's holes are not: its reservation lands on pages its evictions just freed, so sealing
    into it faults nothing in."""
    tier, blob = await _holding(4, 2)
    for i in range(4):
        await tier.put(k(i, "cc"), blob)
    for i in (0, 1):  # cc's freed bytes stay resident, not trimmed by a deletion of one key
        assert await tier.delete(k(i, "cc"))
    assert _resident(tier, "cc") >= 4 << 20
    for i in (10, 11):  # aa grows into fresh pages: under the budget, nothing is evicted
        await tier.put(k(i, "aa", owner="dd"), blob)
    before = _resident(tier, "aa")
    res = tier.reserve(k(12, "aa", owner="dd"), 1 << 20)  # evicts aa's oldest: over the bound
    assert not await tier.contains(k(0, "aa", owner="dd"))
    assert _resident(tier, "cc") <= 2 << 20  # the other group's holes were punched (the control)
    assert _resident(tier, "aa") == before  # the storing group's were not
    spanned = range(res.extent.offset // PAGE, -(-(res.extent.offset + res.nbytes) // PAGE))
    assert set(spanned) <= set(allocated_pages(tier.group_arena("aa").fd))  # it seals into pages already there
    res.view[:] = blob
    assert tier.commit(res)
    assert (await tier.get(k(12, "aa", owner="dd"))).data.tobytes() == blob
    await tier.aclose()


async def test_the_storing_groups_holes_are_trimmed_too_where_the_others_cannot_bring_the_arenas_under() -> None:
    tier, blob = await _holding(8, 3)
    for i in range(6):  # aa's freed bytes stay resident until a trim
        assert await tier.delete(k(i, "aa", owner="dd"))
    for i in range(6):  # cc fills the budget with no holes of its own to give back
        await tier.put(k(i, "cc"), blob)
    assert _resident(tier, "aa") >= 8 << 20 and _resident(tier, "cc") >= 6 << 20
    await tier.put(k(20, "aa", owner="dd"), blob)  # evicts aa's oldest: only aa's holes can go
    assert _resident(tier, "aa") <= 2 << 20
    assert _resident(tier, "aa") + _resident(tier, "cc") <= CAP + CAP // 8
    assert _resident(tier, "cc") >= 6 << 20  # cc's envelopes are untouched
    for i in range(6):
        assert (await tier.get(k(i, "cc"))).data.tobytes() == blob
    await tier.aclose()


AHEAD_CAP = 64 << 20  # the budget of the populating-ahead tests (its bound: 72 MiB)


class _Spy:
    """A ``populate`` that records what it was handed and faults it in on a thread, as the
    server's does (``gateway.protocol.shmpages.prefault_behind``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[memoryview], Callable[[], bool]]] = []
        self.threads: list[threading.Thread] = []

    def __call__(self, views: Sequence[memoryview], stop: Callable[[], bool]) -> threading.Thread | None:
        self.calls.append((list(views), stop))
        thread = prefault_behind(views, stop)
        if thread is not None:
            self.threads.append(thread)
        return thread

    def join(self) -> None:
        for thread in self.threads:
            thread.join(10)


def _pages(offset: int, nbytes: int) -> set[int]:
    return set(range(offset // PAGE, -(-(offset + nbytes) // PAGE)))


async def test_a_groups_arena_is_populated_ahead_so_its_next_store_seals_into_pages_already_there() -> None:
    spy = _Spy()
    tier = MemoryTier(AHEAD_CAP, group_arenas=True, ahead_bytes=16 << 20, populate=spy)
    lazy = MemoryTier(AHEAD_CAP, group_arenas=True)  # the control: nothing ahead
    arena, bare = tier.group_arena("aa"), lazy.group_arena("aa")
    spy.join()
    assert len(spy.calls) == 1 and 16 << 20 <= _resident(tier, "aa") <= (16 << 20) + PAGE
    assert _resident(lazy, "aa") == 0 and arena.dirty == 16 << 20
    for t in (tier, lazy):
        blob = os.urandom(1 << 20)
        reservations = [t.reserve(k(i, "aa"), 1 << 20) for i in range(8)]
        backed = set(allocated_pages(t.group_arena("aa").fd))
        covered = all(_pages(r.extent.offset, r.nbytes) <= backed for r in reservations)
        assert covered is (t is tier)  # every reserved page is there before the seal writes it
        for r in reservations:
            r.view[:] = blob
            assert t.commit(r)
        assert [(await t.get(k(i, "aa"))).data.tobytes() for i in range(8)] == [blob] * 8
    spy.join()
    assert bare.dirty == 0 and len(spy.calls) == 2  # after the store, the 8 MiB it took are named again
    assert arena.dirty == 16 << 20 and _resident(tier, "aa") >= 24 << 20
    await tier.aclose()
    await lazy.aclose()


async def test_a_store_still_sealing_is_not_populated_ahead_of_until_its_last_commit() -> None:
    spy = _Spy()
    tier = MemoryTier(AHEAD_CAP, group_arenas=True, ahead_bytes=16 << 20, populate=spy)
    tier.group_arena("aa")
    spy.join()
    first = [tier.reserve(k(i, "aa"), 6 << 20) for i in range(3)]  # uses 18 MiB: more than was ahead
    assert tier.commit(first[0]) and tier.commit(first[1])
    assert len(spy.calls) == 1  # a reservation of the group is still open: nothing more yet
    assert tier.commit(first[2])
    assert len(spy.calls) == 2
    views, _ = spy.calls[1]
    spy.join()
    arena = tier.group_arena("aa")
    held = set().union(*(_pages(e.offset, e.nbytes) for e in arena.region_extents()))
    named = set().union(*(_pages(np.frombuffer(v, dtype=np.uint8).ctypes.data - arena.region().ctypes.data, v.nbytes) for v in views))
    assert named and not named & held  # only free pages are populated ahead
    assert named <= set(allocated_pages(arena.fd))
    await tier.aclose()


async def test_populating_ahead_keeps_every_arena_within_the_trim_bound() -> None:
    spy = _Spy()
    tier = MemoryTier(AHEAD_CAP, group_arenas=True, ahead_bytes=48 << 20, populate=spy)
    blob = os.urandom(1 << 20)
    for i in range(40):  # aa holds 40 MiB of the 64; the arenas' bound is 72
        await tier.put(k(i, "aa", owner="dd"), blob)
        spy.join()
    tier.group_arena("cc")
    spy.join()
    aa, cc = _resident(tier, "aa"), _resident(tier, "cc")
    assert aa >= 40 << 20 and cc >= 4 << 20  # both got some ahead (the control)
    assert aa + cc <= AHEAD_CAP + AHEAD_CAP // 8 + 2 * PAGE  # never past the bound
    for i in range(40, 70):  # a store past the budget evicts and trims: the bound still holds
        await tier.put(k(i, "aa", owner="dd"), blob)
        spy.join()
    assert _resident(tier, "aa") + _resident(tier, "cc") <= AHEAD_CAP + AHEAD_CAP // 8 + 2 * PAGE
    await tier.aclose()


async def test_populating_ahead_stops_once_its_arena_is_trimmed_or_closed() -> None:
    stops: list[Callable[[], bool]] = []

    def recording(views: Sequence[memoryview], stop: Callable[[], bool]) -> None:
        stops.append(stop)

    tier = MemoryTier(AHEAD_CAP, group_arenas=True, ahead_bytes=16 << 20, populate=recording)
    arena = tier.group_arena("aa")
    assert len(stops) == 1 and not stops[0]()
    arena.trim()
    assert stops[0]()  # the pages it was faulting in were punched out: it stops
    await tier.put(k(0, "aa"), b"x" * 1000)  # the trim gave the ahead back: named again
    assert len(stops) == 2 and not stops[1]()
    await tier.aclose()
    assert stops[1]()
