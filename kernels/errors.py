"""Exceptions raised by ``kernels``.

Every check runs before any tensor is touched, so a raised error means nothing was written.

    KVKernelError                 base of everything this package raises
    ├── KVLayoutError (ValueError)  bad geometry, cache tensors, slots, block ids, chunk or `out`
    └── StagingError                the staging pool cannot hand out a buffer
        ├── StagingExhausted        every buffer is leased and none came back within the timeout
        └── StagingClosed           the pool was closed

Torch errors met while validating (for example a tensor whose bytes cannot be viewed as rows) are
translated into ``KVLayoutError`` here; none escape as ``RuntimeError``.
"""

from __future__ import annotations

__all__ = [
    "KVKernelError",
    "KVLayoutError",
    "StagingClosed",
    "StagingError",
    "StagingExhausted",
]


class KVKernelError(Exception):
    """Base class of every error raised by ``kernels``."""


class KVLayoutError(KVKernelError, ValueError):
    """A geometry, cache tensor, slot mapping, chunk or output buffer does not fit.

    The message names the offending argument and what was expected."""


class StagingError(KVKernelError):
    """The staging pool could not hand out a buffer."""


class StagingExhausted(StagingError):
    """Every staging buffer is leased and none was released within the timeout."""


class StagingClosed(StagingError):
    """The staging pool has been closed; its buffers are gone."""
