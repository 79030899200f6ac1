"""LMCache's storage path on the same chunks as `kvgate bench`, for the side-by-side figures.

Run with the python of ``.venv-lmcache`` (``make bench-setup``; lmcache is never a dependency of
kvgate) by :mod:`gateway.bench.peers`, as ``python -I scripts/lmcache_runner.py``: outside every
package and isolated, so no module of the checkout can shadow the standard library or LMCache. It
imports only torch and lmcache, never kvgate, exits non-zero when any configuration fails, and
prints one JSON object: ``{"lmcache_version", "results": [{"path", "op", "tier", "encrypted",
"chunk_bytes", "chunks", "gbps"}], "errors": [...]}``.

Paths: ``lmcache-mp-storage-manager`` (LMCache 0.5.x's multiprocess-mode ``StorageManager`` on CPU:
tier ``memory`` is its DRAM L1, ``disk`` its ``fs`` L2 adapter, ``redis`` its ``resp`` adapter,
plaintext and with the ``aesgcm`` serde) and ``lmcache-server/lm`` (tier ``rest``: LMCache's own
cache server and its ``lm://`` protocol, plaintext). Bytes are random fp16, as many distinct
buffers as chunks; median of ``reps``. What each path times: docs/architecture.md, section 5."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import torch

PATH = "lmcache-mp-storage-manager"


def _manager(l1_bytes: int, adapter: dict | None):
    from lmcache.v1.distributed.config import parse_args
    from lmcache.v1.distributed.storage_manager import StorageManager

    argv = ["--l1-size-gb", f"{l1_bytes / 2**30:.3f}", "--eviction-policy", "LRU"]
    if adapter is not None:
        argv += ["--l2-adapter", json.dumps(adapter)]
    return StorageManager(parse_args(argv))


def _keys(n: int, tag: str):
    from lmcache.v1.distributed.api import ObjectKey

    return [ObjectKey(chunk_hash=os.urandom(16), model_name=f"bench-{tag}", kv_rank=0, cache_salt="tenant-a") for _ in range(n)]


def _wait(cond, timeout: float = 120.0) -> None:
    t_end = time.perf_counter() + timeout
    while not cond():
        if time.perf_counter() > t_end:
            raise TimeoutError("LMCache background work did not finish")
        time.sleep(0.0005)


def _l2_bytes(sm) -> int:
    return sum(int(u.total_bytes_used) for us in sm.get_l2_usages_by_type().values() for u in us)


def measure(tier: str, adapter: dict | None, chunk_bytes: int, n: int, reps: int) -> tuple[float, float]:
    from lmcache.v1.distributed.api import (
        GroupedObjectKeys,
        MemoryLayoutDesc,
        PrefetchTaskSpec,
    )

    elems = chunk_bytes // 2
    layout = MemoryLayoutDesc(shapes=[torch.Size([elems])], dtypes=[torch.float16])
    src = [torch.randn(elems).half() for _ in range(n)]
    dst = [torch.empty(elems, dtype=torch.float16) for _ in range(n)]
    sm = _manager(chunk_bytes * n * 2 + (256 << 20), adapter)
    try:
        store_t, load_t = [], []
        for rep in range(reps + 1):  # the first is a warm-up
            keys = _keys(n, f"{tier}-{rep}")
            before = _l2_bytes(sm) if adapter else 0
            t0 = time.perf_counter()
            objs = sm.reserve_write(keys, layout)
            if len(objs) != n:
                raise RuntimeError(f"L1 reserved {len(objs)} of {n}")
            for i, k in enumerate(keys):
                objs[k].tensor.view(torch.float16).view(-1).copy_(src[i % len(src)])
            sm.finish_write(keys)
            if adapter:
                _wait(lambda before=before: _l2_bytes(sm) - before >= n * chunk_bytes)
            t1 = time.perf_counter()
            if adapter:  # loads must come from L2
                deleted, _ = sm.delete_l1_keys(keys, force=True)
                if deleted != n:
                    raise RuntimeError("could not empty L1 before the load")
            t2 = time.perf_counter()
            spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)])
            handle = sm.submit_prefetch_task(spec, skip_l2=adapter is None)
            result = None
            while result is None:
                sm.wait_prefetch_status(handle, 60.0)
                result = sm.query_prefetch_status(handle)
            hits = sum(r.popcount() for r in result.hit_cells)
            if hits != n:
                raise RuntimeError(f"prefetch hit {hits} of {n}")
            with sm.read_prefetched_results(keys, result.l1_owners or None) as got:
                if got is None:
                    raise RuntimeError("read_prefetched_results found nothing")
                for i, obj in enumerate(got):
                    dst[i].copy_(obj.tensor.view(torch.float16).view(-1))
            sm.finish_read_prefetched(keys, 1, result.l1_owners or None)
            t3 = time.perf_counter()
            sm.delete_l1_keys(keys, force=True)
            if rep:
                store_t.append(t1 - t0)
                load_t.append(t3 - t2)
        total = chunk_bytes * n
        return total / statistics.median(store_t) / 1e9, total / statistics.median(load_t) / 1e9
    finally:
        sm.close()


SERVER_PATH = "lmcache-server/lm"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_server(chunk_bytes: int, n: int, reps: int) -> tuple[float, float]:
    """(store GB/s, load GB/s) through LMCache's cache server (the module says how)."""
    import socket
    import subprocess

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-I", "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=60)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"lmcache server did not start (exit {proc.poll()})") from None
                time.sleep(0.2)
        with sock:
            return _exchange(sock, chunk_bytes, n, reps)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _exchange(sock, chunk_bytes: int, n: int, reps: int) -> tuple[float, float]:
    """The puts and gets of ``measure_server`` on a connection to LMCache's server."""
    import socket

    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage, ServerReturnCode

    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    elems = chunk_bytes // 2
    shape = torch.Size([elems])
    src = [torch.randn(elems).half() for _ in range(n)]
    dst = [torch.empty(elems, dtype=torch.float16) for _ in range(n)]
    reply_len = ServerMetaMessage.packlength()

    def recv_exact(view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            k = sock.recv_into(view[got:], view.nbytes - got)
            if not k:
                raise RuntimeError("lmcache server closed the connection")
            got += k

    def reply() -> ServerMetaMessage:
        buf = bytearray(reply_len)
        recv_exact(memoryview(buf))
        return ServerMetaMessage.deserialize(bytes(buf))

    def meta(command, key, length: int = 0, shp=torch.Size([0, 0, 0, 0])) -> bytes:
        return ClientMetaMessage(command, key, length, MemoryFormat(1), torch.float16, shp).serialize()

    store_t, load_t = [], []
    for rep in range(reps + 1):  # the first is a warm-up
        keys = [CacheEngineKey("bench", 1, 0, rep * 1_000_000 + i, torch.float16) for i in range(n)]
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            sock.sendall(meta(ClientCommand.PUT, k, chunk_bytes, shape))
            sock.sendall(src[i].view(torch.uint8).numpy().data)
        sock.sendall(meta(ClientCommand.EXIST, keys[-1]))
        if reply().code != ServerReturnCode.SUCCESS:
            raise RuntimeError("lmcache server lost a put")
        t1 = time.perf_counter()
        for i, k in enumerate(keys):
            sock.sendall(meta(ClientCommand.GET, k))
            m = reply()
            if m.code != ServerReturnCode.SUCCESS or m.length != chunk_bytes:
                raise RuntimeError(f"lmcache server missed a get ({m.code}, {m.length} bytes)")
            recv_exact(dst[i].view(torch.uint8).numpy().data)
        t2 = time.perf_counter()
        if not torch.equal(dst[-1], src[-1]):
            raise RuntimeError("lmcache server returned other bytes")
        if rep:
            store_t.append(t1 - t0)
            load_t.append(t2 - t1)
    total = chunk_bytes * n
    return total / statistics.median(store_t) / 1e9, total / statistics.median(load_t) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-bytes", type=int, nargs="+", required=True)
    ap.add_argument("--total-bytes", type=int, default=64 << 20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--redis", default="", help="host:port of a Redis server (skip when empty)")
    ap.add_argument("--tiers", nargs="+", default=["memory", "disk", "redis"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the copies (kvgate's figures: 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import lmcache

    work = tempfile.mkdtemp(prefix="lmcache-bench-")
    keyfile = os.path.join(work, "master.key")
    with open(keyfile, "wb") as f:
        f.write(os.urandom(32))
    aes = {"type": "aesgcm", "aes_bits": 256, "master_key_path": keyfile}
    configs: list[tuple[str, str, bool, dict | None]] = []
    if "memory" in args.tiers:
        configs.append(("memory", "l1-dram", False, None))
    if "disk" in args.tiers:
        configs += [
            ("disk", "l2-fs", False, {"type": "fs", "base_path": os.path.join(work, "fs")}),
            ("disk", "l2-fs-odirect", False, {"type": "fs", "base_path": os.path.join(work, "fsd"), "use_odirect": True}),
            ("disk", "l2-fs+aesgcm", True, {"type": "fs", "base_path": os.path.join(work, "fse"), "serde": aes}),
        ]
    if "redis" in args.tiers and args.redis:
        host, port = args.redis.rsplit(":", 1)
        configs += [
            ("redis", "l2-resp", False, {"type": "resp", "host": host, "port": int(port)}),
            ("redis", "l2-resp+aesgcm", True, {"type": "resp", "host": host, "port": int(port), "serde": aes}),
        ]
    out: dict = {"lmcache_version": getattr(lmcache, "__version__", "?"), "path": PATH, "results": [], "errors": []}
    try:
        if "rest" in args.tiers:  # the remote path: beside kvgate's REST rows
            for chunk_bytes in args.chunk_bytes:
                n = max(2, (args.total_bytes // 4) // chunk_bytes)
                try:
                    store, load = measure_server(chunk_bytes, n, args.reps)
                except Exception as exc:
                    out["errors"].append({"variant": SERVER_PATH, "chunk_bytes": chunk_bytes, "error": repr(exc),
                                          "trace": traceback.format_exc(limit=3)})
                    continue
                for op, gbps in (("store", store), ("load", load)):
                    out["results"].append({
                        "path": SERVER_PATH, "op": op, "tier": "rest", "encrypted": False,
                        "chunk_bytes": chunk_bytes, "chunks": n, "gbps": round(gbps, 3),
                    })
        for chunk_bytes in args.chunk_bytes:
            for tier, variant, encrypted, adapter in configs:
                n = max(2, (args.total_bytes if tier == "memory" else args.total_bytes // 4) // chunk_bytes)
                try:
                    store, load = measure(tier, adapter, chunk_bytes, n, args.reps)
                except Exception as exc:
                    out["errors"].append({"variant": variant, "chunk_bytes": chunk_bytes, "error": repr(exc),
                                          "trace": traceback.format_exc(limit=3)})
                    continue
                for op, gbps in (("store", store), ("load", load)):
                    out["results"].append({
                        "path": f"{PATH}/{variant}", "op": op, "tier": tier, "encrypted": encrypted,
                        "chunk_bytes": chunk_bytes, "chunks": n, "gbps": round(gbps, 3),
                    })
    finally:
        shutil.rmtree(work, ignore_errors=True)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
