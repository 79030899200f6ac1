"""The vLLM integration's two configurations, as pydantic models validated at start.

    ConnectorConfig     ``kv_connector_extra_config`` of ``--kv-transfer-config`` (the connector)
    MiddlewareSettings  ``KVGATE_VLLM_*`` environment variables (the tenant middleware and proxy)

Both refuse what they cannot use with one ``ConnectorConfigError`` that names the key (or the
environment variable) and says what was wrong; neither is read at import time. Every key and
variable is listed in docs/vllm.md.

Secrets never come from ``kv_connector_extra_config``: vLLM prints it at start. ``refuse_secrets``
names the environment variable to use instead (and never echoes the secret).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
)

from gateway.vllm.errors import ConnectorConfigError

__all__ = ["ENV_PREFIX", "ConnectorConfig", "MiddlewareSettings", "explain_validation", "refuse_secrets"]

ENV_PREFIX = "KVGATE_VLLM_"

# settings that hold secrets: from the environment (KVGATE_*) or a file, never from the config
_SECRET_SETTINGS = ("pkcs11_pin", "api_token")
_URL_SETTINGS = ("database_url", "redis_url")


def explain_validation(exc: ValidationError, where: str, name: Any = None) -> str:
    """One line per error of ``exc``: the key (``name(field)`` if given) and pydantic's message."""
    parts = []
    for err in exc.errors(include_url=False, include_input=False):
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        key = name(loc) if name is not None else loc
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{key}: {msg}")
    return f"{where}: " + "; ".join(parts)


def _has_password(url: str) -> bool:
    try:
        return urlsplit(url).password is not None
    except ValueError:
        return False


def refuse_secrets(extra: Mapping[str, Any]) -> None:
    """ConnectorConfigError if ``kv_connector_extra_config`` carries a secret (vLLM logs it)."""
    settings = extra.get("kvgate_settings") or {}
    if not isinstance(settings, Mapping):
        return  # ConnectorConfig says what is wrong with it
    found = [k for k in _SECRET_SETTINGS if k in settings]
    found += [k for k in _URL_SETTINGS if isinstance(settings.get(k), str) and _has_password(settings[k])]
    if extra.get("remote_token"):
        found.append("remote_token")
    if found:
        env = ", ".join("KVGATE_REMOTE_TOKEN or remote_token_file" if k == "remote_token" else f"KVGATE_{k.upper()}" for k in found)
        raise ConnectorConfigError(
            f"secrets in --kv-transfer-config ({', '.join(found)}) would be printed in vLLM's log: "
            f"set {env} in the engine's environment instead"
        )


