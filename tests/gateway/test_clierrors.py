"""Every CLI failure is one line on stderr with the cause and the fix, exit code 2, never a
traceback (issue 22); ``--debug`` shows the traceback. Real subprocesses, real services stopped
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
