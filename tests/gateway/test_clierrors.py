"""Every CLI failure is one line on stderr with the cause and the fix, exit code 2, never a
traceback; ``--debug`` shows the traceback. Real subprocesses, real services stopped
or absent, beside a positive control where one makes sense."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.services import free_port

KVGATE = [sys.executable, "-m", "gateway"]


def run(state: Path, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    e = {**os.environ, "KVGATE_STATE_DIR": str(state), "COLUMNS": "200", **(env or {})}
    e.pop("KVGATE_DEBUG", None)
    return subprocess.run([*KVGATE, *args], capture_output=True, text=True, env=e, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def closed_port() -> int:
    return free_port()  # nothing listens there


def test_audit_export_on_a_fresh_state_dir(tmp_path):
    one_line_error(run(tmp_path / "fresh", "audit", "export", "-o", str(tmp_path / "a.jsonl")), "kvgate migrate")


def test_audit_export_into_a_missing_directory(tmp_path):
    assert run(tmp_path, "migrate").returncode == 0
    line = one_line_error(run(tmp_path, "audit", "export", "--output", str(tmp_path / "nodir" / "a.jsonl")), "nodir")
    assert "no such file or directory" in line


def test_a_tenant_created_twice_is_named_as_such_not_as_a_database_failure(tmp_path):
    assert run(tmp_path, "migrate").returncode == 0
    assert run(tmp_path, "tenants", "create", "acme").returncode == 0  # positive control
    line = one_line_error(run(tmp_path, "tenants", "create", "acme"), "tenant exists")
    assert "database" not in line, line


def test_bad_setting_names_the_setting(tmp_path):
    one_line_error(run(tmp_path, "tenants", "list", env={"KVGATE_TIERS": '["tape"]'}), "configuration error", "tiers")


def test_unreachable_postgres(tmp_path):
    url = f"postgresql+asyncpg://kvgate:s3cret@127.0.0.1:{closed_port()}/kvgate"
    line = one_line_error(run(tmp_path, "tenants", "list", env={"KVGATE_DATABASE_URL": url}), "database")
    assert "s3cret" not in line  # the password never reaches the terminal


def test_unreachable_redis_tier(tmp_path):
    env = {"KVGATE_TIERS": '["memory","redis"]', "KVGATE_REDIS_URL": f"redis://127.0.0.1:{closed_port()}/0"}
    one_line_error(run(tmp_path, "tenants", "list", env=env), "redis")


def test_missing_pkcs11_module(tmp_path):
    env = {"KVGATE_KEK_PROVIDER": "pkcs11", "KVGATE_PKCS11_MODULE": str(tmp_path / "nope.so"),
           "KVGATE_PKCS11_TOKEN_LABEL": "t", "KVGATE_PKCS11_PIN": "1234"}
    one_line_error(run(tmp_path, "tenants", "list", env=env))


def test_audit_verify_missing_files(tmp_path):
    one_line_error(run(tmp_path, "audit", "verify", str(tmp_path / "none.jsonl"), "--public-key", str(tmp_path / "k.pem")), "none")


def test_debug_shows_the_traceback(tmp_path):
    proc = run(tmp_path, "--debug", "tenants", "list", env={"KVGATE_DATABASE_URL": f"postgresql+asyncpg://x@127.0.0.1:{closed_port()}/x"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_serve_on_a_busy_port(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        one_line_error(run(tmp_path, "serve", "--port", str(port)), "--port")


@pytest.mark.slow
def test_token_mint_follows_the_running_server_and_401_says_why(tmp_path):
    """`kvgate serve --port P` on a fresh state dir (it migrates SQLite itself); `token mint` in
    another process issues tokens that server accepts; a bad token's 401 is explained in its log."""
    port = free_port()
    env = {**os.environ, "KVGATE_STATE_DIR": str(tmp_path)}
    env.pop("KVGATE_PUBLIC_URL", None)
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([*KVGATE, "serve", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        info = json.loads((tmp_path / "server.json").read_text())
        assert info["public_url"] == base and info["pid"] == proc.pid
        token = run(tmp_path, "token", "mint", "--tenant", "acme", "--roles", "kv.operator").stdout.strip()
        ok = httpx.post(base + "/v1/admin/tenants", json={"tenant": "acme"}, headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 201, ok.text  # the minted token's issuer is this server's
        bad = httpx.get(base + "/v1/admin/audit/export", headers={"Authorization": f"Bearer {token[:-4]}AAAA"})
        assert bad.status_code == 401
        time.sleep(0.3)
        text = (tmp_path / "serve.log").read_text()
        assert "401 from 127.0.0.1: " in text and token[:-4] not in text
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert not (tmp_path / "server.json").exists()  # unpublished at shutdown


@pytest.fixture(params=["sqlite", "postgres"])
def registry_elsewhere(request, tmp_path) -> dict[str, str]:
    """KVGATE_DATABASE_URL of a registry set up (migrated, one tenant) from ``tmp_path / "real"``."""
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'real' / 'kvgate.db'}"
    else:
        url = request.getfixturevalue("fresh_pg_url")
    env = {"KVGATE_DATABASE_URL": url}
    assert run(tmp_path / "real", "migrate", env=env).returncode == 0
    made = run(tmp_path / "real", "tenants", "create", "acme", env=env)
    assert made.returncode == 0, made.stderr
    return env


def test_a_wrong_state_dir_is_refused_without_creating_a_kek(tmp_path, registry_elsewhere):
    """The operator points a command at another state directory than the one whose KEK wrapped
    the registry's keys: refused, naming the state dir, the KEK file, the registry and the fix;
    no KEK file is created there. Control: the right state directory lists the tenant."""
    real, wrong = tmp_path / "real", tmp_path / "wrong"
    ok = run(real, "tenants", "list", env=registry_elsewhere)
    assert ok.returncode == 0 and "acme" in ok.stdout, ok.stderr
    line = one_line_error(
        run(wrong, "tenants", "list", env=registry_elsewhere),
        f"state directory {wrong}", str(wrong / "kek.key"), "does not exist", "KVGATE_STATE_DIR", "by local:",
    )
    assert "key-encryption key is not usable" not in line
    assert not (wrong / "kek.key").exists()
    one_line_error(run(wrong, "keys", "rotate-kek", env=registry_elsewhere), str(wrong / "kek.key"), "does not exist")
    assert not (wrong / "kek.key").exists()  # a rotation onto a new key file needs --from-kek-file
    url = registry_elsewhere["KVGATE_DATABASE_URL"]
    assert url.split("@")[-1] in line  # the registry it found (a URL without its password)


def test_a_kek_file_that_wrapped_none_of_the_registrys_keys_is_refused(tmp_path, registry_elsewhere):
    """A key file already in the wrong state directory (an earlier silent creation) is named with
    its KEK id beside the registry's; the registry is left as it was."""
    wrong = tmp_path / "wrong"
    wrong.mkdir(mode=0o700)
    (wrong / "kek.key").write_bytes(os.urandom(32))
    (wrong / "kek.key").chmod(0o600)
    line = one_line_error(
        run(wrong, "tenants", "list", env=registry_elsewhere),
        str(wrong / "kek.key"), "holds KEK local:", "wrapped by another", "KVGATE_STATE_DIR",
    )
    assert "key-encryption key is not usable" not in line
    again = run(tmp_path / "real", "tenants", "list", env=registry_elsewhere)
    assert again.returncode == 0 and "acme" in again.stdout


def test_a_registry_whose_kek_file_is_gone_is_not_given_a_new_one(tmp_path):
    """The state directory's own registry without its kek.key: refused with the path to restore;
    control: a fresh state directory creates its KEK file on first use."""
    assert run(tmp_path, "tenants", "create", "acme").returncode == 0
    assert (tmp_path / "kek.key").exists()
    (tmp_path / "kek.key").rename(tmp_path.parent / f"{tmp_path.name}-kek.key")
    one_line_error(run(tmp_path, "tenants", "list"), str(tmp_path / "kek.key"), "does not exist", "KVGATE_KEK_FILE")
    assert not (tmp_path / "kek.key").exists()
