"""A chunk as the contiguous byte runs it occupies in a CPU paged KV cache (the fused data path).

``ChunkPieces`` lists, in exact chunk order (``layouts``: the chunk format of the cache's layout),
the byte runs of a chunk inside each layer's tensor: memoryviews the cipher reads straight out of
the cache (``chunk_pieces``), so sealing needs no ``pack`` copy; ``targets`` gives a byte range
of the chunk layout as writable views of the cache (a segment decrypts straight into them), and
``unpack_range`` scatters such a range from a buffer. A layer's run list is
computed once per chunk from the slots, is the same for every layer, and coalesces consecutive rows.
``write_tokens`` makes the runs of the chunk's later tokens ``SKIP`` runs: a load scatters only the
tokens the engine wants, and decrypts (authenticates) all of them.

``FlatKV`` views each layer once as a flat, writable byte memoryview; build it once per cache (or
per batch). CPU tensors only: a CUDA cache keeps the torch ``pack``/``unpack`` path. Every argument
is validated before any byte moves; an error (``KVLayoutError``) means nothing was written.
Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .errors import KVLayoutError
from .layouts import KVGeometry, KVLayout
from .pack import SlotsLike, _as_index
from .paged import PagedKV

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["ChunkPieces", "FlatKV", "chunk_pieces", "unpack_range"]

SKIP = -1  # the offset of a run scattering reads past (tokens from ``write_tokens`` on)


class FlatKV:
    """Every layer of a CPU ``PagedKV`` as one flat, writable byte memoryview (built once).

    The views keep the layer tensors alive; they are views, so writes land in the cache."""

    __slots__ = ("kv", "views")

    def __init__(self, kv: PagedKV) -> None:
        if not isinstance(kv, PagedKV):
            raise KVLayoutError(f"kv must be a PagedKV, got {type(kv).__name__}")
        if kv.device.type != "cpu":
            raise KVLayoutError(f"the fused path reads CPU caches only, this one is on {kv.device}")
        try:
            views = tuple(rows.numpy().data.cast("B") for rows in kv.rows(torch.uint8))
        except (RuntimeError, TypeError, ValueError) as exc:
            raise KVLayoutError(f"cannot view the cache's bytes: {exc}") from None
        self.kv = kv
        self.views: tuple[memoryview, ...] = views

    @property
    def geometry(self) -> KVGeometry:
        return self.kv.geometry


def _slot_list(slots: SlotsLike, num_slots: int, *, unique: bool) -> list[int]:
    s = _as_index(slots, "slots")
    values: list[int] = s.tolist()
    lo, hi = min(values), max(values)
    if lo < 0 or hi >= num_slots:
        bad = lo if lo < 0 else hi
        raise KVLayoutError(f"slot {bad} is out of range: the cache holds slots 0..{num_slots - 1}")
    if unique and len(set(values)) != len(values):
        raise KVLayoutError("slots must be distinct to scatter into them")
    return values


def _coalesce(units: list[tuple[int, int]], unit_bytes: int) -> list[tuple[int, int]]:
    """(byte offset, byte length) runs of ``(first unit, count)`` pieces in chunk order, adjacent
    ones joined; a piece whose first unit is ``SKIP`` is read past, never written."""
    runs: list[tuple[int, int]] = []
    first, count = units[0]
    for u, c in units[1:]:
        if (u == SKIP and first == SKIP) or (u != SKIP and first != SKIP and u == first + count):
            count += c
            continue
        runs.append((first if first == SKIP else first * unit_bytes, count * unit_bytes))
        first, count = u, c
    runs.append((first if first == SKIP else first * unit_bytes, count * unit_bytes))
    return runs


def _layer_runs(
    slots: list[int], geometry: KVGeometry, num_slots: int, write_tokens: int | None = None
) -> list[tuple[int, int]]:
    """(byte offset, byte length) runs of one layer, in chunk order (``layouts``: the chunk
    format). Tokens from ``write_tokens`` on are ``SKIP`` runs (only scattering honours that)."""
    limit = len(slots) if write_tokens is None else max(0, write_tokens)
    if geometry.layout is KVLayout.CPU:
        return _coalesce(_cpu_units(slots, geometry, limit), geometry.unit_nbytes)
    bs = geometry.block_size
    if geometry.layout is KVLayout.KV_FIRST:
        k_rows = slots
        v_rows = [s + num_slots for s in slots]
    else:
        k_rows = [s + (s // bs) * bs for s in slots]
        v_rows = [r + bs for r in k_rows]
    if limit < len(slots):
        k_rows = k_rows[:limit] + [SKIP] * (len(slots) - limit)
        v_rows = v_rows[:limit] + [SKIP] * (len(slots) - limit)
    return _coalesce([(r, 1) for r in k_rows + v_rows], geometry.row_nbytes)


def _cpu_units(slots: list[int], geometry: KVGeometry, limit: int) -> list[tuple[int, int]]:
    """The CPU format's ``(first unit, count)`` pieces: per group of ``block_size`` tokens, per
    head, K then V; a group that fills one block in order is one piece per head and half (they
    join into the whole block), any other is one piece per unit."""
    bs, heads = geometry.block_size, geometry.num_kv_heads
    out: list[tuple[int, int]] = []
    for a in range(0, len(slots), bs):
        group = slots[a : a + bs]
        m = len(group)
        if a >= limit:
            out.append((SKIP, 2 * heads * m))
            continue
        block, off = divmod(group[0], bs)
        if a + m <= limit and off + m <= bs and group[-1] - group[0] == m - 1 and group == list(range(group[0], group[0] + m)):
            out.extend((((block * heads + h) * 2 + kv) * bs + off, m) for h in range(heads) for kv in (0, 1))
            continue
        for h in range(heads):
            for kv in (0, 1):
                for t, s in enumerate(group):
                    b, o = divmod(s, bs)
                    out.append((((b * heads + h) * 2 + kv) * bs + o, 1) if a + t < limit else (SKIP, 1))
    return out


class ChunkPieces:
    """Where the chunk of ``slots`` lies in a ``FlatKV``: per-layer runs, in chunk order.

    ``unique=True`` (needed to scatter) also rejects repeated slots. ``write_tokens``: scatter
    writes only the chunk's first that many tokens (the rest is read past; ``pieces`` refuses)."""

    __slots__ = ("flat", "layer_nbytes", "masked", "nbytes", "runs", "starts")

    def __init__(
        self, flat: FlatKV, slots: SlotsLike, *, unique: bool = False, write_tokens: int | None = None
    ) -> None:
        kv = flat.kv
        values = _slot_list(slots, kv.num_slots, unique=unique)
        geometry = kv.geometry
        self.flat = flat
        self.masked = write_tokens is not None and write_tokens < len(values)
        self.runs = _layer_runs(values, geometry, kv.num_slots, write_tokens)
        starts, pos = [], 0
        for _, n in self.runs:
            starts.append(pos)
            pos += n
        self.starts: list[int] = starts
        self.layer_nbytes: int = pos  # 2 * len(slots) * row_nbytes
        self.nbytes: int = pos * geometry.num_layers

    def pieces(self) -> list[memoryview]:
        """The chunk's bytes as views into the cache, in chunk order (they concatenate to
        ``pack``'s output). Read them only: they are views of the live cache."""
        if self.masked:
            raise KVLayoutError("a chunk with write_tokens is for scattering only")
        runs = self.runs
        return [v[a : a + n] for v in self.flat.views for a, n in runs]

    def targets(self, start: int, end: int) -> list[memoryview | int]:
        """Bytes ``[start, end)`` of the chunk layout as writable views into the cache, in order
        (a run read past, from ``write_tokens`` on, as its byte count): where a decryption writes
        that range in place. The views are of the live cache."""
        for name, value in (("start", start), ("end", end)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise KVLayoutError(f"{name} must be an int, got {value!r}")
        if not 0 <= start <= end <= self.nbytes:
            raise KVLayoutError(f"range [{start}, {end}) is not within the chunk's {self.nbytes} bytes")
        runs, starts, views, lb = self.runs, self.starts, self.flat.views, self.layer_nbytes
        out: list[memoryview | int] = []
        pos = start
        while pos < end:
            layer, within = divmod(pos, lb)
            view = views[layer]
            j = bisect_right(starts, within) - 1
            rel = within - starts[j]
            while j < len(runs) and pos < end:
                a, n = runs[j]
                take = min(n - rel, end - pos)
                if a == SKIP:
                    if out and isinstance(out[-1], int):
                        out[-1] += take
                    else:
                        out.append(take)
                else:
                    out.append(view[a + rel : a + rel + take])
                pos += take
                j += 1
                rel = 0
        return out

    def scatter(self, src: Buffer, start: int, end: int) -> None:
        """Write bytes ``[start, end)`` of the chunk layout, held in ``src``, into the cache."""
        try:
            data = memoryview(src)
        except TypeError:
            raise KVLayoutError("src must support the buffer protocol") from None
        if not data.c_contiguous:
            raise KVLayoutError("src must be C-contiguous")
        data = data.cast("B")
        targets = self.targets(start, end)
        if data.nbytes != end - start:
            raise KVLayoutError(f"src holds {data.nbytes} bytes, the range [{start}, {end}) {end - start}")
        pos = 0
        for t in targets:
            if isinstance(t, int):
                pos += t
                continue
            t[:] = data[pos : pos + t.nbytes]
            pos += t.nbytes


def chunk_pieces(
    kv_layers: Sequence[torch.Tensor] | PagedKV, slots: SlotsLike, geometry: KVGeometry
) -> list[memoryview]:
    """The chunk of ``slots`` as contiguous byte runs of the cache, in chunk order."""
    return ChunkPieces(FlatKV(PagedKV.of(kv_layers, geometry)), slots).pieces()


def unpack_range(
    chunk_bytes_view: Buffer,
    plain_start: int,
    plain_end: int,
    kv_layers: Sequence[torch.Tensor] | PagedKV,
    slots: SlotsLike,
    geometry: KVGeometry,
) -> None:
    """Scatter bytes ``[plain_start, plain_end)`` of a chunk (held in ``chunk_bytes_view``, which
    is exactly that long) into the cache at ``slots`` (distinct). Scattering every range of a
    partition of the chunk equals ``unpack`` of the whole chunk."""
    pieces = ChunkPieces(FlatKV(PagedKV.of(kv_layers, geometry)), slots, unique=True)
    pieces.scatter(chunk_bytes_view, plain_start, plain_end)
