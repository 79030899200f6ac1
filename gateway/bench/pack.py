"""Measure pack/unpack throughput against a plain contiguous copy of the same bytes.

    python -m gateway.bench.pack [--device cpu|cuda] [--threads 1,2] [--repeats 30] [--variants]

Geometry: Llama-3-8B (32 layers, 8 KV heads, head size 128, fp16, block size 16) in a 4096-block
paged cache per layer, chunks of 256 tokens (33.5 MB) and 16 tokens (2 MB) on randomly placed
blocks. ``--variants`` also times alternatives the kernels do not use (K and V as two
index_selects per layer; byte rows instead of 8-byte words; index_put_ for unpack). Prints the
median and best GB/s (bytes of the chunk per second). A tool, not a test: nothing runs at import.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kernels.layouts import KVGeometry, KVLayout
from kernels.pack import SlotsLike, _checked_slots, pack, slots_from_block_ids, unpack
from kernels.paged import PagedKV, rows_view

__all__ = ["llama3_8b", "main", "measure"]

NUM_BLOCKS = 4096


def llama3_8b(layout: KVLayout) -> KVGeometry:
    """32 layers, 8 KV heads, head size 128, fp16, block size 16."""
    return KVGeometry(32, 8, 128, torch.float16, 16, layout)


def _time(fn: Callable[[], object], repeats: int, device: torch.device) -> list[float]:
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _sparse_cache(g: KVGeometry, blocks: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A full-size layer whose chosen blocks hold data; on CPU the rest is never touched, so
    32 layers of 268 MB cost resident memory only for the blocks the chunk uses."""
    layer = torch.empty(g.layer_shape(NUM_BLOCKS), dtype=g.dtype, device=dev)
    if g.layout is KVLayout.KV_FIRST:
        layer[:, blocks] = torch.randn(layer[:, blocks].shape, dtype=g.dtype, device=dev)
    else:
        layer[blocks] = torch.randn(layer[blocks].shape, dtype=g.dtype, device=dev)
    return layer


def _variants(kv: PagedKV, slots: SlotsLike, out: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The alternatives tried, written out the same way as ``pack``/``unpack`` but unvalidated."""
    g, layers, rows = kv.geometry, kv.layers, kv.num_rows
    s = _checked_slots(slots, kv.num_slots, out.device, unique=True)
    n = s.numel()
    idx = kv.row_index(s)
    k_idx, v_idx = idx[:n], idx[n:]

    def split_kv(word: torch.dtype) -> Callable[[], None]:
        dst = rows_view(out, word, g.num_layers * 2 * n).view(g.num_layers, 2, n, -1)
        src = [rows_view(t, word, rows) for t in layers]

        def run() -> None:
            for layer, o in zip(src, dst):
                torch.index_select(layer, 0, k_idx, out=o[0])
                torch.index_select(layer, 0, v_idx, out=o[1])

        return run

    def fused(word: torch.dtype) -> Callable[[], None]:
        dst = rows_view(out, word, g.num_layers * 2 * n).view(g.num_layers, 2 * n, -1)
        src = [rows_view(t, word, rows) for t in layers]

        def run() -> None:
            for layer, o in zip(src, dst):
                torch.index_select(layer, 0, idx, out=o)

        return run

    def scatter(word: torch.dtype, use_put: bool) -> Callable[[], None]:
        chunk = rows_view(out, word, g.num_layers * 2 * n).view(g.num_layers, 2 * n, -1)
        dst = [rows_view(t, word, rows) for t in layers]

        def run() -> None:
            for layer, c in zip(dst, chunk):
                if use_put:
                    layer.index_put_((idx,), c)
                else:
                    layer.index_copy_(0, idx, c)

        return run

    return {
        "pack  fused K+V, i64 rows, unchecked": fused(torch.int64),
        "pack  fused K+V, u8 rows, unchecked": fused(torch.uint8),
        "pack  K,V split, i64 rows, unchecked": split_kv(torch.int64),
        "pack  K,V split, u8 rows, unchecked": split_kv(torch.uint8),
        "unpack index_copy_, i64 rows, unchecked": scatter(torch.int64, False),
        "unpack index_copy_, u8 rows, unchecked": scatter(torch.uint8, False),
        "unpack index_put_, i64 rows, unchecked": scatter(torch.int64, True),
        "unpack index_put_, u8 rows, unchecked": scatter(torch.uint8, True),
    }


def _cases(
    g: KVGeometry, num_tokens: int, dev: torch.device, gen: torch.Generator, variants: bool
) -> dict[str, Callable[[], object]]:
    nblocks = -(-num_tokens // g.block_size)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:nblocks].to(dev)
    layers = [_sparse_cache(g, blocks, dev) for _ in range(g.num_layers)]
    slots = slots_from_block_ids(blocks, g.block_size, 0, num_tokens, device=dev)
    out = torch.empty(g.chunk_shape(num_tokens), dtype=g.dtype, device=dev)
    copy_src = torch.randn(out.shape, dtype=out.dtype, device=dev)
    kv = PagedKV(layers, g)
    cases: dict[str, Callable[[], object]] = {
        "copy_ (contiguous, same bytes)": lambda: out.copy_(copy_src),
        "pack   (PagedKV)": lambda: pack(kv, slots, g, out=out),
        "unpack (PagedKV)": lambda: unpack(out, kv, slots, g),
        "pack   (list of layers)": lambda: pack(layers, slots, g, out=out),
        "unpack (list of layers)": lambda: unpack(out, layers, slots, g),
    }
    if variants:
        cases.update(_variants(kv, slots, out))
    return cases


def measure(
    num_tokens: int, *, device: str = "cpu", repeats: int = 30, variants: bool = False
) -> dict[str, tuple[float, float]]:
    """``{name: (median GB/s, best GB/s)}`` for one chunk size on the current thread count."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    results: dict[str, tuple[float, float]] = {}
    for layout in KVLayout:
        g = llama3_8b(layout)
        nbytes = g.chunk_nbytes(num_tokens)
        for name, fn in _cases(g, num_tokens, dev, gen, variants).items():
            times = _time(fn, repeats, dev)
            results[f"{layout.value:11s} {name}"] = (
                nbytes / statistics.median(times) / 1e9,
                nbytes / min(times) / 1e9,
            )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--variants", action="store_true")
    args = parser.parse_args(argv)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for n in (256, 16):
            mib = llama3_8b(KVLayout.KV_FIRST).chunk_nbytes(n) / 2**20
            print(f"\n== {args.device}, {threads} thread(s), {n} tokens ({mib:.1f} MiB) ==")
            print(f"{'':52s} {'median':>8s} {'best':>8s}  GB/s")
            results = measure(n, device=args.device, repeats=args.repeats, variants=args.variants)
            for name, (med, best) in results.items():
                print(f"{name:52s} {med:8.2f} {best:8.2f}")


if __name__ == "__main__":
    main()
