"""The gateway's counters: one typed registry, each counter declared once (docs/monitoring.md).

``Metrics`` holds the counters of one process's chunk traffic (embedded, the server, or a remote
worker's client) as int attributes; labelled counters are ``ByLabel`` maps over a closed set of
label values (the Literal types below). A misspelt counter or label is a type error, and at run
time an AttributeError or KeyError rather than a new series. The server's ``/metrics`` exports
them under the names and labels docs/monitoring.md lists (gateway/server/app.py).
"""

from __future__ import annotations

from collections.abc import ItemsView
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar, get_args

__all__ = ["ByLabel", "KeyPurpose", "LoadReason", "LookupReason", "Metrics", "TierReason"]

# why a load ended before the prompt's end (``miss``: the chunk is not stored)
LoadReason = Literal["miss", "integrity", "tier_timeout", "tier_unavailable", "key_unavailable"]
# why a lookup could not fully answer
LookupReason = Literal["tier_timeout", "tier_unavailable", "key_unavailable"]
# why a tier was passed over
TierReason = Literal["tier_timeout", "tier_unavailable"]
# what a per-envelope key issued to a remote worker is for
KeyPurpose = Literal["seal", "open"]

L = TypeVar("L", bound=str)


class ByLabel(Generic[L]):
    """A counter per label value, every value present from the start (zero included: alert rules
    and dashboards need each series to exist). ``counts[label] += n`` counts."""

    __slots__ = ("_counts",)

    def __init__(self, labels: tuple[L, ...]) -> None:
        self._counts: dict[L, int] = dict.fromkeys(labels, 0)

    def __getitem__(self, label: L) -> int:
        return self._counts[label]

    def __setitem__(self, label: L, value: int) -> None:
        if label not in self._counts:  # a value outside the declared set (a cast that lied)
            raise KeyError(label)
        self._counts[label] = value

    def items(self) -> ItemsView[L, int]:
        """(label, count) in the order the label type declares them."""
        return self._counts.items()

    def total(self) -> int:
        return sum(self._counts.values())

    def __repr__(self) -> str:
        return f"ByLabel({self._counts!r})"


@dataclass(slots=True)
class Metrics:
    """The counters of one process (monotonic; read at scrape time, never reset)."""

    # exported by the server's /metrics (names there in the comments)
    lookup_hits: int = 0  # kvgate_lookups{result="hit"}
    lookup_misses: int = 0  # kvgate_lookups{result="miss"}
    load_hits: int = 0  # kvgate_loads{result="hit"}
    load_misses: int = 0  # kvgate_loads{result="miss"}
    chunks_stored: int = 0  # kvgate_chunks{op="store"}
    chunks_loaded: int = 0  # kvgate_chunks{op="load"}
    bytes_in: int = 0  # kvgate_core_bytes{direction="in"}
    bytes_out: int = 0  # kvgate_core_bytes{direction="out"}
    integrity_failures: int = 0  # kvgate_integrity_failures: envelopes that failed authentication
    denials: int = 0  # kvgate_capability_denials
    store_rollback_removed: int = 0  # kvgate_store_rollbacks{outcome="removed"}
    store_rollback_left: int = 0  # kvgate_store_rollbacks{outcome="left"}
    shared_chunks_loaded: int = 0  # kvgate_shared_chunks_loaded: published chunks read from their scope for a member
    load_failed: ByLabel[LoadReason] = field(default_factory=lambda: ByLabel[LoadReason](get_args(LoadReason)))  # kvgate_load_failures
    lookup_degraded: ByLabel[LookupReason] = field(default_factory=lambda: ByLabel[LookupReason](get_args(LookupReason)))  # kvgate_lookup_degraded
    load_degraded: ByLabel[TierReason] = field(default_factory=lambda: ByLabel[TierReason](get_args(TierReason)))  # kvgate_load_degraded
    envelope_keys_issued: ByLabel[KeyPurpose] = field(default_factory=lambda: ByLabel[KeyPurpose](get_args(KeyPurpose)))  # kvgate_envelope_keys_issued

    # kept for tests and logs, not exported
    key_unavailable: int = 0  # a data key could not be had (KEK outage, destroyed version)
    store_failures: int = 0  # chunks a store could not write
    stores_namespace_changed: int = 0  # stores refused whole: sealed for an epoch a clear ended
    integrity_failures_reported: int = 0  # reports from remote workers (server side)
    # a remote worker's client
    unavailable: int = 0  # fetches the server could not answer (unreachable, a tier, a key)
    fetch_failed: ByLabel[TierReason] = field(default_factory=lambda: ByLabel[TierReason](get_args(TierReason)))  # of those, a tier's
    shm_envelopes: int = 0  # envelopes received through a shared-memory region (copied there, or in place)
    arena_envelopes: int = 0  # of those, read in place in the namespace's arena (no copy)
    arena_sealed: int = 0  # envelopes a store sealed in place into the namespace's arena (none sent)
    arena_unreserved: int = 0  # envelopes a store asked extents of the arena for and got none (sent)
    shm_unavailable: int = 0  # the server gave no shared-memory region
    shm_region_busy: int = 0  # a load found the region lent to another and used the stream
