"""A request's plan, validated before anything is read, sealed, sent or written: its chunks
(chained hashes) and every slot of its KV in the paged cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gateway.chunking import Chunk, InvalidTokens, chain_hashes
from gateway.errors import InvalidRequest
from gateway.types import KVModel
from kernels.errors import KVLayoutError
from kernels.pack import slots_from_block_ids
from kernels.paged import PagedKV

__all__ = ["TokensLike", "chunks_of", "request_slots"]

TokensLike = Sequence[int] | torch.Tensor | Any  # numpy arrays too


def chunks_of(model: KVModel, tokens: TokensLike, chunk_tokens: int) -> list[Chunk]:
    """The request's chunks and their chained hashes (computed once per request)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    try:
        return chain_hashes(tokens, model.fingerprint, chunk_tokens, vocab_size=model.vocab_size)
    except InvalidTokens as exc:
        raise InvalidRequest(str(exc)) from None


def request_slots(
    model: KVModel,
    kv_layers: Sequence[torch.Tensor] | PagedKV,
    num_tokens: int,
    block_ids: Sequence[int] | torch.Tensor | None,
    slot_mapping: Sequence[int] | torch.Tensor | None,
) -> tuple[PagedKV, torch.Tensor]:
    """All slots of the request, validated up front so a bad one stores (or loads) nothing."""
    if (block_ids is None) == (slot_mapping is None):
        raise InvalidRequest("give exactly one of block_ids and slot_mapping")
    geometry = model.geometry
    try:
        kv = PagedKV.of(kv_layers, geometry)
        if block_ids is not None:
            slots = slots_from_block_ids(block_ids, geometry.block_size, 0, num_tokens, device=kv.device)
        else:
            slots = torch.as_tensor(slot_mapping).to(device=kv.device)
            if slots.dtype.is_floating_point or slots.dtype == torch.bool or slots.dim() != 1:
                raise InvalidRequest("slot_mapping must be a 1-D integer sequence")
            slots = slots.to(torch.int64)
            if slots.numel() != num_tokens:
                raise InvalidRequest(f"slot_mapping has {slots.numel()} slots for {num_tokens} tokens")
    except KVLayoutError as exc:
        raise InvalidRequest(str(exc)) from None
    limit = kv.num_blocks * geometry.block_size
    lo, hi = int(slots.min()), int(slots.max())
    if lo < 0 or hi >= limit:
        raise InvalidRequest(f"slots must lie in [0, {limit}), got [{lo}, {hi}]")
    return kv, slots
