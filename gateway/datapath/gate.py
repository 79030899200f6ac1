"""When a store's sealing may run: between the engine's forward steps, or once it is due.

    StepGate.forward_begins() / forward_ends()   the engine's worker, around each forward step
    StepGate.wait_turn(latest)                    a store thread, before each slice of a store:
                                                  returns at once while no forward runs, else
                                                  when it ends or at ``latest`` (monotonic), the
                                                  slice's deadline, whichever comes first
    STEPS                                         this process's gate (one engine per process)

A CPU engine's forward keeps every core busy and waits at each barrier for its slowest thread, so
a store slice that runs during a forward slows the whole step. ``DataPlane`` gives slice ``k`` of
``n`` the deadline ``start + finish_s * (k + 1) / n``: a store never starves, and its last slice
starts at most ``finish_s`` after the store did. ``finish_s`` 0 (the default, and any process
without an engine) never waits. Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

import threading
import time

__all__ = ["STEPS", "StepGate"]


class StepGate:
    def __init__(self, finish_s: float = 0.0) -> None:
        self.finish_s = finish_s  # a store's last slice starts at most this long after the store
        self._cond = threading.Condition()
        self._busy = False
        self.waited_s = 0.0  # slices' total wait (traced by the worker)

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
                self._cond.notify_all()

    def deadline(self, start: float, k: int, n: int) -> float | None:
        """Slice ``k`` of ``n`` of a store that started at ``start``: when it runs at the latest
        (None: at once, as without a gate)."""
        if self.finish_s <= 0 or n <= 0:
            return None
        return start + self.finish_s * (k + 1) / n

    def wait_turn(self, latest: float | None) -> float:
        """Wait until no forward runs or ``latest`` (``time.monotonic``) has passed; the seconds
        waited."""
        if latest is None or not self._busy:
            return 0.0
        t0 = time.monotonic()
        with self._cond:
            while self._busy:
                left = latest - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        waited = time.monotonic() - t0
        self.waited_s += waited
        return waited


STEPS = StepGate()  # this process's: the connector's worker side marks its engine's steps
