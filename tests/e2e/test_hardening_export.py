"""Issue 15, point 7: a tenant's own audit export does not hand it other tenants' principals.
Another tenant's admin probes tenant A; A's admin exports: the probes are there (what was done to
A), but their actor is a keyed pseudonym -- the same within A's export, unrelated to the pseudonym
the same prober gets in tenant C's export -- and the export still verifies offline. The operator's
export keeps the real actor."""

from __future__ import annotations

import json
from pathlib import Path

from audit.verify import verify_export
from tests.support import server_fixture
from tests.support.server_fixture import LiveServer

live_server = server_fixture.live_server  # a fixture, registered in this module

UNTIL = "2999-01-01T00:00:00+00:00"


async def _export(live: LiveServer, http, token: str, tenant: str | None = None) -> tuple[list[dict], str, dict]:
    params = {"until": UNTIL} | ({"tenant": tenant} if tenant else {})
    r = await http.get("/v1/admin/audit/export", params=params, headers=live.headers(token))
    assert r.status_code == 200, r.text
    m = await http.get("/v1/admin/audit/export/manifest", params=params, headers=live.headers(token))
    assert m.status_code == 200, m.text
    return [json.loads(line) for line in r.text.splitlines() if line], r.text, m.json()


async def test_other_tenants_actors_are_pseudonyms_in_a_tenants_export(live_server: LiveServer, tmp_path: Path):
    live = live_server
    async with live.client() as http:
        a, b, c = [await live.create_tenant(http) for _ in range(3)]
        prober = live.token(b, ("kv.admin",), subject="mallory@b.example", client_id="b-tool")
        admin_a = live.token(a, ("kv.admin",), subject="alice@a.example")
        admin_c = live.token(c, ("kv.admin",), subject="carol@c.example")
        for target in (a, a, c):  # B's admin probes A twice and C once: 403s, audited as denials
            assert (await http.post(f"/v1/admin/tenants/{target}/keys/rotate", headers=live.headers(prober))).status_code == 403
        assert (await http.post(f"/v1/admin/tenants/{a}/keys/rotate", headers=live.headers(admin_a))).status_code == 200
        await live.call(live.runtime.audit.flush, 10)

        rows_a, text_a, manifest_a = await _export(live, http, admin_a)
        probes_a = [r for r in rows_a if r["action"] == "authz.denied" and r["target"]["tenant"] == a]
        assert len(probes_a) == 2  # what was done to A is there ...
        assert {json.dumps(r["actor"], sort_keys=True) for r in probes_a} == {json.dumps(probes_a[0]["actor"], sort_keys=True)}
        pseudonym = probes_a[0]["actor"]["subject"]
        assert pseudonym.startswith("pseudonym:")
        assert all(v is None for k, v in probes_a[0]["actor"].items() if k != "subject")
        for secret in ("mallory@b.example", "b-tool", b):  # ... but not who did it (nor where from: source is None)
            assert secret not in text_a, f"{secret!r} is in tenant A's export"
        own = [r for r in rows_a if r["action"] == "key.rotate" and r["target"]["tenant"] == a and r["actor"]["tenant"] == a]
        assert own and own[-1]["actor"]["subject"] == "alice@a.example"  # positive control: A's own principals kept
        assert manifest_a["pseudonymized"] is True

        rows_c, _, _ = await _export(live, http, admin_c)
        probes_c = [r for r in rows_c if r["action"] == "authz.denied" and r["target"]["tenant"] == c]
        assert len(probes_c) == 1 and probes_c[0]["actor"]["subject"].startswith("pseudonym:")
        assert probes_c[0]["actor"]["subject"] != pseudonym  # not linkable across tenants

        # the operator's export (filtered on A or not) keeps the real actor
        rows_op, text_op, manifest_op = await _export(live, http, live.operator_token(), tenant=a)
        assert "mallory@b.example" in text_op and manifest_op["pseudonymized"] is False
        assert any(r["actor"]["subject"] == "mallory@b.example" and r["actor"]["tenant"] == b for r in rows_op)

        # A's export still verifies offline, and a changed pseudonymized row does not
        pub = await http.get("/v1/admin/audit/public-key", headers=live.headers(admin_a))
        (tmp_path / "key.pem").write_bytes(pub.content)
        (tmp_path / "a.jsonl").write_text(text_a)
        (tmp_path / "a.manifest.json").write_text(json.dumps(manifest_a))
        report = verify_export(tmp_path / "a.jsonl", tmp_path / "a.manifest.json", tmp_path / "key.pem")
        assert report.ok, report.problems
        tampered = text_a.replace('"outcome":"denied"', '"outcome":"success"', 1)
        (tmp_path / "a.jsonl").write_text(tampered)
        assert not verify_export(tmp_path / "a.jsonl", tmp_path / "a.manifest.json", tmp_path / "key.pem").ok
