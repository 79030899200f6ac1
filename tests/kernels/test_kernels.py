"""kernels: paged KV <-> contiguous chunk, checked bit for bit against a Python-loop reference."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import FrozenInstanceError

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import (
    KVGeometry,
    KVKernelError,
    KVLayout,
    KVLayoutError,
    PagedKV,
    pack,
    slots_from_block_ids,
    unpack,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
LAYOUTS = list(KVLayout)


# -- helpers ------------------------------------------------------------------------------------


def raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (bit-exact comparison, NaN payloads included)."""
    return t.contiguous().view(-1).view(torch.uint8)


def random_cache(g: KVGeometry, num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    """Random bytes (so NaNs and odd fp8 patterns too) viewed as the geometry's dtype."""
    gen = torch.Generator().manual_seed(seed)
    shape = g.layer_shape(num_blocks)
    nbytes = torch.Size(shape).numel() * g.dtype.itemsize
    return [
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        .view(g.dtype)
        .view(shape)
        for _ in range(g.num_layers)
    ]


def zero_cache(g: KVGeometry, num_blocks: int) -> list[torch.Tensor]:
    return [torch.zeros(g.layer_shape(num_blocks), dtype=g.dtype) for _ in range(g.num_layers)]


def _token_bytes(layer: torch.Tensor, g: KVGeometry, kv: int, slot: int) -> torch.Tensor:
    """The bytes of one token's K (kv=0) or V (kv=1), every head: ``[heads, head bytes]`` (a view)."""
    block, off = divmod(slot, g.block_size)
    lb = layer.view(torch.uint8)
    if g.layout is KVLayout.CPU:  # [block, head, token, 2 * dim] holds [block, head, K|V, token, dim]
        b, h, bs, _ = lb.shape
        return lb.view(b, h, 2, bs, -1)[block, :, kv, off]
    return lb[kv, block, off] if g.layout is KVLayout.KV_FIRST else lb[block, kv, off]


def _chunk_order(g: KVGeometry, slots: Sequence[int]) -> list[tuple[int, int, int | None]]:
    """``(kv, slot, head)`` of each unit of a layer's chunk bytes, in order (head None: every
    head). The GPU format: K of every token, then V; the CPU format: per group of block_size
    tokens, per head, K of the group's tokens, then V."""
    if g.layout is not KVLayout.CPU:
        return [(kv, s, None) for kv in (0, 1) for s in slots]
    out: list[tuple[int, int, int | None]] = []
    for a in range(0, len(slots), g.block_size):
        group = slots[a : a + g.block_size]
        out += [(kv, s, h) for h in range(g.num_kv_heads) for kv in (0, 1) for s in group]
    return out


def _unit(layer: torch.Tensor, g: KVGeometry, kv: int, slot: int, head: int | None) -> torch.Tensor:
    t = _token_bytes(layer, g, kv, slot)
    return t if head is None else t[head]


def naive_pack(
    layers: Sequence[torch.Tensor], slots: Sequence[int], g: KVGeometry
) -> torch.Tensor:
    chunk = torch.zeros(g.chunk_shape(len(slots)), dtype=g.dtype)
    cb = chunk.view(torch.uint8).view(g.num_layers, -1)
    for li, layer in enumerate(layers):
        cb[li] = torch.cat([_unit(layer, g, *u).reshape(-1) for u in _chunk_order(g, slots)])
    return chunk


def naive_unpack(chunk: torch.Tensor, layers: Sequence[torch.Tensor], slots: Sequence[int], g):
    cb = chunk.view(torch.uint8).view(g.num_layers, -1)
    for li, layer in enumerate(layers):
        pos = 0
        for u in _chunk_order(g, slots):
            dst = _unit(layer, g, *u)
            dst.copy_(cb[li, pos : pos + dst.numel()].view(dst.shape))
            pos += dst.numel()


def same_bytes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(raw(x), raw(y)) for x, y in zip(a, b))


