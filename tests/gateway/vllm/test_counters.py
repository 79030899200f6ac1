"""The connector's counters: outcomes declared once, handed to vLLM's metrics once each."""

from __future__ import annotations

import threading

import pytest

from gateway.vllm.counters import ConnectorCounters, split_key


def test_counts_are_taken_once_and_totals_stay():
    c = ConnectorCounters()
    c.count("lookup")
    c.count("lookup", "tier_timeout")
    c.tokens("lookup_hit", 256)
    c.tokens("loaded", 0)  # nothing loaded is no entry
    assert c.take() == {"lookup/ok": 1, "lookup/tier_timeout": 1, "tokens/lookup_hit": 256}
    assert c.take() == {}
    assert c.get("lookup") == 1 and c.get("lookup", "tier_timeout") == 1 and c.tokens_of("lookup_hit") == 256
    assert c.failures() == {("lookup", "tier_timeout"): 1}  # ok is not a failure


def test_an_undeclared_event_or_token_kind_is_refused():
    c = ConnectorCounters()
    with pytest.raises(ValueError):
        c.count("loads")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        c.tokens("hit", 1)  # type: ignore[arg-type]
    assert c.take() == {}


def test_counting_from_several_threads_loses_nothing():
    c = ConnectorCounters()
    taken: list[dict[str, int]] = []

    def count() -> None:
        for _ in range(2000):
            c.count("store")

    def take() -> None:
        for _ in range(200):
            taken.append(c.take())

    threads = [threading.Thread(target=count) for _ in range(4)] + [threading.Thread(target=take)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    taken.append(c.take())
    assert sum(d.get("store/ok", 0) for d in taken) == 8000 == c.get("store")


def test_keys_split_into_event_and_outcome():
    assert split_key("load/integrity") == ("load", "integrity")
    assert split_key("tokens/loaded") == ("tokens", "loaded")
    assert split_key("garbage") == ("garbage", "")
