"""When a store's sealing may run: between the engine's forward steps, or once it is due.

    StepGate.forward_begins() / forward_ends()   the engine's worker, around each forward step
    StepGate.wait_turn(latest)                    a store thread, before each slice of a store:
                                                  the engine idle, one of the ``per_gap`` slices
                                                  of a gap between two steps, or ``latest`` (the
                                                  slice's deadline, monotonic), whichever first
    STEPS                                         this process's gate (one engine per process)

A CPU engine's forward keeps every core busy and waits at each barrier for its slowest thread, so
a slice that runs during a forward slows the whole step, and one that began runs to its end: a gap
takes ``per_gap`` slices; ``idle_s`` after a forward ended with none begun, every slice runs.
``DataPlane`` gives slice ``k`` of ``n`` the deadline ``start + finish_s * (k + 1) / n``: a store
never starves and its last slice starts at most ``finish_s`` after it began. ``finish_s`` 0 (the
default, any process without an engine) never waits. Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

import threading
import time

__all__ = ["STEPS", "StepGate"]


class StepGate:
    def __init__(self, finish_s: float = 0.0, per_gap: int = 1, idle_s: float = 0.05) -> None:
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