def check_round_trip(g: KVGeometry, num_blocks: int, slots: list[int], seed: int = 0) -> None:
    src = random_cache(g, num_blocks, seed)
    chunk = pack(src, torch.tensor(slots), g)
    assert chunk.shape == g.chunk_shape(len(slots)) and chunk.dtype == g.dtype
    assert torch.equal(raw(chunk), raw(naive_pack(src, slots, g)))

    dst = zero_cache(g, num_blocks)
    unpack(chunk, dst, slots, g)
    expected = zero_cache(g, num_blocks)
    naive_unpack(chunk, expected, slots, g)
    assert same_bytes(dst, expected)  # touched slots hold the data, untouched ones stay zero
    touched = set(slots)
    for layer_src, layer_dst in zip(src, dst):
        for slot in range(num_blocks * g.block_size):
            for kv in (0, 1):
                got = _token_bytes(layer_dst, g, kv, slot)
                if slot in touched:
                    assert torch.equal(got, _token_bytes(layer_src, g, kv, slot))
                else:
                    assert not got.any()


def geom(layout=KVLayout.KV_FIRST, dtype=torch.float16, **kw) -> KVGeometry:
    fields = {"num_layers": 3, "num_kv_heads": 2, "head_size": 8, "block_size": 4}
    fields.update(kw)
    return KVGeometry(dtype=dtype, layout=layout, **fields)


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_round_trip_random_blocks_partial_last_block(layout: KVLayout, dtype: torch.dtype) -> None:
    g = geom(layout, dtype)
    num_blocks = 12
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7))[:5].tolist()
    assert blocks != sorted(blocks)  # non-contiguous, out of order
    slots = slots_from_block_ids(blocks, g.block_size, 0, 18).tolist()  # 4 full blocks + 2 tokens
    check_round_trip(g, num_blocks, slots, seed=hash((layout, str(dtype))) % 1000)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_round_trip_slot_mapping_with_gaps(layout: KVLayout) -> None:
    g = geom(layout, torch.bfloat16)
    check_round_trip(g, 16, [0, 3, 7, 20, 21, 45, 63, 30], seed=3)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_odd_row_sizes_fall_back_to_narrow_words(layout: KVLayout) -> None:
    # 1 head x 3 x fp16 = 6-byte rows (int16 words); fp8 rows of 3 bytes (uint8 words).
    check_round_trip(geom(layout, torch.float16, num_kv_heads=1, head_size=3), 5, [1, 9, 4, 17])
    if hasattr(torch, "float8_e4m3fn"):
        g = geom(layout, torch.float8_e4m3fn, num_kv_heads=1, head_size=3)
        check_round_trip(g, 5, [19, 0, 2])


def test_chunk_does_not_depend_on_paged_layout_or_block_size() -> None:
    a = geom(KVLayout.KV_FIRST, torch.float16, block_size=4)
    b = geom(KVLayout.BLOCK_FIRST, torch.float16, block_size=8)
    src = random_cache(a, 6, seed=11)
    slots_a = slots_from_block_ids([5, 2, 0], 4, 1, 10)
    chunk = pack(src, slots_a, a)
    dst = zero_cache(b, 4)
    slots_b = slots_from_block_ids([3, 1], 8, 0, 10)
    unpack(chunk, dst, slots_b, b)
    assert torch.equal(raw(pack(dst, slots_b, b)), raw(chunk))
    assert a.fingerprint_fields() == b.fingerprint_fields()


def test_pack_into_unaligned_out_buffer() -> None:
    g = geom(KVLayout.BLOCK_FIRST, torch.float16)
    src = random_cache(g, 8, seed=5)
    slots = [3, 30, 12, 13]
    base = torch.zeros(g.chunk_nbytes(4) + 2, dtype=torch.uint8)
    out = base[2:].view(torch.float16).view(g.chunk_shape(4))  # 2-byte aligned only
    assert pack(src, slots, g, out=out) is out
    assert torch.equal(raw(out), raw(naive_pack(src, slots, g)))
    dst = zero_cache(g, 8)
    unpack(out, dst, slots, g)
    assert torch.equal(raw(pack(dst, slots, g)), raw(out))


