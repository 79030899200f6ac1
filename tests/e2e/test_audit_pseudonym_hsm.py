"""A tenant admin exports its own audit log from a real ``kvgate serve`` whose KEK and audit
signer live in a PKCS#11 token (SoftHSM2): the export is served (200, not 422), other tenants'
actors are pseudonyms, the manifest verifies with the token's public key, and the pseudonym is
the same after a restart and on a second replica sharing the database (the pseudonym secret is
KEK-wrapped in the registry, not derived from the signer). The operator's export is the control.

The token is set up in subprocesses only: SoftHSM2 reads SOFTHSM2_CONF once per process.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from audit.verify import verify_export
from tests.support.killed_server import ServeProcess
from tests.support.softhsm import token_in_subprocesses

UNTIL = "2999-01-01T00:00:00+00:00"


def _token(root: Path) -> dict[str, str]:
    """A SoftHSM2 token with a KEK and an audit key pair; the server settings that name them."""
    return {
        **token_in_subprocesses(root, "kvgate", signing_label="audit-1"), "KVGATE_PKCS11_PIN": "1111",
        "KVGATE_AUDIT_SIGNER": "pkcs11", "KVGATE_AUDIT_PKCS11_KEY_LABEL": "audit-1",
    }


class HsmServe(ServeProcess):
    def __init__(self, state_dir: Path, db_url: str, hsm: dict[str, str]) -> None:
        super().__init__(state_dir, db_url)
        self.hsm = hsm

    def env(self) -> dict[str, str]:
        return {**super().env(), **self.hsm}


def _h(server: ServeProcess, tenant: str, role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.token(tenant, (role,))}"}


async def _export(server: ServeProcess, headers: dict[str, str], tmp: Path, name: str) -> tuple[list[dict], str]:
    """GET the export and its manifest as an admin would, and verify them offline."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        r = await http.get("/v1/admin/audit/export", params={"until": UNTIL}, headers=headers)
        assert r.status_code == 200, (r.status_code, r.text)
        m = await http.get("/v1/admin/audit/export/manifest", params={"until": UNTIL}, headers=headers)
        assert m.status_code == 200, m.text
        pub = await http.get("/v1/admin/audit/public-key", headers=headers)
    (tmp / f"{name}.jsonl").write_text(r.text)
    (tmp / f"{name}.manifest.json").write_text(m.text)
    (tmp / f"{name}.pem").write_bytes(pub.content)
    report = verify_export(tmp / f"{name}.jsonl", tmp / f"{name}.manifest.json", tmp / f"{name}.pem")
    assert report.ok and m.json()["signature_algorithm"] == "ECDSA-P256-SHA256", report.problems
    return [json.loads(line) for line in r.text.splitlines() if line], r.text


def _probe_actors(rows: list[dict], tenant: str) -> set[str]:
    return {r["actor"]["subject"] for r in rows if r["action"] == "authz.denied" and r["target"]["tenant"] == tenant}


@pytest.mark.slow
async def test_tenant_admin_exports_its_log_with_an_hsm_signer_and_stable_pseudonyms(tmp_path: Path) -> None:
    hsm = _token(tmp_path / "hsm")
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}"
    server = HsmServe(tmp_path / "state-1", db_url, hsm)
    server.start()
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            for t in ("acme", "globex"):
                r = await http.post("/v1/admin/tenants", json={"tenant": t}, headers=_h(server, "platform", "kv.operator"))
                assert r.status_code == 201, r.text
            # globex's admin probes acme: a refusal audited on acme's side
            r = await http.post("/v1/admin/tenants/acme/keys/rotate", headers=_h(server, "globex", "kv.admin"))
            assert r.status_code == 403, r.text
        rows, text = await _export(server, _h(server, "acme", "kv.admin"), tmp_path, "first")
        (pseudonym,) = _probe_actors(rows, "acme")
        assert pseudonym.startswith("pseudonym:") and "globex" not in text
        op_rows, _ = await _export(server, _h(server, "platform", "kv.operator"), tmp_path, "operator")
        assert any(r["actor"]["tenant"] == "globex" for r in op_rows if r["action"] == "authz.denied")  # control
        server.stop()
        server.start()  # a restart: the same pseudonym
        rows, _ = await _export(server, _h(server, "acme", "kv.admin"), tmp_path, "restarted")
        assert _probe_actors(rows, "acme") == {pseudonym}
    finally:
        server.stop()
    replica = HsmServe(tmp_path / "state-2", db_url, hsm)  # another replica on the same registry
    replica.start()
    try:
        rows, _ = await _export(replica, _h(replica, "acme", "kv.admin"), tmp_path, "replica")
        assert _probe_actors(rows, "acme") == {pseudonym}
    finally:
        replica.stop()
