"""Capability tokens: minting, verification, holder-side attenuation, revocation, fuzzing.

Forgeries are built here with the standard library's hmac, independently of the module's own
helpers, so the tests also pin the documented wire format.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import timeit
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenancy.capabilities import CapabilityAuthority, RevocationList, attenuate, read_unverified
from tenancy.errors import CapabilityDenied, CapabilityRequestInvalid
from tenancy.types import Capability

KEY = b"k" * 32
H1, H2, H3 = "aa" * 32, "bb" * 32, "cc" * 32


class FakeClock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def auth(clock: FakeClock) -> CapabilityAuthority:
    return CapabilityAuthority({"k1": KEY}, "k1", clock=clock)


def b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64d(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def append_caveat(token: str, caveat: dict[str, Any]) -> str:
    """What any holder can do without the module: extend the chain with one caveat."""
    *body, tag = token.split(".")
    block = json.dumps(caveat, sort_keys=True, separators=(",", ":")).encode()
    new_tag = hmac.new(b64d(tag), block, hashlib.sha256).digest()
    return ".".join([*body, b64e(block), b64e(new_tag)])


def forge_root(root: dict[str, Any], key: bytes = KEY, kid: str = "k1") -> str:
    block = json.dumps(root, sort_keys=True, separators=(",", ":")).encode()
    tag = hmac.new(
        key, b"kvgate-cap/1\x00" + kid.encode() + b"\x00" + block, hashlib.sha256
    ).digest()
    return ".".join(["kvc1", kid, b64e(block), b64e(tag)])


def ok(auth: CapabilityAuthority, token: str, op: str = "get", **kw: Any) -> Capability:
    kw.setdefault("tenant", "acme")
    kw.setdefault("namespace", "ns1")
    return auth.verify(token, op=op, **kw)


def denied(auth: CapabilityAuthority, token: str, op: str = "get", **kw: Any) -> str:
    with pytest.raises(CapabilityDenied) as info:
        ok(auth, token, op, **kw)
    assert str(info.value) == "capability denied"
    return info.value.reason


# ---------------------------------------------------------------- mint and verify


def test_mint_and_verify(auth: CapabilityAuthority, clock: FakeClock):
    token, issued = auth.issue("acme", "ns1", ["get", "lookup"], ttl=60)
    cap = ok(auth, token, "lookup")
    assert cap == issued
    assert (cap.tenant, cap.namespace, cap.ops, cap.chunks) == (
        "acme",
        "ns1",
        {"get", "lookup"},
        None,
    )
    assert cap.expires_at == pytest.approx(clock() + 60, abs=0.002)
    assert ok(auth, token, "get", tenant=None).tenant == "acme"
    assert token.startswith("kvc1.k1.")
    assert read_unverified(token) == cap


@pytest.mark.parametrize(
    "args",
    [
        ("acme", "ns1", [], 60),
        ("acme", "ns1", ["delete"], 60),
        ("acme", "ns1", ["get"], 601),
        ("acme", "ns1", ["get"], 0),
        ("", "ns1", ["get"], 60),
        ("acme", "n\x00s", ["get"], 60),
    ],
)
def test_mint_rejects_bad_requests(auth: CapabilityAuthority, args: tuple[Any, ...]):
    with pytest.raises(CapabilityRequestInvalid):
        auth.mint(*args)


def test_default_and_configured_max_ttl(clock: FakeClock):
    a = CapabilityAuthority({"k1": KEY}, "k1", clock=clock, max_ttl=30)
    assert read_unverified(a.mint("acme", "ns1", ["get"])).expires_at == pytest.approx(
        clock() + 30, abs=0.002
    )
    with pytest.raises(CapabilityRequestInvalid):
        a.mint("acme", "ns1", ["get"], ttl=31)
    with pytest.raises(CapabilityRequestInvalid):
        CapabilityAuthority({"k1": b"short"}, "k1")


# ---------------------------------------------------------------- rejections


def test_forged_signature(auth: CapabilityAuthority, clock: FakeClock):
    token = auth.mint("acme", "ns1", ["get"])
    body, tag = token.rsplit(".", 1)
    raw = bytearray(b64d(tag))
    raw[0] ^= 1
    assert denied(auth, f"{body}.{b64e(bytes(raw))}") == "bad tag"
    other = CapabilityAuthority({"k1": b"o" * 32}, "k1", clock=clock).mint("acme", "ns1", ["get"])
    assert denied(auth, other) == "bad tag"
    assert denied(auth, token.replace("kvc1.k1.", "kvc1.k2.")) == "bad tag"  # unknown key id
    root = json.loads(b64d(token.split(".")[2]))
    assert (
        denied(auth, forge_root({**root, "ops": ["get", "put", "pin"]}, key=b"x" * 32)) == "bad tag"
    )


def test_tampered_root_is_rejected(auth: CapabilityAuthority):
    token = auth.mint("acme", "ns1", ["get"])
    parts = token.split(".")
    root = json.loads(b64d(parts[2]))
    for change in (
        {"t": "globex"},
        {"ops": ["get", "put"]},
        {"exp": root["exp"] + 10**6},
        {"ns": "x"},
    ):
        block = json.dumps({**root, **change}, sort_keys=True, separators=(",", ":")).encode()
        assert denied(auth, ".".join([*parts[:2], b64e(block), parts[3]]), tenant=None) == "bad tag"


def test_widened_operations_are_rejected(auth: CapabilityAuthority):
    token = auth.mint("acme", "ns1", ["lookup", "get"])
    with pytest.raises(CapabilityDenied):
        attenuate(token, ops=["get", "put"])
    widened = append_caveat(token, {"ops": ["lookup", "get", "put", "pin"]})  # valid chain
    assert denied(auth, widened, "put") == "operation not granted"
    narrowed = attenuate(token, ops=["get"])
    rewidened = append_caveat(narrowed, {"ops": ["lookup", "get"]})
    assert denied(auth, rewidened, "lookup") == "operation not granted"


def test_later_expiry_is_rejected(auth: CapabilityAuthority, clock: FakeClock):
    token = auth.mint("acme", "ns1", ["get"], ttl=60)
    with pytest.raises(CapabilityDenied):
        attenuate(token, expires_at=clock() + 120)
    later = append_caveat(token, {"exp": int((clock() + 3600) * 1000)})
    clock.advance(61)
    assert denied(auth, later) == "expired"


def test_removed_or_reordered_attenuation_is_rejected(auth: CapabilityAuthority):
    token = auth.mint("acme", "ns1", ["lookup", "get", "put"])
    one = attenuate(token, ops=["get"])
    two = attenuate(one, chunks=[H1])
    p = two.split(".")
    assert denied(auth, ".".join(p[:3] + p[4:]), chunk=H1) == "bad tag"  # first caveat removed
    assert denied(auth, ".".join(p[:4] + p[5:]), chunk=H1) == "bad tag"  # last caveat removed
    assert denied(auth, ".".join(p[:3] + [p[4], p[3], p[5]]), chunk=H1) == "bad tag"  # swapped
    assert denied(auth, ".".join(p[:3] + [p[-1]]), chunk=H1) == "bad tag"  # all removed, new tag
    ok(auth, two, chunk=H1)


def test_another_tenant_or_namespace(auth: CapabilityAuthority):
    token = auth.mint("acme", "ns1", ["get"])
    assert denied(auth, token, tenant="globex") == "other tenant"
    assert denied(auth, token, namespace="ns2") == "other namespace"


def test_expired(auth: CapabilityAuthority, clock: FakeClock):
    token = auth.mint("acme", "ns1", ["get"], ttl=10)
    clock.advance(9.9)
    ok(auth, token)
    clock.advance(0.1)
    assert denied(auth, token) == "expired"


def test_revoked_id_and_tenant(auth: CapabilityAuthority, clock: FakeClock):
    a, cap_a = auth.issue("acme", "ns1", ["get"])
    b = auth.mint("acme", "ns1", ["get"])
    g = auth.mint("globex", "ns1", ["get"])
    ok(auth, a), ok(auth, b)  # now cached: the cache must not bypass revocation
    auth.revocations.revoke(cap_a.cap_id, until=cap_a.expires_at)
    assert denied(auth, a) == "revoked"
    assert denied(auth, attenuate(a, ops=["get"])) == "revoked"
    ok(auth, b)
    auth.revocations.revoke_tenant("acme")  # secure clear
    assert denied(auth, b) == "revoked"
    ok(auth, g, tenant="globex")
    clock.advance(0.002)
    ok(auth, auth.mint("acme", "ns1", ["get"]))  # minted after the clear


def test_revocation_export_load_and_prune(clock: FakeClock):
    src = RevocationList(clock=clock)
    src.revoke("id1", until=clock() + 10)
    src.revoke_tenant("acme", before=clock())
    dst = RevocationList(clock=clock)
    dst.load(json.loads(json.dumps(src.export())))
    assert dst.export() == src.export()
    with pytest.raises(CapabilityRequestInvalid):
        dst.load([{"kind": "id", "cap_id": "x", "until": 1}, {"kind": "tenant", "tenant": 5}])
    assert dst.export() == src.export()  # a bad batch changes nothing
    clock.advance(11)
    assert dst.prune(max_ttl=600) == 1
    clock.advance(600)
    assert dst.prune(max_ttl=600) == 1 and dst.export() == []


def test_attenuated_token_works_for_narrower_scope_only(
    auth: CapabilityAuthority, clock: FakeClock
):
    token = auth.mint("acme", "ns1", ["lookup", "get", "put"], ttl=600)
    narrow = attenuate(token, ops=["get", "lookup"], expires_at=clock() + 60, chunks=[H1, H2])
    cap = ok(auth, narrow, "get", chunk=H1)
    assert cap.ops == {"get", "lookup"} and cap.chunks == {H1, H2}
    ok(auth, narrow, "lookup", chunks=[H1, H2])
    assert denied(auth, narrow, "put", chunk=H1) == "operation not granted"
    assert denied(auth, narrow, "get", chunk=H3) == "chunk not granted"
    assert denied(auth, narrow, "lookup", chunks=[H1, H3]) == "chunk not granted"
    assert denied(auth, narrow, "get") == "chunk not granted"  # restricted, no chunk named
    with pytest.raises(CapabilityDenied):
        attenuate(narrow, chunks=[H3])
    narrower = attenuate(narrow, chunks=[H2])
    assert (
        denied(auth, append_caveat(narrower, {"chunks": [H1, H2, H3]}), chunk=H1)
        == "chunk not granted"
    )
    ok(auth, token, "put", chunk=H3)  # the original is untouched
    clock.advance(61)
    assert denied(auth, narrow, chunk=H1) == "expired"
    ok(auth, token, "put")
    with pytest.raises(CapabilityRequestInvalid):
        attenuate(token)


def test_unknown_caveat_denies(auth: CapabilityAuthority):
    token = append_caveat(auth.mint("acme", "ns1", ["get"]), {"tenant": "globex"})
    assert denied(auth, token) == "unknown caveat"


def test_key_rotation(clock: FakeClock):
    auth = CapabilityAuthority({"k1": KEY}, "k1", clock=clock)
    old = auth.mint("acme", "ns1", ["get"])
    ok(auth, old)
    auth.rotate({"k1": KEY, "k2": b"2" * 32}, "k2")
    new = auth.mint("acme", "ns1", ["get"])
    assert new.startswith("kvc1.k2.")
    ok(auth, old), ok(auth, new)
    auth.rotate({"k2": b"2" * 32}, "k2")
    assert denied(auth, old) == "bad tag"
    ok(auth, new)


# ---------------------------------------------------------------- fuzzing and speed


@pytest.fixture(scope="module")
def fuzz_auth() -> CapabilityAuthority:
    return CapabilityAuthority({"k1": KEY}, "k1", cache_size=0)


_VALID = CapabilityAuthority({"k1": KEY}, "k1", max_ttl=86400).mint("acme", "ns1", ["get", "put"])
_VALID = attenuate(_VALID, chunks=[H1])


def _check(auth: CapabilityAuthority, token: Any) -> None:
    for call in (
        lambda: auth.verify(token, tenant="acme", namespace="ns1", op="get", chunk=H1),
        lambda: read_unverified(token),
        lambda: attenuate(token, ops=["get"]),
    ):
        try:
            call()
        except CapabilityDenied:
            pass


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.one_of(
        st.text(max_size=300),
        st.binary(max_size=200).map(lambda b: "kvc1.k1." + b64e(b) + ".AA"),
        st.none(),
        st.integers(),
        st.lists(st.text(), max_size=3),
    )
)
def test_fuzz_arbitrary_input(fuzz_auth: CapabilityAuthority, token: Any):
    _check(fuzz_auth, token)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.integers(0, len(_VALID) - 1), st.sampled_from('.-_=A0z{}"[]\x00é')),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from(["", ".", ".e30", "." + b64e(b'{"ops":[]}'), "." + b64e(b"[1]")]),
)
def test_fuzz_mutated_token(
    fuzz_auth: CapabilityAuthority, edits: list[tuple[int, str]], tail: str
):
    chars = list(_VALID)
    for pos, ch in edits:
        chars[pos] = ch
    _check(fuzz_auth, "".join(chars))
    _check(fuzz_auth, _VALID + tail)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=5),
        max_leaves=20,
    )
)
def test_fuzz_validly_tagged_blocks(fuzz_auth: CapabilityAuthority, value: Any):
    """Blocks that pass the tag check (forged with the key) must still never crash the parser."""
    root = {"exp": 2**40, "iat": 0, "id": "x", "ns": "ns1", "ops": ["get"], "t": "acme"}
    _check(fuzz_auth, forge_root(value if isinstance(value, dict) else {**root, "ops": value}))
    _check(fuzz_auth, append_caveat(forge_root(root), {"chunks": value}))
    if isinstance(value, dict):
        _check(fuzz_auth, append_caveat(forge_root(root), value))


def test_verify_speed(auth: CapabilityAuthority):
    token = attenuate(auth.mint("acme", "ns1", ["get", "put"]), ops=["get"], chunks=[H1, H2])
    cold = CapabilityAuthority({"k1": KEY}, "k1", cache_size=0)

    def per_call(a: CapabilityAuthority) -> float:
        n = 2000
        best = min(
            timeit.repeat(
                lambda: a.verify(token, tenant="acme", namespace="ns1", op="get", chunk=H1),
                number=n,
                repeat=5,
            )
        )
        return best / n * 1e6

    cached, uncached = per_call(auth), per_call(cold)
    print(f"capability verify: cached {cached:.2f} us/call, uncached {uncached:.2f} us/call")
    assert cached < 50
    assert uncached < 200