def test_large_rows_round_trip() -> None:
    # 4 heads x 4096 x fp16 = 32 KiB rows: past the CPU gather's byte-row limit, so wider words.
    check_round_trip(
        geom(KVLayout.BLOCK_FIRST, num_layers=1, num_kv_heads=4, head_size=4096, block_size=2),
        3,
        [5, 0, 3],
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_paged_kv_is_validated_once_and_reused(layout: KVLayout) -> None:
    g = geom(layout, torch.bfloat16)
    src_layers, dst_layers = random_cache(g, 9, seed=4), zero_cache(g, 9)
    src, dst = PagedKV(src_layers, g), PagedKV(dst_layers, g)
    assert src.num_blocks == 9 and src.num_slots == 36 and src.device == torch.device("cpu")
    slots = slots_from_block_ids([8, 0, 4], 4, 2, 9)
    chunk = pack(src, slots, g)
    assert torch.equal(raw(chunk), raw(pack(src_layers, slots, g)))
    unpack(chunk, dst, slots, g)
    assert torch.equal(raw(pack(dst_layers, slots, g)), raw(chunk))  # wrote through to the layers
    other = geom(layout, torch.bfloat16, block_size=2)
    with pytest.raises(KVLayoutError, match="built for"):
        pack(src, slots, other)
    with pytest.raises(KVLayoutError, match="dtype"):
        PagedKV([t.float() for t in src_layers], g)
    with pytest.raises(KVLayoutError, match="KVGeometry"):
        PagedKV(src_layers, "kv_first")  # type: ignore[arg-type]


def _allocated_bytes(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def test_no_payload_sized_allocation_when_out_is_given() -> None:
    g = KVGeometry(4, 8, 128, torch.float16, 16, KVLayout.BLOCK_FIRST)
    kv = PagedKV(random_cache(g, 32), g)
    slots = slots_from_block_ids(torch.randperm(32)[:16], 16, 0, 256)
    out = torch.empty(g.chunk_shape(256), dtype=g.dtype)
    payload = g.chunk_nbytes(256)  # 4 MiB
    assert _allocated_bytes(lambda: pack(kv, slots, g)) >= payload  # the probe sees allocations
    assert _allocated_bytes(lambda: pack(kv, slots, g, out=out)) < payload // 100
    assert _allocated_bytes(lambda: unpack(out, kv, slots, g)) < payload // 100


def test_pack_allows_duplicate_slots() -> None:
    g = geom()
    src = random_cache(g, 4)
    assert torch.equal(raw(pack(src, [5, 5, 1], g)), raw(naive_pack(src, [5, 5, 1], g)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_random_geometries(data: st.DataObject) -> None:
    g = KVGeometry(
        num_layers=data.draw(st.integers(1, 3)),
        num_kv_heads=data.draw(st.integers(1, 3)),
        head_size=data.draw(st.integers(1, 9)),
        dtype=data.draw(st.sampled_from(DTYPES)),
        block_size=data.draw(st.integers(1, 8)),
        layout=data.draw(st.sampled_from(LAYOUTS)),
    )
    num_blocks = data.draw(st.integers(1, 10))
    total = num_blocks * g.block_size
    slots = data.draw(
        st.lists(st.integers(0, total - 1), min_size=1, max_size=min(total, 40), unique=True)
    )
    check_round_trip(g, num_blocks, slots, seed=data.draw(st.integers(0, 2**16)))


# -- slots_from_block_ids -----------------------------------------------------------------------


def test_slots_from_block_ids_values() -> None:
    got = slots_from_block_ids([7, 2, 5], 4, 0, 10)
    assert got.dtype == torch.int64
    assert got.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    # a start inside the block table (the second 3-token chunk), partial last block
    assert slots_from_block_ids(torch.tensor([7, 2, 5]), 4, 3, 3).tolist() == [31, 8, 9]
    # trailing blocks past the last needed one are ignored
    assert slots_from_block_ids([1, 9], 4, 0, 2).tolist() == [4, 5]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1, 2], 4, 0, 9), "cover 8 tokens"),
        (([1, 2], 4, 6, 3), "cover 8 tokens"),
        (([], 4, 0, 1), "empty"),
        (([1, -2], 4, 0, 5), ">= 0"),
        (([1.0, 2.0], 4, 0, 2), "integers"),
        (([[1, 2]], 4, 0, 2), "1-D"),
        (([1], 0, 0, 1), "block_size"),
        (([1], 4, -1, 1), "start_token"),
        (([1], 4, 0, 0), "num_tokens"),
        (([1], 4, 0, True), "num_tokens"),
        ((["a"], 4, 0, 1), "ints"),
    ],
)
def test_slots_from_block_ids_rejects(args: tuple, match: str) -> None:
    with pytest.raises(KVLayoutError, match=match):
        slots_from_block_ids(*args)


# -- bad input: typed error, nothing written ----------------------------------------------------

NB = 6
G = geom(KVLayout.BLOCK_FIRST, torch.float16)
GOOD_SLOTS = [0, 5, 9, 22]


