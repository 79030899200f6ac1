"""The fault schedule and how each fault is made and ended.

A fault is planned at a time after the run starts and lasts ``hold`` seconds where it is an
outage; its ``start`` is when it was made and its ``end`` when the condition was taken away (Redis,
the token, Postgres back; for a server restart, the new process launched), both on the monotonic
clock every soak process shares. Recovery is measured from ``end`` (``checks``)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from scripts.soak.stack import Stack

KINDS = ("redis_stall", "redis_restart", "kek_outage", "sigterm_restart", "postgres_outage", "sigkill_restart")


@dataclass
class Fault:
    kind: str
    at: float  # planned, seconds after the run started
    hold: float  # how long the condition lasts (0: a restart, as long as it takes)
    start: float = 0.0
    end: float = 0.0
    wall_start: str = ""  # the same instants in UTC, to read beside the server's log
    wall_end: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "at": self.at, "hold": self.hold, "start": self.start, "end": self.end,
                "wall_start": self.wall_start, "wall_end": self.wall_end, "detail": self.detail}


def plan(duration: float, every: float, warmup: float, holds: dict[str, float], kinds: tuple[str, ...] = KINDS,
         settle: float | None = None) -> list[Fault]:
    """Faults every ``every`` seconds from ``warmup`` on, cycling through ``kinds``; the last one
    leaves ``settle`` seconds (default: ``every``) before the end so that its recovery is seen."""
    settle = every if settle is None else settle
    out: list[Fault] = []
    t, i = warmup, 0
    while t + holds.get(kinds[i % len(kinds)], 0) + settle <= duration:
        kind = kinds[i % len(kinds)]
        out.append(Fault(kind, round(t, 3), holds.get(kind, 0.0)))
        t += every
        i += 1
    return out


def _utc(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).isoformat(timespec="milliseconds")


class Injector:
    """Makes and ends faults on the soak's own stack (never the machine's shared services)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def run(self, fault: Fault) -> None:
        fault.start, fault.wall_start = time.monotonic(), _utc()
        getattr(self, fault.kind)(fault)
        if not fault.end:
            fault.end = time.monotonic()
        fault.wall_end = _utc(time.time() - (time.monotonic() - fault.end))

    def redis_stall(self, fault: Fault) -> None:
        pid = self.stack.redis_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(fault.hold)
        finally:
            os.kill(pid, signal.SIGCONT)
        fault.detail["pid"] = pid

    def redis_restart(self, fault: Fault) -> None:
        redis = self.stack.redis
        assert redis is not None
        redis.kill()  # SIGKILL: what it held is gone (no persistence), as for a node replaced
        time.sleep(fault.hold)
        redis.start()
        fault.detail["pid"] = self.stack.redis_pid()

    def kek_outage(self, fault: Fault) -> None:
        hsm = self.stack.hsm
        assert hsm is not None
        hsm.take_away()
        try:
            time.sleep(fault.hold)
        finally:
            hsm.give_back()

    def postgres_outage(self, fault: Fault) -> None:
        pg = self.stack.pg
        assert pg is not None
        pg.stop("immediate")
        try:
            time.sleep(fault.hold)
        finally:
            pg.start()

    def _restart(self, fault: Fault, sig: signal.Signals) -> None:
        server = self.stack.server
        assert server is not None
        fault.detail["old_pid"] = server.pid
        fault.detail["exit"] = server.stop(sig)
        time.sleep(fault.hold)
        server.launch()
        fault.end = time.monotonic()
        fault.detail["new_pid"] = server.pid
        fault.detail["healthy_after_s"] = round(server.wait_healthy(), 3)

    def sigterm_restart(self, fault: Fault) -> None:
        self._restart(fault, signal.SIGTERM)

    def sigkill_restart(self, fault: Fault) -> None:
        self._restart(fault, signal.SIGKILL)
