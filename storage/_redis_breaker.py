"""A circuit breaker for a remote tier, so a dead server is not hammered on every lookup.

States::

    closed    --(``failures`` consecutive failures)-->  open
    open      --(``cooldown_s`` elapsed, next call)-->  half-open: that one call is the probe;
                                                         others keep failing fast meanwhile
    half-open --(probe succeeds)--> closed   --(probe fails)--> open for another cooldown

A *failure* is the server being unreachable or too slow (connection errors, timeouts). A miss or a
server-side refusal (out of memory) proves the server is alive and counts as a success. The clock
is injectable for tests. Single event loop, no locks needed: every method runs without awaiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["CircuitBreaker"]

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class CircuitBreaker:
    def __init__(
        self, failures: int = 5, cooldown_s: float = 2.0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not isinstance(failures, int) or isinstance(failures, bool) or failures < 1:
            raise ValueError("breaker_failures must be an int >= 1")
        if not cooldown_s >= 0:
            raise ValueError("breaker_cooldown_s must be >= 0")
        self.failures = failures
        self.cooldown_s = float(cooldown_s)
        self._clock = clock
        self._consecutive = 0
        self._opened_at: float | None = None
        self._probing = False
        self.trips = 0  # how many times the breaker opened

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return CLOSED
        if self._probing or self._clock() - self._opened_at >= self.cooldown_s:
            return HALF_OPEN
        return OPEN

    def allow(self) -> bool:
        """May a call go to the server now? In half-open state, True for exactly one caller (the
        probe) until it reports back with :meth:`success`, :meth:`failure` or :meth:`abandon`."""
        if self._opened_at is None:
            return True
        if self._probing or self._clock() - self._opened_at < self.cooldown_s:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        self._consecutive = 0
        self._opened_at = None
        self._probing = False

    def failure(self) -> None:
        self._consecutive += 1
        if self._probing or (self._opened_at is None and self._consecutive >= self.failures):
            self._opened_at = self._clock()
            self._probing = False
            self.trips += 1

    def abandon(self) -> None:
        """The call gave no verdict (it was cancelled): let the next caller probe."""
        self._probing = False
