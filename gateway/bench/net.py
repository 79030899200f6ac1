"""Network figures for `kvgate bench`: the Redis tier beside raw redis-py, the REST data plane
beside a raw loopback socket, and lookup latency for a 32K-token prefix (128 chunks).

The REST data plane is measured as workers use it: one ``PUT /v1/chunks`` frame and one streamed
``POST /v1/chunks/fetch`` per prefix (``get_keyed``: each envelope after its opening key), over the
data plane's own client ``gateway.remote.wire``, received into a buffer per envelope as
``gateway.remote.client`` does. The fast paths stand beside the public ones in the same run
(``fast_paths``): the same calls through httpx instead of the wire client (``*_httpx``), and
against a server with its raw paths off (``raw=False``).

Every ceiling is measured in the same run on the same bytes: ``redis_set`` / ``redis_get`` are
the faster of redis-py's default asyncio client and the tuned one the Redis tier itself uses;
``socket`` is one TCP connection over loopback to a separate process that reads into (or writes
from) a preallocated buffer, the most any HTTP server on this machine could move.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from crypto.envelope import ChunkCipher, DataKey, EnvelopeContext
from gateway.bench.common import percentiles_ms
from gateway.protocol import frames, sockets
from gateway.remote import wire
from gateway.remote.shm import attach

__all__ = ["KEEP_FAST_PATH", "fast_paths", "redis_ceilings", "rest_figures", "socket_ceiling"]

KEEP_FAST_PATH = 1.10
"""A fast path is kept where the public route costs at least this much more in the same run
(GB/s for a transfer, p50 for a lookup): docs/server.md, "Raw paths"."""

_SINK = r"""
import socket, sys
size = int(sys.argv[1]); mode = sys.argv[2]; path = sys.argv[3] if len(sys.argv) > 3 else ""
if path:  # a Unix socket, with the buffers kvgate's own ends ask for (gateway.protocol.sockets.tune_unix_socket)
    srv = socket.socket(socket.AF_UNIX); srv.bind(path); srv.listen(1); print(path, flush=True)
else:
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0)); srv.listen(1); print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept(); buf = bytearray(size); view = memoryview(buf)
if path:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        conn.setsockopt(socket.SOL_SOCKET, opt, int(sys.argv[4]))
while True:
    if mode == "recv":
        got = 0
        while got < size:
            n = conn.recv_into(view[got:])
            if not n: sys.exit(0)
            got += n
        conn.sendall(b"k")
    else:
        if not conn.recv(1): sys.exit(0)
        conn.sendall(view)
