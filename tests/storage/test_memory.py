"""MemoryTier beyond the contract: LRU order, byte budget, pins, TierFull, per-owner fair share."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import ChunkKey, ChunkNotFound, MemoryTier, TierFull


def k(i: int, owner: str = "aa", group: str = "bb") -> ChunkKey:
    return ChunkKey(owner, group, f"{i:064x}")


async def present(tier: MemoryTier, keys: list[ChunkKey]) -> list[bool]:
    return await tier.contains_many(keys)


async def test_eviction_order_is_lru_and_get_refreshes() -> None:
    tier = MemoryTier(400)
    keys = [k(i) for i in range(4)]
    for key in keys:
        await tier.put(key, bytes(100))
    await tier.get(keys[0])  # 0 becomes most recent: 1 is now the oldest
    await tier.put(k(4), bytes(100))
    assert await present(tier, keys) == [True, False, True, True]
    await tier.put(k(5), bytes(150))  # needs 150: evicts 2 then 3 (oldest first), not 0
    assert await present(tier, keys) == [True, False, False, False]
    assert await tier.contains(k(4)) and await tier.contains(k(5))
    assert tier.stats().evictions == 3


async def test_replace_accounts_bytes_and_refreshes() -> None:
    tier = MemoryTier(300)
    await tier.put(k(0), bytes(100))
    await tier.put(k(1), bytes(100))
    await tier.put(k(0), bytes(200))  # 100 freed, 200 taken: exactly full, nothing evicted
    assert tier.used_bytes == 300 and tier.stats().evictions == 0
    await tier.put(k(0), bytes(10))
    assert tier.used_bytes == 110
    assert tier.stats().owner_bytes == {"aa": 110}


async def test_put_copies_into_the_arena_and_get_is_a_view_of_it() -> None:
    # envelopes live in the tier's arena (put copies once, or the data path seals
    # straight into a reserved extent); get hands out views of the arena, not copies
    tier = MemoryTier(1000)
    buf = bytearray(b"abc")
    await tier.put(k(0), buf)
    buf[0] = ord("z")  # the caller's buffer is its own again after put
    got, again = await tier.get(k(0)), await tier.get(k(0))
    assert bytes(got.data) == b"abc"
    base = tier.arena.array(tier._data[k(0)]).ctypes.data
    assert np.frombuffer(got.data, dtype=np.uint8).ctypes.data == base  # zero copy
    assert np.frombuffer(again.data, dtype=np.uint8).ctypes.data == base


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "pin", "unpin", "delete"]), st.integers(0, 15), st.integers(0, 400)
        ),
        max_size=80,
    )
)
async def test_budget_never_exceeded_and_accounting_matches(ops: list[tuple[str, int, int]]) -> None:
    tier = MemoryTier(1000, owner_quota_bytes=400)
    model: dict[ChunkKey, int] = {}
    for op, i, size in ops:
        key = k(i, owner="0a" if i % 2 else "0b")
        if op == "put":
            try:
                await tier.put(key, bytes(size))
                model[key] = size
            except TierFull:
                pass
        elif op == "get":
            with contextlib.suppress(ChunkNotFound):
                await tier.get(key)
        elif op == "pin":
            with contextlib.suppress(ChunkNotFound):
                await tier.pin(key)
        elif op == "unpin":
            await tier.unpin(key)
        else:
            await tier.delete(key)
        held = set(await tier.list_keys())
        model = {key: n for key, n in model.items() if key in held}
        assert held == set(model)
        assert tier.used_bytes == sum(model.values()) <= 1000
        stats = tier.stats()
        assert stats.pinned_bytes == sum(n for key, n in model.items() if tier.is_pinned(key))
        assert sum(stats.owner_bytes.values()) == stats.used_bytes


async def test_pinned_chunks_survive_a_flood() -> None:
    tier = MemoryTier(10_000)
    pinned = [k(i, group="01") for i in range(5)]
    for key in pinned:
        await tier.put(key, bytes(1000))
        await tier.pin(key)
    for i in range(200):
        await tier.put(k(1000 + i), bytes(500))
    assert await present(tier, pinned) == [True] * 5
    assert tier.stats().pinned_bytes == 5000
    assert tier.used_bytes <= 10_000
    # the unpinned half of the budget is all the flood could use
    with pytest.raises(TierFull):
        await tier.put(k(5000), bytes(5001))
    await tier.unpin(pinned[0])
    await tier.put(k(5000), bytes(5001))  # the unpinned chunk can go now
    assert await present(tier, pinned) == [False, True, True, True, True]


async def test_put_too_large_raises_tier_full_and_changes_nothing() -> None:
    tier = MemoryTier(1000)
    for i in range(4):
        await tier.put(k(i), bytes(200))
    await tier.pin(k(0))
    before = (set(await tier.list_keys()), tier.used_bytes)
    with pytest.raises(TierFull):
        await tier.put(k(9), bytes(1001))  # larger than the whole budget
    with pytest.raises(TierFull):
        await tier.put(k(9), bytes(801))  # fits only by evicting the pinned chunk
    with pytest.raises(TierFull):
        await tier.put(k(1), bytes(801))  # a replacement that cannot fit keeps the old value
    assert (set(await tier.list_keys()), tier.used_bytes) == before
    assert (await tier.get(k(1))).nbytes == 200
    assert tier.stats().evictions == 0 and tier.stats().rejected_puts == 3
    await tier.put(k(9), bytes(800))  # positive control: this one fits after evicting 1..3
    assert tier.stats().evictions == 3


@pytest.mark.parametrize("quota", [500, None])
async def test_owner_flood_and_fair_share(quota: int | None) -> None:
    tier = MemoryTier(1000, owner_quota_bytes=quota)
    b_keys = [k(i, owner="0b") for i in range(4)]  # B holds 400, within a 500 quota
    for key in b_keys:
        await tier.put(key, bytes(100))
    for i in range(50):  # A floods
        await tier.put(k(i, owner="0a"), bytes(100))
        await tier.get(k(i, owner="0a"))
    survivors = await present(tier, b_keys)
    if quota is not None:
        assert survivors == [True] * 4
        assert tier.stats().owner_bytes == {"0a": 600, "0b": 400}
    else:  # the control: plain LRU lets the flood evict every one of B's chunks
        assert survivors == [False] * 4
    assert tier.used_bytes <= 1000


async def test_over_quota_owner_is_evicted_first_by_others() -> None:
    tier = MemoryTier(1000, owner_quota_bytes=400)
    for i in range(8):  # A takes 800 while the tier is empty (quota is a share, not a cap)
        await tier.put(k(i, owner="0a"), bytes(100))
    b_old = k(0, owner="0b")
    await tier.put(b_old, bytes(100))
    await tier.put(k(1, owner="0b"), bytes(100))  # full
    for i in (1, 2, 3, 4, 5, 6, 7, 0):  # A's chunks become recent: B's are the global LRU now
        await tier.get(k(i, owner="0a"))
    for i in range(2, 4):
        await tier.put(k(i, owner="0b"), bytes(100))
    assert await tier.contains(b_old)  # plain LRU would have evicted B's chunk
    assert tier.stats().owner_bytes == {"0a": 600, "0b": 400}
    # A's least recent went first
    assert await present(tier, [k(i, owner="0a") for i in (1, 2, 3, 0)]) == [False, False, True, True]


async def test_over_quota_owner_cannot_evict_within_quota_owner() -> None:
    tier = MemoryTier(1000, owner_quota_bytes=500)
    for i in range(5):
        await tier.put(k(i, owner="0b"), bytes(100))
    for i in range(5):
        await tier.put(k(i, owner="0a"), bytes(100))
        await tier.pin(k(i, owner="0a"))
    with pytest.raises(TierFull):  # A is at quota with only pinned chunks: it may not take B's
        await tier.put(k(9, owner="0a"), bytes(100))
    assert tier.stats().owner_bytes == {"0a": 500, "0b": 500}
    await tier.put(k(9, owner="0b"), bytes(100))  # B over its quota pays with its own
    assert not await tier.contains(k(0, owner="0b"))


async def test_random_owner_mix_keeps_within_quota_owners_whole() -> None:
    rng = random.Random(7)
    tier = MemoryTier(4000, owner_quota_bytes=1000)
    quiet = [k(i, owner="0c") for i in range(9)]
    for key in quiet:
        await tier.put(key, bytes(100))  # 900: within its quota
    for i in range(500):
        owner = rng.choice(["0a", "0b", "0d"])
        await tier.put(k(i, owner=owner), bytes(rng.randint(1, 400)))
    assert await present(tier, quiet) == [True] * 9
    assert tier.used_bytes <= 4000


async def test_delete_group_and_owner_update_indexes_and_stats() -> None:
    tier = MemoryTier(10_000)
    await tier.put(k(0, "0a", "01"), bytes(10))
    await tier.put(k(1, "0a", "02"), bytes(20))
    await tier.put(k(2, "0b", "01"), bytes(30))
    await tier.pin(k(2, "0b", "01"))
    assert await tier.delete_group("01") == 2
    stats = tier.stats()
    assert stats.used_bytes == 20 and stats.pinned_bytes == 0 and stats.owner_bytes == {"0a": 20}
    assert await tier.delete_owner("0a") == 1
    assert tier.stats().owner_bytes == {} and tier.used_bytes == 0


async def test_hit_and_miss_counters() -> None:
    tier = MemoryTier(100)
    await tier.put(k(0), b"x")
    await tier.get(k(0))
    with pytest.raises(ChunkNotFound):
        await tier.get(k(1))
    s = tier.stats()
    assert (s.hits, s.misses, s.puts) == (1, 1, 1)


def test_bad_configuration() -> None:
    with pytest.raises(ValueError):
        MemoryTier(-1)
    with pytest.raises(ValueError):
        MemoryTier(100, owner_quota_bytes=-5)
