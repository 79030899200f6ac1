"""Write-behind: a store returns once the chunk is in the fastest tier; a paused or
killed Redis, or a failing disk, during a flood never blocks or fails a store; a crash loses only
the queued copies; ``aclose`` drains or counts what it drops; write-through stays available."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from storage import ChunkKey, DiskTier, MemoryTier
from storage.manager import TierManager
from storage.redis import RedisTier
from tests.support.services import free_port


def k(i: int, group: str = "bb") -> ChunkKey:
    return ChunkKey("aa", group, f"{i:064x}")


def payload(i: int, n: int = 64 << 10) -> bytes:
    return i.to_bytes(4, "little") * (n // 4)


def _redis_server(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        ping = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True, check=False)
        if ping.stdout.strip() == "PONG":
            return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


async def _flood(tiers: TierManager, n: int, *, slowest_s: float = 0.25) -> list[float]:
    """Store n chunks; every store must return, in the fastest tier, without waiting on the rest."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        assert await tiers.put(k(i), payload(i)) == ["memory"]
        times.append(time.perf_counter() - t0)
    assert max(times) < slowest_s, max(times)
    return times


@pytest.mark.redis
@pytest.mark.parametrize("fault", ["pause", "kill"])
async def test_a_paused_or_killed_redis_never_blocks_or_fails_a_store(fault: str) -> None:
    port = free_port()
    proc = _redis_server(port)
    try:
        redis = await RedisTier.open(f"redis://127.0.0.1:{port}/0", prefix="wb:", op_timeout_s=0.1, put_timeout_s=0.5)
        tiers = TierManager([MemoryTier(64 << 20), redis], write_mode="behind", max_pending_items=16, drain_timeout_s=1.0)
        await _flood(tiers, 8)
        await tiers.flush()
        assert tiers.behind.written["redis"] == 8  # the positive control: copies land
        if fault == "pause":
            os.kill(proc.pid, signal.SIGSTOP)
        else:
            proc.kill()
            proc.wait()
        await _flood(tiers, 200)
        assert tiers.dropped["redis"] > 0  # back-pressure dropped copies, counted
        assert tiers.behind.queued <= 16
        assert all([await tiers.tiers[0].contains(k(i)) for i in range(200)])
        t0 = time.perf_counter()
        await tiers.aclose()  # drains at most drain_timeout_s, then counts what it drops
        assert time.perf_counter() - t0 < 3.0
        b = tiers.behind
        assert b.written["redis"] + b.errors["redis"] + b.dropped["redis"] == 208
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


async def test_a_failing_disk_during_a_flood_never_fails_a_store(tmp_path: Path) -> None:
    disk = await DiskTier.open(tmp_path / "disk", fsync=False)
    tiers = TierManager([MemoryTier(64 << 20), disk], write_mode="behind", max_pending_items=32)
    await _flood(tiers, 4)
    await tiers.flush()
    assert len(await disk.list_keys()) == 4  # the positive control
    shutil.rmtree(tmp_path / "disk")
    (tmp_path / "disk").write_bytes(b"not a directory")  # every later disk write fails
    await _flood(tiers, 100)
    await tiers.flush()
    assert tiers.behind.errors["disk"] + tiers.dropped["disk"] == 100
    assert all([await tiers.tiers[0].contains(k(i)) for i in range(100)])
    await tiers.aclose()


async def test_a_crash_loses_only_the_queued_copies(tmp_path: Path) -> None:
    disk = await DiskTier.open(tmp_path / "disk", fsync=True)
    tiers = TierManager([MemoryTier(64 << 20), disk], write_mode="behind", drain_timeout_s=0.0)
    for i in range(40):
        await tiers.put(k(i), payload(i))
    await asyncio.sleep(0)  # a copy or so gets going
    lost = await tiers.behind.close(drain_timeout_s=0.0)  # the "crash": queued copies never land
    written = tiers.behind.written["disk"]
    assert lost == tiers.dropped["disk"] and lost + written + tiers.behind.errors["disk"] == 40
    reopened = await DiskTier.open(tmp_path / "disk", fsync=True)
    on_disk = await reopened.list_keys()
    assert written <= len(on_disk) <= written + 1  # the copy being written at the crash may land whole
    for key in on_disk:  # whatever landed is whole and right
        assert bytes((await reopened.get(key)).data) == payload(int(key.digest, 16))
    await reopened.aclose()