def _bad_last_layer(make: Callable[[torch.Tensor], torch.Tensor]):
    """Layers whose *last* member is bad, so a pack that wrote before checking would be caught."""

    def build(layers: list[torch.Tensor]) -> list[torch.Tensor]:
        return [*layers[:-1], make(layers[-1])]

    return build


LAYER_CASES = {
    "too few layers": (lambda ls: ls[:-1], "layers"),
    "stacked tensor": (lambda ls: torch.stack(ls), "sequence"),
    "wrong dtype": (_bad_last_layer(lambda t: t.float()), "dtype"),
    "wrong shape": (_bad_last_layer(lambda t: t[:, :, :2].contiguous()), "shape"),
    "fewer blocks": (_bad_last_layer(lambda t: t[:-1].contiguous()), "shape"),
    "not contiguous": (
        _bad_last_layer(lambda t: t.transpose(3, 4).contiguous().transpose(3, 4)),
        "contiguous",
    ),
    "other device": (_bad_last_layer(lambda t: torch.empty_like(t, device="meta")), "meta"),
    "not a tensor": (_bad_last_layer(lambda t: t.tolist()), "tensor"),
}
SLOT_CASES = {
    "slot too large": ([0, NB * G.block_size], "out of range"),
    "negative slot": ([3, -1], "out of range"),
    "empty slots": ([], "empty"),
    "float slots": (torch.tensor([1.0, 2.0]), "integers"),
    "2-D slots": (torch.tensor([[1, 2]]), "1-D"),
}


@pytest.mark.parametrize("case", list(LAYER_CASES), ids=str)
def test_pack_bad_layers_raise_and_leave_out_untouched(case: str) -> None:
    make, match = LAYER_CASES[case]
    layers = make(random_cache(G, NB))
    out = torch.full(G.chunk_shape(len(GOOD_SLOTS)), 7.0, dtype=G.dtype)
    before = out.clone()
    with pytest.raises(KVLayoutError, match=match):
        pack(layers, GOOD_SLOTS, G, out=out)
    assert torch.equal(raw(out), raw(before))


@pytest.mark.parametrize("case", list(LAYER_CASES), ids=str)
def test_unpack_bad_layers_raise_and_leave_cache_untouched(case: str) -> None:
    make, match = LAYER_CASES[case]
    cache = random_cache(G, NB, seed=1)
    layers = make(cache)
    snapshot = [raw(t).clone() for t in cache]
    chunk = pack(random_cache(G, NB, seed=2), GOOD_SLOTS, G)
    with pytest.raises(KVLayoutError, match=match):
        unpack(chunk, layers, GOOD_SLOTS, G)
    assert all(torch.equal(raw(t), s) for t, s in zip(cache, snapshot))


@pytest.mark.parametrize("case", list(SLOT_CASES), ids=str)
def test_bad_slots_raise_and_write_nothing(case: str) -> None:
    slots, match = SLOT_CASES[case]
    cache = random_cache(G, NB)
    snapshot = [raw(t).clone() for t in cache]
    out = torch.zeros(G.chunk_shape(4), dtype=G.dtype)
    with pytest.raises(KVLayoutError, match=match):
        pack(cache, slots, G, out=out)
    assert not raw(out).any()
    with pytest.raises(KVLayoutError, match=match):
        unpack(out, cache, slots, G)
    assert all(torch.equal(raw(t), s) for t, s in zip(cache, snapshot))


OUT_CASES = {
    "too few tokens": (lambda: torch.zeros(G.chunk_shape(3), dtype=G.dtype), "shape"),
    "too many tokens": (lambda: torch.zeros(G.chunk_shape(5), dtype=G.dtype), "shape"),
    "wrong dtype": (lambda: torch.zeros(G.chunk_shape(4), dtype=torch.bfloat16), "dtype"),
    "not contiguous": (
        lambda: torch.zeros(G.chunk_shape(8), dtype=G.dtype)[:, :, ::2],
        "contiguous",
    ),
    "other device": (lambda: torch.zeros(G.chunk_shape(4), dtype=G.dtype, device="meta"), "meta"),
    "flat bytes": (lambda: torch.zeros(G.chunk_nbytes(4), dtype=torch.uint8), "dtype"),
}


@pytest.mark.parametrize("case", list(OUT_CASES), ids=str)
def test_pack_bad_out_raises_and_leaves_it_untouched(case: str) -> None:
    make, match = OUT_CASES[case]
    out = make()
    before = out.clone() if out.device.type != "meta" else None
    with pytest.raises(KVLayoutError, match=match):
        pack(random_cache(G, NB), GOOD_SLOTS, G, out=out)
    if before is not None:
        assert torch.equal(out, before)


