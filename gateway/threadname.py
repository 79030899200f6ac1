"""A kvgate thread's name where the kernel shows it.

``top -H``, ``ps -L`` and ``/proc/<pid>/task/<tid>/comm`` read a thread's kernel name, which
Python's ``threading`` name does not reach (before Python 3.14): every thread of a process shows
the process's name. In an engine's process, where kvgate's store, cipher, wire and prefault threads
run beside the engine's own, the kernel name is how an operator, or a sampler of ``/proc``, tells
them apart. Linux only (``prctl(PR_SET_NAME)``, at most 15 bytes kept); elsewhere, or where the call
is refused, the name stays as it was (the call through ``gateway.libc``)."""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

from gateway.libc import libc

__all__ = ["name_thread"]

_PR_SET_NAME = 15
_prctl: Any = None


def name_thread(name: str | None = None) -> None:
    """Give the calling thread ``name`` (its ``threading`` name where None) in the kernel."""
    global _prctl
    if sys.platform != "linux":
        return
    if _prctl is None:
        try:
            _prctl = libc().prctl
        except (AttributeError, OSError):  # a C library without prctl: names stay as they are
            _prctl = False
    if _prctl:
        raw = (name or threading.current_thread().name).encode("utf-8", "replace")[:15]
        _prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)  # a refusal (-1) changes nothing
