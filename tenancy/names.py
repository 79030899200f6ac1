"""The one rule for names: tenants, namespaces (and whatever else a caller names).

A name is canonical by construction: lowercase ASCII letters, digits, ``.``, ``_`` and ``-``,
starting and ending with a letter or a digit, 1 to 64 characters:

    ^[a-z0-9]([a-z0-9._-]{0,62}[a-z0-9])?$

Nothing is normalised or folded: a name that is not already canonical is refused. So two names
that look alike are the same bytes or one of them is refused -- no case variants (``Acme``), no
trailing space or dot, no NUL or other control character, no zero-width or lookalike character
(Cyrillic ``а``), no Unicode normal forms to disagree about. Every route, the CLI and the core
check names with ``check_name``; ``escape`` renders a refused value safely for logs and audit.
"""

from __future__ import annotations

import re
from typing import TypeGuard

__all__ = ["NAME_MAX", "NAME_PATTERN", "InvalidName", "check_name", "escape", "is_name"]

NAME_MAX = 64
NAME_PATTERN = r"^[a-z0-9]([a-z0-9._-]{0,62}[a-z0-9])?$"
_NAME = re.compile(NAME_PATTERN.replace("$", r"\Z"))


class InvalidName(ValueError):
    def __init__(self, what: str, value: object) -> None:
        super().__init__(
            f"{what} must be 1..{NAME_MAX} characters of a-z, 0-9, '.', '_', '-', "
            "starting and ending with a letter or digit"
        )
        self.what = what
        self.value = value


def is_name(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and len(value) <= NAME_MAX and _NAME.match(value) is not None


def check_name(value: object, what: str = "name") -> str:
    """``value`` if it is a canonical name, else ``InvalidName`` (a ValueError)."""
    if not is_name(value):
        raise InvalidName(what, value)
    return value


def escape(value: object, limit: int = 200) -> str:
    """A refused value as printable ASCII (``\\x00``, ``\\u200b``), cut to ``limit`` characters."""
    text = value if isinstance(value, str) else repr(value)
    return ascii(text[: limit * 4])[1:-1][:limit]
