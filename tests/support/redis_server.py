"""A redis-server of a test's own (a free port, no persistence), stopped by its pid; and a fast filler."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from storage import ChunkKey
from storage._redis_layout import Header, Layout, pack_header
from tests.support.services import free_port, missing


async def fill(url: str, prefix: str, owner: str, group: str, n: int, batch: int = 5000) -> None:
    """Write ``n`` tiny chunks of one group through pipelines, exactly as RedisTier.put lays
    them out (head + index sets), without a round trip per chunk."""
    lay = Layout(prefix)
    client = aioredis.from_url(url)
    try:
        value = pack_header(Header(16, 0, b"\0" * 8)) + bytes(16)
        for start in range(0, n, batch):
            pipe = client.pipeline(transaction=False)
            heads = [lay.head(ChunkKey(owner, group, f"{i:064x}")) for i in range(start, min(n, start + batch))]
            for head in heads:
                pipe.set(head, value)
            pipe.sadd(lay.group_set(owner, group), *heads)
            await pipe.execute()
        await client.sadd(lay.group_owners(group), owner)
        await client.sadd(lay.owner_groups(owner), group)
        await client.sadd(lay.owners, owner)
    finally:
        await client.aclose()

class Server:
    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--enable-debug-command", "local", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

@pytest.fixture
def server() -> Iterator[Server]:
    if shutil.which("redis-server") is None:
        missing("redis-server is not installed")
    srv = Server()
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()
