"""``prefault_behind``: a store's slots faulted in ahead of its seals, whole pages, no byte changed.
``map_resident_behind``: a second mapping of a region maps the pages the first one populated, and
allocates none of its holes."""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from gateway.protocol.shmpages import map_resident, map_resident_behind, prefault_behind
from tests.support.memfd import allocated_pages, mapped_pages

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd and MADV_POPULATE_WRITE are Linux's")

PAGE = mmap.PAGESIZE
PAGES = 16


@pytest.fixture
def region() -> Iterator[tuple[int, np.ndarray]]:
    fd = os.memfd_create("kvgate-test-prefault")
    os.ftruncate(fd, PAGES * PAGE)
    mm = mmap.mmap(fd, PAGES * PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        yield fd, np.frombuffer(mm, dtype=np.uint8)  # the mapping goes with the last view of it
    finally:
        os.close(fd)


def test_the_pages_a_stores_slots_span_are_faulted_in_and_no_byte_of_a_neighbour_changes(region: tuple[int, np.ndarray]) -> None:
    fd, arr = region
    arr[3 * PAGE : 3 * PAGE + 10] = 7  # a neighbour's envelope ends on page 3, where a slot starts
    assert allocated_pages(fd) == [3]
    slots = [arr[PAGE + 100 : 2 * PAGE + 50].data, arr[3 * PAGE + 10 : 5 * PAGE].data]
    thread = prefault_behind(slots, stop=lambda: False)
    assert thread is not None
    thread.join(10)
    assert allocated_pages(fd) == [1, 2, 3, 4]  # whole pages, those spanned and no other
    assert (arr[3 * PAGE : 3 * PAGE + 10] == 7).all() and not arr[3 * PAGE + 10 :].any()


def test_a_store_that_ended_stops_the_prefault_and_read_only_or_empty_views_ask_for_none(region: tuple[int, np.ndarray]) -> None:
    fd, arr = region
    thread = prefault_behind([arr[: 4 * PAGE].data], stop=lambda: True)  # the store ended first
    assert thread is not None
    thread.join(10)
    assert allocated_pages(fd) == []
    # the control: the same slot with the store still running is faulted in
    thread = prefault_behind([arr[: 4 * PAGE].data], stop=lambda: False)
    assert thread is not None
    thread.join(10)
    assert allocated_pages(fd) == [0, 1, 2, 3]
    assert prefault_behind([], stop=lambda: False) is None
    assert prefault_behind([arr[8 * PAGE :].data.toreadonly(), arr[:0].data], stop=lambda: False) is None
    assert allocated_pages(fd) == [0, 1, 2, 3]


def test_a_second_mapping_maps_the_pages_the_first_populated_and_allocates_no_hole(region: tuple[int, np.ndarray]) -> None:
    """The server's side populates pages 2, 3 and 9 of an arena; the worker's mapping of the same
    memfd maps exactly those, writable (a write through it lands in the server's bytes), and the
    holes stay holes. The control: before, the worker's mapping maps none of them; stopped at
    once, it maps nothing."""
    fd, server = region
    server[2 * PAGE : 4 * PAGE] = 1
    server[9 * PAGE + 5] = 2
    mm = mmap.mmap(fd, PAGES * PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    worker = np.frombuffer(mm, dtype=np.uint8)
    assert mapped_pages(worker) == []  # the control: a fresh mapping maps nothing yet
    assert map_resident(worker, stop=lambda: True) == 0 and mapped_pages(worker) == []
    thread = map_resident_behind(worker, stop=lambda: False)
    thread.join(10)
    assert mapped_pages(worker) == [2, 3, 9]
    assert allocated_pages(fd) == [2, 3, 9]  # no hole allocated
    assert map_resident(worker) == 3 * PAGE  # again: the same pages, nothing more
    worker[9 * PAGE + 6] = 3
    assert server[9 * PAGE + 6] == 3 and server[9 * PAGE + 5] == 2
    assert mapped_pages(server) == [2, 3, 9]  # the other side's own mapping is as it was


def test_mapping_ahead_goes_on_while_the_other_side_is_still_populating(region: tuple[int, np.ndarray]) -> None:
    """The server populates an arena as the worker starts mapping it (a region asked for at the
    step that stores): the worker maps again while it finds more, so the pages populated after its
    first round are mapped too. The control: one round, before anything was populated, maps
    nothing."""
    fd, server = region
    mm = mmap.mmap(fd, PAGES * PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    worker = np.frombuffer(mm, dtype=np.uint8)
    once = map_resident_behind(worker, stop=lambda: False, rounds=1)
    once.join(10)
    assert mapped_pages(worker) == []  # the control

    def populate() -> None:
        for p in range(8):
            server[p * PAGE] = 1
            time.sleep(0.02)

    writer = threading.Thread(target=populate)
    writer.start()
    mapper = map_resident_behind(worker, stop=lambda: False, rounds=40, pause_s=0.3)
    writer.join(10)
    mapper.join(30)
    assert not mapper.is_alive()
    assert mapped_pages(worker) == list(range(8)) and allocated_pages(fd) == list(range(8))
