"""A real ``kvgate serve --uds`` in its own process, for the tests of remote mode through the
server's Unix socket (``tests/gateway/remote/test_uds.py``, ``test_shm.py``, ``tests/engine/test_remote_shm.py``).

The workers' base URL (``NOWHERE``) names a host nothing listens on, so every call of theirs that
works went through the socket. The server runs with the memory tier and shared memory on (1 GiB),
on a free TCP port beside the socket, and is stopped by its process id."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tenancy.devissuer import DevIssuer
from tests.support.services import free_port

__all__ = ["BLOCKS", "N", "NOWHERE", "NUM_BLOCKS", "Served", "create_tenant", "serve", "served", "stop", "wait_up"]

NOWHERE = "http://kvgate.invalid"  # no TCP connection can be made there: only the socket works
NUM_BLOCKS = 32
N = 16 * 3 + 5  # three full chunks of 16 tokens and a partial one
BLOCKS = list(range(14))


@dataclass
class Served:
    url: str
    path: Path
    proc: subprocess.Popen[bytes]
    issuer: DevIssuer
    log: Path

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=NOWHERE, transport=httpx.HTTPTransport(uds=str(self.path)), timeout=10.0)

    def bearer(self, tenant: str, roles: list[str]) -> dict[str, str]:
        return {"Authorization": "Bearer " + self.issuer.mint(tenant, roles)}


def serve(
    tmp_path: Path, path: Path, name: str = "serve", extra_env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state = tmp_path / "state"
    state.mkdir(exist_ok=True, mode=0o700)
    env = {
        **os.environ, "KVGATE_STATE_DIR": str(state), "KVGATE_PUBLIC_URL": url, "KVGATE_TIERS": '["memory"]',
        "KVGATE_CHUNK_TOKENS": "16", "KVGATE_MEMORY_BYTES": str(256 << 20), "KVGATE_SHM_MAX_BYTES": str(1 << 30),
        **(extra_env or {}),
    }
    env.pop("KVGATE_DATABASE_URL", None)
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--uds", str(path)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    return proc, url, log


def wait_up(path: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=NOWHERE, transport=httpx.HTTPTransport(uds=str(path)), timeout=1.0) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"kvgate serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if http.get("/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise AssertionError(f"kvgate serve did not answer on {path}: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    path = tmp_path / "kvgate.sock"
    proc, url, log = serve(tmp_path, path)
    try:
        wait_up(path, proc, log)
        yield Served(url, path, proc, DevIssuer(tmp_path / "state", issuer_url=url + "/dev-issuer"), log)
    finally:
        stop(proc)


def create_tenant(s: Served, http: httpx.Client, name: str) -> str:
    r = http.post("/v1/admin/tenants", json={"tenant": name}, headers=s.bearer("platform", ["kv.operator"]))
    assert r.status_code == 201, r.text
    return name
