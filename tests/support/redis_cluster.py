"""A real Redis Cluster for tests and scripts: six ``redis-server`` processes on 127.0.0.1 (three
masters, three replicas), made one cluster by ``redis-cli --cluster create``; stopped by process
id, their directories removed.

``cluster-node-timeout`` is short (1 s) for a cluster a test kills nodes of, so a killed master's
replica is promoted within a few seconds; the shared session cluster uses 3 s, so a node starved of
CPU on a loaded box is not failed over under the tests that assume a steady cluster. Persistence is off.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from storage._cluster_client import make_cluster_client
from storage._cluster_layout import ClusterLayout
from storage._cluster_slot import on_slot
from storage._redis_layout import Header, pack_header
from storage.types import (
    ChunkKey,
)

__all__ = ["Cluster", "own_redis_cluster", "redis_cluster", "replication_caught_up", "start_cluster"]

NODE_TIMEOUT_MS = 1000  # a cluster of a test's own: failover within a few seconds
SHARED_NODE_TIMEOUT_MS = 3000  # the shared cluster: steady on a loaded 2-core box


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int) -> list[int]:
    """Free ports whose cluster bus port (+10000) is free too (redis-server's rule), both below
    the kernel's ephemeral range (32768 and up on Linux), where an outgoing connection of the
    same test run could take one between this check and redis-server's bind."""
    rng = random.Random()
    found: list[int] = []
    while len(found) < n:
        port = rng.randrange(12000, 22700)
        if port not in found and port + 10000 not in found and _bindable(port) and _bindable(port + 10000):
            found.append(port)
    return found


def cli(port: int, *args: str, timeout: float = 30.0) -> str:
    out = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
                         capture_output=True, text=True, timeout=timeout, check=False)
    return out.stdout


