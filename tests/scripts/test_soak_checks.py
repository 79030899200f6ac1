"""The soak's resident-memory invariant on made-up samples: a level process passes, a leak
fails, by the trend and, where a run is too short for one, by the ceiling."""

from __future__ import annotations

from scripts.soak.checks import rss_trend


def _samples(pid: int, start_mib: float, mib_per_min: float, seconds: float = 120.0) -> list[tuple[float, int, int]]:
    return [(t / 2, pid, int((start_mib + mib_per_min * t / 120) * 1024)) for t in range(int(seconds * 2))]


def test_the_trend_tells_a_level_process_from_a_leaking_one() -> None:
    assert rss_trend(_samples(1, 160, 0.0), warmup_s=30, limit=2.0)["held"]
    leak = rss_trend(_samples(1, 160, 10.0), warmup_s=30, limit=2.0)
    assert not leak["held"] and leak["slope_mib_per_min"] > 9


def test_a_short_run_is_judged_by_its_ceiling() -> None:
    levelling = _samples(1, 76, 90.0, seconds=50)  # still climbing to its level: the slope says nothing yet
    judged = rss_trend(levelling, warmup_s=15, limit=None, ceiling_mib=384)
    assert judged["held"] and judged["slope_mib_per_min"] > 8 and judged["max_mib"] < 160
    runaway = _samples(1, 76, 600.0, seconds=50)
    assert not rss_trend(runaway, warmup_s=15, limit=None, ceiling_mib=384)["held"]
    assert not rss_trend([], warmup_s=15, limit=None, ceiling_mib=384)["held"]  # nothing sampled proves nothing