class ConnectorConfig(BaseModel):
    """``kv_connector_extra_config``; unknown keys are refused (a typo must not pass silently)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["embedded", "remote"] = "embedded"
    # embedded: fields of gateway.config.Settings (KVGATE_* variables fill what is left out);
    # validated when the embedded backend opens (``embedded_settings``)
    kvgate_settings: dict[str, Any] = Field(default_factory=dict)
    remote_url: str = ""
    # the server's Unix socket, where it runs on this host (``kvgate serve --uds``): every call
    # goes there; remote_url still names the server
    remote_uds: str | None = Field(None, min_length=1)
    # with remote_uds: loads borrow a shared-memory region of this many MiB per tenant from the
    # server (gateway/server/shm.py): the envelopes that fit skip the socket; 0: none
    remote_shm_mb: int = Field(0, ge=0, le=1 << 16)
    remote_token_file: str | None = None
    chunk_tokens: int = Field(256, gt=0)  # remote mode (embedded: kvgate_settings.chunk_tokens)
    model_name: str | None = None
    layout: Literal["auto", "cpu", "kv_first", "block_first"] = "auto"
    timeout_s: float = Field(30.0, gt=0)
    # stores sealing and putting in the background, per worker (their staging copies): past it a
    # step's end waits for room, at most ``store_wait_s``; a store that finds none is dropped, and
    # so is every store past the cap until one fits again (no second wait while the tiers lag)
    store_in_flight_bytes: int = Field(1 << 30, gt=0)
    store_wait_s: float = Field(5.0, ge=0, le=600)
    # the nice value of the threads that seal stores (Linux), so that decoding goes first while a
    # store is in flight (gateway.datapath.path); 0: stores at the engine's own priority
    store_nice: int = Field(10, ge=0, le=19)
    # a store faults its slots' pages in ahead of its seals on a nice-19 thread, so a seal that
    # runs beside a forward step does not (gateway.protocol.shmpages); false: the seals fault them in
    store_prefault: bool = True
    # a store seals between the engine's forward steps, slice by slice, and a slice that waited
    # that long runs anyway: a store's last slice starts at most this many seconds after it
    # began (gateway/datapath/gate.py); 0: stores seal at once, beside the forward
    store_finish_s: float = Field(4.0, ge=0, le=3600)
    # embedded mode: a store's copies to the slower tiers (Redis, disk; written behind) wait while
    # the engine runs forward steps, each at most this many seconds after it was queued
    # (storage/writebehind.py); the scheduler's lookups see a store once they are in; 0: at once
    copies_finish_s: float = Field(2.0, ge=0, le=3600)
    # loads into a CPU cache go layer by layer: the forward starts on the first layers while the
    # rest load (gateway/vllm/layers.py); false: every layer is in before the forward starts
    layerwise_loads: bool = True
    # of a hit, how much is loaded (gateway/vllm/policy.py): adaptive: none, a prefix or all,
    # whichever the measured load and prefill times expect to reach the first token soonest;
    # always: all of it (a kv_consumer's default: for_role); recompute: none (the hit is still
    # looked up, and not stored again)
    load_policy: Literal["always", "adaptive", "recompute"] = "adaptive"
    # prefill/decode disaggregation (vLLM's kv_role; gateway/vllm/handoff.py): a kv_producer
    # stores and loads only with producer_loads, a kv_consumer loads and stores only with
    # consumer_stores; a consumer waits at most handoff_wait_s for a receipt's store to be
    # visible (polling every handoff_poll_s), then recomputes what it cannot load
    producer_loads: bool = False
    consumer_stores: bool = False
    handoff_wait_s: float = Field(5.0, ge=0, le=600)
    handoff_poll_s: float = Field(0.02, gt=0, le=10)
    trace_path: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Validate ``kv_connector_extra_config``: secrets first, then every key."""
        extra = dict(extra or {})
        refuse_secrets(extra)
        extra.pop("remote_token", None)  # an empty one: nothing to refuse, nothing to use
        try:
            return cls.model_validate(extra)
        except ValidationError as exc:
            raise ConnectorConfigError(explain_validation(exc, "kv_connector_extra_config")) from None

    def for_role(self, kv_role: str | None) -> ConnectorConfig:
        """This configuration as a worker of ``kv_role`` runs it. A kv_producer's stores are
        hand-offs, which the consumer's first token waits for, and a producer does not decode: its
        stores seal at once (``store_finish_s`` 0) at the engine's priority (``store_nice`` 0),
        and their copies go at once (``copies_finish_s`` 0), each unless set. A kv_consumer loads
        every hit (``load_policy`` always, unless set): it is the decode engine, and a prompt it
        recomputed instead of loading would put back on it the prefill that disaggregation moved
        to the producers, beside the decodes it serves. Any other role: unchanged."""
        if kv_role == "kv_producer":
            unset: dict[str, Any] = {"store_finish_s": 0.0, "store_nice": 0, "copies_finish_s": 0.0}
        elif kv_role == "kv_consumer":
            unset = {"load_policy": "always"}
        else:
            return self
        return self.model_copy(update={k: v for k, v in unset.items() if k not in self.model_fields_set})

    def backend_key(self) -> tuple[Any, ...]:
        """What makes two connectors of a process share one backend."""
        settings = tuple(sorted((k, repr(v)) for k, v in self.kvgate_settings.items()))
        return (
            self.mode, settings, self.remote_url, self.remote_uds, self.remote_shm_mb, self.chunk_tokens, self.store_nice,
            self.copies_finish_s,
        )

    def remote_token(self, env: Mapping[str, str] | None = None) -> str:
        """The worker's service token: ``KVGATE_REMOTE_TOKEN``, else ``remote_token_file``."""
        token = (os.environ if env is None else env).get("KVGATE_REMOTE_TOKEN")
        if not token and self.remote_token_file:
            try:
                with open(self.remote_token_file, encoding="utf-8") as f:
                    token = f.read().strip()
            except OSError as exc:
                raise ConnectorConfigError(f"remote_token_file: cannot read it ({exc.strerror})") from None
        return token or ""


