"""Paged KV-cache layouts and the geometry of a packed chunk.

vLLM keeps one paged tensor per attention layer, in one of two layouts:

    KVLayout.KV_FIRST     [2, num_blocks, block_size, num_kv_heads, head_size]   (flash-attn)
    KVLayout.BLOCK_FIRST  [num_blocks, 2, block_size, num_kv_heads, head_size]   (FlashInfer, CPU)

A token's place in a layer is its slot: ``slot = block_id * block_size + offset``.

A chunk of ``n`` tokens, packed across every layer, always has the shape

    [num_layers, 2, n, num_kv_heads, head_size]        (K at index 0, V at index 1)

whatever the paged layout or block size was; the cipher encrypts exactly these bytes, so a chunk
written by a flash-attn worker can be loaded by a FlashInfer worker with another block size.
That is why ``fingerprint_fields()`` leaves the paged layout and block size out.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import KVLayoutError

__all__ = ["CHUNK_LAYOUT", "KVGeometry", "KVLayout"]

#: Names the fixed chunk layout; part of the model fingerprint so a format change cannot be misread.
CHUNK_LAYOUT = "layer,kv,token,head,dim:v1"


class KVLayout(str, enum.Enum):
    """How one layer's paged KV tensor is laid out."""

    KV_FIRST = "kv_first"
    BLOCK_FIRST = "block_first"


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KVLayoutError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Shape facts of a model's paged KV cache; everything pack/unpack needs besides the slots."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    layout: KVLayout

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.dtype, torch.dtype):
            raise KVLayoutError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.dtype.itemsize < 1:
            raise KVLayoutError(f"dtype {self.dtype} has no whole-byte element size")
        try:
            layout = KVLayout(self.layout)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in KVLayout)
            raise KVLayoutError(f"layout must be one of {allowed}, got {self.layout!r}") from None
        object.__setattr__(self, "layout", layout)

    # -- sizes -------------------------------------------------------------------------------

    @property
    def row_nbytes(self) -> int:
        """Bytes of one token's K (or V) in one layer: ``num_kv_heads * head_size * itemsize``."""
        return self.num_kv_heads * self.head_size * self.dtype.itemsize

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of a packed chunk of ``num_tokens`` tokens."""
        n = _positive_int("num_tokens", num_tokens)
        return (self.num_layers, 2, n, self.num_kv_heads, self.head_size)

    def chunk_nbytes(self, num_tokens: int) -> int:
        """Bytes of a packed chunk of ``num_tokens`` tokens."""
        return math.prod(self.chunk_shape(num_tokens)) * self.dtype.itemsize

    def layer_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's paged tensor holding ``num_blocks`` blocks."""
        b = _positive_int("num_blocks", num_blocks)
        if self.layout is KVLayout.KV_FIRST:
            return (2, b, self.block_size, self.num_kv_heads, self.head_size)
        return (b, 2, self.block_size, self.num_kv_heads, self.head_size)

    # -- validation --------------------------------------------------------------------------

    def validate_layers(self, kv_layers: Sequence[torch.Tensor]) -> int:
        """Check the per-layer paged tensors against this geometry; return ``num_blocks``.

        Checks: a sequence (not one stacked tensor) of ``num_layers`` tensors, each of this
        dtype, of the layout's shape with the same number of blocks, all on one device, and
        contiguous. Raises ``KVLayoutError`` naming the first layer that does not fit."""
        if isinstance(kv_layers, torch.Tensor) or not isinstance(kv_layers, Sequence):
            raise KVLayoutError(
                f"kv_layers must be a sequence of {self.num_layers} per-layer tensors, "
                f"got {type(kv_layers).__name__}"
            )
        if len(kv_layers) != self.num_layers:
            raise KVLayoutError(
                f"kv_layers has {len(kv_layers)} layers, geometry expects {self.num_layers}"
            )
        first = kv_layers[0]
        if not isinstance(first, torch.Tensor) or first.dim() != 5:
            raise KVLayoutError(f"kv_layers[0] must be a 5-D tensor, got {_describe(first)}")
        num_blocks = first.shape[0 if self.layout is KVLayout.BLOCK_FIRST else 1]
        if num_blocks <= 0:
            raise KVLayoutError("kv_layers[0] holds no blocks")
        want = self.layer_shape(num_blocks)
        for i, t in enumerate(kv_layers):
            where = f"kv_layers[{i}]"
            if not isinstance(t, torch.Tensor):
                raise KVLayoutError(f"{where} must be a tensor, got {type(t).__name__}")
            if t.dtype != self.dtype:
                raise KVLayoutError(f"{where} has dtype {t.dtype}, geometry expects {self.dtype}")
            if tuple(t.shape) != want:
                raise KVLayoutError(
                    f"{where} has shape {tuple(t.shape)}, expected {want} "
                    f"({self.layout.value} layout, {num_blocks} blocks)"
                )
            if t.device != first.device:
                raise KVLayoutError(f"{where} is on {t.device}, kv_layers[0] on {first.device}")
            if not t.is_contiguous():
                raise KVLayoutError(f"{where} is not contiguous (strides {t.stride()})")
        return num_blocks

    def validate_chunk(
        self,
        chunk: torch.Tensor,
        num_tokens: int,
        device: torch.device | None = None,
        *,
        name: str = "chunk",
    ) -> None:
        """Check a packed chunk (or an ``out`` buffer) of ``num_tokens`` tokens."""
        if not isinstance(chunk, torch.Tensor):
            raise KVLayoutError(f"{name} must be a tensor, got {type(chunk).__name__}")
        want = self.chunk_shape(num_tokens)
        if chunk.dtype != self.dtype:
            raise KVLayoutError(f"{name} has dtype {chunk.dtype}, geometry expects {self.dtype}")
        if tuple(chunk.shape) != want:
            raise KVLayoutError(
                f"{name} has shape {tuple(chunk.shape)}, expected {want} for {num_tokens} tokens"
            )
        if device is not None and chunk.device != device:
            raise KVLayoutError(f"{name} is on {chunk.device}, the KV cache on {device}")
        if not chunk.is_contiguous():
            raise KVLayoutError(f"{name} is not contiguous (strides {chunk.stride()})")

    # -- identity ----------------------------------------------------------------------------

    def fingerprint_fields(self) -> dict[str, Any]:
        """The fields of this geometry a model fingerprint must cover (JSON-ready values).

        Paged layout and block size are left out on purpose: the chunk bytes do not depend on
        them. The gateway adds model name and tensor-parallel rank."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "chunk_layout": CHUNK_LAYOUT,
        }


def _describe(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a {obj.dim()}-D tensor of shape {tuple(obj.shape)}"
    return type(obj).__name__
