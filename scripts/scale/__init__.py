"""How kvgate's cost grows with the work it holds: ``python -m scripts.scale --out FILE.json``.

Parts (each beside a ceiling or a ratio measured in the same run): ``embedded`` (lookup latency
and resident memory with 10^3..10^6 chunks in the memory tier; namespace and tenant clear time
against chunk count, memory and Redis tiers), ``served`` (the same lookups through a live
``kvgate serve`` on Postgres, and requests/s with 1..64 remote worker processes, ``worker``),
``auditrate`` (audit rows/s sustained into Postgres beside raw INSERTs), ``render`` (the
Markdown tables, docs/runs.md's Scale section). This module stays light: worker processes
import it.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

__all__ = ["ENVELOPE_BYTES", "LOOKUP_CHUNKS", "median", "rss_bytes"]

ENVELOPE_BYTES = 256  # the stored envelopes of the lookup and clear figures: header, 184 bytes, tag
LOOKUP_CHUNKS = 128  # a 32K-token prefix of 256-token chunks, every one stored


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of process ``pid`` (this one by default), from Linux ``/proc``."""
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc status")


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))
