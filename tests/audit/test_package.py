"""The audit package's lazy names: ``__all__`` is spelled out for type checkers and must list
exactly the names ``__getattr__`` serves."""

from __future__ import annotations

import audit


def test_all_lists_exactly_the_lazy_names() -> None:
    assert audit.__all__ == sorted(audit._NAMES)
    for name in audit.__all__:
        assert getattr(audit, name) is not None
