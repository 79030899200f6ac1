"""kvgate's threads carry their names into the kernel (``gateway.threadname``), where ``top -H``
and ``/proc/<pid>/task/<tid>/comm`` read them; a thread that never asks keeps the process's."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from gateway.datapath import DataPath
from gateway.protocol.shmpages import prefault_behind
from gateway.threadname import name_thread

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="kernel thread names are Linux's")


def _comm(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def _in_thread(fn, name: str) -> str:
    """``fn()`` in a new thread called ``name``; that thread's kernel name after it."""
    got: list[str] = []

    def run() -> None:
        fn()
        got.append(_comm(threading.get_native_id()))

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join(10)
    return got[0]


def test_a_thread_that_names_itself_shows_its_name_and_one_that_does_not_keeps_the_processs() -> None:
    process = _comm(threading.get_native_id()) if threading.current_thread() is threading.main_thread() else None
    assert _in_thread(name_thread, "kvgate-test-abc") == "kvgate-test-abc"
    assert _in_thread(lambda: name_thread("kvgate-a-name-longer-than-15"), "x") == "kvgate-a-name-l"  # 15 bytes kept
    unnamed = _in_thread(lambda: None, "kvgate-never-asked")  # the control
    assert unnamed != "kvgate-never-as"
    if process is not None:
        assert unnamed == process


def test_the_data_paths_store_and_cipher_threads_and_a_prefault_show_their_names() -> None:
    from crypto.envelope import ChunkCipher

    path = DataPath(ChunkCipher(), 2, store_nice=5)
    try:
        assert path._executor is not None and path._store_executor is not None
        cipher = path._executor.submit(lambda: _comm(threading.get_native_id())).result(10)
        store = path._store_executor.submit(lambda: _comm(threading.get_native_id())).result(10)
    finally:
        path.close()
    assert cipher.startswith("kvgate-cpu") and store.startswith("kvgate-store")
    seen: list[str] = []
    buf = np.zeros(1 << 16, dtype=np.uint8)
    # the prefault thread reads its own name as it first asks whether to stop
    thread = prefault_behind([buf.data], stop=lambda: bool(seen.append(_comm(threading.get_native_id()))))
    assert thread is not None
    thread.join(10)
    assert seen and seen[0] == "kvgate-prefault"
