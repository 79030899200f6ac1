"""Exceptions raised by ``kernels``.

Every check runs before any tensor is touched, so a raised error means nothing was written.

    KVKernelError                 base of everything this package raises
    └── KVLayoutError (ValueError)  bad geometry, cache tensors, slots, block ids, chunk or `out`

Torch errors met while validating (for example a tensor whose bytes cannot be viewed as rows) are
translated into ``KVLayoutError`` here; none escape as ``RuntimeError``.
"""

from __future__ import annotations

__all__ = [
    "KVKernelError",
    "KVLayoutError",
]


class KVKernelError(Exception):
    """Base class of every error raised by ``kernels``."""


class KVLayoutError(KVKernelError, ValueError):
    """A geometry, cache tensor, slot mapping, chunk or output buffer does not fit.

    The message names the offending argument and what was expected."""