@pytest.mark.parametrize("case", list(OUT_CASES), ids=str)
def test_unpack_bad_chunk_raises_and_leaves_cache_untouched(case: str) -> None:
    make, match = OUT_CASES[case]
    cache = random_cache(G, NB)
    snapshot = [raw(t).clone() for t in cache]
    with pytest.raises(KVLayoutError, match=match):
        unpack(make(), cache, GOOD_SLOTS, G)
    assert all(torch.equal(raw(t), s) for t, s in zip(cache, snapshot))


def test_unpack_duplicate_slots_raise_and_write_nothing() -> None:
    cache = zero_cache(G, NB)
    chunk = pack(random_cache(G, NB), [1, 2, 3, 2], G)
    with pytest.raises(KVLayoutError, match="slot 2 appears more than once"):
        unpack(chunk, cache, [1, 2, 3, 2], G)
    assert not any(raw(t).any() for t in cache)


def test_errors_are_typed() -> None:
    assert issubclass(KVLayoutError, ValueError) and issubclass(KVLayoutError, KVKernelError)


# -- geometry -----------------------------------------------------------------------------------


def test_geometry_shapes_and_fingerprint() -> None:
    g = KVGeometry(32, 8, 128, torch.float16, 16, "kv_first")  # type: ignore[arg-type]
    assert g.layout is KVLayout.KV_FIRST
    assert g.chunk_shape(256) == (32, 2, 256, 8, 128)
    assert g.chunk_nbytes(256) == 33_554_432
    assert g.layer_shape(10) == (2, 10, 16, 8, 128)
    b = KVGeometry(32, 8, 128, torch.float16, 16, KVLayout.BLOCK_FIRST)
    assert b.layer_shape(10) == (10, 2, 16, 8, 128)
    fp = g.fingerprint_fields()
    assert json.loads(json.dumps(fp)) == fp
    assert fp["dtype"] == "float16" and fp["num_layers"] == 32
    assert fp["num_kv_heads"] == 8 and fp["head_size"] == 128
    assert KVGeometry(32, 8, 128, torch.bfloat16, 16, "kv_first").fingerprint_fields() != fp
    assert KVGeometry(32, 4, 128, torch.float16, 16, "kv_first").fingerprint_fields() != fp
    with pytest.raises(FrozenInstanceError):
        g.num_layers = 1  # type: ignore[misc]
    assert g.validate_layers([torch.empty(g.layer_shape(3), dtype=g.dtype)] * 32) == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_size": 2.0}, "head_size"),
        ({"block_size": True}, "block_size"),
        ({"dtype": "float16"}, "dtype"),
        ({"layout": "heads_first"}, "layout"),
    ],
)
def test_geometry_rejects_bad_fields(kwargs: dict, match: str) -> None:
    fields = {"num_layers": 2, "num_kv_heads": 2, "head_size": 4, "block_size": 4}
    fields |= {"dtype": torch.float16, "layout": "kv_first"}
    fields.update(kwargs)
    with pytest.raises(KVLayoutError, match=match):
        KVGeometry(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, -3, 1.5])
def test_chunk_shape_rejects_bad_token_counts(n) -> None:
    with pytest.raises(KVLayoutError, match="num_tokens"):
        geom().chunk_shape(n)


# -- CUDA -----------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.value)
def test_cuda_matches_cpu_bit_for_bit(layout: KVLayout) -> None:
    g = geom(layout, DTYPES[-1], num_layers=4, num_kv_heads=8, head_size=64, block_size=16)
    cpu = random_cache(g, 64, seed=21)
    gpu = [t.cuda() for t in cpu]
    slots = slots_from_block_ids(torch.randperm(64)[:9], 16, 3, 130)
    want = pack(cpu, slots, g)
    out = torch.empty(g.chunk_shape(130), dtype=g.dtype, device="cuda")
    got = pack(gpu, slots.cuda(), g, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(raw(got.cpu()), raw(want))
    dst = [torch.zeros_like(t) for t in gpu]
    unpack(got, dst, slots, g)
    ref = zero_cache(g, 64)
    unpack(want, ref, slots, g)
    assert same_bytes([t.cpu() for t in dst], ref)
