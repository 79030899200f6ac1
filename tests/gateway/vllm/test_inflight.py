"""The worker's stores in flight (gateway/vllm/inflight.py), without vLLM: the staging pool
reuses buffers and keeps idle ones within the room it is given; the in-flight set admits under
its cap (one store always, when none is in flight), reaps ended stores once, waits bounded."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from gateway.vllm.inflight import InFlight, StagingPool
from kernels.layouts import BlockView

LAYERS, B, H, BS, D = 2, 16, 2, 4, 8
BLOCK_BYTES = LAYERS * 2 * BS * H * D * 4  # one block of every layer, float32


def _pool() -> StagingPool:
    return StagingPool(BlockView.of({f"l.{i}": torch.zeros(B, H, BS, 2 * D) for i in range(LAYERS)}, BS))


def test_buffers_are_whole_powers_of_two_and_reused():
    pool = _pool()
    assert pool.block_nbytes() == BLOCK_BYTES and pool.nbytes(3) == 4 * BLOCK_BYTES and pool.nbytes(4) == 4 * BLOCK_BYTES
    buf = pool.take(3, room=1 << 20)
    assert len(buf) == LAYERS and buf[0].shape == (4, H, BS, 2 * D) and buf[0].is_contiguous()  # the CPU layout, kept
    pool.give(buf, room=1 << 20)
    assert pool.idle_bytes == 4 * BLOCK_BYTES
    again = pool.take(4, room=1 << 20)
    assert again[0].data_ptr() == buf[0].data_ptr() and pool.idle_bytes == 0
    other = pool.take(5, room=1 << 20)  # 8 blocks: another size, a new buffer
    assert other[0].shape[0] == 8 and other[0].data_ptr() != buf[0].data_ptr()


def test_idle_buffers_stay_within_the_room_they_are_given():
    pool = _pool()
    a, b = pool.take(4, room=0), pool.take(8, room=0)
    pool.give(a, room=4 * BLOCK_BYTES)
    pool.give(b, room=4 * BLOCK_BYTES)  # would make 12 blocks idle: freed instead
    assert pool.idle_bytes == 4 * BLOCK_BYTES
    pool.give(b, room=12 * BLOCK_BYTES)
    assert pool.idle_bytes == 12 * BLOCK_BYTES
    pool.take(1, room=2 * BLOCK_BYTES)  # a new 1-block buffer; the idle ones no longer fit beside it
    assert pool.idle_bytes == 0


def test_in_flight_admits_under_the_cap_and_one_store_always():
    flight: InFlight[int] = InFlight(cap_bytes=100)
    assert flight.admit(1000)  # none in flight: a store larger than the cap still goes
    ended: list[int] = []
    f1, f2 = Future[int](), Future[int]()
    flight.add(f1, 60, lambda f: ended.append(f.result()))
    assert flight.admit(40) and not flight.admit(41)
    flight.add(f2, 40, lambda f: ended.append(f.result()))
    assert len(flight) == 2 and flight.nbytes == 100
    assert flight.reap() == 0 and not flight.wait(0.05)  # bounded: nothing ended
    f2.set_result(2)
    assert flight.reap() == 1 and ended == [2] and flight.nbytes == 60 and flight.reap() == 0
    f1.set_exception(RuntimeError("a failed store ends too"))
    failed: list[BaseException | None] = []
    flight._pending[0].on_end = lambda f: failed.append(f.exception())
    assert flight.wait(1) and len(flight) == 0 and flight.nbytes == 0
    assert isinstance(failed[0], RuntimeError)
