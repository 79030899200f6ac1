"""The connector's counters, each declared once, without vLLM.

A lookup, a load or a store is counted with its outcome: ``ok`` or the reason it fell short (a
miss reason of ``gateway.vllm.logs.miss_reason``, or one of the connector's own: a store cut
after a failed load, dropped past the in-flight cap, a layer-wise load whose hooks were missed).
A load-or-recompute choice is counted as a ``decision`` with its reason (``gateway.vllm.policy``), a
published prefix's warm-up report as a ``warm_report``.
Tokens are counted by kind (hit on lookup, loaded, stored, declined: hit tokens recomputed).
``take`` hands over what was counted since the last call, as plain data that vLLM carries from the
workers to its logger process (``gateway.vllm.stats`` wraps it in vLLM's ``KVConnectorStats``).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Literal, get_args

__all__ = ["EVENTS", "OK", "TOKEN_KINDS", "ConnectorCounters", "Event", "TokenKind"]

Event = Literal["lookup", "load", "store", "handoff", "decision", "warm_report"]
TokenKind = Literal["lookup_hit", "loaded", "stored", "declined"]
EVENTS: tuple[Event, ...] = get_args(Event)
TOKEN_KINDS: tuple[TokenKind, ...] = get_args(TokenKind)
OK = "ok"

# the connector's own outcomes, beside the miss reasons
STORE_CUT = "cut_after_failed_load"
STORE_DROPPED = "dropped_in_flight"
LAYER_HOOKS_MISSED = "layer_hooks_missed"


class ConnectorCounters:
    """Totals since the connector started, and what was counted since the last ``take``.
    Counted from the engine's threads and the backend's loop thread alike."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: Counter[tuple[Event, str]] = Counter()
        self._tokens: Counter[TokenKind] = Counter()
        self._pending: Counter[str] = Counter()

    def count(self, event: Event, outcome: str = OK, n: int = 1) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown connector event {event!r}")
        with self._lock:
            self._events[(event, outcome)] += n
            self._pending[f"{event}/{outcome}"] += n

    def tokens(self, kind: TokenKind, n: int) -> None:
        if kind not in TOKEN_KINDS:
            raise ValueError(f"unknown token kind {kind!r}")
        if n <= 0:
            return
        with self._lock:
            self._tokens[kind] += n
            self._pending[f"tokens/{kind}"] += n

    def get(self, event: Event, outcome: str = OK) -> int:
        with self._lock:
            return self._events[(event, outcome)]

    def tokens_of(self, kind: TokenKind) -> int:
        with self._lock:
            return self._tokens[kind]

    def failures(self) -> dict[tuple[Event, str], int]:
        """Every outcome but ``ok`` (a decision's reason is none), with its total."""
        with self._lock:
            return {k: n for k, n in self._events.items() if k[1] != OK and k[0] != "decision" and n}

    def take(self) -> dict[str, int]:
        """What was counted since the last call (``event/outcome`` and ``tokens/kind`` keys),
        and start counting anew."""
        with self._lock:
            out, self._pending = dict(self._pending), Counter()
        return out


def split_key(key: str) -> tuple[str, str]:
    """``("load", "integrity")`` of ``"load/integrity"``; a malformed key is ``(key, "")``."""
    head, sep, tail = key.partition("/")
    return (head, tail) if sep else (key, "")