@dataclass
class Cluster:
    ports: list[int]
    root: Path
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    node_timeout_ms: int = NODE_TIMEOUT_MS

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _start(self, port: int) -> None:
        d = self.root / str(port)
        d.mkdir(exist_ok=True)
        self.procs[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
             "--save", "", "--appendonly", "no", "--dir", str(d), "--daemonize", "no",
             "--protected-mode", "no", "--logfile", str(d / "log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def masters(self) -> list[int]:
        """Ports of the live masters that own slots."""
        found = []
        for port, proc in self.procs.items():
            if proc.poll() is None and "role:master" in cli(port, "info", "replication"):
                if any(line.split()[2].endswith("master") and len(line.split()) > 8
                       for line in cli(port, "cluster", "nodes").splitlines() if "myself" in line):
                    found.append(port)
        return sorted(found)

    def node_id(self, port: int) -> str:
        return cli(port, "cluster", "myid").strip()

    def kill(self, port: int) -> None:
        """kill -9 one node."""
        proc = self.procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every live node reports cluster_state:ok and agrees on three slot-owning masters."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [p for p, proc in self.procs.items() if proc.poll() is None]
            if all("cluster_state:ok" in cli(p, "cluster", "info") for p in live) and len(self.masters()) == 3:
                return
            time.sleep(0.2)
        # say what each node saw, so a failure here can be diagnosed from the CI log alone
        # (short: a CI log keeps the first lines of a long message only)
        seen = {p: (cli(p, "cluster", "info").split("\r\n")[0],
                    " ".join(f for line in cli(p, "cluster", "nodes").splitlines() if "myself" in line
                             for f in line.split()[2:4] + line.split()[8:9]))
                for p, proc in self.procs.items() if proc.poll() is None}
        raise RuntimeError(f"the cluster did not reach cluster_state:ok in {timeout:.0f} s; masters {self.masters()}; "
                           f"each live node's state, flags, master and first slots: {seen}")

    def reshard(self, src: int, dst: int, slots: int, timeout: float = 120.0) -> None:
        """Move ``slots`` slots from master ``src`` to master ``dst`` (redis-cli --cluster reshard)."""
        out = subprocess.run(
            ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{src}", "--cluster-from", self.node_id(src),
             "--cluster-to", self.node_id(dst), "--cluster-slots", str(slots), "--cluster-yes",
             "--cluster-pipeline", "100"],
            capture_output=True, text=True, timeout=timeout, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"reshard failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)


def _wait_ping(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cli(port, "ping", timeout=5).strip() == "PONG":
            return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on {port} did not answer")


def start_cluster(node_timeout_ms: int = NODE_TIMEOUT_MS) -> Cluster:
    """Six nodes, three masters with one replica each, cluster_state:ok on every node."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise FileNotFoundError("redis-server and redis-cli are needed for a test cluster")
    for attempt in range(3):  # a port taken between the check and the bind: start again elsewhere
        cluster = Cluster(_free_ports(6), Path(tempfile.mkdtemp(prefix="kvgate-cluster-")),
                          node_timeout_ms=node_timeout_ms)
        for port in cluster.ports:
            cluster._start(port)
        try:
            for port in cluster.ports:
                _wait_ping(port)
            break
        except RuntimeError:
            cluster.stop()
            if attempt == 2:
                raise
    try:
        out = subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.ports),
             "--cluster-replicas", "1", "--cluster-yes"], capture_output=True, text=True, timeout=60, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"cluster create failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
        cluster.wait_ok()
    except BaseException:
        cluster.stop()
        raise
    return cluster


# -- the pytest fixture: one cluster per test session, shared by every module that imports it --
_shared: list[Cluster] = []
_users = [0]


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Cluster]:
    """A running 6-node cluster (started once per session; a module that imports this fixture
    gets the same cluster as any other)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        from tests.support.services import missing

        missing("redis-server and redis-cli are needed for the Redis Cluster tests")
    if not _shared:
        _shared.append(start_cluster(SHARED_NODE_TIMEOUT_MS))
    _users[0] += 1
    try:
        yield _shared[0]
    finally:
        _users[0] -= 1
        if _users[0] == 0:
            _shared.pop().stop()


@pytest.fixture
def own_redis_cluster() -> Iterator[Cluster]:
    """A 6-node cluster of this test's own, for a test that kills nodes or moves slots: whatever
    state it leaves the cluster in, the shared one (and every test that uses it) never sees it."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        from tests.support.services import missing

        missing("redis-server and redis-cli are needed for the Redis Cluster tests")
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


def replication_caught_up(cluster: Cluster, timeout: float = 30.0) -> None:
    """Until every live master's replicas report its replication offset (so a kill loses nothing
    written before this returns)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        behind = False
        for port in cluster.masters():
            info = dict(line.split(":", 1) for line in cli(port, "info", "replication").splitlines() if ":" in line)
            offset = int(info.get("master_repl_offset", "0"))
            replicas = [v for k, v in info.items() if k.startswith("slave") and k[5:].isdigit()]
            if not replicas or any(int(dict(f.split("=") for f in r.split(","))["offset"]) < offset for r in replicas):
                behind = True
        if not behind:
            return
        time.sleep(0.1)
    raise RuntimeError("replicas did not catch up")


async def fill(url: str, prefix: str, owner: str, group: str, n: int, batch: int = 20_000) -> int:
    """Write ``n`` tiny chunks of one (owner, group) exactly as RedisClusterTier.put lays them out
    (head, tag counters, counter shards), one pipeline per slot per batch instead of a round trip
    per chunk. Returns the payload bytes written."""
    lay = ClusterLayout(prefix)
    client = make_cluster_client(url, connect_timeout_s=5.0, socket_timeout_s=120.0, max_connections=16)
    payload = pack_header(Header(16, 0, b"\0" * 8)) + bytes(16)
    try:
        await client.initialize()
        gate = asyncio.Semaphore(12)

        async def send(key: str, cmds: list[tuple[object, ...]]) -> None:
            async with gate:
                await on_slot(client, key, cmds, transaction=False)

        for start in range(0, n, batch):
            by_slot: dict[str, list[tuple[object, ...]]] = {}
            for i in range(start, min(n, start + batch)):
                k = ChunkKey(owner, group, hashlib.sha256(i.to_bytes(8, "little")).hexdigest())
                by_slot.setdefault(lay.tag_bytes(k), []).append(("SET", lay.head(k), payload))
            shards: dict[str, int] = {}
            for tag_counter, cmds in by_slot.items():
                cmds.append(("INCRBY", tag_counter, 16 * len(cmds)))
                shard = lay.shard_name(tag_counter[len(prefix) + 1:].split(".")[2][0])
                shards[shard] = shards.get(shard, 0) + 16 * (len(cmds) - 1)
            for name, total in shards.items():
                by_slot.setdefault(name, []).append(("INCRBY", name, total))
            await asyncio.gather(*(send(key, cmds) for key, cmds in by_slot.items()))
    finally:
        await client.aclose()
    return 16 * n
