"""Pack a chunk's KV from every layer's paged tensor into one contiguous buffer, and back.

Each layer is viewed as rows of raw machine words, one row per (K or V, slot):
``[rows, num_kv_heads * head_size * itemsize / word]``. One row-index tensor is computed per
call (K rows, then V rows, matching the chunk's ``[2, n, ...]`` order), then each layer is moved
with a single ``torch.index_select(..., out=)`` (pack) or ``index_copy_`` (unpack). Moving words,
never floats, makes every dtype (fp8 and NaN payloads included) bit-exact, and the same code runs
on CPU and CUDA. With ``out`` given, nothing proportional to the payload is allocated (only
the 2n-entry row index). Pass a ``PagedKV`` built once at registration to skip re-checking and
re-viewing every layer per call (see ``paged.py``).

Every argument is validated before any tensor is touched: an error means nothing was written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import KVLayoutError
from .layouts import KVGeometry, KVLayout
from .paged import WORDS, PagedKV, rows_view, word_alignment

__all__ = ["KVLayers", "SlotsLike", "chunk_rows", "pack", "slots_from_block_ids", "unpack"]

SlotsLike = torch.Tensor | Sequence[int]
KVLayers = Sequence[torch.Tensor] | PagedKV

_NO_DUP = torch.iinfo(torch.int64).max
# at::internal::GRAIN_SIZE. CPU index_select memcpy's whole rows (of rows < GRAIN_SIZE elements)
# and hands each thread GRAIN_SIZE // row_elements rows, so the narrowest word spreads a chunk
# over the most threads.
_CPU_GRAIN = 32768


def _as_index(values: SlotsLike, name: str) -> torch.Tensor:
    """A 1-D, non-empty integer tensor (not yet moved, not yet range-checked)."""
    if not isinstance(values, torch.Tensor):
        try:
            values = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise KVLayoutError(f"{name} must be a sequence of ints: {exc}") from None
    if values.dim() != 1:
        raise KVLayoutError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
    if values.numel() == 0:
        raise KVLayoutError(f"{name} is empty")
    if values.dtype == torch.bool or values.is_floating_point() or values.is_complex():
        raise KVLayoutError(f"{name} must hold integers, got dtype {values.dtype}")
    return values


def slots_from_block_ids(
    block_ids: SlotsLike,
    block_size: int,
    start_token: int,
    num_tokens: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Slots of tokens ``start_token .. start_token + num_tokens - 1`` of a block table.

    ``block_ids`` lists a sequence's blocks in token order (as vLLM's block table does); token
    ``t`` lives at ``block_ids[t // block_size] * block_size + t % block_size``. The last block
    may be partly used; blocks past the last needed one are ignored. Returns int64 on ``device``
    (default: the device of ``block_ids``, CPU for a list)."""
    for name, value, least in (
        ("block_size", block_size, 1),
        ("start_token", start_token, 0),
        ("num_tokens", num_tokens, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise KVLayoutError(f"{name} must be an int >= {least}, got {value!r}")
    ids = _as_index(block_ids, "block_ids")
    end = start_token + num_tokens
    covered = ids.numel() * block_size
    if end > covered:
        raise KVLayoutError(
            f"{ids.numel()} block ids of {block_size} tokens cover {covered} tokens, "
            f"but tokens {start_token}..{end - 1} were asked for"
        )
    if device is None:
        device = ids.device
    ids = ids.to(device=device, dtype=torch.int64)
    if int(ids.min()) < 0:
        raise KVLayoutError("block_ids must be >= 0")
    pos = torch.arange(start_token, end, device=device, dtype=torch.int64)
    return ids[pos // block_size] * block_size + pos % block_size


def _checked_slots(
    slots: SlotsLike, num_slots: int, device: torch.device, *, unique: bool
) -> torch.Tensor:
    """Slots as int64 on ``device``, each in ``[0, num_slots)``, distinct if ``unique``.

    One host sync whatever the device: min, max and the first duplicate travel together."""
    s = _as_index(slots, "slots").to(device=device, dtype=torch.int64)
    lo, hi = torch.aminmax(s)
    stats = [lo, hi]
    if unique and s.numel() > 1:
        ordered = torch.sort(s).values
        dup = ordered[1:] == ordered[:-1]
        stats.append(torch.where(dup, ordered[1:], _NO_DUP).min())
    lo_v, hi_v, *dup_v = torch.stack(stats).tolist()
    if lo_v < 0 or hi_v >= num_slots:
        bad = lo_v if lo_v < 0 else hi_v
        raise KVLayoutError(
            f"slot {bad} is out of range: the cache holds slots 0..{num_slots - 1}"
        )
    if dup_v and dup_v[0] != _NO_DUP:
        raise KVLayoutError(f"slot {dup_v[0]} appears more than once; unpack needs distinct slots")
    return s


def _word(row_nbytes: int, alignment: int, device: torch.device, *, gather: bool) -> torch.dtype:
    """The integer word rows are moved in.

    Scatter (index_copy_) and every CUDA kernel work element by element: the widest word wins.
    CPU gather (index_select) memcpy's rows: the narrowest word below ``_CPU_GRAIN`` wins."""
    sizes = [w for w in (1, 2, 4, 8) if row_nbytes % w == 0 and w <= alignment]
    if gather and device.type == "cpu":
        for w in sizes:
            if row_nbytes // w < _CPU_GRAIN:
                return WORDS[w]
    return WORDS[sizes[-1]]


def pack(
    kv_layers: KVLayers,
    slots: SlotsLike,
    geometry: KVGeometry,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather the KV of ``slots`` from every layer into a ``geometry.chunk_shape(n)`` tensor.

    ``kv_layers``: the per-layer paged tensors, or a ``PagedKV`` built from them once (cheaper).
    ``out``, when given, must be contiguous, of the chunk's shape and dtype and on the cache's
    device; it is filled and returned. Duplicate slots are allowed (they are only read)."""
    kv = PagedKV.of(kv_layers, geometry)
    s = _checked_slots(slots, kv.num_slots, kv.device, unique=False)
    n = s.numel()
    if out is None:
        out = torch.empty(geometry.chunk_shape(n), dtype=geometry.dtype, device=kv.device)
    else:
        geometry.validate_chunk(out, n, kv.device, name="out")
    idx = kv.row_index(s)
    align = min(kv.alignment, word_alignment([out]))
    word = _word(geometry.unit_nbytes, align, kv.device, gather=True)
    units = idx.numel()
    dst = rows_view(out, word, geometry.num_layers * units).view(geometry.num_layers, units, -1)
    for rows, rows_out in zip(kv.rows(word), dst, strict=True):
        torch.index_select(rows, 0, idx, out=rows_out)
    return out


def unpack(
    chunk: torch.Tensor,
    kv_layers: KVLayers,
    slots: SlotsLike,
    geometry: KVGeometry,
    *,
    write_tokens: int | None = None,
) -> None:
    """Scatter a packed chunk back into every layer at ``slots`` (which must be distinct).

    ``kv_layers``: the per-layer paged tensors, or a ``PagedKV`` built from them once.
    ``write_tokens``: write only the chunk's first that many tokens (the rest of the slots are
    left as they are)."""
    kv = PagedKV.of(kv_layers, geometry)
    s = _checked_slots(slots, kv.num_slots, kv.device, unique=True)
    n = s.numel()
    geometry.validate_chunk(chunk, n, kv.device, name="chunk")
    idx = kv.row_index(s)
    align = min(kv.alignment, word_alignment([chunk]))
    word = _word(geometry.unit_nbytes, align, kv.device, gather=False)
    units = idx.numel()
    src = rows_view(chunk, word, geometry.num_layers * units).view(geometry.num_layers, units, -1)
    if write_tokens is not None and write_tokens < n:
        keep = (kv.unit_tokens(n) < max(0, write_tokens)).nonzero().view(-1)
        idx = idx.index_select(0, keep)
        src = src.index_select(1, keep)
    for rows, rows_in in zip(kv.rows(word), src, strict=True):
        rows.index_copy_(0, idx, rows_in)


def chunk_rows(
    kv_layers: KVLayers, slots: SlotsLike, geometry: KVGeometry, *, unique: bool = False
) -> tuple[PagedKV, torch.Tensor]:
    """``(PagedKV, row index)`` of a chunk, the slots checked as ``pack`` (``unique``: as
    ``unpack``) checks them: what a fused gather/scatter kernel reads (``PagedKV.row_index``)."""
    kv = PagedKV.of(kv_layers, geometry)
    if geometry.layout is KVLayout.CPU:  # the kernels move whole rows (every head of a token)
        raise KVLayoutError("the fused device kernels take kv_first or block_first caches, not the cpu layout")
    s = _checked_slots(slots, kv.num_slots, kv.device, unique=unique)
    return kv, kv.row_index(s).contiguous()
