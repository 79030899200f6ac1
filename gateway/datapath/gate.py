"""When a store's sealing may run: between the engine's forward steps, or once it is due.

    StepGate.forward_begins() / forward_ends()   the engine's worker, around each forward step
    StepGate.idle()                               the engine's worker, at a step with no forward
    StepGate.engine_busy()                        whether the engine is running steps (the
                                                  write-behind copies of an embedded store wait)
    StepGate.wait_turn(latest)                    a store thread, before each slice of a store:
                                                  the engine idle, one of the ``per_gap`` slices
                                                  of a gap between two steps, or ``latest`` (the
                                                  slice's deadline, monotonic), whichever first
    STEPS                                         this process's gate (one engine per process)
    spread()                                      a kvgate thread's start: every CPU of the process

A slice run during a forward slows the whole step (the engine waits at each barrier for its slowest
thread), and one begun in a gap runs on into the next forward: a gap takes ``per_gap`` (0) slices,
an idle engine (``idle_s`` after a forward ended, none begun) all. Slice ``k`` of ``n`` is due at
``start + finish_s * (k + 1) / n`` (``DataPlane``): a store never starves, its last slice starts
within ``finish_s``; 0 (any process without an engine) never waits. Design: architecture.md, 5."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from gateway.threadname import name_thread

__all__ = ["STEPS", "StepGate", "spread"]

log = logging.getLogger("kvgate.datapath")


class StepGate:
    def __init__(self, finish_s: float = 0.0, per_gap: int = 0, idle_s: float = 0.05) -> None:
        self.finish_s = finish_s  # a store's last slice starts at most this long after the store
        self.per_gap = per_gap  # slices that may start between two forward steps
        self.idle_s = idle_s  # no forward for this long: the engine is idle, every slice may start
        self._cond = threading.Condition()
        self._busy = False
        self._ended = float("-inf")  # when the last forward ended (monotonic)
        self._started = 0  # slices started since then
        self.waited_s = 0.0  # slices' total wait
        self.forced = 0  # slices that ran at their deadline, the engine not idle

    @property
    def busy(self) -> bool:
        return self._busy

    def engine_busy(self) -> bool:
        """The engine runs forward steps: one now, or one ended less than ``idle_s`` ago (the
        gap to the next step of a decode). What waits on this yields to decoding."""
        return self._busy or time.monotonic() < self._ended + self.idle_s

    def forward_begins(self) -> None:
        with self._cond:
            self._busy = True

    def forward_ends(self) -> None:
        with self._cond:
            if self._busy:
                self._busy = False
                self._ended = time.monotonic()
                self._started = 0
                self._cond.notify_all()

    def idle(self) -> None:
        """A step that runs no forward (nothing scheduled, e.g. blocks waiting for a hand-off
        store): the engine is idle now, every slice may start without waiting ``idle_s``."""
        with self._cond:
            self._busy = False
            self._ended = float("-inf")
            self._started = 0
            self._cond.notify_all()

    def deadline(self, start: float, k: int, n: int) -> float | None:
        """Slice ``k`` of ``n`` of a store that started at ``start``: when it runs at the latest
        (None: at once, as without a gate)."""
        if self.finish_s <= 0 or n <= 0:
            return None
        return start + self.finish_s * (k + 1) / n

    def wait_turn(self, latest: float | None) -> float:
        """Wait for a turn: the engine idle, or one of the ``per_gap`` slices of the gap between
        two forward steps, or ``latest`` (``time.monotonic``) passed; the seconds waited."""
        if latest is None:
            return 0.0
        t0 = time.monotonic()
        with self._cond:
            while True:
                now = time.monotonic()
                if now >= latest:
                    self.forced += 1
                    break
                wait = latest - now
                if not self._busy:
                    idle_at = self._ended + self.idle_s
                    if now >= idle_at:
                        break
                    if self._started < self.per_gap:
                        self._started += 1
                        break
                    wait = min(wait, idle_at - now)
                self._cond.wait(wait)
        waited = time.monotonic() - t0
        self.waited_s += waited
        return waited


STEPS = StepGate()  # this process's: the connector's worker side marks its engine's steps


def _cpu_list(text: str) -> set[int]:
    """``0-3,6`` (a kernel CPU list) as a set."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit():
            cpus.update(range(int(lo), int(hi if hi.isdigit() else lo) + 1))
    return cpus


def _process_cpus() -> set[int]:
    """Every CPU some thread of this process may run on (Linux; empty where unknown)."""
    cpus: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return cpus
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        cpus |= _cpu_list(line.split(":", 1)[1])
                        break
        except OSError:  # a thread that ended meanwhile
            continue
    return cpus


def spread() -> None:
    """A kvgate thread's start (the data path's, the connector's loop): free to run on every CPU
    the process's threads may use. A CPU engine pins each of its compute threads to one core, its
    main thread included, and a thread inherits the mask of the thread that started it: without
    this, every seal and open of the process would share the main thread's one core. The thread
    also takes its name in the kernel (``gateway.threadname``)."""
    if sys.platform != "linux":
        return
    name_thread()
    cpus = _process_cpus()
    try:
        if cpus and cpus != os.sched_getaffinity(0):
            os.sched_setaffinity(0, cpus)
    except OSError as exc:  # refused: the thread keeps the mask it inherited
        log.warning("kvgate threads keep their inherited CPUs: %s", exc)
