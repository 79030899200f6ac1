"""Paged KV-cache layouts and the geometry of a packed chunk.

    KVLayout.KV_FIRST     [2, num_blocks, block_size, num_kv_heads, head_size]   (flash-attn)
    KVLayout.BLOCK_FIRST  [num_blocks, 2, block_size, num_kv_heads, head_size]   (FlashInfer)
    KVLayout.CPU          [num_blocks, num_kv_heads, block_size, 2 * head_size]  (vLLM's CPU backend)

A token's slot is ``block_id * block_size + offset``. ``block_first_view`` sees the GPU layouts as
BLOCK_FIRST (a view, no copy); ``BlockView`` gathers a request's blocks into a compact buffer
(``gather_into`` a reused one) and scatters back only chosen blocks; a CPU cache is held as it is.
The chunk format of ``n`` tokens (what the cipher encrypts), layer after layer: for the GPU
layouts ``[num_layers, 2, n, num_kv_heads, head_size]``, independent of GPU layout and block size
(``fingerprint_fields()`` leaves those out); for CPU, per group of ``block_size`` tokens,
``[num_kv_heads, 2, m, head_size]`` (a block's bytes), so its fingerprint names the block size and
format and CPU and GPU workers never read each other's chunks. Design notes:
docs/architecture.md, section 5."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import KVLayoutError

__all__ = ["CHUNK_LAYOUT", "PAGED_LAYOUTS", "BlockView", "KVGeometry", "KVLayout", "block_first_view", "layer_order"]

#: Names the chunk format of the GPU layouts; part of the model fingerprint so a format change
#: cannot be misread.
CHUNK_LAYOUT = "layer,kv,token,head,dim:v1"
#: The chunk format of the CPU layout (with the block size in the fingerprint beside it).
CPU_CHUNK_LAYOUT = "layer,block,head,kv,token,dim:v1"


class KVLayout(str, enum.Enum):
    """How one layer's paged KV tensor is laid out."""

    KV_FIRST = "kv_first"
    BLOCK_FIRST = "block_first"
    CPU = "cpu"  # [num_blocks, num_kv_heads, block_size, 2 * head_size] (vLLM's CPU attention backend)


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

    @property
    def unit_nbytes(self) -> int:
        """Bytes of the unit pack/unpack move per index entry: a row (one token's K or V, every
        head) in the GPU layouts, one head's K or V of one token in the CPU layout."""
        if self.layout is KVLayout.CPU:
            return self.head_size * self.dtype.itemsize
        return self.row_nbytes

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of a packed chunk of ``num_tokens`` tokens (the CPU format: flat per layer)."""
        n = _positive_int("num_tokens", num_tokens)
        if self.layout is KVLayout.CPU:
            return (self.num_layers, 2 * n * self.num_kv_heads * self.head_size)
        return (self.num_layers, 2, n, self.num_kv_heads, self.head_size)

    def chunk_nbytes(self, num_tokens: int) -> int:
        """Bytes of a packed chunk of ``num_tokens`` tokens."""
        return math.prod(self.chunk_shape(num_tokens)) * self.dtype.itemsize

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's paged tensor holding ``num_blocks`` blocks."""
        b = _positive_int("num_blocks", num_blocks)
        if self.layout is KVLayout.KV_FIRST:
            return (2, b, self.block_size, self.num_kv_heads, self.head_size)
        if self.layout is KVLayout.CPU:
            return (b, self.num_kv_heads, self.block_size, 2 * self.head_size)
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
        dims = 4 if self.layout is KVLayout.CPU else 5
        if not isinstance(first, torch.Tensor) or first.dim() != dims:
            raise KVLayoutError(f"kv_layers[0] must be a {dims}-D tensor, got {_describe(first)}")
        num_blocks = first.shape[1 if self.layout is KVLayout.KV_FIRST else 0]
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

    @property
    def chunk_format(self) -> str:
        """The chunk format's name: ``CHUNK_LAYOUT`` for the GPU layouts (whatever their block
        size), the CPU format with its block size (its bytes depend on it)."""
        if self.layout is KVLayout.CPU:
            return f"{CPU_CHUNK_LAYOUT};block_size={self.block_size}"
        return CHUNK_LAYOUT

    def fingerprint_fields(self) -> dict[str, Any]:
        """The fields of this geometry a model fingerprint must cover (JSON-ready values).

        The GPU layouts and their block size are left out on purpose: their chunk bytes do not
        depend on them. The CPU format does, and ``chunk_layout`` names it with its block size.
        The gateway adds model name and tensor-parallel rank."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "chunk_layout": self.chunk_format,
        }


def _describe(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a {obj.dim()}-D tensor of shape {tuple(obj.shape)}"
    return type(obj).__name__


# -- vLLM's paged tensors, seen as blocks ---------------------------------------------------------

#: names a caller may give for a paged tensor's layout ("auto": recognised by shape)
PAGED_LAYOUTS = ("auto", "cpu", "kv_first", "block_first")


def layer_order(names: Sequence[str]) -> list[str]:
    """Layer names sorted by the first integer in them (``model.layers.10.attn`` after ``.9.``)."""

    def key(name: str) -> tuple[int, str]:
        for part in name.split("."):
            if part.isdigit():
                return int(part), name
        return -1, name

    return sorted(names, key=key)


def block_first_view(t: torch.Tensor, block_size: int, layout: str = "auto") -> torch.Tensor:
    """``t`` (CPU, KV-first or block-first paged layout) as ``[num_blocks, 2, block_size, heads,
    head_size]``, without a copy. ``KVLayoutError`` for a shape none of them explains."""
    if _is_cpu_layout(t, block_size, layout):
        b, h, bs, d2 = t.shape
        return t.view(b, h, 2, bs, d2 // 2).permute(0, 2, 3, 1, 4)
    if t.dim() == 5 and t.shape[2] == block_size:
        if layout == "kv_first" or (layout == "auto" and t.shape[0] == 2 and t.shape[1] != 2):
            return t.permute(1, 0, 2, 3, 4)
        if layout == "block_first" or (layout == "auto" and t.shape[1] == 2 and t.shape[0] != 2):
            return t
    raise KVLayoutError(
        f"unsupported paged KV layout: shape {tuple(t.shape)}, block size {block_size}, layout {layout!r}; "
        "set kv_connector_extra_config.layout to cpu, kv_first or block_first"
    )


def _is_cpu_layout(t: torch.Tensor, block_size: int, layout: str) -> bool:
    return layout in ("auto", "cpu") and t.dim() == 4 and t.shape[2] == block_size and t.shape[3] % 2 == 0


@dataclass(frozen=True)
class BlockView:
    """Every layer of a worker's KV cache as blocks along dim 0: a CPU cache as it is
    (``native``: ``[num_blocks, heads, block_size, 2 * head_size]``, geometry ``KVLayout.CPU``),
    a GPU one as ``[num_blocks, 2, block_size, heads, head_size]`` (geometry BLOCK_FIRST, the
    layout of its compact buffers)."""

    names: tuple[str, ...]
    views: tuple[torch.Tensor, ...]
    geometry: KVGeometry  # of the compact buffers (and, when native, of the cache itself)
    native: bool = False

    @classmethod
    def of(cls, kv_caches: Mapping[str, torch.Tensor], block_size: int, layout: str = "auto") -> BlockView:
        if not kv_caches:
            raise KVLayoutError("vLLM registered no KV caches")
        names = tuple(layer_order(list(kv_caches)))
        tensors = [kv_caches[n] for n in names]
        if all(_is_cpu_layout(t, block_size, layout) and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
            views = tuple(tensors)
            heads, head_size, kind = views[0].shape[1], views[0].shape[3] // 2, KVLayout.CPU
        else:
            views = tuple(block_first_view(t, block_size, layout) for t in tensors)
            heads, head_size, kind = views[0].shape[3], views[0].shape[4], KVLayout.BLOCK_FIRST
        first = views[0]
        for n, v in zip(names, views):
            if v.shape[1:] != first.shape[1:] or v.dtype != first.dtype:
                raise KVLayoutError(f"layer {n} has shape {tuple(v.shape)}, {names[0]} {tuple(first.shape)}")
        geometry = KVGeometry(
            num_layers=len(views), num_kv_heads=heads, head_size=head_size, dtype=first.dtype,
            block_size=block_size, layout=kind,
        )
        return cls(names, views, geometry, native=kind is KVLayout.CPU)

    @property
    def num_blocks(self) -> int:
        return int(self.views[0].shape[0])

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        idx = torch.as_tensor(list(block_ids), dtype=torch.int64, device=self.views[0].device)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks):
            raise KVLayoutError(f"block ids must lie in [0, {self.num_blocks})")
        return idx

    def gather(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """A contiguous copy of these blocks of every layer (the compact buffer for a store)."""
        idx = self._index(block_ids)
        return [v.index_select(0, idx).contiguous() for v in self.views]

    def gather_into(self, block_ids: Sequence[int], out: Sequence[torch.Tensor]) -> None:
        """Copy these blocks of every layer into blocks ``0..len(block_ids)-1`` of ``out`` (a
        reused compact buffer, one contiguous tensor per layer with at least that many blocks)."""
        idx = self._index(block_ids)
        n = idx.numel()
        for view, buf in zip(self.views, out, strict=True):
            if (buf.shape[0] < n or buf.shape[1:] != view.shape[1:] or buf.dtype != view.dtype
                    or buf.device != view.device or not buf.is_contiguous()):
                raise KVLayoutError(f"a compact buffer of shape {tuple(buf.shape)} cannot take {n} blocks of this cache")
            torch.index_select(view, 0, idx, out=buf[:n])

    def empty(self, num_blocks: int) -> list[torch.Tensor]:
        """A zeroed compact buffer of ``num_blocks`` blocks (for a load)."""
        shape = (num_blocks, *self.views[0].shape[1:])
        return [torch.zeros(shape, dtype=self.geometry.dtype, device=self.views[0].device) for _ in self.views]

    def scatter(self, compact: Sequence[torch.Tensor], positions: range, block_ids: Sequence[int]) -> None:
        """Write compact blocks ``positions`` into the engine's blocks ``block_ids[positions]``."""
        if not positions:
            return
        idx = self._index([block_ids[p] for p in positions])
        if positions.step == 1:  # the usual case: a slice, not a gathered copy
            for view, buf in zip(self.views, compact):
                view.index_copy_(0, idx, buf[positions.start : positions.stop])
            return
        src = torch.as_tensor(list(positions), dtype=torch.int64, device=idx.device)
        for view, buf in zip(self.views, compact):
            view.index_copy_(0, idx, buf.index_select(0, src))