"""


def _wire_headers(headers: dict[str, str], content_type: str) -> list[tuple[str, str]]:
    return [("Authorization", headers["Authorization"]), ("X-KV-Capability", headers["X-KV-Capability"]),
            ("Content-Type", content_type)]


def _median_gbps(fn: Callable[[], object], nbytes: int, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def socket_ceiling(size: int, count: int, reps: int, uds: bool = False) -> tuple[float, float]:
    """GB/s sending ``count`` bodies of ``size`` bytes to another process, and receiving them
    (``uds``: over a Unix socket, else loopback TCP)."""
    out = []
    for mode in ("recv", "send"):
        tmp = tempfile.mkdtemp(prefix="kvgate-sink-") if uds else ""
        args = [os.path.join(tmp, "s.sock"), str(sockets.SOCKET_BUFFER_BYTES)] if uds else []
        try:
            proc = subprocess.Popen([sys.executable, "-c", _SINK, str(size), mode, *args], stdout=subprocess.PIPE, text=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True) if tmp else None
            raise
        try:
            assert proc.stdout is not None  # stdout=PIPE
            where = proc.stdout.readline().strip()
            if uds:
                sock = socket.socket(socket.AF_UNIX)
                sockets.tune_unix_socket(sock)
                sock.connect(where)
            else:
                sock = socket.create_connection(("127.0.0.1", int(where)))
            payload = memoryview(os.urandom(size))
            buf = memoryview(bytearray(size))

            def send() -> None:
                for _ in range(count):
                    sock.sendall(payload)
                    sock.recv(1)

            def recv() -> None:
                for _ in range(count):
                    sock.sendall(b"g")
                    got = 0
                    while got < size:
                        got += sock.recv_into(buf[got:])

            out.append(_median_gbps(send if mode == "recv" else recv, size * count, reps))
            sock.close()
        finally:
            proc.terminate()
            proc.wait(5)
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
    return out[0], out[1]


async def redis_ceilings(url: str, size: int, count: int, reps: int) -> tuple[float, float]:
    """(SET GB/s, GET GB/s): the best raw redis-py client on the same server and bytes."""
    import redis.asyncio as aioredis

    from storage._redis_client import make_client  # the tuned client the tier uses

    payload = os.urandom(size)
    prefix = f"kvgate-bench-raw:{secrets.token_hex(4)}:"
    keys = [f"{prefix}{i}" for i in range(count)]
    best_set = best_get = 0.0
    clients = [aioredis.from_url(url), make_client(url, connect_timeout_s=2, socket_timeout_s=60, max_connections=8)]
    try:
        for client in clients:
            async def run(op: Callable[[], Awaitable[None]]) -> float:
                await op()
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    await op()
                    times.append(time.perf_counter() - t0)
                return size * count / statistics.median(times) / 1e9

            async def sets() -> None:
                for k in keys:
                    await client.set(k, payload)

            async def gets() -> None:
                for k in keys:
                    await client.get(k)

            best_set = max(best_set, await run(sets))
            best_get = max(best_get, await run(gets))
        await clients[0].delete(*keys)
    finally:
        for c in clients:
            await c.aclose()
    return best_set, best_get


async def _storage_keys(http: Any, capability: dict[str, str], hashes: list[str]) -> list[bytes]:
    """The storage key of each hash, as a sealing key brings it (an upload names it: ``KVB2``)."""
    r = await http.post("/v1/keys/envelopes", json={"purpose": "seal", "hashes": hashes}, headers=capability)
    r.raise_for_status()
    return [bytes.fromhex(k["storage_key"]) for k in r.json()["keys"]]


def _envelope(size: int) -> bytes:
    """A well-formed envelope of about ``size`` bytes (the server checks only the header)."""
    ctx = EnvelopeContext("bench", "default", "ab" * 32, "cd" * 32, 1)
    return bytes(ChunkCipher().seal(DataKey(os.urandom(32), os.urandom(32)), ctx, os.urandom(size - 56 - 16 * (-(-size // (2 << 20))))))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def rest_figures(
    base: Path, sizes: list[int], counts: dict[int, int], reps: int, uds: bool = False, raw: bool = True,
) -> dict[str, Any]:
    """Start a real `kvgate serve` (SQLite, memory tier) and measure store and load GB/s per size
    (``put``: one upload frame; ``get_keyed``: the fetch with each envelope's opening key, as a
    remote worker loads), the CPU seconds per GB each costs the client and the server
    (``cpu_s_per_gb``), and lookup latency for 128 chained hashes: ``lookup_ms`` as a remote worker asks (the data plane's own
    client, ``gateway.remote.wire``), ``lookup_ms_httpx`` through a general-purpose client;
    ``put_httpx`` and ``get_keyed_httpx`` are the batched calls through httpx. ``raw``: the server's
    raw paths (``KVGATE_RAW_PATHS``; off: every request through ASGI and FastAPI). ``uds``: the
    server also listens on a Unix socket and every call goes there (``kvgate serve --uds``), and
    ``get_keyed_shm`` is the keyed fetch with a shared-memory region lent (``gateway.server.shm``:
    the envelopes are copied into it by the server and read there, only their heads cross)."""
    from gateway.services import dbschema
    from tenancy.devissuer import DevIssuer

    state = base / (("rest-uds" if uds else "rest") + ("" if raw else "-routed"))
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ, "KVGATE_STATE_DIR": str(state), "KVGATE_PUBLIC_URL": url,
        "KVGATE_TIERS": '["memory"]', "KVGATE_MEMORY_BYTES": str(4 << 30), "KVGATE_SHM_MAX_BYTES": str(4 << 30),
        "KVGATE_MAX_CHUNK_BYTES": str(max(sizes) + (1 << 20)),
        "KVGATE_MAX_BATCH_BYTES": str(max(max(sizes) + (1 << 20), max(s * counts[s] for s in sizes) + (1 << 20))),
        "KVGATE_RAW_PATHS": "true" if raw else "false",
    }
    env.pop("KVGATE_DATABASE_URL", None)
    await asyncio.to_thread(dbschema.upgrade, f"sqlite+aiosqlite:///{state / 'kvgate.db'}")
    sock = str(state / "kvgate.sock") if uds else None
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(port), *(["--uds", sock] if sock else [])],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[str, Any] = {
        "put": {}, "get_keyed": {}, "put_httpx": {}, "get_keyed_httpx": {}, "cpu_s_per_gb": {},
    }
    pool = wire.WirePool(url, timeout_s=120.0, connections=2, uds=sock)
    try:
        transport = httpx.AsyncHTTPTransport(uds=sock) if sock else None
        async with httpx.AsyncClient(base_url=url, timeout=120.0, transport=transport) as http:
            for _ in range(150):
                try:
                    if (await http.get("/healthz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
            dev = DevIssuer(state, issuer_url=url + "/dev-issuer")
            op = {"Authorization": "Bearer " + dev.mint("ops", ["kv.operator"])}
            (await http.post("/v1/admin/tenants", json={"tenant": "bench"}, headers=op)).raise_for_status()
            user = {"Authorization": "Bearer " + dev.mint("bench", ["kv.worker", "kv.admin"])}
            r = await http.post("/v1/capabilities", json={"namespace": "default", "ops": ["lookup", "get", "put"]}, headers=user)
            r.raise_for_status()
            capability = {**user, "X-KV-Capability": r.json()["capability"]}
            hdr = {**capability, "Content-Type": "application/octet-stream"}
            for size in sizes:
                body = _envelope(size)
                hashes = [secrets.token_hex(32) for _ in range(counts[size])]
                sealed = await _storage_keys(http, capability, hashes)

                async def timed(fn: Callable[[], Awaitable[object]], name: str) -> float:
                    """GB/s (median of ``reps``); CPU seconds per GB of client and server go to
                    ``out["cpu_s_per_gb"]`` (steadier than wall time on a loaded machine)."""
                    await fn()
                    times = []
                    c0, s0 = time.process_time(), _cpu_seconds(proc.pid)
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        await fn()
                        times.append(time.perf_counter() - t0)
                    gb = len(body) * len(hashes) * reps / 1e9
                    out["cpu_s_per_gb"].setdefault(name, {})[size] = {
                        "client": round((time.process_time() - c0) / gb, 3),
                        "server": round((_cpu_seconds(proc.pid) - s0) / gb, 3),
                    }
                    return len(body) * len(hashes) / statistics.median(times) / 1e9

                def put_frame(ex: wire.Exchange, headers: list[tuple[str, str]]) -> None:
                    """As ``gateway.remote.client`` uploads: the index, then each envelope from its buffer."""
                    index = frames.encode_sealed_index([(bytes.fromhex(h), k, len(body)) for h, k in zip(hashes, sealed)])
                    try:
                        ex.start("PUT", "/v1/chunks", headers, [index, *[body] * len(hashes)])
                        assert ex.status == 204, (ex.status, ex.read_rest())
                        ex.read_rest()
                    finally:
                        ex.close()

                async def put_batch() -> None:
                    await pool.run(put_frame, _wire_headers(capability, "application/octet-stream"))

                def fetch(ex: wire.Exchange, headers: list[tuple[str, str]], region: Any = None) -> None:
                    """As ``gateway.remote.client`` loads: each envelope, after its key, received into a
                    buffer of its own (or, in ``region``'s window, read where the server put it)."""
                    window = region.lend() if region is not None else None
                    request: dict[str, Any] = {"hashes": hashes, "keys": True}
                    if window is not None:
                        request["shm"] = window.request()
                    try:
                        ex.start("POST", "/v1/chunks/fetch", headers, [json.dumps(request).encode()])
                        assert ex.status == 200, (ex.status, ex.read_rest())
                        _ct, t_len, n_len = frames.parse_keyed_head(ex.read(frames.KEYED_HEAD))
                        ex.read(t_len + n_len)
                        for _ in hashes:
                            item = frames.parse_keyed_item_head(ex.read(frames.KEYED_ITEM_HEAD))
                            if window is not None and item.status == frames.IN_REGION:
                                window.take(item.length)  # as gateway.remote.client takes it: a view, nothing received
                                continue
                            assert item.status == frames.OK, item.status
                            ex.readinto(wire.receive_buffers.take(item.length))  # as gateway.remote.client receives
                        ex.at_end()
                    finally:
                        ex.close()
                        if window is not None:
                            window.end(True)

                # as a worker loads: each envelope after its opening key, under one capability per
                # size (a worker keeps its capability; (reps + 1) x count keys stay far inside its budget)
                r = await http.post("/v1/capabilities", json={"namespace": "default", "ops": ["get"]}, headers=user)
                keyed = {**user, "X-KV-Capability": r.raise_for_status().json()["capability"]}

                async def get_keyed() -> None:
                    await pool.run(fetch, _wire_headers(keyed, "application/json"))

                async def put_httpx() -> None:
                    """The upload frame through httpx: the index, then each envelope from its buffer."""
                    index = frames.encode_sealed_index([(bytes.fromhex(h), k, len(body)) for h, k in zip(hashes, sealed)])

                    async def parts() -> Any:
                        yield index
                        for _ in hashes:
                            yield body

                    size = len(index) + len(body) * len(hashes)
                    r = await http.put("/v1/chunks", content=parts(), headers={**hdr, "Content-Length": str(size)})
                    assert r.status_code == 204, (r.status_code, r.text)

                async def get_keyed_httpx() -> None:
                    """The keyed fetch through httpx, each envelope read into a buffer of its own."""
                    request = {"hashes": hashes, "keys": True}
                    async with http.stream("POST", "/v1/chunks/fetch", json=request, headers=keyed) as resp:
                        assert resp.status_code == 200, resp.status_code
                        reader = frames.Reader(resp.aiter_raw())
                        await frames.read_keyed_head(reader)
                        for _ in hashes:
                            item = frames.parse_keyed_item_head(await reader.read(frames.KEYED_ITEM_HEAD))
                            assert item.status == frames.OK, item.status
                            await reader.into(wire.receive_buffers.take(item.length))
                        await reader.end()

                out["put"][size] = await timed(put_batch, "put")
                out["get_keyed"][size] = await timed(get_keyed, "get_keyed")
                out["put_httpx"][size] = await timed(put_httpx, "put_httpx")
                out["get_keyed_httpx"][size] = await timed(get_keyed_httpx, "get_keyed_httpx")
                if sock is not None and raw:  # a region travels on the raw chunk writer: off, it is refused
                    status, region = await asyncio.to_thread(
                        attach, pool, _wire_headers(keyed, "application/json"), len(body) * len(hashes) + (1 << 20)
                    )
                    assert status == 200, (status, region)

                    async def get_keyed_shm() -> None:
                        await pool.run(fetch, _wire_headers(keyed, "application/json"), region)

                    out.setdefault("get_keyed_shm", {})[size] = await timed(get_keyed_shm, "get_keyed_shm")
                out.setdefault("bytes", {})[size] = len(body)
            # lookup latency: a 32K-token prefix is 128 chunks of 256 tokens, all present
            small = _envelope(4096)
            hashes = [secrets.token_hex(32) for _ in range(128)]
            sealed = await _storage_keys(http, capability, hashes)
            index = frames.encode_sealed_index([(bytes.fromhex(h), k, len(small)) for h, k in zip(hashes, sealed)])
            (await http.put("/v1/chunks", content=index + small * len(hashes), headers=hdr)).raise_for_status()
            body = json.dumps({"hashes": hashes, "chunk_tokens": 256}).encode()
            lookup_headers = _wire_headers(capability, "application/json")

            def lookup(ex: wire.Exchange) -> None:
                """As ``gateway.remote.client`` asks: one POST on the data plane's own client."""
                try:
                    ex.start("POST", "/v1/lookup", lookup_headers, [body])
                    got = json.loads(ex.read_rest())
                    assert ex.status == 200 and got["hit_chunks"] == 128, got
                finally:
                    ex.close()

            async def via_httpx() -> None:
                r = await http.post("/v1/lookup", content=body, headers={**capability, "Content-Type": "application/json"})
                assert r.status_code == 200 and r.json()["hit_chunks"] == 128, r.text

            async def via_wire() -> None:
                await pool.run(lookup)

            calls: list[tuple[str, Callable[[], Awaitable[None]]]] = [("lookup_ms", via_wire), ("lookup_ms_httpx", via_httpx)]
            for name, call in calls:
                for _ in range(20):
                    await call()
                lat = []
                for _ in range(300):
                    t0 = time.perf_counter()
                    await call()
                    lat.append(time.perf_counter() - t0)
                out[name] = percentiles_ms(lat)
    finally:
        pool.close()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def fast_paths(fast: dict[str, Any], routed: dict[str, Any]) -> list[dict[str, Any]]:
    """Each fast path beside its public route, from one run: ``fast`` from a server with its raw
    paths on, ``routed`` with them off. ``speedup``: the public route's cost over the fast
    path's (GB/s for transfers, p50 for the lookup); ``cpu_ratio``: the same for the CPU seconds
    per GB of the side the path is on; ``keep``: ``speedup >= KEEP_FAST_PATH``."""
    rows: list[dict[str, Any]] = []

    def row(
        figure: str, side: str, size: int, fast_v: float, public_v: float,
        cpu: tuple[str, str, str, dict[str, Any]] | None, cost: bool = False,
    ) -> None:
        """``cost``: the figures are times (less is better), else rates."""
        num, den = (public_v, fast_v) if cost else (fast_v, public_v)
        speedup = num / den if den else 0.0
        out: dict[str, Any] = {"figure": figure, "side": side, "chunk_bytes": size, "fast": round(fast_v, 3),
                               "public": round(public_v, 3), "speedup": round(speedup, 3)}
        if cpu is not None:
            fast_name, public_name, who, public_run = cpu
            f_cpu = fast["cpu_s_per_gb"][fast_name][size][who]
            p_cpu = public_run["cpu_s_per_gb"][public_name][size][who]
            out["cpu_ratio"] = round(p_cpu / f_cpu, 3) if f_cpu else 0.0
        out["keep"] = speedup >= KEEP_FAST_PATH
        rows.append(out)

    for size in sorted(fast["put"]):
        row("upload GB/s: raw body vs ASGI", "server", size, fast["put"][size], routed["put"][size], ("put", "put", "server", routed))
        row("keyed fetch GB/s: raw chunks vs ASGI", "server", size, fast["get_keyed"][size], routed["get_keyed"][size],
            ("get_keyed", "get_keyed", "server", routed))
        row("upload GB/s: wire vs httpx", "client", size, fast["put"][size], fast["put_httpx"][size], ("put", "put_httpx", "client", fast))
        row("keyed fetch GB/s: wire vs httpx", "client", size, fast["get_keyed"][size], fast["get_keyed_httpx"][size],
            ("get_keyed", "get_keyed_httpx", "client", fast))
    row("lookup p50 ms: raw endpoint vs FastAPI route", "server", 0, fast["lookup_ms"]["p50"], routed["lookup_ms"]["p50"],
        None, cost=True)
    row("lookup p50 ms: wire vs httpx", "client", 0, fast["lookup_ms"]["p50"], fast["lookup_ms_httpx"]["p50"], None, cost=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    """Only the REST rows of ``kvgate bench`` (and the socket ceiling of the same run, of the same
    transport), as ratios: ``python -m gateway.bench.net --sizes-mib 2 32 --reps 5``; loopback
    TCP and the server's Unix socket (``--transports tcp uds``)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m gateway.bench.net", description=main.__doc__)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[2, 32])
    p.add_argument("--total-mib", type=int, default=64, help="bytes per measured transfer (kvgate bench: 64)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--transports", nargs="+", choices=["tcp", "uds"], default=["tcp", "uds"])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-fast-paths", action="store_true", help="skip the second server with its raw paths off")
    args = p.parse_args(argv)
    sizes = [m << 20 for m in args.sizes_mib]
    counts = {b: max(2, (args.total_mib << 20) // b) for b in sizes}
    rows: list[dict[str, Any]] = []
    lookups: dict[str, Any] = {}
    compared: dict[str, Any] = {}
    for transport in args.transports:
        uds = transport == "uds"
        base = Path(tempfile.mkdtemp(prefix="kvgate-bench-net-"))
        try:
            rest = asyncio.run(rest_figures(base, sizes, counts, args.reps, uds=uds))
            if not args.no_fast_paths:
                routed = asyncio.run(rest_figures(base, sizes, counts, args.reps, uds=uds, raw=False))
                compared[transport] = fast_paths(rest, routed)
                for c in compared[transport]:
                    print(f"{transport} {c['figure']:46s} {c['chunk_bytes'] >> 20:3d} MiB  fast {c['fast']:8.3f}  "
                          f"public {c['public']:8.3f}  speedup {c['speedup']:5.2f}  cpu {c.get('cpu_ratio', '-')}  "
                          f"{'keep' if c['keep'] else 'NOT WORTH IT'}")
        finally:
            shutil.rmtree(base, ignore_errors=True)
        for b in sizes:
            send, recv = socket_ceiling(rest["bytes"][b], counts[b], args.reps, uds=uds)
            names = [("put", send), ("get_keyed", recv), ("put_httpx", send), ("get_keyed_httpx", recv)]
            for name, sock in names + ([("get_keyed_shm", recv)] if uds else []):
                gbps, cpu = rest[name][b], rest["cpu_s_per_gb"][name][b]
                rows.append({"transport": transport, "op": name, "mib": b >> 20, "count": counts[b], "gbps": round(gbps, 3),
                             "socket_gbps": round(sock, 3), "ratio": round(gbps / sock, 3), "cpu_s_per_gb": cpu})
                print(f"{transport} {name:14s} {b >> 20:3d} MiB x{counts[b]:<3d} {gbps:7.3f} GB/s  socket {sock:7.3f}  "
                      f"ratio {gbps / sock:5.2f}  cpu/GB client {cpu['client']:.3f} server {cpu['server']:.3f}")
        lookups[transport] = {"lookup_ms": rest["lookup_ms"], "lookup_ms_httpx": rest["lookup_ms_httpx"]}
        print(f"{transport} lookup 32K tokens: {rest['lookup_ms']} (httpx: {rest['lookup_ms_httpx']})")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "lookups": lookups, "fast_paths": compared}, indent=1))


if __name__ == "__main__":
    main()
