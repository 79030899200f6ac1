"""vLLM's paged tensors seen as blocks (kernels/layouts.py: ``block_first_view``, ``BlockView``):
the CPU backend's layout beside KV-first and block-first, views that write through to the
engine's tensors, and refusals that name the layout option."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import KVLayoutError
from kernels.layouts import BlockView, KVLayout, block_first_view, layer_order

B, H, BS, D = 6, 2, 4, 8


def test_cpu_layout_keeps_k_rows_then_v_rows_per_block_and_head():
    raw = torch.arange(B * H * BS * 2 * D, dtype=torch.float32).view(B, H, BS, 2 * D)
    v = block_first_view(raw, BS, "auto")
    assert v.shape == (B, 2, BS, H, D) and v.data_ptr() == raw.data_ptr()  # a view, no copy
    for b, h, t in [(0, 0, 0), (3, 1, 2), (5, 1, 3)]:
        rows = raw[b, h].reshape(2, BS, D)  # memory: block_size K rows, then block_size V rows
        assert torch.equal(v[b, 0, t, h], rows[0, t]) and torch.equal(v[b, 1, t, h], rows[1, t])
    assert torch.equal(block_first_view(raw, BS, "cpu"), v)


def test_kv_first_and_block_first_are_recognised_and_forced():
    kv_first = torch.randn(2, B, BS, H, D)
    assert torch.equal(block_first_view(kv_first, BS), kv_first.permute(1, 0, 2, 3, 4))
    block_first = torch.randn(B, 2, BS, H, D)
    assert block_first_view(block_first, BS) is block_first
    # ambiguous by shape (2 blocks): the option decides
    two = torch.randn(2, 2, BS, H, D)
    assert torch.equal(block_first_view(two, BS, "kv_first"), two.permute(1, 0, 2, 3, 4))
    assert block_first_view(two, BS, "block_first") is two
    with pytest.raises(KVLayoutError, match="set kv_connector_extra_config.layout"):
        block_first_view(two, BS, "auto")


@pytest.mark.parametrize("shape, layout", [
    ((B, H, BS + 1, 2 * D), "auto"),  # block size does not match
    ((B, H, BS, 2 * D + 1), "cpu"),  # odd K|V width
    ((B, 2, BS, H, D), "cpu"),  # forced to a layout it is not
    ((B, BS, H, D), "auto"),
])
def test_a_shape_no_layout_explains_is_refused(shape, layout):
    with pytest.raises(KVLayoutError, match="unsupported paged KV layout"):
        block_first_view(torch.zeros(shape), BS, layout)


def test_block_view_orders_layers_and_writes_through():
    caches = {f"model.layers.{i}.attn": torch.randn(B, H, BS, 2 * D) for i in (10, 2, 9)}
    assert layer_order(list(caches)) == ["model.layers.2.attn", "model.layers.9.attn", "model.layers.10.attn"]
    view = BlockView.of(caches, BS)
    assert view.names == tuple(layer_order(list(caches))) and view.num_blocks == B
    g = view.geometry  # a CPU cache is held as it is: its compact buffers are in its own layout
    assert (g.num_layers, g.num_kv_heads, g.head_size, g.block_size, g.layout) == (3, H, D, BS, KVLayout.CPU)
    assert view.native and all(v is caches[n] for n, v in zip(view.names, view.views))
    compact = view.gather([4, 1])
    assert torch.equal(compact[0][0], view.views[0][4]) and compact[0].is_contiguous()
    before = {n: t.clone() for n, t in caches.items()}
    view.scatter(compact, range(1, 2), [0, 5])  # compact block 1 (engine block 1) into block 5 only
    for n, t in caches.items():
        assert torch.equal(t[5], before[n][1]) and torch.equal(t[:5], before[n][:5])
    empty = view.empty(3)
    assert len(empty) == 3 and empty[0].shape == (3, H, BS, 2 * D) and not empty[0].any()


def test_block_view_of_a_gpu_layout_or_a_strided_cpu_cache_is_block_first():
    for caches in (
        {f"l.{i}": torch.randn(B, 2, BS, H, D) for i in range(2)},  # block-first
        {f"l.{i}": torch.randn(2, B, BS, H, D) for i in range(2)},  # kv-first
        {f"l.{i}": torch.randn(B, H, 2 * BS, 2 * D)[:, :, :BS] for i in range(2)},  # CPU shape, not contiguous
    ):
        view = BlockView.of(caches, BS)
        assert not view.native and view.geometry.layout is KVLayout.BLOCK_FIRST
        assert view.views[0].shape == (B, 2, BS, H, D)
        assert view.empty(3)[0].shape == (3, 2, BS, H, D)


def test_block_view_refuses_mismatched_layers_and_foreign_block_ids():
    with pytest.raises(KVLayoutError, match="no KV caches"):
        BlockView.of({}, BS)
    with pytest.raises(KVLayoutError, match="layer l.1"):
        BlockView.of({"l.0": torch.zeros(B, H, BS, 2 * D), "l.1": torch.zeros(B, H + 1, BS, 2 * D)}, BS)
    view = BlockView.of({"l.0": torch.zeros(B, H, BS, 2 * D)}, BS)
    for ids in ([B], [-1], [0, B + 3]):
        with pytest.raises(KVLayoutError, match=r"block ids must lie in \[0, 6\)"):
            view.gather(ids)
    view.gather([0, B - 1])  # positive control


def test_gather_into_fills_the_leading_blocks_of_a_reused_buffer_and_refuses_one_that_does_not_fit():
    caches = {f"l.{i}": torch.randn(B, H, BS, 2 * D) for i in range(2)}
    view = BlockView.of(caches, BS)
    buf = [torch.full((4, H, BS, 2 * D), 7.0) for _ in range(2)]  # a pooled buffer, last used for 4 blocks
    view.gather_into([4, 1], buf)
    for got, want in zip(buf, view.gather([4, 1])):
        assert torch.equal(got[:2], want) and (got[2:] == 7.0).all()  # only the leading blocks written
    for bad in (
        [torch.zeros(1, H, BS, 2 * D)] * 2,  # too few blocks
        [torch.zeros(4, H, BS, 2 * D, dtype=torch.float64)] * 2,  # another dtype
        [torch.zeros(4, H, BS, 2 * D + 2)] * 2,  # another shape
        [torch.zeros(H, 4, BS, 2 * D).transpose(0, 1)] * 2,  # not contiguous
    ):
        with pytest.raises(KVLayoutError, match="compact buffer"):
            view.gather_into([4, 1], bad)
    with pytest.raises(ValueError):
        view.gather_into([4, 1], buf[:1])  # one tensor per layer
