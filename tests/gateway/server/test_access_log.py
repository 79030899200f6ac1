"""``KVGATE_ACCESS_LOG``: ``kvgate serve`` writes uvicorn's line per request by default, none
when it is false (the other log lines stay)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.services import free_port


@pytest.mark.parametrize("access_log", ["", "false"])
def test_kvgate_serve_writes_access_lines_unless_told_not_to(tmp_path, access_log):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    env = {**os.environ, "KVGATE_STATE_DIR": str(state), "KVGATE_PUBLIC_URL": url, "KVGATE_TIERS": '["memory"]',
           "KVGATE_MEMORY_BYTES": str(64 << 20)}
    env.pop("KVGATE_DATABASE_URL", None)
    if access_log:
        env["KVGATE_ACCESS_LOG"] = access_log
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(port)], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        assert httpx.get(url + "/readyz", timeout=5).status_code in (200, 503)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    text = log.read_text()
    assert "Application startup complete" in text  # the control: the server's own lines are there
    assert ('"GET /readyz HTTP/1.1"' in text) is (access_log != "false"), text[-2000:]
