"""Pkcs11Kek against a real SoftHSM2 token: round trip, non-extractable KEK, wrong PIN, a token
that disappears mid-run (loads become misses through the gateway core), KEK rotation in the HSM.

Needs the `softhsm2` Debian package and python-pkcs11; skipped without them, FAILED when CI=true.
SoftHSM2 reads SOFTHSM2_CONF once per process, so every token this module uses is initialised
up front, before the library is loaded.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from crypto.errors import KekError, SigningKeyError
from crypto.kek import Secret
from tests.support.gw import (
    ALL_OPS,
    gateway_runtime,
    gathered,
    model_for,
    random_cache,
    small_geometry,
    zero_cache,
)
from tests.support.softhsm import MODULE_PATHS, _missing

TOKENS = {"kvgate-main": "1111", "kvgate-pin": "2222", "kvgate-gone": "3333", "kvgate-rot": "4444"}
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def hsm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    module = next((p for p in MODULE_PATHS if p and Path(p).is_file()), None)
    util = shutil.which("softhsm2-util")
    if module is None or util is None:
        _missing("SoftHSM2 is not installed")
    if importlib.util.find_spec("pkcs11") is None:
        _missing("python-pkcs11 is not installed")
    root = tmp_path_factory.mktemp("softhsm")
    (root / "tokens").mkdir()
    conf = root / "softhsm2.conf"
    conf.write_text(f"directories.tokendir = {root / 'tokens'}\nobjectstore.backend = file\nlog.level = ERROR\n")
    old = os.environ.get("SOFTHSM2_CONF")
    os.environ["SOFTHSM2_CONF"] = str(conf)
    for label, pin in TOKENS.items():
        subprocess.run(
            [util, "--init-token", "--free", "--label", label, "--pin", pin, "--so-pin", "so-" + pin],
            check=True, capture_output=True, env=os.environ | {"SOFTHSM2_CONF": str(conf)},
        )
    from crypto.kek_pkcs11 import generate_pkcs11_kek

    for label, pin in TOKENS.items():
        generate_pkcs11_kek(module, label, Secret(pin.encode()), "kek-1")
    yield {"module": module, "tokendir": root / "tokens"}
    if old is None:
        os.environ.pop("SOFTHSM2_CONF", None)
    else:
        os.environ["SOFTHSM2_CONF"] = old


def _kek(hsm: dict, token: str = "kvgate-main", label: str = "kek-1", pin: str | None = None):
    from crypto.kek_pkcs11 import Pkcs11Kek

    return Pkcs11Kek(hsm["module"], token, Secret((pin or TOKENS[token]).encode()), label)


def _raw_session(hsm: dict, token: str, rw: bool = False):
    """A raw python-pkcs11 session sharing the login a live provider holds (no PIN, no logout)."""
    import pkcs11

    for slot in pkcs11.lib(hsm["module"]).get_slots():
        try:  # slot by slot: a token another test took away answers with an error
            found = slot.get_token()
        except pkcs11.PKCS11Error:
            continue
        if found.label == token:
            return found.open(rw=rw)
    raise AssertionError(f"token {token} not found")


def _settings(hsm: dict, token: str, label: str = "kek-1") -> dict:
    return {
        "kek_provider": "pkcs11", "pkcs11_module": hsm["module"], "pkcs11_token_label": token,
        "pkcs11_pin": TOKENS[token], "pkcs11_key_label": label,
    }


def test_wrap_unwrap_round_trip(hsm: dict) -> None:
    kek = _kek(hsm)
    dek, ctx = os.urandom(32), b"\x00\x00\x00\x04acme/dek/7"
    wrapped = kek.wrap(dek, ctx)
    assert dek not in wrapped and len(wrapped) == 2 + len("kek-1") + 12 + 32 + 16
    assert kek.unwrap(wrapped, ctx) == dek
    assert kek.key_id == "pkcs11:kvgate-main/kek-1" and kek.key_id_of(wrapped) == kek.key_id
    assert kek.wrap(dek, ctx) != wrapped  # fresh nonce per wrap
    with pytest.raises(KekError):
        kek.unwrap(wrapped, ctx + b"x")  # the context is bound (GCM AAD inside the token)
    for bad in (wrapped[:-1] + bytes([wrapped[-1] ^ 1]), wrapped[:20], b"", b"\x02" + wrapped[1:]):
        with pytest.raises(KekError):
            kek.unwrap(bad, ctx)
    with pytest.raises(KekError):
        kek.wrap(b"", ctx)
    kek.health()
    assert TOKENS["kvgate-main"] not in repr(kek) and "hidden" in repr(kek)


def test_typed_contexts_and_close(hsm: dict) -> None:
    from crypto.contexts import dek_context, lp

    kek = _kek(hsm)
    ctx = dek_context("acme", 7)
    old = kek.wrap(b"k" * 32, lp("kvgate/dek/v1", "acme", 7))  # as tenancy wrapped before crypto.contexts
    assert kek.unwrap(old, ctx) == b"k" * 32
    assert kek.unwrap(kek.wrap(b"j" * 32, ctx), ctx.encode()) == b"j" * 32
    with pytest.raises(KekError):
        kek.unwrap(old, dek_context("acme", 8))
    assert kek.key_id_of(old, ctx) == kek.key_id_of(old) == kek.key_id
    kek.close()
    kek.close()  # idempotent


def test_kek_cannot_be_read_out_of_the_token(hsm: dict) -> None:
    import pkcs11
    from pkcs11 import Attribute, KeyType, ObjectClass

    kek = _kek(hsm)  # holds the login the raw session shares
    session = _raw_session(hsm, "kvgate-main")
    try:
        key = session.get_key(object_class=ObjectClass.SECRET_KEY, key_type=KeyType.AES, label="kek-1")
        assert key[Attribute.SENSITIVE] is True and key[Attribute.EXTRACTABLE] is False
        with pytest.raises(pkcs11.exceptions.AttributeSensitive):
            key[Attribute.VALUE]
    finally:
        session.close()
    kek.health()


def test_extractable_key_is_refused(hsm: dict) -> None:
    from pkcs11 import Attribute, KeyType

    kek = _kek(hsm)
    session = _raw_session(hsm, "kvgate-main", rw=True)
    try:
        session.generate_key(KeyType.AES, 256, label="weak", store=True,
                             template={Attribute.SENSITIVE: False, Attribute.EXTRACTABLE: True})
    finally:
        session.close()
    with pytest.raises(KekError, match="non-extractable"):
        _kek(hsm, label="weak")
    kek.health()


def test_wrong_pin_and_missing_parts_fail_cleanly(hsm: dict) -> None:
    with pytest.raises(KekError, match="wrong PIN"):
        _kek(hsm, "kvgate-pin", pin="0000")  # a real C_Login on a token nobody is logged into
    good = _kek(hsm, "kvgate-pin")  # positive control: the right PIN works
    good.health()
    with pytest.raises(KekError, match="wrong PIN"):
        _kek(hsm, "kvgate-pin", pin="0001")  # refused against the live login too
    with pytest.raises(KekError, match="not found"):
        _kek(hsm, "kvgate-nope", pin="1")
    with pytest.raises(KekError, match="no AES key"):
        _kek(hsm, label="kek-404")
    from crypto.kek_pkcs11 import Pkcs11Kek

    with pytest.raises(KekError, match="cannot load"):
        Pkcs11Kek("/nonexistent/libpkcs11.so", "kvgate-main", Secret(b"1111"))


async def test_rotation_to_a_new_kek_in_the_token(hsm: dict, tmp_path: Path) -> None:
    from crypto.kek_pkcs11 import generate_pkcs11_kek
    from gateway.services.kekrotate import rotate_from_settings
    from tests.support.gw import settings_for

    g = small_geometry()
    model = model_for(g)
    src, blocks, tokens = random_cache(g, NUM_BLOCKS, seed=3), list(range(10)), list(range(40))
    async with gateway_runtime(tmp_path, **_settings(hsm, "kvgate-rot")) as rt:
        for tenant in ("acme", "globex"):
            await rt.admin.create_tenant(tenant)
            await rt.admin.rotate_key(tenant)  # two versions each
            cap = await rt.gateway.mint_capability(tenant, "default", ALL_OPS, 600)
            assert (await rt.gateway.store(cap, model, tokens, src, block_ids=blocks)).stored == 3
    generate_pkcs11_kek(hsm["module"], "kvgate-rot", Secret(TOKENS["kvgate-rot"].encode()), "kek-2")
    new = settings_for(tmp_path, **_settings(hsm, "kvgate-rot", "kek-2"))
    report = await rotate_from_settings(new)
    # three gateway secrets: the namespace master, the capability key, the audit pseudonym secret
    assert report.complete and (report.data_keys, report.secrets, report.salts) == (4, 3, 2)
    again = await rotate_from_settings(new)  # nothing left to do
    assert (again.rewrapped, again.already_current) == (0, 2)
    # the old KEK is gone from the token: everything still opens under kek-2
    kek2 = _kek(hsm, "kvgate-rot", "kek-2")
    session = _raw_session(hsm, "kvgate-rot", rw=True)
    try:
        session.get_key(label="kek-1").destroy()
    finally:
        session.close()
    async with gateway_runtime(tmp_path, **_settings(hsm, "kvgate-rot", "kek-2")) as rt:
        for tenant in ("acme", "globex"):
            keys = await rt.registry.list_keys(tenant)
            assert {k.kek_id for k in keys} == {kek2.key_id}
            cap = await rt.gateway.mint_capability(tenant, "default", ALL_OPS, 600)
            dst = zero_cache(g, NUM_BLOCKS)
            assert (await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=blocks)).loaded_tokens == 40
            assert torch.equal(gathered(src, g, blocks, 40), gathered(dst, g, blocks, 40))


def _token_dir(hsm: dict, label: str) -> Path:
    padded = label.encode().ljust(32)
    for d in hsm["tokendir"].iterdir():
        if padded in (d / "token.object").read_bytes():
            return d
    raise AssertionError(f"no token directory for {label}")


async def test_token_that_disappears_turns_loads_into_misses(hsm: dict, tmp_path: Path) -> None:
    g = small_geometry()
    model = model_for(g)
    async with gateway_runtime(tmp_path, **_settings(hsm, "kvgate-gone")) as rt:
        await rt.admin.create_tenant("acme")
        cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        src, blocks, tokens = random_cache(g, NUM_BLOCKS), list(range(10)), list(range(40))
        assert (await rt.gateway.store(cap, model, tokens, src, block_ids=blocks)).stored == 3
        dst = zero_cache(g, NUM_BLOCKS)
        rt.keyring.forget("acme")
        got = await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=blocks)
        assert got.loaded_tokens == 40  # positive control: the HSM unwraps the DEK again
        assert torch.equal(gathered(src, g, blocks, 40), gathered(dst, g, blocks, 40))

        token_dir = _token_dir(hsm, "kvgate-gone")
        aside = tmp_path / "token-aside"
        token_dir.rename(aside)  # the token goes away mid-run
        try:
            rt.keyring.forget("acme")
            dst = zero_cache(g, NUM_BLOCKS)
            got = await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=blocks)
            assert got.loaded_tokens == 0 and got.unavailable >= 1 and got.integrity_failures == 0
            assert all(not x.any() for x in dst)  # nothing was written into the engine's cache
            assert rt.metrics.key_unavailable >= 1
            got = await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=blocks)  # still a miss
            assert got.loaded_tokens == 0
        finally:
            shutil.move(aside, token_dir)  # SoftHSM lists every token again (other tests need them)


async def test_audit_checkpoints_and_manifests_are_signed_in_the_token(hsm: dict, tmp_path: Path) -> None:
    """Issue 16: the audit signing key is an EC P-256 pair in the KEK's token (SoftHSM2 has
    CKM_ECDSA, not CKM_EDDSA); the private half cannot be read out; what it signs verifies with
    the exported public key, and a whole export verifies against its checkpoint."""
    import pkcs11
    from pkcs11 import Attribute, KeyType, ObjectClass

    from audit import export_to_files, verify_export
    from audit.checkpoint import read_checkpoint
    from audit.signing import ECDSA_P256, load_public_key
    from crypto.signer_pkcs11 import generate_pkcs11_signing_key

    generate_pkcs11_signing_key(hsm["module"], "kvgate-main", Secret(TOKENS["kvgate-main"].encode()), "audit-1")
    with pytest.raises(SigningKeyError, match="already exists"):
        generate_pkcs11_signing_key(hsm["module"], "kvgate-main", Secret(TOKENS["kvgate-main"].encode()), "audit-1")
    settings = _settings(hsm, "kvgate-main") | {"audit_signer": "pkcs11", "audit_pkcs11_key_label": "audit-1"}
    for d in ("state", "state2"):
        (tmp_path / d).mkdir(mode=0o700)
    async with gateway_runtime(tmp_path / "state", **settings) as rt:
        assert rt.signer.algorithm == ECDSA_P256
        session = _raw_session(hsm, "kvgate-main")
        try:
            priv = session.get_key(object_class=ObjectClass.PRIVATE_KEY, key_type=KeyType.EC, label="audit-1")
            assert priv[Attribute.SENSITIVE] is True and priv[Attribute.EXTRACTABLE] is False
            with pytest.raises(pkcs11.exceptions.AttributeSensitive):
                priv[Attribute.VALUE]
        finally:
            session.close()
        await rt.admin.create_tenant("acme")
        cp = await rt.checkpointer.checkpoint()
        pub = tmp_path / "audit_public.pem"
        pub.write_bytes(rt.signer.public_key_pem())
        kept = rt.checkpointer.directory.files()[0]
        out, man = tmp_path / "a.jsonl", tmp_path / "a.jsonl.manifest.json"
        await rt.audit.flush(10)
        await export_to_files(rt.audit.store, rt.signer, out, man)
    assert read_checkpoint(kept, load_public_key(pub)).root_hash == cp.root_hash
    report = verify_export(out, man, pub, [kept])
    assert report.ok and report.manifest["signature_algorithm"] == ECDSA_P256, report.problems
    missing_key = _settings(hsm, "kvgate-main") | {"audit_signer": "pkcs11", "audit_pkcs11_key_label": "nope"}
    from audit import AuditKeyError

    with pytest.raises(AuditKeyError, match="no EC P-256 key pair labelled 'nope' in PKCS#11 token 'kvgate-main'"):
        async with gateway_runtime(tmp_path / "state2", **missing_key):
            pass


def test_the_cli_names_a_missing_audit_signing_key_not_the_kek(hsm: dict, tmp_path: Path) -> None:
    """An operator whose token holds the KEK but not the audit signing key runs `kvgate audit
    export`: the one line names the audit key pair (label, token, module), the setting that names
    it and the fix, not the KEK. Control: once the pair is generated, the same command exports."""
    import sys

    from crypto.signer_pkcs11 import generate_pkcs11_signing_key

    env = {
        **os.environ, "KVGATE_STATE_DIR": str(tmp_path / "state"), "KVGATE_KEK_PROVIDER": "pkcs11",
        "KVGATE_PKCS11_MODULE": hsm["module"], "KVGATE_PKCS11_TOKEN_LABEL": "kvgate-main",
        "KVGATE_PKCS11_PIN": TOKENS["kvgate-main"], "KVGATE_PKCS11_KEY_LABEL": "kek-1",
        "KVGATE_AUDIT_SIGNER": "pkcs11", "KVGATE_AUDIT_PKCS11_KEY_LABEL": "cli-audit", "COLUMNS": "200",
    }
    env.pop("KVGATE_DEBUG", None)

    def kvgate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True, env=env,
                              timeout=120)

    assert kvgate("migrate").returncode == 0
    out = tmp_path / "audit.jsonl"
    missing = kvgate("audit", "export", "-o", str(out))
    lines = [ln for ln in missing.stderr.splitlines() if ln.strip()]
    assert missing.returncode == 2 and len(lines) == 1, missing.stderr
    for needle in ("audit signing key", "'cli-audit'", "'kvgate-main'", hsm["module"],
                   "KVGATE_AUDIT_PKCS11_KEY_LABEL", "generate_pkcs11_signing_key"):
        assert needle in lines[0], lines[0]
    assert "key-encryption key" not in lines[0]
    generate_pkcs11_signing_key(hsm["module"], "kvgate-main", Secret(TOKENS["kvgate-main"].encode()), "cli-audit")
    done = kvgate("audit", "export", "-o", str(out))
    assert done.returncode == 0 and out.exists(), done.stderr
