"""kvgate's logging: one logger tree, text or JSON lines, configured once per process.

    kvgate                 root of the tree (a handler is attached here, never to the root logger)
     +-- kvgate.core       the gateway core: failed loads (WARNING, with the reason), integrity
     +-- kvgate.server     the REST server: why a request got 401 (INFO), outages
     +-- kvgate.vllm       the connector and middleware: failed loads and degraded lookups
     +-- kvgate.storage    tiers: breaker trips, deadlines
     +-- kvgate.audit      the audit writer: spool growth, delivery

``KVGATE_LOG_LEVEL`` (default info for `kvgate serve`, warning inside vLLM) and
``KVGATE_LOG_FORMAT`` (``text`` or ``json``: one JSON object a line with time, level, logger,
message and any ``extra`` fields) choose the rest. An application that configured logging for
``kvgate`` or the root logger itself keeps its own configuration.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

__all__ = ["JsonFormatter", "RateLimitedLogger", "configure_logging"]

_TEXT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_STD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_lock = threading.Lock()


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STD and not k.startswith("_")})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str | None = None, fmt: str | None = None, *, force: bool = False) -> bool:
    """Give the ``kvgate`` logger one stderr handler unless logging is configured already (or
    ``force``). Returns whether it attached one."""
    level = (level or os.environ.get("KVGATE_LOG_LEVEL") or "info").upper()
    fmt = (fmt or os.environ.get("KVGATE_LOG_FORMAT") or "text").lower()
    kv = logging.getLogger("kvgate")
    with _lock:
        if not force and (kv.handlers or logging.getLogger().handlers):
            return False
        for h in list(kv.handlers):
            kv.removeHandler(h)
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT))
        kv.addHandler(handler)
        kv.setLevel(getattr(logging, level, logging.INFO))
        kv.propagate = False
        return True


class RateLimitedLogger:
    """At most one WARNING per ``interval_s`` for one kind of event; the next one says how many
    were held back (an outage degrades every request, and the log must stay readable)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._log, self._interval = logger, interval_s
        self._next = 0.0
        self._held = 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._held += 1
                return
            held, self._held, self._next = self._held, 0, now + self._interval
        if held:
            msg += " (%d more like this in the last %.0f s)"
            args = (*args, held, self._interval)
        self._log.warning(msg, *args)
