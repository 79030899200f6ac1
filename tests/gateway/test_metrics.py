"""The typed counter registry (gateway/metrics.py): every counter and label value exists from the
start at zero, a counter or label value that is not declared is refused (and counts nothing),
and the label values are those of their Literal types, in order (the /metrics series)."""

from __future__ import annotations

from typing import Any, get_args

import pytest

from gateway.metrics import KeyPurpose, LoadReason, LookupReason, Metrics, TierReason


def test_every_series_exists_at_zero_in_the_declared_order() -> None:
    m = Metrics()
    assert [v for v, _ in m.load_failed.items()] == list(get_args(LoadReason))
    assert [v for v, _ in m.lookup_degraded.items()] == list(get_args(LookupReason))
    assert [v for v, _ in m.load_degraded.items()] == list(get_args(TierReason))
    assert [v for v, _ in m.envelope_keys_issued.items()] == list(get_args(KeyPurpose)) == ["seal", "open"]
    assert m.lookup_hits == m.denials == m.envelope_keys_issued.total() == 0


def test_counts_go_where_they_are_declared() -> None:
    m = Metrics()
    m.load_failed["tier_timeout"] += 2
    m.envelope_keys_issued["seal"] += 3
    m.envelope_keys_issued["open"] += 1
    m.denials += 1
    assert (m.load_failed["tier_timeout"], m.load_failed["miss"]) == (2, 0)
    assert (m.envelope_keys_issued["seal"], m.envelope_keys_issued.total()) == (3, 4)
    assert Metrics().denials == 0  # each registry its own: nothing shared between processes' runtimes


def test_an_undeclared_counter_or_label_is_refused_and_counts_nothing() -> None:
    m = Metrics()
    labels: Any = m.load_failed  # past the type checker, as a cast that lied would be
    with pytest.raises(KeyError):
        labels["tier_timout"] += 1
    assert [n for _, n in m.load_failed.items()] == [0] * len(get_args(LoadReason))
    anything: Any = m
    with pytest.raises(AttributeError):
        anything.lookup_hit += 1  # a misspelt counter does not become a new one
    assert not hasattr(m, "lookup_hit")
    m.lookup_hits += 1  # the control
    assert m.lookup_hits == 1
