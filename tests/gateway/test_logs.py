"""kvgate's logger tree (gateway/logs.py): one handler on ``kvgate``, text or JSON lines, and an
application's own configuration left alone."""

from __future__ import annotations

import io
import json
import logging

import pytest

from gateway.logs import JsonFormatter, configure_logging
from gateway.vllm.logs import RateLimitedLogger


@pytest.fixture
def clean_kvgate_logger():
    kv, root = logging.getLogger("kvgate"), logging.getLogger()
    saved = (list(kv.handlers), kv.level, kv.propagate, list(root.handlers))
    for h in list(kv.handlers):
        kv.removeHandler(h)
    for h in list(root.handlers):
        root.removeHandler(h)
    yield kv
    for h in list(kv.handlers):
        kv.removeHandler(h)
    for h in saved[0]:
        kv.addHandler(h)
    kv.setLevel(saved[1])
    kv.propagate = saved[2]
    for h in saved[3]:
        root.addHandler(h)


def test_json_lines_carry_level_logger_message_and_extras(clean_kvgate_logger):
    assert configure_logging("info", "json", force=True)  # pytest itself puts handlers on the root logger
    stream = io.StringIO()
    clean_kvgate_logger.handlers[0].setStream(stream)
    logging.getLogger("kvgate.core").warning("load ended: %s", "integrity", extra={"tenant_label": "ab12"})
    logging.getLogger("kvgate.core").debug("not shown at info")
    (line,) = stream.getvalue().splitlines()
    rec = json.loads(line)
    assert (rec["level"], rec["logger"], rec["message"], rec["tenant_label"]) == ("warning", "kvgate.core", "load ended: integrity", "ab12")


def test_an_application_configuration_is_kept(clean_kvgate_logger):
    app_handler = logging.StreamHandler(io.StringIO())
    logging.getLogger().addHandler(app_handler)
    try:
        assert not configure_logging("info", "json")  # the root logger is configured: leave it
        assert not clean_kvgate_logger.handlers
    finally:
        logging.getLogger().removeHandler(app_handler)


def test_json_formatter_includes_exceptions():
    try:
        raise ValueError("boom")
    except ValueError:
        rec = logging.LogRecord("kvgate.x", logging.ERROR, __file__, 1, "failed", (), exc_info=__import__("sys").exc_info())
    assert "ValueError: boom" in json.loads(JsonFormatter().format(rec))["exception"]


def test_rate_limited_warning_says_how_many_were_held_back(caplog):
    log = logging.getLogger("kvgate.test.rl")
    rl = RateLimitedLogger(log, interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger="kvgate.test.rl"):
        for _ in range(5):
            rl.warning("lookup degraded: %s", "tier_timeout")
        import time

        time.sleep(0.25)
        rl.warning("lookup degraded: %s", "tier_timeout")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "lookup degraded: tier_timeout" and len(msgs) == 2
    assert "4 more like this" in msgs[1]
