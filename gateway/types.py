"""The gateway's value types: the model a worker moves KV for, and the results of the core's
operations. Imports no I/O; the core re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.chunking import ModelFingerprint
from gateway.errors import InvalidRequest
from tenancy import names

if TYPE_CHECKING:  # torch: a KVModel exists only where KV does (the data path, the connector)
    from kernels.layouts import KVGeometry

__all__ = ["KVModel", "StoreResult", "LookupResult", "RetrieveResult", "ClearResult", "check_name"]


def check_name(value: str, what: str) -> str:
    """The one name rule (``tenancy.names``), as the core's InvalidRequest."""
    try:
        return names.check_name(value, what)
    except names.InvalidName as exc:
        raise InvalidRequest(str(exc)) from None


@dataclass(frozen=True, slots=True)
class KVModel:
    """The model whose KV a worker moves: a name (what the operator calls it) and its geometry."""

    name: str
    geometry: KVGeometry
    tp_rank: int = 0
    tp_size: int = 1
    vocab_size: int | None = None

    fingerprint: ModelFingerprint = field(init=False, repr=False, compare=False)
    fingerprint_digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from kernels.layouts import CHUNK_LAYOUT

        g = self.geometry
        fp = ModelFingerprint(
            model=self.name,
            dtype=str(g.dtype).removeprefix("torch."),
            num_layers=g.num_layers,
            num_kv_heads=g.num_kv_heads,
            head_size=g.head_size,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            layout_version=int(CHUNK_LAYOUT.rsplit(":v", 1)[1]),
            chunk_format="" if g.chunk_format == CHUNK_LAYOUT else g.chunk_format,
        )
        object.__setattr__(self, "fingerprint", fp)
        object.__setattr__(self, "fingerprint_digest", fp.digest)


@dataclass(slots=True)
class StoreResult:
    tokens: int
    chunks: int
    stored: int
    skipped: int
    bytes_stored: int


@dataclass(slots=True)
class LookupResult:
    hit_tokens: int
    hit_chunks: int
    total_chunks: int
    locations: list[list[str]] = field(default_factory=list)
    # why the answer may be short although chunks are stored: "" (it is not), "tier_timeout",
    # "tier_unavailable" (a tier missed its lookup deadline or is down), "key_unavailable"
    degraded: str = ""


@dataclass(slots=True)
class RetrieveResult:
    loaded_tokens: int
    loaded_chunks: int
    integrity_failures: int
    unavailable: int  # key destroyed/unwrappable or tier unreachable
    # why the prefix ended before the last chunk: "" (it did not), "miss" (gone since the
    # lookup), "integrity", "tier_timeout", "tier_unavailable", "key_unavailable"
    reason: str = ""
    # a faster tier failed and a slower one served (part of) what was loaded: "",
    # "tier_timeout", "tier_unavailable"
    degraded: str = ""


@dataclass(slots=True)
class ClearResult:
    job_id: str
    tenant: str
    namespace: str | None
    deleted_chunks: int
    destroyed_key_versions: list[int]
    epochs: dict[str, int]