class MiddlewareSettings(BaseModel):
    """The middleware's and the proxy's settings, from ``KVGATE_VLLM_<FIELD>`` variables (other
    ``KVGATE_VLLM_*`` variables are not theirs and are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    issuer: str = Field(min_length=1)
    audience: str = "kvgate"
    tenant_claim: str = "tenant"
    roles_claim: str = "roles"
    required_typ: str | None = "at+jwt"  # empty: no typ check
    gateway_url: str | None = None
    salt_secret: SecretStr | None = None  # hex, >= 32 bytes
    salt_secret_file: str | None = None
    namespace: str = "default"
    capability_ttl: int = Field(300, gt=0)
    upstream: str | None = None  # the proxy's vLLM server
    salt_epoch: str | None = None  # refused: the epoch is the namespace epoch the server reports
    # identity from an authenticating gateway in front (gateway/vllm/peers.py): the tenant named by
    # tenant_header, accepted only from trusted_peers; a per-request namespace in namespace_header
    tenant_header: str | None = Field(None, pattern=r"^[A-Za-z0-9-]{1,64}$")
    namespace_header: str | None = Field(None, pattern=r"^[A-Za-z0-9-]{1,64}$")
    trusted_peers: str | None = None  # comma-separated: unix, unix:/path, addresses or CIDRs
    trusted_namespaces: str | None = None  # for a tenant the header names: comma-separated, or *
    # mints capabilities for a tenant the header names (kv.operator): the variable, else the file
    service_token: SecretStr | None = None
    service_token_file: str | None = None
    # where the middleware audits the requests it refuses for their identity headers
    audit_database_url: SecretStr | None = None
    audit_spool_dir: str | None = None

    @field_validator("tenant_header", "namespace_header")
    @classmethod
    def _header_name(cls, v: str | None) -> str | None:
        return v.lower() if v else None

    @field_validator("required_typ")
    @classmethod
    def _empty_is_none(cls, v: str | None) -> str | None:
        return v or None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MiddlewareSettings:
        env = os.environ if env is None else env
        values = {k[len(ENV_PREFIX):].lower(): v for k, v in env.items() if k.upper().startswith(ENV_PREFIX)}
        if "issuer" not in values or not values["issuer"]:
            raise ConnectorConfigError("KVGATE_VLLM_ISSUER (the OIDC issuer URL) is required")
        try:
            settings = cls.model_validate(values)
        except ValidationError as exc:
            raise ConnectorConfigError(explain_validation(exc, "middleware settings", _env_name)) from None
        if settings.salt_epoch is not None:
            raise ConnectorConfigError(
                "KVGATE_VLLM_SALT_EPOCH is no longer read: the cache_salt epoch is the namespace epoch the "
                "kvgate server reports (a secure clear bumps it); remove the variable"
            )
        if settings.tenant_header and not settings.trusted_peers:
            raise ConnectorConfigError(
                "KVGATE_VLLM_TENANT_HEADER needs KVGATE_VLLM_TRUSTED_PEERS (the peers whose header is believed)"
            )
        if (settings.tenant_header or settings.namespace_header) and settings.audit_database_url is None:
            raise ConnectorConfigError(
                "KVGATE_VLLM_TENANT_HEADER and KVGATE_VLLM_NAMESPACE_HEADER need KVGATE_VLLM_AUDIT_DATABASE_URL "
                "(the audit database where refused identity headers are recorded)"
            )
        return settings

    def service_token_value(self) -> str | None:
        """The token that mints for a tenant the header names: the variable, else the file."""
        if self.service_token is not None and self.service_token.get_secret_value():
            return self.service_token.get_secret_value()
        if self.service_token_file:
            try:
                with open(self.service_token_file, encoding="utf-8") as f:
                    return f.read().strip() or None
            except OSError as exc:
                raise ConnectorConfigError(f"KVGATE_VLLM_SERVICE_TOKEN_FILE: cannot read it ({exc.strerror})") from None
        return None

    def salt_secret_bytes(self) -> bytes:
        """The cache-salt secret, from ``KVGATE_VLLM_SALT_SECRET`` or ``..._FILE`` (hex, >= 32 bytes)."""
        secret_hex = self.salt_secret.get_secret_value() if self.salt_secret else ""
        if not secret_hex and self.salt_secret_file:
            try:
                with open(self.salt_secret_file, encoding="ascii") as f:
                    secret_hex = f.read().strip()
            except OSError as exc:
                raise ConnectorConfigError(f"KVGATE_VLLM_SALT_SECRET_FILE: cannot read it ({exc.strerror})") from None
        try:
            secret = bytes.fromhex(secret_hex)
        except ValueError:
            raise ConnectorConfigError("KVGATE_VLLM_SALT_SECRET must be hex") from None
        if len(secret) < 32:
            raise ConnectorConfigError("KVGATE_VLLM_SALT_SECRET must hold at least 32 bytes (64 hex digits)")
        return secret


def _env_name(field: str) -> str:
    return ENV_PREFIX + field.split(".", 1)[0].upper()
