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

import numpy as np
import pytest

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
