"""The promises every tier keeps, run against each real tier (no mocks).

To add a tier, add a :class:`TierSpec` to ``SPECS``: an async factory that gets ``tmp_path`` and the
values of the fixtures it names, for example::

    async def _redis(tmp_path, fx):
        return RedisTier(fx["redis_url"], prefix=fx["redis_prefix"])

    SPECS["redis"] = TierSpec(_redis, fixtures=("redis_url", "redis_prefix"), marks=(pytest.mark.redis,))
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from storage import ChunkKey, ChunkNotFound, DiskTier, InvalidChunk, MemoryTier, StoredChunk, Tier
from storage.types import TierError

BIG = 33_554_432 + 512 * 1024  # 33.5 MiB: a 256-token chunk of a large model



@dataclass(frozen=True)
class TierSpec:
    make: Callable[[Path, dict[str, Any]], Awaitable[Tier]]
    fixtures: tuple[str, ...] = ()
    marks: tuple[pytest.MarkDecorator, ...] = ()


async def _memory(tmp_path: Path, fx: dict[str, Any]) -> Tier:
    return MemoryTier(256 * 1024 * 1024)


async def _disk(tmp_path: Path, fx: dict[str, Any]) -> Tier:
    return await DiskTier.open(tmp_path / "disk", fsync=True)


async def _disk_sha256(tmp_path: Path, fx: dict[str, Any]) -> Tier:
    return await DiskTier.open(tmp_path / "disk", fsync=False, checksum="sha256")


async def _redis(tmp_path: Path, fx: dict[str, Any]) -> Tier:
    from storage.redis import RedisTier

    # the contract asserts no timing: generous timeouts keep it steady on a loaded machine
    return RedisTier(fx["redis_url"], prefix=fx["redis_prefix"], op_timeout_s=2.0, put_timeout_s=10.0)


async def _redis_cluster(tmp_path: Path, fx: dict[str, Any]) -> Tier:
    from storage.redis_cluster import RedisClusterTier

    return RedisClusterTier(fx["redis_cluster"].url, prefix=f"kvgate-test:{secrets.token_hex(4)}:",
                            op_timeout_s=2.0, read_timeout_s=5.0, put_timeout_s=10.0)


SPECS: dict[str, TierSpec] = {
    "memory": TierSpec(_memory),
    "disk": TierSpec(_disk),
    "disk-sha256-nofsync": TierSpec(_disk_sha256),
    "redis": TierSpec(_redis, fixtures=("redis_url", "redis_prefix"), marks=(pytest.mark.redis,)),
    # a real 6-process cluster the session starts (tests/support/redis_cluster.py)
    "redis-cluster": TierSpec(_redis_cluster, fixtures=("redis_cluster",), marks=(pytest.mark.redis,)),
}


@pytest.fixture(params=[pytest.param(name, marks=spec.marks) for name, spec in SPECS.items()])
def tier_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Awaitable[Tier]]:
    """A factory of fresh tiers of one kind; fixtures the kind needs are resolved here (sync)."""
    spec = SPECS[request.param]
    fx = {name: request.getfixturevalue(name) for name in spec.fixtures}
    return lambda: spec.make(tmp_path, fx)


@pytest.fixture
async def tier(tier_factory: Callable[[], Awaitable[Tier]]) -> AsyncIterator[Tier]:
    t = await tier_factory()
    try:
        yield t
    finally:
        await t.aclose()


def key(owner: str = "aa", group: str = "bb", digest: str | None = None) -> ChunkKey:
    return ChunkKey(owner, group, digest or secrets.token_hex(32))


async def test_round_trip_of_every_buffer_type(tier: Tier) -> None:
    payload = secrets.token_bytes(4096)
    for data in (payload, bytearray(payload), memoryview(payload), memoryview(bytearray(payload))):
        k = key()
        await tier.put(k, data)
        got = await tier.get(k)
        assert isinstance(got, StoredChunk)
        assert got.key == k and got.tier == tier.name
        assert bytes(got.data) == payload and got.nbytes == len(payload)
        assert got.data.readonly
        with pytest.raises(TypeError):
            got.data[0] = 0  # type: ignore[index]


async def test_multidimensional_view_is_stored_as_its_bytes(tier: Tier) -> None:
    raw = bytearray(range(256)) * 4
    view = memoryview(raw).cast("B", (32, 32))
    k = key()
    await tier.put(k, view)
    assert bytes((await tier.get(k)).data) == bytes(raw)


async def test_bad_input_is_rejected_and_changes_nothing(tier: Tier) -> None:
    k = key()
    with pytest.raises(InvalidChunk):
        await tier.put(k, "text")  # type: ignore[arg-type]
    with pytest.raises(InvalidChunk):
        await tier.put(k, memoryview(bytearray(64))[::2])  # not contiguous
    with pytest.raises(InvalidChunk):
        await tier.put(("aa", "bb", "cc"), b"x")  # type: ignore[arg-type]
    assert not await tier.contains(k)
    assert await tier.list_keys() == []


async def test_missing_key_raises_typed_error_with_key(tier: Tier) -> None:
    k = key()
    with pytest.raises(ChunkNotFound) as info:
        await tier.get(k)
    assert info.value.key == k
    assert info.value.tier == tier.name
    assert isinstance(info.value, TierError)


async def test_replace(tier: Tier) -> None:
    k = key()
    await tier.put(k, b"first value, longer")
    await tier.put(k, b"second")
    assert bytes((await tier.get(k)).data) == b"second"
    assert await tier.list_keys() == [k]


async def test_delete_returns_whether_something_was_removed(tier: Tier) -> None:
    k, other = key(), key()
    await tier.put(k, b"x")
    await tier.put(other, b"y")
    assert await tier.delete(k) is True
    assert await tier.delete(k) is False
    assert not await tier.contains(k)
    with pytest.raises(ChunkNotFound):
        await tier.get(k)
    assert bytes((await tier.get(other)).data) == b"y"


async def test_contains_and_contains_many(tier: Tier) -> None:
    present, absent = key(), key()
    await tier.put(present, b"p")
    assert await tier.contains(present) is True
    assert await tier.contains(absent) is False
    assert await tier.contains_many([present, absent, present]) == [True, False, True]
    assert await tier.contains_many([]) == []


async def test_delete_group_removes_exactly_that_group(tier: Tier) -> None:
    g1 = [key("a1", "01") for _ in range(5)] + [key("a2", "01")]
    g2 = [key("a1", "02") for _ in range(3)]
    for k in g1 + g2:
        await tier.put(k, k.digest.encode())
    assert await tier.delete_group("01") == len(g1)
    assert await tier.contains_many(g1) == [False] * len(g1)
    for k in g2:  # positive control: the others are still there and readable
        assert bytes((await tier.get(k)).data) == k.digest.encode()
    assert await tier.delete_group("01") == 0
    assert await tier.delete_group("ff") == 0


async def test_delete_owner_removes_exactly_that_owner(tier: Tier) -> None:
    mine = [key("0a", "01"), key("0a", "02"), key("0a", "02")]
    theirs = [key("0b", "01"), key("0b", "02")]
    for k in mine + theirs:
        await tier.put(k, k.digest.encode())
    assert await tier.delete_owner("0a") == len(mine)
    assert await tier.contains_many(mine) == [False] * len(mine)
    for k in theirs:
        assert bytes((await tier.get(k)).data) == k.digest.encode()
    assert await tier.delete_owner("0a") == 0


async def test_list_keys(tier: Tier) -> None:
    a = [key("aa", "01") for _ in range(3)]
    b = [key("aa", "02") for _ in range(2)]
    for k in a + b:
        await tier.put(k, b"v")
    assert set(await tier.list_keys()) == set(a + b)
    assert set(await tier.list_keys("01")) == set(a)
    assert await tier.list_keys("03") == []


async def test_pin_absent_key_raises_and_pins_survive_replacement(tier: Tier) -> None:
    k = key()
    with pytest.raises(ChunkNotFound) as info:
        await tier.pin(k)
    assert info.value.key == k
    await tier.put(k, b"v1")
    await tier.pin(k)
    await tier.pin(k)  # idempotent
    await tier.put(k, b"v2")
    assert bytes((await tier.get(k)).data) == b"v2"
    await tier.unpin(k)
    await tier.unpin(k)
    await tier.unpin(key())  # unpinning an absent key is not an error
    assert await tier.delete(k) is True


async def test_zero_length_value(tier: Tier) -> None:
    k = key()
    await tier.put(k, b"")
    assert await tier.contains(k)
    got = await tier.get(k)
    assert got.nbytes == 0 and bytes(got.data) == b""


async def test_large_value(tier: Tier) -> None:
    payload = bytearray(secrets.token_bytes(BIG))
    k = key()
    await tier.put(k, payload)
    got = await tier.get(k)
    assert got.nbytes == BIG
    assert got.data == memoryview(payload)


async def test_aclose_is_idempotent_and_closes(tier_factory: Callable[[], Awaitable[Tier]]) -> None:
    t = await tier_factory()
    k = key()
    await t.put(k, b"v")
    await t.aclose()
    await t.aclose()
    with pytest.raises(TierError):
        await t.get(k)


async def test_async_context_manager(tier_factory: Callable[[], Awaitable[Tier]]) -> None:
    t = await tier_factory()
    k = key()
    async with t as entered:
        assert entered is t
        await t.put(k, b"inside")
        assert bytes((await t.get(k)).data) == b"inside"
    with pytest.raises(TierError):
        await t.put(k, b"after close")


async def test_used_bytes_tracks_puts_and_deletes(tier: Tier) -> None:
    assert tier.used_bytes == 0
    k = key()
    await tier.put(k, bytes(1000))
    one = tier.used_bytes
    assert one >= 1000
    await tier.put(k, bytes(1000))  # replace: no double counting
    assert tier.used_bytes == one
    await tier.delete(k)
    assert tier.used_bytes == 0


async def test_a_held_view_never_changes_when_its_key_is_replaced_or_deleted(tier: Tier) -> None:
    # the memory tier reuses arena extents; a reader's view must outlive eviction
    k, other = key(), key()
    first = secrets.token_bytes(8192)
    await tier.put(k, first)
    held = (await tier.get(k)).data
    await tier.put(k, secrets.token_bytes(8192))  # replaced while held
    await tier.delete(k)
    for _ in range(8):  # the freed room is reused by other chunks
        await tier.put(other, secrets.token_bytes(8192))
    assert bytes(held) == first
