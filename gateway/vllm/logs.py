"""Logging of the vLLM integration: visible under vLLM's own configuration, never a flood.

vLLM configures its ``vllm`` logger and leaves the root logger bare, so a ``kvgate.*`` record
would reach only Python's last-resort handler (unformatted) or nothing. ``ensure_visible_logging``
gives the ``kvgate`` logger one stderr handler at WARNING when nobody configured logging for it
(an application that did keeps its own). The logger tree is drawn in ``gateway/logs.py``.
``Tracer`` appends the connector's optional JSON-lines trace (``trace_path``); ``wait_for_stores``
reads it back to wait, from outside the engine, until every asynchronous store has ended (tests and
the end-to-end benchmark, before a request that expects what the last one stored).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from gateway.logs import RateLimitedLogger

__all__ = ["RateLimitedLogger", "Tracer", "ensure_visible_logging", "miss_reason", "wait_for_stores"]


def ensure_visible_logging() -> None:
    """Give the ``kvgate`` logger a stderr handler (WARNING unless KVGATE_LOG_LEVEL says
    otherwise) when neither it nor the root logger has one; see ``gateway/logs.py``."""
    from gateway.logs import configure_logging

    configure_logging(os.environ.get("KVGATE_LOG_LEVEL") or "warning")


class Tracer:
    """One JSON line per lookup, load and store (hit tokens, failure reason, timings; no
    secrets) appended to ``path``; nothing when ``path`` is None."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def __call__(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def wait_for_stores(path: str | None, timeout_s: float = 60.0) -> float:
    """Wait until the trace at ``path`` has an end (``store`` with tokens) for every
    ``store_submit``, and, for every store whose slower tiers' copies are written behind
    (``copies_behind``), the line saying they are in (``store_copies``): only then does the
    scheduler's lookup, which reads the shared tiers, see the whole store. Returns the seconds
    waited, raises TimeoutError past ``timeout_s``."""
    t0 = time.monotonic()
    while path:
        try:
            with open(path, encoding="utf-8") as f:
                events = [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:  # nothing traced yet: nothing submitted
            break
        except json.JSONDecodeError:  # a line half written
            events = None
        if events is not None:
            submitted = sum(e["event"] == "store_submit" for e in events)
            behind = sum(e["event"] == "store" and bool(e.get("copies_behind")) for e in events)
            copied = sum(e["event"] == "store_copies" for e in events)
            if sum(e["event"] == "store" and e["tokens"] > 0 for e in events) >= submitted and copied >= behind:
                break
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"kvgate stores still in flight after {timeout_s} s")
        time.sleep(0.01)
    return time.monotonic() - t0


def miss_reason(exc: BaseException) -> str:
    """A short, stable reason for a lookup, load or store that raised (for logs and counters)."""
    from gateway.errors import AccessDenied, TenantUnavailable
    from gateway.vllm.errors import GatewayTimeout

    if isinstance(exc, AccessDenied):
        return "denied"
    if isinstance(exc, TenantUnavailable):
        return "tenant_unavailable"
    if isinstance(exc, GatewayTimeout):
        return "gateway_timeout"
    if isinstance(exc, ValueError):
        return "invalid_request"
    return "gateway_error"
