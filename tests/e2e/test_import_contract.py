"""The control plane never loads torch, and the auditor's tool never loads SQLAlchemy
(DESIGN section 3). Checked at run time in a fresh interpreter, because the core loads the data
path lazily: a static import graph cannot tell a lazy import from an eager one.
(`lint-imports`, run by .ci/run, checks the package rules on the static graph.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO

ROOT = REPO


def _run(code: str, tmp_path: Path, **env: str) -> dict:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "KVGATE_STATE_DIR": str(tmp_path / "state"), **env}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=environ, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_rest_server_serves_without_torch(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVGATE_STATE_DIR": str(tmp_path / "state")}
    done = subprocess.run([sys.executable, "-m", "gateway", "migrate"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = _run(
        """
import json, sys
from fastapi.testclient import TestClient
from gateway.config import Settings
from gateway.server.app import create_app
with TestClient(create_app(Settings())) as client:
    health = client.get("/healthz").status_code
    ready = client.get("/readyz").status_code
    spec = client.get("/openapi.json").status_code
print(json.dumps({"codes": [health, ready, spec], "torch": "torch" in sys.modules,
                  "triton": "triton" in sys.modules}))
""",
        tmp_path,
    )
    assert got["codes"] == [200, 200, 200]  # positive control: it really started and served
    assert not got["torch"] and not got["triton"]


def test_the_data_path_does_load_torch(tmp_path: Path) -> None:
    """The probe can see torch when it is there (the other tests' negative is meaningful)."""
    got = _run("import json, sys, gateway.datapath.plane; print(json.dumps({'torch': 'torch' in sys.modules}))", tmp_path)
    assert got["torch"]


@pytest.mark.slow
def test_audit_verify_loads_neither_torch_nor_sqlalchemy(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVGATE_STATE_DIR": str(tmp_path / "state")}
    for argv in (["tenants", "create", "acme"],
                 ["audit", "export", "-o", str(tmp_path / "a.jsonl"), "--public-key", str(tmp_path / "pub.pem")]):
        done = subprocess.run([sys.executable, "-m", "gateway", *argv], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    got = _run(
        f"""
import json, sys
from gateway.cli.main import main
sys.argv = ["kvgate", "audit", "verify", {str(tmp_path / "a.jsonl")!r}, "--public-key", {str(tmp_path / "pub.pem")!r}]
try:
    main()
except SystemExit as exc:
    code = exc.code
print(json.dumps({{"code": code, "torch": "torch" in sys.modules, "sqlalchemy": "sqlalchemy" in sys.modules}}))
""",
        tmp_path,
    )
    assert got["code"] in (0, None)  # it verified (the export is real)
    assert not got["torch"] and not got["sqlalchemy"]
