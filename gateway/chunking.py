"""Chunk identity (docs/architecture.md, section 3): tokens cut into chunks, a chained sha256 per chunk.

    h_0 = sha256(model fingerprint)
    h_i = sha256(h_{i-1} || tokens_i as int32 little endian)

The last partial chunk is kept. Nothing here depends on PYTHONHASHSEED or the process: the same
tokens and model give the same hashes everywhere. Tenant namespacing happens later, when
``tenancy.namespaces`` turns each hash into an HMAC storage key."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["ModelFingerprint", "Chunk", "chunk_tokens", "chain_hashes", "InvalidTokens"]

MAX_TOKEN_ID = 2**31 - 1


class InvalidTokens(ValueError):
    """Token ids that cannot be hashed: empty, not integers, negative or out of range."""


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """What makes KV of one model incompatible with another's: hashed into h_0 and bound into
    every envelope's associated data."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_rank: int = 0
    tp_size: int = 1
    layout_version: int = 1
    # the chunk format where it is not the GPU layouts' one (kernels.layouts: the CPU format and
    # its block size); left out of the canonical form when empty, so their digests are unchanged
    chunk_format: str = ""

    def canonical(self) -> bytes:
        fields: dict[str, object] = {
            "model": self.model,
            "dtype": self.dtype,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "layout_version": self.layout_version,
        }
        if self.chunk_format:
            fields["chunk_format"] = self.chunk_format
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        """Hex sha256 of the canonical form; the form bound into envelopes."""
        return hashlib.sha256(self.canonical()).hexdigest()


@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    start: int  # first token position
    end: int  # one past the last token position
    chained_hash: bytes  # h_i, 32 bytes

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def _list_as_int32(tokens: list[int] | tuple[int, ...]) -> np.ndarray | None:
    """A list of Python ints packed in one C pass, straight to int32 little endian (numpy's
    asarray on a long token list costs about as much as the rest of a lookup; ``struct.pack``
    is the fastest of the standard ways, ahead of ``array.array``); None when it is not plainly a
    list of int32 (the numpy path then says why)."""
    if not tokens:
        return None
    try:
        packed = struct.pack(f"<{len(tokens)}i", *tokens)  # rejects floats, strings, nesting, ints past int32
    except struct.error:
        return None
    arr = np.frombuffer(packed, dtype="<i4")
    if int(arr.max()) <= 1 and all(type(t) is bool for t in tokens):
        return None  # only bools: numpy's path rejects them
    return arr


def _as_int32(tokens: Sequence[int] | np.ndarray, vocab_size: int | None) -> np.ndarray:
    fast = _list_as_int32(tokens) if isinstance(tokens, (list, tuple)) else None
    try:
        arr = np.asarray(tokens) if fast is None else fast
    except (TypeError, ValueError) as exc:
        raise InvalidTokens("tokens must be a sequence of integers") from exc
    if arr.ndim != 1:
        raise InvalidTokens(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidTokens("tokens must not be empty")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidTokens(f"tokens must be integers, got {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    limit = MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
    if lo < 0 or hi > limit:
        raise InvalidTokens(f"token ids must lie in [0, {limit}], got range [{lo}, {hi}]")
    return arr.astype("<i4", copy=False)


def chain_hashes(
    tokens: Sequence[int] | np.ndarray,
    fingerprint: ModelFingerprint,
    chunk_size: int = 256,
    *,
    vocab_size: int | None = None,
) -> list[Chunk]:
    """Cut ``tokens`` into chunks of ``chunk_size`` (the last one may be partial) and chain-hash them."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    arr = _as_int32(tokens, vocab_size)
    prev = hashlib.sha256(fingerprint.canonical()).digest()
    raw = memoryview(arr.tobytes())  # int32 little endian, one copy for every chunk
    chunks: list[Chunk] = []
    for i, start in enumerate(range(0, arr.size, chunk_size)):
        end = min(start + chunk_size, arr.size)
        h = hashlib.sha256(prev)
        h.update(raw[start * 4 : end * 4])
        prev = h.digest()
        chunks.append(Chunk(index=i, start=start, end=end, chained_hash=prev))
    return chunks


def chunk_tokens(num_tokens: int, chunk_size: int = 256) -> list[tuple[int, int]]:
    """The (start, end) token ranges of the chunks of a prompt of ``num_tokens`` tokens."""
    return [(s, min(s + chunk_size, num_tokens)) for s in range(0, num_tokens, chunk_size)]
