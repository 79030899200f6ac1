"""DiskTier beyond the contract: crash leftovers, corruption, restart, concurrent writers,
permissions, path safety, capacity."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import stat
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from storage import ChunkKey, ChunkNotFound, DiskTier, TierFull, TierUnavailable, _diskio
from storage._diskio import HEADER
from tests.support.paths import REPO

ROOT_DIR = REPO


def k(i: int, owner: str = "aa", group: str = "bb") -> ChunkKey:
    return ChunkKey(owner, group, f"{i:064x}")


def chunk_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvc"))


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.tmp"))


def dead_pid() -> int:
    code = "import os; print(os.getpid())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(proc.stdout)


# crc32c (optional, LGPL) is not a dependency; the standard-library algorithms are tested here.
CHECKSUMS = ["sha256", "crc32"]


def expected_checksum(algo: str, payload: bytes) -> bytes:
    if algo == "sha256":
        return hashlib.sha256(payload).digest()
    return zlib.crc32(payload).to_bytes(4, "little") + bytes(28)


@pytest.mark.parametrize("algo", CHECKSUMS)
async def test_file_layout_and_header(tmp_path: Path, algo: str) -> None:
    payload = secrets.token_bytes(1000)
    async with DiskTier(tmp_path / "d", checksum=algo) as tier:
        key = k(0xABC)
        await tier.put(key, payload)
        path = tier.path_of(key)
    assert path == tmp_path / "d" / "aa" / "bb" / "00" / f"{key.digest}.kvc"
    raw = path.read_bytes()
    magic, version, algo_id, _, length, checksum = HEADER.unpack(raw[: HEADER.size])
    assert (magic, version, algo_id, length) == (b"KVGC", 1, _diskio.ALGORITHMS[algo], 1000)
    assert checksum == expected_checksum(algo, payload)
    assert raw[HEADER.size :] == payload


async def test_files_of_either_checksum_are_read(tmp_path: Path) -> None:
    root = tmp_path / "d"
    async with DiskTier(root, checksum="sha256") as tier:
        await tier.put(k(1), b"sha")
    async with DiskTier(root) as tier:  # the default (crc32c where installed, else zlib crc32)
        await tier.put(k(2), b"default")
    async with DiskTier(root, checksum="sha256", verify_on_start=True) as tier:
        assert bytes((await tier.get(k(1))).data) == b"sha"
        assert bytes((await tier.get(k(2))).data) == b"default"
    with pytest.raises(ValueError):
        DiskTier(root, checksum="md5")


async def test_truncated_and_temp_files_are_cleaned_at_start(tmp_path: Path) -> None:
    root = tmp_path / "d"
    async with DiskTier(root) as tier:
        await tier.put(k(1), bytes(5000))
        await tier.put(k(2), b"kept")
        truncated, kept = tier.path_of(k(1)), tier.path_of(k(2))
    os.truncate(truncated, HEADER.size + 100)
    crumbs = truncated.parent
    leftover = crumbs / f".{k(3).digest}.{dead_pid()}.{secrets.token_hex(8)}.tmp"
    leftover.write_bytes(b"half a chunk")
    old = crumbs / f".{k(4).digest}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    old.write_bytes(b"old")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    live = crumbs / f".{k(5).digest}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    live.write_bytes(b"a writer of this process may still be busy with it")
    stray = crumbs / "README"
    stray.write_text("not ours")

    tier = await DiskTier.open(root)
    try:
        assert await tier.list_keys() == [k(2)]
        assert bytes((await tier.get(k(2))).data) == b"kept"
        with pytest.raises(ChunkNotFound):
            await tier.get(k(1))
        assert not truncated.exists() and kept.exists()
        assert not leftover.exists() and not old.exists()
        assert live.exists() and stray.exists()  # control: a fresh temp of a live writer is kept
        stats = tier.stats()
        assert (stats.corrupt_removed, stats.temp_removed) == (1, 2)
    finally:
        await tier.aclose()


@pytest.mark.parametrize("algo", CHECKSUMS)
@pytest.mark.parametrize("where", ["payload", "checksum", "magic", "algorithm", "length", "appended"])
async def test_corruption_is_detected_as_absent(tmp_path: Path, where: str, algo: str) -> None:
    async with DiskTier(tmp_path / "d", checksum=algo) as tier:
        await tier.put(k(1), secrets.token_bytes(4096))
        await tier.put(k(2), b"neighbour")
        path = tier.path_of(k(1))
        with open(path, "r+b") as f:
            if where in ("payload", "checksum"):
                offset = HEADER.size + 2000 if where == "payload" else 17
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0x01]))
            elif where == "magic":
                f.write(b"XXXX")
            elif where == "algorithm":
                f.seek(5)
                f.write(b"\x09")
            elif where == "length":
                f.seek(8)
                f.write((10).to_bytes(8, "little"))
            else:
                f.seek(0, os.SEEK_END)
                f.write(b"extra")
        with pytest.raises(ChunkNotFound):
            await tier.get(k(1))
        assert not path.exists()
        assert not await tier.contains(k(1))
        assert tier.stats().corrupt_removed == 1
        assert bytes((await tier.get(k(2))).data) == b"neighbour"
        assert tier.used_bytes == HEADER.size + len(b"neighbour")


async def test_verify_on_start_finds_bit_rot(tmp_path: Path) -> None:
    root = tmp_path / "d"
    async with DiskTier(root) as tier:
        await tier.put(k(1), bytes(100))
        path = tier.path_of(k(1))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    async with DiskTier(root) as lazy:  # header-only scan: found at first read
        assert await lazy.contains(k(1))
    async with DiskTier(root, verify_on_start=True) as strict:
        assert not await strict.contains(k(1))
        assert strict.stats().corrupt_removed == 1


async def test_index_rebuilt_after_reopening(tmp_path: Path) -> None:
    root = tmp_path / "d"
    data = {k(i, owner=f"0{i % 3}", group=f"1{i % 2}"): secrets.token_bytes(i * 37) for i in range(30)}
    async with DiskTier(root, fsync=False) as tier:
        for key, value in data.items():
            await tier.put(key, value)
        used = tier.used_bytes
    async with DiskTier(root) as tier:
        assert set(await tier.list_keys()) == set(data)
        assert set(await tier.list_keys("11")) == {key for key in data if key.group == "11"}
        assert tier.used_bytes == used
        for key, value in data.items():
            assert bytes((await tier.get(key)).data) == value
        assert await tier.delete_owner("01") == 10
    async with DiskTier(root) as tier:
        assert len(await tier.list_keys()) == 20


async def test_concurrent_writers_of_one_key_in_one_loop(tmp_path: Path) -> None:
    payloads = [secrets.token_bytes(1000 + 97 * i) for i in range(20)]
    async with DiskTier(tmp_path / "d") as tier:
        key = k(7)
        await asyncio.gather(*(tier.put(key, p) for p in payloads))
        files = chunk_files(tmp_path / "d")
        assert files == [tier.path_of(key)]
        assert temp_files(tmp_path / "d") == []
        on_disk = files[0].read_bytes()[HEADER.size :]
        assert on_disk in payloads
        assert bytes((await tier.get(key)).data) == on_disk
        assert tier.used_bytes == HEADER.size + len(on_disk)
    async with DiskTier(tmp_path / "d") as reopened:
        assert bytes((await reopened.get(key)).data) == on_disk


WRITER = """
import asyncio, os, random, sys, time
from pathlib import Path
from storage import ChunkKey, DiskTier

