"""The one data path, for embedded and remote mode alike (docs/architecture.md, section 3).

    plan.py     tokens -> chunks (chained hashes) and the request's slots, validated up front
    codec.py    the envelope codec seam (AES-256-GCM envelopes; benchmarks pass their own)
    buffers.py  the one buffer pool: envelopes, scratch, staging, pinned copies
    sealers.py  CPU fused / device / host sealing, one chosen per KV cache
    path.py     ``DataPath``: the sealer choice, the thread pool
    stores.py   ``ChunkStore``: where envelopes go -- the tiers in process, or a kvgate server
    plane.py    ``DataPlane``: store / lookup / retrieve over a ``ChunkStore``

This package (with ``kernels`` and the vLLM connector) is where torch lives; the control plane
(the REST server, the admin and audit tools) never imports it. Names are loaded on first use, so
importing ``gateway.datapath.stores`` (torch-free) does not load the rest."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.datapath.codec import CipherCodec, EnvelopeCodec
    from gateway.datapath.path import DataPath
    from gateway.datapath.sealers import OpenJob, SealJob

__all__ = ["CipherCodec", "DataPath", "EnvelopeCodec", "OpenJob", "SealJob"]

_WHERE = {
    "CipherCodec": "codec", "EnvelopeCodec": "codec", "DataPath": "path", "OpenJob": "sealers", "SealJob": "sealers",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'gateway.datapath' has no attribute {name!r}")
    return getattr(import_module(f"gateway.datapath.{where}"), name)
