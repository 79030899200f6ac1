"""vLLM's per-layer paged KV tensors seen as blocks, and the compact buffers the connector moves.

vLLM 0.32 hands the connector one tensor per attention layer. The layouts met so far:

    CPU backend        [num_blocks, num_kv_heads, block_size, 2 * head_size]
                       (memory: per block and head, block_size K rows, then block_size V rows)
    KV-first (flash)   [2, num_blocks, block_size, num_kv_heads, head_size]
    block-first        [num_blocks, 2, block_size, num_kv_heads, head_size]

``BlockView`` views each of them as ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (a
strided view, no copy). The connector gathers a request's blocks into a contiguous compact
buffer of that shape (``kernels``' BLOCK_FIRST layout, blocks 0..n-1), lets the gateway core
pack/seal or open/unpack it, and scatters back only the blocks that loaded and authenticated:
so unauthenticated KV never reaches the engine, and blocks the engine already computed (a local
prefix-cache hit) are never written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gateway.vllm.errors import ConnectorConfigError
from kernels.layouts import KVGeometry, KVLayout

__all__ = ["BlockView", "layer_order"]


def layer_order(names: Sequence[str]) -> list[str]:
    """Layer names sorted by the first integer in them (``model.layers.10.attn`` after ``.9.``)."""

    def key(name: str) -> tuple[int, str]:
        for part in name.split("."):
            if part.isdigit():
                return int(part), name
        return -1, name

    return sorted(names, key=key)


def _as_blocks(t: torch.Tensor, block_size: int, layout: str) -> torch.Tensor:
    if layout in ("auto", "cpu") and t.dim() == 4 and t.shape[2] == block_size and t.shape[3] % 2 == 0:
        b, h, bs, d2 = t.shape
        return t.view(b, h, 2, bs, d2 // 2).permute(0, 2, 3, 1, 4)
    if t.dim() == 5 and t.shape[2] == block_size:
        if layout == "kv_first" or (layout == "auto" and t.shape[0] == 2 and t.shape[1] != 2):
            return t.permute(1, 0, 2, 3, 4)
        if layout == "block_first" or (layout == "auto" and t.shape[1] == 2 and t.shape[0] != 2):
            return t
    raise ConnectorConfigError(
        f"unsupported paged KV layout: shape {tuple(t.shape)}, block size {block_size}, layout {layout!r}; "
        "set kv_connector_extra_config.layout to cpu, kv_first or block_first"
    )


@dataclass(frozen=True)
class BlockView:
    """Every layer of a worker's KV cache as ``[num_blocks, 2, block_size, heads, head_size]``."""

    names: tuple[str, ...]
    views: tuple[torch.Tensor, ...]
    geometry: KVGeometry  # of the compact buffers (BLOCK_FIRST)

    @classmethod
    def of(cls, kv_caches: Mapping[str, torch.Tensor], block_size: int, layout: str = "auto") -> BlockView:
        if not kv_caches:
            raise ConnectorConfigError("vLLM registered no KV caches")
        names = tuple(layer_order(list(kv_caches)))
        views = tuple(_as_blocks(kv_caches[n], block_size, layout) for n in names)
        first = views[0]
        for n, v in zip(names, views):
            if v.shape[1:] != first.shape[1:] or v.dtype != first.dtype:
                raise ConnectorConfigError(f"layer {n} has shape {tuple(v.shape)}, {names[0]} {tuple(first.shape)}")
        _, _, bs, heads, head_size = first.shape
        geometry = KVGeometry(
            num_layers=len(views), num_kv_heads=heads, head_size=head_size, dtype=first.dtype,
            block_size=bs, layout=KVLayout.BLOCK_FIRST,
        )
        return cls(names, views, geometry)

    @property
    def num_blocks(self) -> int:
        return int(self.views[0].shape[0])

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        idx = torch.as_tensor(list(block_ids), dtype=torch.int64, device=self.views[0].device)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks):
            raise ValueError(f"block ids must lie in [0, {self.num_blocks})")
        return idx

    def gather(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """A contiguous copy of these blocks of every layer (the compact buffer for a store)."""
        idx = self._index(block_ids)
        return [v.index_select(0, idx).contiguous() for v in self.views]

    def empty(self, num_blocks: int) -> list[torch.Tensor]:
        """A zeroed compact buffer of ``num_blocks`` blocks (for a load)."""
        shape = (num_blocks, *self.views[0].shape[1:])
        return [torch.zeros(shape, dtype=self.geometry.dtype, device=self.views[0].device) for _ in self.views]

    def scatter(self, compact: Sequence[torch.Tensor], positions: range, block_ids: Sequence[int]) -> None:
        """Write compact blocks ``positions`` into the engine's blocks ``block_ids[positions]``."""
        if not positions:
            return
        idx = self._index([block_ids[p] for p in positions])
        src = torch.as_tensor(list(positions), dtype=torch.int64, device=idx.device)
        for view, buf in zip(self.views, compact):
            view.index_copy_(0, idx, buf.index_select(0, src))