async def main(root, tag):
    rng = random.Random(tag)
    async with DiskTier(Path(root)) as tier:
        Path(root, f"ready-{tag}").touch()
        while not Path(root, "go").exists():
            time.sleep(0.001)
        key = ChunkKey("aa", "bb", "77" * 32)
        for i in range(30):
            j = rng.randrange(4)
            await tier.put(key, bytes([tag, i, j]) * (100_000 * (j + 1)))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def expected_payload(payload: bytes) -> bytes:
    tag, i, j = payload[:3]
    assert tag in (1, 2) and 0 <= i < 30 and 0 <= j < 4
    return bytes([tag, i, j]) * (100_000 * (j + 1))


async def test_concurrent_writers_of_one_key_in_two_processes(tmp_path: Path) -> None:
    root = tmp_path / "d"
    root.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR)}
    procs = [
        await asyncio.create_subprocess_exec(sys.executable, "-c", WRITER, str(root), str(tag), env=env)
        for tag in (1, 2)
    ]
    deadline = time.monotonic() + 60
    while not all((root / f"ready-{tag}").exists() for tag in (1, 2)):
        assert time.monotonic() < deadline and all(p.returncode is None for p in procs)
        await asyncio.sleep(0.01)
    (root / "go").touch()  # both start writing at once
    assert [await p.wait() for p in procs] == [0, 0]
    files = chunk_files(root)
    assert len(files) == 1 and temp_files(root) == []
    payload = files[0].read_bytes()[HEADER.size :]
    assert payload == expected_payload(payload)
    async with DiskTier(root, verify_on_start=True) as tier:
        assert bytes((await tier.get(ChunkKey("aa", "bb", "77" * 32))).data) == payload


