"""The KEK protocol's close and key_id_of (key file), and the async face that runs a provider's
blocking calls in a worker thread, off the event loop."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from crypto.contexts import dek_context, secret_context
from crypto.errors import KekError
from crypto.kek import KekProvider, LocalFileKek
from crypto.kek_async import AsyncKek, aclose, ahealth, aunwrap, awrap


class _Recording:
    """A key file KEK that records which thread each call ran on."""

    def __init__(self, kek: LocalFileKek) -> None:
        self.kek, self.threads = kek, []  # type: tuple[LocalFileKek, list[int]]
        self.key_id = kek.key_id

    def wrap(self, key: bytes, context: object) -> bytes:
        self.threads.append(threading.get_ident())
        return self.kek.wrap(key, context)  # type: ignore[arg-type]  # passed through as received

    def unwrap(self, wrapped: bytes, context: object) -> bytes:
        self.threads.append(threading.get_ident())
        return self.kek.unwrap(wrapped, context)  # type: ignore[arg-type]  # passed through as received

    def key_id_of(self, wrapped: bytes, context: object = None) -> str | None:
        return self.kek.key_id_of(wrapped, context)  # type: ignore[arg-type]  # passed through as received

    def health(self) -> None:
        self.threads.append(threading.get_ident())
        self.kek.health()

    def close(self) -> None:
        self.threads.append(threading.get_ident())
        self.kek.close()


def test_the_key_file_provider_satisfies_the_protocol(tmp_path: Path) -> None:
    kek: KekProvider = LocalFileKek(tmp_path / "kek.key")
    assert callable(kek.close) and callable(kek.key_id_of)


def test_key_id_of_a_key_file_blob_needs_its_context(tmp_path: Path) -> None:
    kek, other = LocalFileKek(tmp_path / "a.key"), LocalFileKek(tmp_path / "b.key")
    ctx = dek_context("acme", 1)
    mine, theirs = kek.wrap(b"k" * 32, ctx), other.wrap(b"k" * 32, ctx)
    assert kek.key_id_of(mine, ctx) == kek.key_id  # positive control
    assert kek.key_id_of(theirs, ctx) is None
    assert kek.key_id_of(mine, dek_context("acme", 2)) is None
    assert kek.key_id_of(mine) is None  # the blob does not name its KEK
    assert kek.key_id_of(b"\x01garbage", ctx) is None


def test_a_closed_key_file_provider_refuses_every_call(tmp_path: Path) -> None:
    kek = LocalFileKek(tmp_path / "kek.key")
    ctx = secret_context("index")
    wrapped = kek.wrap(b"k" * 32, ctx)
    kek.health()
    kek.close()
    kek.close()  # idempotent
    for call in (lambda: kek.wrap(b"k" * 32, ctx), lambda: kek.unwrap(wrapped, ctx), kek.health):
        with pytest.raises(KekError, match="closed"):
            call()
    assert LocalFileKek(tmp_path / "kek.key").unwrap(wrapped, ctx) == b"k" * 32  # the file is untouched


async def test_async_calls_run_off_the_event_loop_thread(tmp_path: Path) -> None:
    rec = _Recording(LocalFileKek(tmp_path / "kek.key"))
    loop_thread = threading.get_ident()
    ctx = dek_context("acme", 3)
    wrapped = await awrap(rec, b"k" * 32, ctx)
    assert await aunwrap(rec, wrapped, ctx) == b"k" * 32
    await ahealth(rec)
    with pytest.raises(KekError):
        await aunwrap(rec, wrapped, dek_context("acme", 4))
    await aclose(rec)
    assert len(rec.threads) == 5 and loop_thread not in rec.threads


async def test_async_kek_does_not_block_the_loop(tmp_path: Path) -> None:
    gate = threading.Event()

    class _Slow(_Recording):
        def unwrap(self, wrapped: bytes, context: object) -> bytes:
            gate.wait(5)
            return super().unwrap(wrapped, context)

    kek = AsyncKek(_Slow(LocalFileKek(tmp_path / "kek.key")))  # type: ignore[arg-type]  # a test provider
    ctx = dek_context("acme", 1)
    wrapped = await kek.wrap(b"k" * 32, ctx)
    pending = asyncio.ensure_future(kek.unwrap(wrapped, ctx))
    await asyncio.sleep(0.05)
    assert not pending.done()  # the unwrap waits in its thread while the loop runs this line
    gate.set()
    assert await pending == b"k" * 32
    assert await kek.key_id_of(wrapped, ctx) == kek.key_id
    await kek.health()
    await kek.aclose()
    with pytest.raises(KekError, match="closed"):
        await kek.wrap(b"k" * 32, ctx)
