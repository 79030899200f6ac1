"""``prefault_behind``: a store's slots faulted in ahead of its seals, whole pages, no byte changed."""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from gateway.protocol.shmpages import prefault_behind
from tests.support.memfd import allocated_pages

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
