"""The vLLM integration's configuration (gateway/vllm/config.py): ``kv_connector_extra_config``
and ``KVGATE_VLLM_*`` validated at start, each refusal naming the key or variable to fix, every
documented key still accepted."""

from __future__ import annotations

import pytest

from gateway.vllm.backend import EmbeddedBackend, RemoteBackend
from gateway.vllm.config import ConnectorConfig, MiddlewareSettings
from gateway.vllm.errors import ConnectorConfigError
from gateway.vllm.guard import GuardConfig

SECRET_HEX = "ab" * 32
BASE_ENV = {"KVGATE_VLLM_ISSUER": "http://127.0.0.1:1/i", "KVGATE_VLLM_SALT_SECRET": SECRET_HEX}


# -- the connector ----------------------------------------------------------------------------
def test_every_documented_connector_key_is_accepted(tmp_path):
    extra = {
        "mode": "remote", "kvgate_settings": {"chunk_tokens": 64}, "remote_url": "https://k:8420",
        "remote_token_file": str(tmp_path / "t"), "chunk_tokens": 64, "model_name": "m", "layout": "cpu",
        "timeout_s": 5, "trace_path": str(tmp_path / "trace"),
    }
    c = ConnectorConfig.from_extra(extra)
    assert (c.mode, c.chunk_tokens, c.layout, c.timeout_s, c.model_name) == ("remote", 64, "cpu", 5.0, "m")
    d = ConnectorConfig.from_extra(None)
    assert (d.mode, d.kvgate_settings, d.layout, d.timeout_s, d.trace_path) == ("embedded", {}, "auto", 30.0, None)


@pytest.mark.parametrize("extra, named", [
    ({"mode": "embeded"}, "mode"),
    ({"timout_s": 5}, "timout_s: unknown key"),
    ({"timeout_s": "soon"}, "timeout_s"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"chunk_tokens": -64}, "chunk_tokens"),
    ({"layout": "paged"}, "layout"),
    ({"kvgate_settings": ["memory"]}, "kvgate_settings"),
])
def test_a_bad_connector_key_is_refused_by_name(extra, named):
    with pytest.raises(ConnectorConfigError, match=named) as err:
        ConnectorConfig.from_extra(extra)
    assert str(err.value).startswith("kv_connector_extra_config: ")


def test_secrets_are_refused_before_anything_else_and_never_echoed():
    with pytest.raises(ConnectorConfigError, match="KVGATE_REMOTE_TOKEN") as err:
        ConnectorConfig.from_extra({"remote_token": "hunter2", "timout_s": 1})
    assert "hunter2" not in str(err.value)


def test_a_bad_kvgate_setting_is_named_when_the_embedded_backend_is_built(tmp_path):
    with pytest.raises(ConnectorConfigError, match=r"kvgate_settings: tiers\.0"):
        EmbeddedBackend({"state_dir": str(tmp_path), "tiers": ["tape"]})
    with pytest.raises(ConnectorConfigError, match="kvgate_settings: chunk_tokns: unknown key"):
        EmbeddedBackend({"state_dir": str(tmp_path), "chunk_tokns": 64})
    assert EmbeddedBackend({"state_dir": str(tmp_path), "chunk_tokens": 64}).chunk_tokens == 64  # positive control


def test_the_remote_token_comes_from_the_environment_or_its_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    c = ConnectorConfig.from_extra({"mode": "remote", "remote_url": "http://k", "remote_token_file": str(token_file)})
    assert c.remote_token({"KVGATE_REMOTE_TOKEN": "env-token"}) == "env-token"
    assert c.remote_token({}) == "file-token"
    gone = ConnectorConfig.from_extra({"mode": "remote", "remote_token_file": str(tmp_path / "missing")})
    with pytest.raises(ConnectorConfigError, match="remote_token_file"):
        gone.remote_token({})
    with pytest.raises(ConnectorConfigError, match="remote_url and KVGATE_REMOTE_TOKEN"):
        RemoteBackend("", "", 64)


def test_backends_are_shared_by_configuration_not_by_presentation():
    a = ConnectorConfig.from_extra({"kvgate_settings": {"tiers": ["redis"], "chunk_tokens": 64}, "trace_path": "/x"})
    b = ConnectorConfig.from_extra({"kvgate_settings": {"chunk_tokens": 64, "tiers": ["redis"]}, "layout": "cpu"})
    c = ConnectorConfig.from_extra({"kvgate_settings": {"chunk_tokens": 128, "tiers": ["redis"]}})
    assert a.backend_key() == b.backend_key() != c.backend_key()


