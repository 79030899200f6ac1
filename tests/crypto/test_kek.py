"""LocalFileKek: file creation and permissions, wrap/unwrap, concurrent first start; Secret."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from crypto.errors import KekError
from crypto.kek import KekProvider, LocalFileKek, Secret

CONTEXT = b"tenant-a/dek/v3"


def test_created_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "state" / "kek.key"
    kek = LocalFileKek(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == 32
    assert kek.key_id.startswith("local:")
    assert [p.name for p in path.parent.iterdir()] == ["kek.key"]  # no temp file left behind


def test_reload_gives_the_same_key(tmp_path: Path) -> None:
    path = tmp_path / "kek.key"
    first = LocalFileKek(path)
    wrapped = first.wrap(b"k" * 32, CONTEXT)
    second = LocalFileKek(path, create=False)
    assert second.key_id == first.key_id
    assert second.unwrap(wrapped, CONTEXT) == b"k" * 32


def test_missing_file_without_create(tmp_path: Path) -> None:
    with pytest.raises(KekError, match="does not exist"):
        LocalFileKek(tmp_path / "kek.key", create=False)
    assert not (tmp_path / "kek.key").exists()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_group_or_world_accessible_file_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "kek.key"
    LocalFileKek(path)
    path.chmod(mode)
    with pytest.raises(KekError, match="chmod 600"):
        LocalFileKek(path)


@pytest.mark.parametrize("size", [0, 16, 31, 33, 64])
def test_wrong_length_refused(tmp_path: Path, size: int) -> None:
    path = tmp_path / "kek.key"
    path.write_bytes(os.urandom(size))
    path.chmod(0o600)
    with pytest.raises(KekError, match="exactly 32 bytes"):
        LocalFileKek(path)
    assert path.stat().st_size == size  # not replaced


def test_directory_instead_of_file_refused(tmp_path: Path) -> None:
    path = tmp_path / "kek.key"
    path.mkdir(mode=0o700)
    with pytest.raises(KekError):
        LocalFileKek(path)


def test_wrap_unwrap_round_trip(tmp_path: Path) -> None:
    kek: KekProvider = LocalFileKek(tmp_path / "kek.key")
    key = os.urandom(32)
    wrapped = kek.wrap(key, CONTEXT)
    assert wrapped[0] == 1 and len(wrapped) == 1 + 12 + 32 + 16
    assert key not in wrapped
    assert kek.unwrap(wrapped, CONTEXT) == key
    assert kek.wrap(key, CONTEXT) != wrapped  # random nonce
    kek.health()


def test_unwrap_failures(tmp_path: Path) -> None:
    kek = LocalFileKek(tmp_path / "kek.key")
    wrapped = kek.wrap(os.urandom(32), CONTEXT)
    other = LocalFileKek(tmp_path / "other.key")
    bad = [
        (wrapped, b"tenant-b/dek/v3"),
        (wrapped, b"tenant-a/dek/v4"),
        (wrapped, b""),
        (wrapped[:-1], CONTEXT),
        (wrapped + b"\x00", CONTEXT),
        (b"\x02" + wrapped[1:], CONTEXT),
        (wrapped[:5] + bytes([wrapped[5] ^ 1]) + wrapped[6:], CONTEXT),
        (b"", CONTEXT),
    ]
    for blob, context in bad:
        with pytest.raises(KekError, match="unwrap failed"):
            kek.unwrap(blob, context)
    with pytest.raises(KekError, match="unwrap failed"):
        other.unwrap(wrapped, CONTEXT)
    with pytest.raises(KekError):
        kek.wrap(b"", CONTEXT)


def test_health_notices_a_deleted_or_replaced_file(tmp_path: Path) -> None:
    path = tmp_path / "kek.key"
    kek = LocalFileKek(path)
    kek.health()
    path.unlink()
    with pytest.raises(KekError, match="disappeared"):
        kek.health()
    LocalFileKek(path)  # a new, different key
    with pytest.raises(KekError, match="changed"):
        kek.health()


def test_uncreatable_path(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    with pytest.raises(KekError, match="Not a directory"):
        LocalFileKek(not_a_dir / "kek.key")


def _start(path: str, barrier: Any, fsync_delay: float) -> tuple[str, bytes]:
    """Child: wait for the other process, then open the KEK. ``fsync_delay`` slows this process's
    fsync calls so the two creations really overlap (both find no file, both write a key)."""
    real_fsync = os.fsync

    def slow_fsync(fd: Any) -> None:
        time.sleep(fsync_delay)
        real_fsync(fd)

    os.fsync = slow_fsync
    try:
        barrier.wait()
        kek = LocalFileKek(Path(path))
    finally:
        os.fsync = real_fsync
    return kek.key_id, kek.wrap(b"from-" + str(os.getpid()).encode(), CONTEXT)


@pytest.mark.parametrize("delays", [(0.0, 0.0), (0.01, 0.08), (0.08, 0.01)])
def test_two_processes_creating_at_once_end_with_one_key(
    tmp_path: Path, delays: tuple[float, float]
) -> None:
    path = tmp_path / "kek.key"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(2) as pool:
        barrier = manager.Barrier(2)
        results = pool.starmap(_start, [(str(path), barrier, d) for d in delays])
    (id_a, wrapped_a), (id_b, wrapped_b) = results
    assert id_a == id_b
    kek = LocalFileKek(path, create=False)
    assert kek.key_id == id_a
    assert kek.unwrap(wrapped_a, CONTEXT).startswith(b"from-")
    assert kek.unwrap(wrapped_b, CONTEXT).startswith(b"from-")
    assert [p.name for p in tmp_path.iterdir()] == ["kek.key"]  # no temp files left


def test_secret_hides_its_value() -> None:
    s = Secret(b"\x01" * 32)
    assert "01" not in repr(s) and "\\x01" not in str(s) and "hidden" in repr(s)
    assert s.reveal() == b"\x01" * 32
    assert s == Secret(b"\x01" * 32) and s != Secret(b"\x02" * 32)
    with pytest.raises(TypeError):
        pickle.dumps(s)
    with pytest.raises(TypeError):
        hash(s)


def test_kek_repr_shows_no_key_material(tmp_path: Path) -> None:
    path = tmp_path / "kek.key"
    kek = LocalFileKek(path)
    key = path.read_bytes()
    assert key.hex() not in repr(kek) and repr(key) not in repr(kek)
