"""Paged KV cache <-> contiguous chunk, in torch (CPU and CUDA alike). Imports nothing of the project.

    KVLayout, KVGeometry        the two paged layouts vLLM uses and a model's KV shape facts
    PagedKV                     a model's per-layer paged tensors, checked once (register time)
    slots_from_block_ids        block table (+ start token, count) -> slot mapping
    pack / unpack               every layer's slots <-> one [layers, 2, n, heads, head_size] chunk
    errors                      KVKernelError > KVLayoutError

The device AES-GCM lives in submodules, imported on demand: ``aes_gcm`` (torch ops, the reference),
``triton_gcm`` (fused Triton kernels; imports triton), ``device_aead`` (which one runs: the
``device_aes`` setting), ``transfer`` (segment copies to and from pinned host memory on a side
stream). The package imports and works without triton.

Moving bytes is exact for every dtype (fp8 included): pack and unpack copy machine words, never
floats. A chunk does not depend on the paged layout or block size it came from.
"""

from .errors import KVKernelError, KVLayoutError
from .layouts import CHUNK_LAYOUT, KVGeometry, KVLayout
from .pack import KVLayers, SlotsLike, pack, slots_from_block_ids, unpack
from .paged import PagedKV

__all__ = [
    "CHUNK_LAYOUT",
    "KVGeometry",
    "KVKernelError",
    "KVLayers",
    "KVLayout",
    "KVLayoutError",
    "PagedKV",
    "SlotsLike",
    "pack",
    "slots_from_block_ids",
    "unpack",
]