# -- the middleware ---------------------------------------------------------------------------
def test_middleware_defaults_and_every_documented_variable(tmp_path):
    s = MiddlewareSettings.from_env(BASE_ENV)
    assert (s.audience, s.tenant_claim, s.roles_claim, s.required_typ, s.namespace, s.capability_ttl) == (
        "kvgate", "tenant", "roles", "at+jwt", "default", 300,
    )
    secret = tmp_path / "salt.hex"
    secret.write_text(SECRET_HEX + "\n")
    env = {
        "KVGATE_VLLM_ISSUER": "https://idp.example/realms/a", "KVGATE_VLLM_AUDIENCE": "aud",
        "KVGATE_VLLM_TENANT_CLAIM": "org", "KVGATE_VLLM_ROLES_CLAIM": "groups", "KVGATE_VLLM_REQUIRED_TYP": "",
        "KVGATE_VLLM_GATEWAY_URL": "https://kvgate:8420", "KVGATE_VLLM_SALT_SECRET_FILE": str(secret),
        "KVGATE_VLLM_NAMESPACE": "ns1", "KVGATE_VLLM_CAPABILITY_TTL": "60", "KVGATE_VLLM_UPSTREAM": "http://vllm:8000",
        "KVGATE_VLLM_REPORT": "/tmp/not-ours", "KVGATE_DATABASE_URL": "sqlite://",  # not the middleware's: ignored
    }
    s = MiddlewareSettings.from_env(env)
    assert s.upstream == "http://vllm:8000" and s.salt_secret_bytes() == bytes.fromhex(SECRET_HEX)
    g = GuardConfig.from_env(env)
    (issuer,) = g.issuers
    assert (issuer.issuer, issuer.audience, issuer.tenant_claim, issuer.roles_claim, issuer.required_typ) == (
        "https://idp.example/realms/a", "aud", "org", "groups", None,
    )
    assert not issuer.allow_http
    assert (g.gateway_url, g.namespace, g.capability_ttl, g.salt_secret) == ("https://kvgate:8420", "ns1", 60, bytes.fromhex(SECRET_HEX))
    assert GuardConfig.from_env(BASE_ENV).issuers[0].allow_http  # a loopback issuer may be plain http


@pytest.mark.parametrize("env, named", [
    ({"KVGATE_VLLM_SALT_SECRET": SECRET_HEX}, "KVGATE_VLLM_ISSUER"),
    ({**BASE_ENV, "KVGATE_VLLM_CAPABILITY_TTL": "five minutes"}, "KVGATE_VLLM_CAPABILITY_TTL"),
    ({**BASE_ENV, "KVGATE_VLLM_CAPABILITY_TTL": "0"}, "KVGATE_VLLM_CAPABILITY_TTL"),
    ({**BASE_ENV, "KVGATE_VLLM_SALT_SECRET": "zz" * 32}, "KVGATE_VLLM_SALT_SECRET must be hex"),
    ({**BASE_ENV, "KVGATE_VLLM_SALT_SECRET": "ab" * 31}, "at least 32 bytes"),
    ({"KVGATE_VLLM_ISSUER": "http://127.0.0.1:1/i"}, "KVGATE_VLLM_SALT_SECRET"),
    ({"KVGATE_VLLM_ISSUER": "http://127.0.0.1:1/i", "KVGATE_VLLM_SALT_SECRET_FILE": "/nonexistent/s"}, "SALT_SECRET_FILE"),
    ({**BASE_ENV, "KVGATE_VLLM_SALT_EPOCH": "3"}, "SALT_EPOCH"),
])
def test_a_bad_middleware_variable_is_refused_by_name(env, named):
    with pytest.raises(ConnectorConfigError, match=named) as err:
        GuardConfig.from_env(env)
    assert SECRET_HEX not in str(err.value)


def test_a_producers_hand_off_stores_seal_at_once_at_the_engines_priority_unless_set():
    """A kv_producer's stores are on the consumer's way to its first token: neither the store
    gate nor a lower priority defers them behind the producer's other work unless the operator
    sets them explicitly."""
    default = ConnectorConfig.from_extra({})
    producer = default.for_role("kv_producer")
    assert (producer.store_finish_s, producer.store_nice, producer.copies_finish_s) == (0.0, 0, 0.0)
    for role in ("kv_consumer", "kv_both", None):  # positive control: other roles keep them
        mine = default.for_role(role)
        assert (mine.store_finish_s, mine.store_nice, mine.copies_finish_s) == (4.0, 10, 2.0)
    kept = ConnectorConfig.from_extra({"store_finish_s": 2.5, "store_nice": 5, "copies_finish_s": 1.0}).for_role("kv_producer")
    assert (kept.store_finish_s, kept.store_nice, kept.copies_finish_s) == (2.5, 5, 1.0)
    assert ConnectorConfig.from_extra({"store_nice": 5}).for_role("kv_producer").store_finish_s == 0.0


def test_load_policy_defaults_to_adaptive_and_a_kv_consumer_loads_every_hit():
    """A decode engine (kv_consumer) that recomputed a hit would run the prefill disaggregation
    moved to the producers: it loads every hit unless its operator names a policy."""
    default = ConnectorConfig.from_extra({})
    assert default.load_policy == "adaptive"
    assert default.for_role("kv_consumer").load_policy == "always"
    for role in ("kv_producer", "kv_both", None):  # positive control: every other role keeps adaptive
        assert default.for_role(role).load_policy == "adaptive"
    named = ConnectorConfig.from_extra({"load_policy": "adaptive"}).for_role("kv_consumer")
    assert named.load_policy == "adaptive"
    assert ConnectorConfig.from_extra({"load_policy": "recompute"}).for_role("kv_consumer").load_policy == "recompute"
