"""A model's per-layer paged KV tensors, checked once and viewed as rows of machine words.

vLLM allocates its KV cache once and hands it to the connector once (``register_kv_caches``).
``PagedKV`` takes it then: the shape/dtype/device/contiguity checks and the per-layer row views
are done at that point instead of on every chunk, which is most of the fixed cost of packing a
small chunk. ``pack``/``unpack`` accept either a ``PagedKV`` or a plain list of tensors (then it
is built on the fly).

A layer viewed as units: ``[num_units, unit_nbytes / word]``, ``word`` an integer dtype of 1, 2,
4 or 8 bytes. In the GPU layouts a unit is a row, one token's K or V (``num_kv_heads *
head_size`` elements: ``2 * num_blocks * block_size`` of them); in the CPU layout it is one
head's K or V of one token (``head_size`` elements), as that layout interleaves heads and tokens.
``row_index`` lists a chunk's units in chunk order (``layouts``: the chunk format).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import KVLayoutError
from .layouts import KVGeometry, KVLayout

__all__ = ["PagedKV", "rows_view", "word_alignment"]

WORDS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_alignment(tensors: Sequence[torch.Tensor]) -> int:
    """The largest word size (<= 8) that every tensor's data pointer is aligned to."""
    size = 8
    for t in tensors:
        while t.data_ptr() % size:
            size //= 2
    return size


def rows_view(t: torch.Tensor, word: torch.dtype, nrows: int) -> torch.Tensor:
    """A contiguous tensor's bytes as ``[nrows, -1]`` words (a view, no copy)."""
    return t.view(-1).view(torch.uint8).view(word).view(nrows, -1)


class PagedKV:
    """Per-layer paged KV tensors validated against a geometry, with cached row views."""

    __slots__ = ("_rows", "alignment", "device", "geometry", "layers", "num_blocks")

    def __init__(self, kv_layers: Sequence[torch.Tensor], geometry: KVGeometry) -> None:
        if not isinstance(geometry, KVGeometry):
            raise KVLayoutError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        self.num_blocks: int = geometry.validate_layers(kv_layers)
        self.geometry = geometry
        self.layers: tuple[torch.Tensor, ...] = tuple(kv_layers)
        self.device: torch.device = self.layers[0].device
        self.alignment: int = word_alignment(self.layers)
        self._rows: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}

    @classmethod
    def of(cls, kv_layers: Sequence[torch.Tensor] | PagedKV, geometry: KVGeometry) -> PagedKV:
        """``kv_layers`` itself if it is a ``PagedKV`` of ``geometry``, else a new one."""
        if isinstance(kv_layers, PagedKV):
            if kv_layers.geometry != geometry:
                raise KVLayoutError(
                    f"the PagedKV was built for {kv_layers.geometry}, not {geometry}"
                )
            return kv_layers
        return cls(kv_layers, geometry)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.geometry.block_size

    @property
    def num_rows(self) -> int:
        """Units per layer (rows in the GPU layouts)."""
        if self.geometry.layout is KVLayout.CPU:
            return 2 * self.num_slots * self.geometry.num_kv_heads
        return 2 * self.num_slots

    def rows(self, word: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Every layer as ``[num_rows, unit words]`` (cached per word dtype)."""
        views = self._rows.get(word)
        if views is None:
            views = tuple(rows_view(t, word, self.num_rows) for t in self.layers)
            self._rows[word] = views
        return views

    def row_index(self, slots: torch.Tensor) -> torch.Tensor:
        """Unit numbers of a chunk at ``slots`` (int64, on this device), in chunk order: in the
        GPU layouts all K rows, then all V rows; in the CPU layout per group of ``block_size``
        tokens, per head, K then V, per token."""
        bs = self.geometry.block_size
        if self.geometry.layout is KVLayout.KV_FIRST:  # rows: [2][num_blocks * bs]
            return torch.cat((slots, slots + self.num_slots))
        if self.geometry.layout is KVLayout.CPU:
            return _cpu_units(slots, bs, self.geometry.num_kv_heads)
        # BLOCK_FIRST, rows: [num_blocks][2][bs]; K row = block * 2 * bs + slot % bs
        k = slots + torch.div(slots, bs, rounding_mode="floor") * bs
        return torch.cat((k, k + bs))

    def unit_tokens(self, num_tokens: int) -> torch.Tensor:
        """The chunk token (0..num_tokens-1) of each unit of ``row_index``, in the same order."""
        t = torch.arange(num_tokens, dtype=torch.int64, device=self.device)
        if self.geometry.layout is not KVLayout.CPU:
            return torch.cat((t, t))
        return _cpu_units(t, self.geometry.block_size, self.geometry.num_kv_heads, tokens=True)

    def __repr__(self) -> str:
        return f"PagedKV({self.geometry!r}, num_blocks={self.num_blocks}, device={self.device})"


def _cpu_units(values: torch.Tensor, bs: int, heads: int, *, tokens: bool = False) -> torch.Tensor:
    """The CPU layout's units of a chunk, in chunk order ``[group][head][k|v][token]``.

    ``values``: the chunk's slots (its unit numbers: block ``b``, offset ``o`` -> ``((b * heads +
    h) * 2 + kv) * bs + o``), or with ``tokens`` its token numbers (returned for every unit)."""
    n = values.numel()
    h = torch.arange(heads, dtype=torch.int64, device=values.device).view(1, heads, 1, 1)
    kv = torch.arange(2, dtype=torch.int64, device=values.device).view(1, 1, 2, 1)
    parts = []
    for a, b in ((0, n - n % bs), (n - n % bs, n)):  # the whole groups, then a shorter last one
        if a == b:
            continue
        v = values[a:b].view(-1, 1, 1, min(bs, b - a))
        if tokens:
            parts.append(v.expand(-1, heads, 2, -1).reshape(-1))
        else:
            blocks, offsets = torch.div(v, bs, rounding_mode="floor"), v % bs
            parts.append((((blocks * heads + h) * 2 + kv) * bs + offsets).reshape(-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
