"""Settings: environment (KVGATE_*) and an optional TOML file (KVGATE_CONFIG), validated at start.

Built explicitly with ``load_settings()`` (never at import time). Secrets are SecretStr, so their
repr hides them. Production mode refuses the development-only parts (the local KEK file, the
local PEM audit signing key and the development OIDC issuer).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

__all__ = ["Settings", "IssuerSettings", "load_settings", "default_state_dir"]


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvgate"


class IssuerSettings(BaseSettings):
    """One trusted OIDC issuer."""

    model_config = SettingsConfigDict(extra="forbid")

    issuer: str
    audience: str = "kvgate"
    tenant_claim: str = "tenant"
    roles_claim: str = "roles"
    algorithms: list[str] = Field(default_factory=lambda: ["RS256", "ES256", "EdDSA"])
    required_typ: str | None = "at+jwt"
    jwks_lifespan_s: float = 300.0
    refetch_cooldown_s: float = 30.0
    leeway_s: float = 60.0


def _default_tiers() -> list[Literal["memory", "disk", "redis"]]:
    return ["memory", "disk"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", env_nested_delimiter="__", extra="forbid")

    mode: Literal["development", "production"] = "development"
    state_dir: Path = Field(default_factory=default_state_dir)
    database_url: str | None = None  # default: SQLite under state_dir
    redis_url: str | None = None
    redis_prefix: str = "kvgate:"

    # storage
    tiers: list[Literal["memory", "disk", "redis"]] = Field(default_factory=_default_tiers)
    memory_bytes: int = 4 << 30
    memory_owner_quota_bytes: int | None = None
    # the memory tier's arena (one for every namespace; not the per-namespace arenas of
    # shm_arenas): off: a page is faulted in when a store first writes it, inside that store;
    # behind: a nice-19 thread faults the whole arena in from the start, a step at a time, in the
    # process's idle time (gateway.protocol.shmpages.populate_behind), so the stores of a fresh
    # process write into pages already there; start: all of it before the tier opens
    # (MAP_POPULATE). With behind or start the tier's RSS is its budget within seconds; true and
    # false read as start and off. The vLLM connector's embedded mode defaults to behind
    memory_prefault: Literal["off", "behind", "start"] = "off"
    write_back_tiers: list[Literal["memory", "disk", "redis"]] = Field(default_factory=list)
    # write_behind: a store returns once the chunk is in the first (fastest) tier; the slower
    # tiers get their copies from a bounded queue (full: copies dropped, counted; a crash loses
    # only queued copies). write_through: every tier is written before a store returns.
    tier_write_mode: Literal["write_behind", "write_through"] = "write_behind"
    disk_dir: Path | None = None  # default: state_dir / "chunks"
    disk_bytes: int | None = None
    disk_fsync: bool = True
    # deadlines of a remote tier (Redis), seconds: a lookup (presence check), a read (plus the
    # payload at 128 MiB/s) and a write (likewise). A missed deadline is a miss, counted; it
    # never fails the engine. The scheduler waits for lookups, so keep that one short.
    tier_lookup_timeout_s: float = 0.1
    tier_read_timeout_s: float = 0.25
    tier_write_timeout_s: float = 1.0

    # chunking and crypto
    chunk_tokens: int = 256
    segment_bytes: int = 2 << 20
    cpu_threads: int = 2
    # the nice value of the threads that seal stores (Linux; gateway.datapath.path says why): > 0
    # lets a process's other work (an engine's forward steps) go first while stores are in flight
    store_nice: int = Field(default=0, ge=0, le=19)
    # a store faults its slots' pages in ahead of its seals, on a nice-19 thread
    # (gateway.protocol.shmpages says why); false: each seal faults in the pages it writes
    store_prefault: bool = True
    # auto: KV on a GPU is encrypted there (only ciphertext reaches the host); host: the explicit
    # switch that lets plaintext KV cross to the host to be encrypted there (logged at start)
    device_cipher: Literal["auto", "host"] = "auto"
    # the device cipher: auto = the fused Triton kernels on CUDA when triton is installed, else the
    # torch-ops AES-GCM (the reference); triton / torch force one (kernels.device_aead)
    device_aes: Literal["auto", "triton", "torch"] = "auto"
    invocation_limit: int = 2**32
    kek_provider: Literal["file", "pkcs11", "kms"] = "file"
    kek_file: Path | None = None  # default: state_dir / "kek.key"
    # kek_provider = "pkcs11" (see docs/kek.md): module, token and PIN; the key label is the KEK version
    pkcs11_module: Path | None = None
    pkcs11_token_label: str | None = None
    pkcs11_pin: SecretStr | None = None
    pkcs11_key_label: str = "kvgate-kek-1"
    # kek_provider = "kms": key id, ARN or alias; older keys that may still unwrap during a rotation
    kms_key_id: str | None = None
    kms_region: str | None = None
    kms_endpoint_url: str | None = None
    kms_previous_key_ids: list[str] = Field(default_factory=list)
    kms_key_state_ttl_s: float = 60.0  # how long a DescribeKey "Enabled" answer is trusted
    kek_cache_ttl_s: float = 300.0  # unwrapped data keys stay in memory this long at most

    # identity
    issuers: list[IssuerSettings] = Field(default_factory=list)
    dev_issuer: bool = True  # development only: a local issuer whose JWKS the server publishes
    public_url: str = "http://127.0.0.1:8420"
    capability_max_ttl_s: int = 600
    audit_key_file: Path | None = None  # default: state_dir / "audit_ed25519.pem" (development signer)
    # who signs export manifests and checkpoints: "file" is the local Ed25519 PEM (development
    # only), "pkcs11" an EC P-256 key pair (audit_pkcs11_key_label) in the KEK's token, "kms" an
    # ECC_NIST_P256 SIGN_VERIFY key (audit_kms_key_id). "auto": in production where the KEK lives
    # (pkcs11 or kms), in development the local PEM.
    audit_signer: Literal["auto", "file", "pkcs11", "kms"] = "auto"
    audit_pkcs11_key_label: str = "kvgate-audit-1"
    audit_kms_key_id: str | None = None
    audit_checkpoint_dir: Path | None = None  # default: state_dir / "audit-checkpoints"
    audit_checkpoint_interval_s: float = 300.0  # 0: only on demand and on export
    audit_checkpoint_stream: str | None = "audit-checkpoints"  # a Redis stream copy where redis_url is set

    # logging (gateway/logs.py): the kvgate logger tree, text or one JSON object a line
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"

    # server
    host: str = "127.0.0.1"
    port: int = 8420
    # a Unix socket served beside host:port, for workers on the same host (remote mode's
    # ``remote_uds``): same API, same authentication, a faster data plane than loopback TCP.
    # Created with ``uds_mode`` (connecting needs write permission on it), removed on exit.
    uds: Path | None = None
    uds_mode: int = 0o660  # octal in the environment: KVGATE_UDS_MODE=660 (or 0660, 0o660)
    # shared-memory loads for workers on the Unix socket (gateway/server/shm.py): the most bytes
    # of regions the server makes for them at once, a quarter of it per tenant (0, the default:
    # off, every load goes through the socket; the server allocates what it hands out)
    shm_max_bytes: int = Field(default=0, ge=0)
    # fault a region's pages in on a nice-19 thread as it is made, on both sides, so a worker's
    # first load through it does not pay for them (gateway/protocol/shmpages.py); off: as loads touch them
    shm_populate: bool = True
    # with shared-memory loads on: the memory tier keeps each namespace's envelopes in an arena of
    # its own, which workers that may write that namespace map read-only and read envelopes from in
    # place, with no copy by the server (gateway/server/shm.py); off: envelopes are copied into the
    # worker's region
    shm_arenas: bool = True
    # with shm_arenas: the most free bytes of a namespace's arena the server faults in ahead of its
    # next store, on a nice-19 thread when the arena is made and after each store (so the worker's
    # seals write into pages already there); only while the arenas stay within the memory tier's
    # bound (its budget and an eighth, counted as resident), and given back when trimmed. Default:
    # half of memory_bytes; 0: off
    shm_arena_ahead_bytes: int | None = Field(default=None, ge=0)
    # uvicorn's access log, a line per request (it costs server CPU on every request): off
    # leaves requests to the metrics, traces and, for the audited ones, the audit log
    access_log: bool = True
    # the server's raw request paths (docs/server.md, "Raw paths"): an upload read from the socket
    # into the tier's buffers, the fetch stream written from them, the lookup served without
    # FastAPI's per-request work; off: every request through uvicorn's ASGI and FastAPI, as any app
    raw_paths: bool = True
    # SIGTERM: stop taking connections, wait at most this long for the requests in flight, then
    # cancel them, write the audit queue, withdraw the published URL and exit 0
    shutdown_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    max_chunk_bytes: int = 64 << 20
    # the batched data plane (gateway/protocol/frames.py): the most bytes and items one PUT /v1/chunks frame carries
    max_batch_bytes: int = Field(default=256 << 20, ge=1 << 20)
    max_batch_items: int = Field(default=4096, ge=1, le=65536)
    api_token: SecretStr | None = None
    # request bounds: JSON bodies of the small routes, the header block, read timeouts
    max_json_body_bytes: int = Field(default=16 << 10, ge=1024, le=1 << 20)
    max_header_bytes: int = Field(default=16 << 10, ge=4096, le=1 << 20)
    max_header_count: int = Field(default=64, ge=8, le=1024)
    header_timeout_s: float = Field(default=10.0, gt=0, le=300)
    body_timeout_s: float = Field(default=10.0, gt=0, le=300)

    @field_validator("chunk_tokens", "segment_bytes", "memory_bytes")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("must be positive")
        return v

    @field_validator("memory_prefault", mode="before")
    @classmethod
    def _prefault_flag(cls, v: Any) -> Any:
        flag = str(v).strip().lower() if isinstance(v, (bool, str)) else None
        return {"true": "start", "1": "start", "false": "off", "0": "off"}.get(flag or "", v)

    @field_validator("uds_mode", mode="before")
    @classmethod
    def _octal_mode(cls, v: Any) -> Any:
        if isinstance(v, str):  # a file mode is written in octal, as chmod takes it
            text = v.strip().lower().removeprefix("0o")
            try:
                return int(text, 8)
            except ValueError:
                raise ValueError(f"must be an octal file mode such as 660, got {v!r}") from None
        return v

    @field_validator("uds_mode")
    @classmethod
    def _sane_mode(cls, v: int) -> int:
        if isinstance(v, bool) or not 0 <= v <= 0o777:
            raise ValueError("must be a file mode between 0 and 0o777")
        if v & 0o600 != 0o600:
            raise ValueError("must let the server's own user read and write the socket (0o600 at least)")
        if v & 0o002:
            raise ValueError("must not let every local user connect (no o+w); use a group instead")
        return v

    @field_validator("cpu_threads")
    @classmethod
    def _threads(cls, v: int) -> int:
        if not 0 <= v <= 64:
            raise ValueError("must be between 0 (inline) and 64")
        return v

    @model_validator(mode="after")
    def _production_rules(self) -> Settings:
        if self.mode == "production":
            if self.kek_provider == "file":
                raise ValueError(
                    "the local KEK file is for development only; production needs an HSM or KMS provider"
                )
            if self.dev_issuer:
                raise ValueError("the development OIDC issuer refuses to run in production mode")
            if self.audit_signer_kind == "file":
                raise ValueError(
                    "the local PEM audit signing key is for development only; production signs audit "
                    "checkpoints and manifests with the HSM or KMS (audit_signer 'pkcs11' or 'kms')"
                )
        if self.audit_signer_kind == "pkcs11":
            missing = [n for n in ("pkcs11_module", "pkcs11_token_label", "pkcs11_pin") if getattr(self, n) is None]
            if missing:
                raise ValueError(f"audit_signer 'pkcs11' needs {', '.join(missing)}")
        if self.audit_signer_kind == "kms" and not self.audit_kms_key_id:
            raise ValueError("audit_signer 'kms' needs audit_kms_key_id (an ECC_NIST_P256 SIGN_VERIFY key)")
        if self.audit_checkpoint_interval_s < 0:
            raise ValueError("audit_checkpoint_interval_s must be >= 0")
        if self.kek_provider == "pkcs11":
            missing = [n for n in ("pkcs11_module", "pkcs11_token_label", "pkcs11_pin") if getattr(self, n) is None]
            if missing:
                raise ValueError(f"kek_provider 'pkcs11' needs {', '.join(missing)}")
        if self.kek_provider == "kms" and not self.kms_key_id:
            raise ValueError("kek_provider 'kms' needs kms_key_id")
        if self.kek_cache_ttl_s <= 0:
            raise ValueError("kek_cache_ttl_s must be positive")
        for name in ("tier_lookup_timeout_s", "tier_read_timeout_s", "tier_write_timeout_s"):
            if not 0 < getattr(self, name) <= 60:
                raise ValueError(f"{name} must be in (0, 60] seconds")
        if "redis" in self.tiers and not self.redis_url:
            raise ValueError("the redis tier needs redis_url")
        return self

    # derived paths -----------------------------------------------------------------------------
    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{self.state_dir / 'kvgate.db'}"

    @property
    def chunk_dir(self) -> Path:
        return self.disk_dir or self.state_dir / "chunks"

    @property
    def kek_path(self) -> Path:
        return self.kek_file or self.state_dir / "kek.key"

    @property
    def audit_key_path(self) -> Path:
        return self.audit_key_file or self.state_dir / "audit_ed25519.pem"

    @property
    def audit_signer_kind(self) -> str:
        if self.audit_signer != "auto":
            return self.audit_signer
        return self.kek_provider if self.mode == "production" else "file"

    @property
    def audit_checkpoint_path(self) -> Path:
        return self.audit_checkpoint_dir or self.state_dir / "audit-checkpoints"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get("KVGATE_CONFIG")
        if path:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(path)))
        return tuple(sources)


def load_settings(**overrides: Any) -> Settings:
    """Read and validate settings; a missing config file is an error, not a silent default."""
    path = os.environ.get("KVGATE_CONFIG")
    if path and not Path(path).is_file():
        raise FileNotFoundError(f"KVGATE_CONFIG points at {path}, which is not a file")
    return Settings(**overrides)
