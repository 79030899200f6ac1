"""ChunkKey.many: the batch constructor builds the same keys with the same checks."""

from __future__ import annotations

import pytest

from storage.types import ChunkKey, TierFull, TierTimeout, TierUnavailable, failure_reason


def test_many_equals_one_by_one() -> None:
    digests = [f"{i:064x}" for i in range(128)]
    keys = ChunkKey.many("ab", "cd", digests)
    assert keys == [ChunkKey("ab", "cd", d) for d in digests]
    assert len({hash(k) for k in keys}) == 128
    with pytest.raises(AttributeError):
        keys[0].digest = "ff"  # type: ignore[misc]  # still frozen


@pytest.mark.parametrize(
    ("owner", "group", "digest"),
    [("AB", "cd", "ef"), ("ab", "", "ef"), ("ab", "cd", "xyz"), ("ab", "cd", "f" * 129), ("ab", "cd", 5)],
)
def test_many_rejects_what_the_constructor_rejects(owner: object, group: object, digest: object) -> None:
    with pytest.raises(ValueError):
        ChunkKey(owner, group, digest)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ChunkKey.many(owner, group, ["00", digest])  # type: ignore[arg-type, list-item]


def test_failure_reason_names_a_missed_deadline_before_an_outage() -> None:
    assert failure_reason([]) == ""  # nothing failed
    assert failure_reason([TierUnavailable("down")]) == "tier_unavailable"
    assert failure_reason([TierFull("full")]) == "tier_unavailable"  # any other tier failure
    assert failure_reason([TierUnavailable("down"), TierTimeout("slow")]) == "tier_timeout"
    assert failure_reason(iter([TierTimeout("slow"), TierUnavailable("down")])) == "tier_timeout"
