"""The HSM holding the KEK and the audit signing key goes away under a production ``kvgate
serve`` and comes back (SoftHSM2, its token directory moved aside and back, as the soak's KEK
outage does). While it is away a checkpoint, an export manifest and a key rotation are each a 503
with Retry-After on a connection that stays usable (an outage, never a 500 that drops
keep-alive); once it is back the same requests on the same connection succeed, without a restart.

The token is set up in subprocesses only: SoftHSM2 reads SOFTHSM2_CONF once per process."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.support.killed_server import ServeProcess
from tests.support.oidc_issuer import LocalIssuer
from tests.support.softhsm import token_dir, token_in_subprocesses

pytestmark = [pytest.mark.slow]


class HsmServe(ServeProcess):
    def __init__(self, state_dir: Path, hsm: dict[str, str], issuer: LocalIssuer) -> None:
        super().__init__(state_dir, f"sqlite+aiosqlite:///{state_dir.parent / 'kvgate.db'}")
        self.extra = {
            **hsm, "KVGATE_PKCS11_PIN": "1111", "KVGATE_MODE": "production", "KVGATE_AUDIT_SIGNER": "pkcs11",
            "KVGATE_AUDIT_PKCS11_KEY_LABEL": "audit-1", "KVGATE_DEV_ISSUER": "false",
            "KVGATE_ISSUERS": json.dumps([{"issuer": issuer.issuer, "audience": "kvgate"}]),
            "KVGATE_AUDIT_CHECKPOINT_INTERVAL_S": "0",
        }

    def env(self) -> dict[str, str]:
        return {**super().env(), **self.extra}


def _port_of(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_signer_outage_is_503_on_a_usable_connection_then_signs_again(tmp_path: Path) -> None:
    hsm = token_in_subprocesses(tmp_path / "hsm", "kvgate", signing_label="audit-1")
    where = token_dir(tmp_path / "hsm" / "tokens", "kvgate")
    with LocalIssuer() as issuer:
        issuer.add_key("k1", "EC")
        op = issuer.sign("k1", issuer.claims(tenant="platform", roles=["kv.operator"]))
        server = HsmServe(tmp_path / "state", hsm, issuer)
        server.start()
        try:
            limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
            with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {op}"}, timeout=60,
                              limits=limits) as http:
                assert http.post("/v1/admin/tenants", json={"tenant": "acme"}).status_code == 201
                assert http.post("/v1/admin/tenants/acme/keys/rotate").status_code == 200  # the KEK wraps
                r = http.post("/v1/admin/audit/checkpoints")
                assert r.status_code == 201, r.text  # the control: the token signs
                port = _port_of(r)
                aside = tmp_path / "token-aside"
                where.rename(aside)
                try:
                    for _ in range(2):  # twice: the first failure must not poison the next
                        r = http.post("/v1/admin/audit/checkpoints")
                        assert r.status_code == 503, (r.status_code, r.text)
                        assert r.headers["content-type"].startswith("application/problem+json")
                        assert int(r.headers["retry-after"]) > 0
                        assert "audit signer" in r.json()["detail"]
                        assert _port_of(r) == port, "the keep-alive connection was dropped"
                    r = http.get("/v1/admin/audit/export/manifest", params={"until": "2999-01-01T00:00:00+00:00"})
                    assert r.status_code == 503, (r.status_code, r.text)
                    r = http.post("/v1/admin/tenants/acme/keys/rotate")  # a new data key to wrap
                    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0, (r.status_code, r.text)
                    assert _port_of(r) == port
                finally:
                    shutil.move(aside, where)
                for path in ("/v1/admin/audit/checkpoints", "/v1/admin/tenants/acme/keys/rotate"):
                    deadline = time.monotonic() + 30  # the provider logs in again at most once a second
                    while (r := http.post(path)).status_code not in (200, 201):
                        assert r.status_code == 503 and time.monotonic() < deadline, (path, r.status_code, r.text)
                        time.sleep(0.2)
                    assert _port_of(r) == port
        finally:
            server.stop()