async def test_aclose_drains_and_write_through_writes_before_returning(tmp_path: Path) -> None:
    disk = await DiskTier.open(tmp_path / "a", fsync=False)
    tiers = TierManager([MemoryTier(64 << 20), disk], write_mode="behind")
    for i in range(30):
        await tiers.put(k(i), payload(i))
    await tiers.aclose()
    reopened = await DiskTier.open(tmp_path / "a", fsync=False)
    assert len(await reopened.list_keys()) == 30 and sum(tiers.dropped.values()) == 0
    await reopened.aclose()

    disk = await DiskTier.open(tmp_path / "b", fsync=False)
    through = TierManager([MemoryTier(64 << 20), disk], write_mode="through")
    assert await through.put(k(1), payload(1)) == ["memory", "disk"]
    assert await disk.contains(k(1)) and through.behind.queued == 0
    await through.aclose()


async def test_a_delete_purges_queued_copies_so_none_lands_after_it(tmp_path: Path) -> None:
    disk = await DiskTier.open(tmp_path / "disk", fsync=False)
    tiers = TierManager([MemoryTier(64 << 20), disk], write_mode="behind")
    for i in range(20):
        await tiers.put(k(i, group="cc"), payload(i))
    await tiers.put(k(99), payload(99))
    await tiers.delete_group("cc")
    await tiers.flush()
    assert await disk.list_keys() == [k(99)]  # the control survives; the cleared group is gone
    await tiers.aclose()


async def test_reserved_extent_is_committed_and_copied_behind(tmp_path: Path) -> None:
    disk = await DiskTier.open(tmp_path / "disk", fsync=False)
    tiers = TierManager([MemoryTier(64 << 20), disk], write_mode="behind")
    res = tiers.reserve(k(5), 4096)
    res.view[:] = payload(5, 4096)
    assert await tiers.commit(res)
    await tiers.flush()
    assert bytes((await disk.get(k(5))).data) == payload(5, 4096)
    await tiers.aclose()


async def test_copies_yield_while_the_engine_is_busy_and_never_past_their_bound(tmp_path: Path) -> None:
    """``pace``: a copy waits while its process's engine runs steps, goes as soon as it is idle,
    and goes anyway ``finish_s`` after it was queued; a copy purged while it waits never lands."""
    disk = await DiskTier.open(tmp_path / "disk", fsync=False)
    tiers = TierManager([MemoryTier(64 << 20), disk], write_mode="behind")
    busy = [True]
    tiers.behind.pace(lambda: busy[0], 30.0)
    await tiers.put(k(1), payload(1))
    await asyncio.sleep(0.2)
    assert await disk.list_keys() == []  # the engine is busy: the copy waits
    busy[0] = False
    await asyncio.wait_for(tiers.flush(), 5)  # idle: it goes at once
    assert await disk.list_keys() == [k(1)]
    # busy for good: a copy still lands at its bound, so a store is never starved
    busy[0] = True
    tiers.behind.pace(lambda: busy[0], 0.3)
    t0 = time.monotonic()
    await tiers.put(k(2), payload(2))
    await asyncio.wait_for(tiers.flush(), 5)
    assert 0.25 <= time.monotonic() - t0 < 3.0
    assert await disk.list_keys() == [k(1), k(2)] and tiers.behind.paced_s >= 0.25
    # a secure clear does not wait for a copy that is waiting for its turn: it is dropped
    tiers.behind.pace(lambda: busy[0], 30.0)
    await tiers.put(k(3, group="cc"), payload(3))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    await asyncio.wait_for(tiers.delete_group("cc"), 5)
    assert time.monotonic() - t0 < 1.0
    busy[0] = False
    await tiers.flush()
    assert await disk.list_keys() == [k(1), k(2)]
    await tiers.aclose()
