"""`kvgate doctor` against a healthy setup (Postgres, Redis, a KEK, a real OIDC issuer over
HTTP) and against each broken dependency: a stopped Postgres and a killed Redis of the test's
own, a wrong PKCS#11 PIN (SoftHSM2), an unreachable issuer. Each broken run names the failing
row, with its fix, and exits 1; the healthy run is the positive control (exit 0)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.oidc_issuer import LocalIssuer
from tests.support.paths import REPO
from tests.support.redis_server import Server
from tests.support.services import REDIS_URL, _need, free_port
from tests.support.softhsm import token_in_subprocesses

pytestmark = [pytest.mark.slow]
KVGATE = [sys.executable, "-m", "gateway"]


def doctor(state: Path, env: dict[str, str]) -> tuple[int, dict[str, tuple[str, str]], str]:
    e = {**os.environ, "KVGATE_STATE_DIR": str(state), "COLUMNS": "250", **env}
    proc = subprocess.run([*KVGATE, "doctor"], capture_output=True, text=True, env=e, timeout=120)
    rows: dict[str, tuple[str, str]] = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if len(cells) == 4 and cells[1] in ("ok", "warn", "FAIL"):
            rows[cells[0]] = (cells[1], cells[3])
    return proc.returncode, rows, proc.stdout + proc.stderr


def migrate(state: Path, env: dict[str, str]) -> None:
    e = {**os.environ, "KVGATE_STATE_DIR": str(state), **env}
    for args in (["migrate"], ["tenants", "create", "acme"]):  # the KEK file and secrets exist after
        subprocess.run([*KVGATE, *args], check=True, capture_output=True, env=e, timeout=120)


@pytest.fixture
def issuer():
    with LocalIssuer() as iss:
        iss.add_key("k1")
        yield iss


def _issuers(url: str) -> str:
    return json.dumps([{"issuer": url, "audience": "kvgate"}])


def test_healthy_then_postgres_stopped(tmp_path, issuer, pg_cluster):
    _need("Redis", REDIS_URL, 6379)
    pg = pg_cluster
    env = {"KVGATE_DATABASE_URL": pg.url, "KVGATE_REDIS_URL": REDIS_URL, "KVGATE_ISSUERS": _issuers(issuer.issuer),
           "KVGATE_DEV_ISSUER": "false"}
    migrate(tmp_path, env)
    code, rows, out = doctor(tmp_path, env)
    assert code == 0, out  # positive control
    for name in ("settings", "database", "redis", "kek", f"oidc: {issuer.issuer}"):
        assert rows[name][0] == "ok", (name, out)
    pg.stop()
    code, rows, out = doctor(tmp_path, env)
    assert code == 1 and rows["database"][0] == "FAIL" and "KVGATE_DATABASE_URL" in rows["database"][1], out
    assert rows["redis"][0] == "ok" and rows["kek"][0] == "ok"  # the rest still fine


def test_redis_killed(tmp_path):
    srv = Server()
    srv.start()
    env = {"KVGATE_REDIS_URL": srv.url}
    migrate(tmp_path, {})
    try:
        code, rows, out = doctor(tmp_path, env)
        assert code == 0 and rows["redis"][0] == "ok", out
        srv.kill()
        code, rows, out = doctor(tmp_path, env)
        assert code == 1 and rows["redis"][0] == "FAIL" and "KVGATE_REDIS_URL" in rows["redis"][1], out
        assert rows["database"][0] == "ok"
    finally:
        srv.kill()


def test_unmigrated_postgres_names_kvgate_migrate(tmp_path, fresh_pg_url):
    code, rows, out = doctor(tmp_path, {"KVGATE_DATABASE_URL": fresh_pg_url})
    assert code == 1 and rows["database"] == ("FAIL", "kvgate migrate"), out


def _own_token(root: Path) -> dict[str, str]:
    return token_in_subprocesses(root, "doctor")


def test_wrong_kek_pin(tmp_path):
    base = _own_token(tmp_path / "hsm")
    code, rows, out = doctor(tmp_path / "state", {**base, "KVGATE_PKCS11_PIN": "1111"})
    assert rows["kek"][0] == "ok", out  # the right PIN: a round trip through the HSM
    code, rows, out = doctor(tmp_path / "state", {**base, "KVGATE_PKCS11_PIN": "0000"})
    assert code == 1 and rows["kek"][0] == "FAIL" and "KVGATE_PKCS11_PIN" in rows["kek"][1], out
    assert "0000" not in out  # the PIN is never printed


def test_an_hsm_audit_signing_key_is_checked_in_the_hsm_not_as_a_local_file(tmp_path):
    base = {**_own_token(tmp_path / "hsm"), "KVGATE_PKCS11_PIN": "1111", "KVGATE_AUDIT_SIGNER": "pkcs11"}
    code, rows, out = doctor(tmp_path / "state", base)
    assert rows["kek"][0] == "ok", out
    # no EC key pair in the token yet: the row says so and names the setting, not the KEK
    assert code == 1 and rows["signing key"][0] == "FAIL", out
    assert "KVGATE_AUDIT_PKCS11_KEY_LABEL" in out and "kvgate-audit-1" in out, out
    assert "permissions: audit key" not in out  # no local PEM is looked for
    env = {**os.environ, "SOFTHSM2_CONF": base["SOFTHSM2_CONF"]}
    subprocess.run([sys.executable, "-c", "from crypto.kek import Secret; "
                    "from crypto.signer_pkcs11 import generate_pkcs11_signing_key; "
                    f"generate_pkcs11_signing_key({base['KVGATE_PKCS11_MODULE']!r}, 'doctor', Secret(b'1111'), 'kvgate-audit-1')"],
                   check=True, capture_output=True, env=env, cwd=str(REPO))
    code, rows, out = doctor(tmp_path / "state", base)
    assert rows["signing key"][0] == "ok" and "pkcs11: key" in out, out  # the control


def test_unreachable_issuer(tmp_path, issuer):
    ok = {"KVGATE_ISSUERS": _issuers(issuer.issuer), "KVGATE_DEV_ISSUER": "false"}
    code, rows, out = doctor(tmp_path, ok)
    assert rows[f"oidc: {issuer.issuer}"][0] == "ok", out
    gone = f"http://127.0.0.1:{free_port()}/realms/acme"
    code, rows, out = doctor(tmp_path, {"KVGATE_ISSUERS": _issuers(gone), "KVGATE_DEV_ISSUER": "false"})
    assert code == 1 and rows[f"oidc: {gone}"][0] == "FAIL", out


def test_bad_settings_is_one_failed_row(tmp_path):
    code, rows, out = doctor(tmp_path, {"KVGATE_TIERS": '["tape"]'})
    assert code == 1 and rows["settings"][0] == "FAIL" and "Traceback" not in out, out


def test_redis_cluster_url(tmp_path, redis_cluster):
    """A cluster URL is checked as a cluster (its state and masters), and a dead seed list fails."""
    migrate(tmp_path, {})
    code, rows, out = doctor(tmp_path, {"KVGATE_REDIS_URL": redis_cluster.url})
    assert code == 0 and rows["redis"][0] == "ok" and "cluster_state ok, 3 masters" in out, out  # positive control
    dead = f"redis+cluster://127.0.0.1:{free_port()}"
    code, rows, out = doctor(tmp_path, {"KVGATE_REDIS_URL": dead})
    assert code == 1 and rows["redis"][0] == "FAIL" and "KVGATE_REDIS_URL" in rows["redis"][1], out


def test_an_80_column_terminal_shows_the_whole_redis_row(tmp_path):
    """On an 80-column terminal a six-seed cluster URL folds onto the next lines of its cell
    instead of being cut; the whole URL and the fix are there (a 250-column run is the control)."""
    seeds = ",".join(f"127.0.0.1:{free_port()}" for _ in range(6))
    url = f"redis+cluster://{seeds}"
    env = {**os.environ, "KVGATE_STATE_DIR": str(tmp_path), "KVGATE_REDIS_URL": url}
    for columns in ("250", "80"):
        out = subprocess.run([*KVGATE, "doctor"], capture_output=True, text=True, timeout=120,
                             env={**env, "COLUMNS": columns}).stdout
        cells: dict[str, list[str]] = {}
        row = ""
        for line in out.splitlines():
            parts = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
            if len(parts) != 4:
                continue
            row = parts[0] or row
            cells.setdefault(row, []).append(parts[2] + "\0" + parts[3])
        detail = "".join(c.split("\0")[0] for c in cells["redis"])
        fix = " ".join(c.split("\0")[1] for c in cells["redis"])
        assert url in detail and "…" not in detail, (columns, out)
        assert "KVGATE_REDIS_URL" in fix, (columns, out)