async def test_write_protocol_is_atomic_without_the_tier_lock(tmp_path: Path) -> None:
    """The per-key lock serialises one tier's writers; this drives the file protocol itself from
    20 threads at once, as writers in separate processes would."""
    root = tmp_path / "d"
    root.mkdir()
    path = _diskio.chunk_path(root, k(1))
    payloads = [bytes([i]) * (50_000 * (1 + i % 5)) for i in range(20)]
    await asyncio.gather(
        *(asyncio.to_thread(_diskio.write_chunk, root, path, memoryview(p), True) for p in payloads)
    )
    assert chunk_files(root) == [path] and temp_files(root) == []
    data, _ = _diskio.read_chunk(path)  # checksum and length verified
    assert bytes(data) in payloads


async def test_permissions(tmp_path: Path) -> None:
    root = tmp_path / "d"
    async with DiskTier(root) as tier:
        await tier.put(k(1, owner="0a", group="0b"), b"secret-ish ciphertext")
        path = tier.path_of(k(1, owner="0a", group="0b"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for d in (root, root / "0a", root / "0a" / "0b", path.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


@pytest.mark.parametrize(
    "labels",
    [("..", "bb", "cc"), ("aa", "../../etc", "cc"), ("aa", "bb", "../passwd"), ("aa", "bb", "/etc/passwd"),
     ("AA", "bb", "cc"), ("aa", "", "cc"), ("aa", "bb", "c" * 129), ("aa", "b/b", "cc")],
)
def test_path_traversal_is_impossible(labels: tuple[str, str, str]) -> None:
    with pytest.raises(ValueError):
        ChunkKey(*labels)


async def test_capacity_evicts_lru_and_honours_pins(tmp_path: Path) -> None:
    per = HEADER.size + 1000
    async with DiskTier(tmp_path / "d", capacity_bytes=4 * per, fsync=False) as tier:
        for i in range(4):
            await tier.put(k(i), bytes(1000))
        await tier.pin(k(0))
        await tier.get(k(1))
        await tier.put(k(4), bytes(1000))  # evicts 2: 0 is pinned, 1 was just read
        assert await tier.contains_many([k(i) for i in range(5)]) == [True, True, False, True, True]
        assert len(chunk_files(tmp_path / "d")) == 4
        before = (sorted(map(str, chunk_files(tmp_path / "d"))), tier.used_bytes)
        with pytest.raises(TierFull):
            await tier.put(k(9), bytes(4 * 1000 + 1))
        with pytest.raises(TierFull):
            await tier.put(k(9), bytes(3 * 1000 + 3 * HEADER.size + 1))  # would need the pinned one
        assert (sorted(map(str, chunk_files(tmp_path / "d"))), tier.used_bytes) == before
        assert tier.stats().evictions == 1
    async with DiskTier(tmp_path / "d", capacity_bytes=2 * per) as smaller:  # budget shrank
        assert len(await smaller.list_keys()) == 2 and smaller.used_bytes == 2 * per


async def test_delete_group_also_removes_files_not_indexed(tmp_path: Path) -> None:
    root = tmp_path / "d"
    async with DiskTier(root) as first:
        await first.put(k(1, group="01"), b"indexed")
        await first.put(k(1, group="02"), b"other group")
        async with DiskTier(root) as second:  # a file this instance has not indexed
            await second.put(k(2, group="01"), b"written elsewhere")
        (first.path_of(k(1, group="01")).parent / f".{k(3).digest}.1.ab.tmp").write_bytes(b"x")
        assert await first.delete_group("01") == 2
        assert [p.name for p in chunk_files(root)] == [first.path_of(k(1, group="02")).name]
        assert temp_files(root) == [] and not (root / "aa" / "01").exists()


async def test_delete_group_waits_for_puts_in_flight(tmp_path: Path) -> None:
    async with DiskTier(tmp_path / "d") as tier:
        keys = [k(i, group="01") for i in range(20)]
        puts = [asyncio.create_task(tier.put(key, bytes(20_000))) for key in keys]
        await asyncio.sleep(0)
        removed = await tier.delete_group("01")
        await asyncio.gather(*puts)
        held = set(await tier.list_keys("01"))
        on_disk = {p.name[:-4] for p in chunk_files(tmp_path / "d")}
        assert on_disk == {key.digest for key in held}  # the index tells the truth
        assert removed + len(held) == 20


async def test_file_vanishing_is_a_miss_and_is_forgotten(tmp_path: Path) -> None:
    async with DiskTier(tmp_path / "d") as tier:
        await tier.put(k(1), b"v")
        tier.path_of(k(1)).unlink()
        with pytest.raises(ChunkNotFound):
            await tier.get(k(1))
        assert not await tier.contains(k(1)) and tier.used_bytes == 0


async def test_not_started_and_closed_tiers_refuse(tmp_path: Path) -> None:
    async with DiskTier(tmp_path / "d") as seed:
        await seed.put(k(0), b"seed")
    tier = DiskTier(tmp_path / "d")
    with pytest.raises(TierUnavailable):
        await tier.put(k(1), b"v")
    await asyncio.gather(tier.start(), tier.start())  # concurrent starts scan once
    assert tier.used_bytes == HEADER.size + 4 and len(await tier.list_keys()) == 1
    await tier.put(k(1), b"v")
    await tier.aclose()
    with pytest.raises(TierUnavailable):
        await tier.get(k(1))
    assert len(chunk_files(tmp_path / "d")) == 2  # closing keeps the files
    with pytest.raises(TierUnavailable):
        await tier.start()


def test_constructor_does_no_io(tmp_path: Path) -> None:
    DiskTier(tmp_path / "d")
    assert not (tmp_path / "d").exists()


async def test_unusable_root_is_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(TierUnavailable):
        await DiskTier.open(blocker / "d")


async def test_cancelled_puts_leave_index_and_files_in_agreement(tmp_path: Path) -> None:
    async with DiskTier(tmp_path / "d") as tier:
        key = k(1)
        first = asyncio.create_task(tier.put(key, bytes(3_000_000)))
        waiting = asyncio.create_task(tier.put(key, bytes(10)))  # queued behind the first
        others = [asyncio.create_task(tier.put(k(i), bytes(1000))) for i in range(2, 6)]
        await asyncio.sleep(0)
        first.cancel()
        waiting.cancel()
        results = await asyncio.gather(first, waiting, *others, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results[:2])
        await tier.drain()
        deadline = time.monotonic() + 10
        while temp_files(tmp_path / "d") and time.monotonic() < deadline:  # only a stray thread
            await asyncio.sleep(0.01)
        assert await tier.contains(key) == tier.path_of(key).exists()
        await tier.put(k(9), b"the tier still works")
    async with DiskTier(tmp_path / "d") as reopened:
        on_disk = {p.name[:-4] for p in chunk_files(tmp_path / "d")}
        assert {key.digest for key in await reopened.list_keys()} == on_disk
        assert k(9).digest in on_disk and all(k(i).digest in on_disk for i in range(2, 6))


async def test_key_lock_handles_cancelled_waiters() -> None:
    from storage._keylocks import KeyLocks

    locks, key = KeyLocks(), k(1)
    await locks.acquire(key)
    waiter = asyncio.create_task(locks.acquire(key))
    later = asyncio.create_task(locks.acquire(key))
    await asyncio.sleep(0)
    waiter.cancel()
    locks.release(key)  # skips the cancelled waiter, hands the key to the next
    await asyncio.sleep(0)
    assert waiter.cancelled() and later.done()
    assert locks.busy(key)
    locks.release(key)
    assert not locks.busy(key) and locks.held() == []


async def test_a_second_tier_on_the_same_root_sees_what_the_first_wrote_after_it_started(tmp_path: Path):
    """Two processes share a root (vLLM's scheduler and worker): a chunk one writes is found by
    the other's contains, contains_many and get, bit-exact; a key neither wrote stays a miss."""
    writer, reader = await DiskTier.open(tmp_path), await DiskTier.open(tmp_path)
    try:
        assert await reader.contains_many([k(1), k(2)]) == [False, False]  # control: nothing yet
        await writer.put(k(1), b"written by the other process")
        assert await reader.contains_many([k(1), k(2)]) == [True, False]
        assert await reader.contains(k(1)) and not await reader.contains(k(2))
        assert bytes((await reader.get(k(1))).data) == b"written by the other process"
        with pytest.raises(ChunkNotFound):
            await reader.get(k(2))
        await writer.delete(k(1))
        with pytest.raises(ChunkNotFound):  # gone on disk: forgotten here too
            await reader.get(k(1))
    finally:
        await reader.aclose()
        await writer.aclose()
