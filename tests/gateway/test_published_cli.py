"""``kvgate prefixes``, run as a real subprocess against a fresh state directory."""

from __future__ import annotations

import json

from tests.gateway.test_cli import run


def test_published_prefixes_from_the_command_line(tmp_path):
    for t in ("acme", "globex"):
        run(tmp_path, "tenants", "create", t)
    out = json.loads(run(tmp_path, "prefixes", "scope-create", "team", "--member", "acme").stdout)
    assert out == {"scope": "team", "everyone": False, "members": ["acme"]}
    assert "added to" in run(tmp_path, "prefixes", "scope-add", "team", "globex").stdout
    assert "acme, globex" in run(tmp_path, "prefixes", "scopes").stdout
    # a scope's owner is never a tenant: the tenant list does not show it
    assert "scope:" not in run(tmp_path, "tenants", "list").stdout
    tokens = ",".join(str(t) for t in range(300, 300 + 600))  # two whole chunks of 256, and 88 tokens
    got = json.loads(run(tmp_path, "prefixes", "publish", "team", "--model", "m", "--tokens", tokens).stdout)
    assert got["whole_chunks"] == 2 and got["capability"].startswith("kvc1.") and got["num_tokens"] == 600
    listed = run(tmp_path, "prefixes", "list").stdout
    assert got["id"] in listed and "active" in listed
    revoked = json.loads(run(tmp_path, "prefixes", "revoke", got["id"]).stdout)
    assert revoked["scope_shredded"] is True and revoked["destroyed_key_versions"]
    assert "revoked" in run(tmp_path, "prefixes", "list", "--scope", "team").stdout
    # refusals: one line, exit 2, no traceback
    for args in (("prefixes", "revoke", got["id"]), ("prefixes", "scope-create", "team"),
                 ("prefixes", "publish", "no-such", "--model", "m", "--tokens", tokens),
                 ("prefixes", "scope-create", "Bad:Name")):
        proc = run(tmp_path, *args, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert "removed from" in run(tmp_path, "prefixes", "scope-remove", "team", "acme").stdout
