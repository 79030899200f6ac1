"""SIGTERM to ``kvgate serve`` with a request in flight, as an operator's orchestrator sends it.

The server stops taking connections at once, lets the request in flight finish (its body arrives
after the signal and it is answered), writes the audit events it emitted, withdraws its published
URL and exits 0. A request that does not finish within ``KVGATE_SHUTDOWN_TIMEOUT_S`` is cut at
that deadline, and the server still exits 0 with its events written.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.services import free_port

pytestmark = [pytest.mark.slow]


class Serve:
    def __init__(self, tmp: Path, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = tmp / "state"
        self.state.mkdir(mode=0o700)
        self.env = {**os.environ, "KVGATE_STATE_DIR": str(self.state), "KVGATE_PUBLIC_URL": self.url,
                    "KVGATE_TIERS": '["memory"]', "KVGATE_MEMORY_BYTES": str(64 << 20), **env}
        self.env.pop("KVGATE_DATABASE_URL", None)
        self.log = tmp / "serve.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(self.port)],
                                         env=self.env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.tail()
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, self.tail()
            time.sleep(0.1)

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def cli(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "gateway", *args], env=self.env, capture_output=True,
                              text=True, timeout=120, check=True)
        return done.stdout.strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def _half_sent_mint(s: Serve, token: str, namespace: str) -> tuple[socket.socket, bytes]:
    """A capability request whose head and first half of the body are sent; the rest is returned."""
    body = json.dumps({"namespace": namespace, "ops": ["lookup"]}).encode()
    head = (f"POST /v1/capabilities HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=30)
    sock.sendall(head + body[: len(body) // 2])
    # the server has read that head once it answers a request sent after it (one event loop, in
    # order): until then the connection is idle to it, and a shutdown closes an idle connection
    assert httpx.get(s.url + "/healthz", timeout=10).status_code == 200
    return sock, body[len(body) // 2 :]


def _status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


def _refused(url: str) -> bool:
    try:
        httpx.get(url + "/healthz", timeout=1)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def _mints(state: Path) -> int:
    with sqlite3.connect(state / "kvgate.db") as db:
        return int(db.execute("select count(*) from kv_audit_events where action = 'capability.mint'").fetchone()[0])


def _prepare(s: Serve) -> str:
    op = s.cli("token", "mint", "--tenant", "platform", "--roles", "kv.operator")
    r = httpx.post(s.url + "/v1/admin/tenants", json={"tenant": "acme"}, headers={"Authorization": f"Bearer {op}"},
                   timeout=30)
    assert r.status_code == 201, r.text
    return s.cli("token", "mint", "--tenant", "acme", "--roles", "kv.worker")


def test_graceful_sigterm_finishes_the_request_in_flight_then_exits_0(tmp_path: Path):
    s = Serve(tmp_path, KVGATE_SHUTDOWN_TIMEOUT_S="20")
    try:
        token = _prepare(s)
        sock, rest = _half_sent_mint(s, token, "default")
        s.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        # new connections are refused while the request in flight is still open
        deadline = time.monotonic() + 10
        while not _refused(s.url):
            assert time.monotonic() < deadline, "the server still took new connections after SIGTERM"
            time.sleep(0.05)
        assert s.proc.poll() is None  # it waits for the request in flight
        assert (s.state / "server.json").exists()
        sock.sendall(rest)
        assert _status(sock) == 201  # the request in flight was answered in full
        sock.close()
        assert s.proc.wait(30) == 0, s.tail()
        assert time.monotonic() - t0 < 20  # done once the request was, not at the deadline
        assert not (s.state / "server.json").exists()  # the published URL is withdrawn
        assert _mints(s.state) >= 1  # the in-flight request's audit event was written before exit
    finally:
        s.close()


def test_graceful_sigterm_cuts_a_request_past_the_deadline_and_still_exits_0(tmp_path: Path):
    s = Serve(tmp_path, KVGATE_SHUTDOWN_TIMEOUT_S="2", KVGATE_BODY_TIMEOUT_S="120")
    try:
        token = _prepare(s)
        r = httpx.post(s.url + "/v1/capabilities", json={"namespace": "default", "ops": ["lookup"]},
                       headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 201, r.text  # the control: a whole request is answered
        sock, _ = _half_sent_mint(s, token, "default")  # its body never comes
        s.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert s.proc.wait(60) == 0, s.tail()
        waited = time.monotonic() - t0
        assert 1.5 < waited < 20, waited  # cut at the shutdown deadline, not at the body timeout
        sock.close()
        assert not (s.state / "server.json").exists()
        assert _mints(s.state) >= 1  # what was acknowledged before the signal is written
    finally:
        s.close()
