"""RSS of a `kvgate serve` process while 3 unauthenticated clients each send a 57 MB body.

    PYTHONPATH=<repo> python scripts/rss_unauth_bodies.py [--clients 3] [--mb 57] [--path /v1/admin/clear]

Starts ``python -m gateway serve`` on a free port with a fresh state directory (SQLite, memory
and disk tiers), waits for /healthz, then sends the bodies concurrently over raw sockets (no
Authorization header, invalid JSON) and samples /proc/<pid>/status (VmRSS, VmHWM) every 10 ms.
Prints one JSON line: idle RSS, peak RSS, the statuses the clients got and how long they took.
Run it against two checkouts to compare them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time


def _rss(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) // 1024  # MiB
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send(port: int, path: str, size: int, results: list, i: int) -> None:
    t0 = time.monotonic()
    status = "no answer"
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n".encode()
        )
        block = b"[" * (1 << 20)  # invalid JSON
        sent = 0
        try:
            while sent < size:
                n = min(len(block), size - sent)
                s.sendall(block[:n])
                sent += n
        except OSError as exc:
            status = f"cut after {sent >> 20} MiB ({type(exc).__name__})"
        try:
            data = s.recv(4096)
            if data:
                status = data.split(b"\r\n", 1)[0].decode(errors="replace") + (f" after {sent >> 20} MiB sent" if sent < size else "")
        except OSError as exc:
            status += f"; recv {type(exc).__name__}"
        s.close()
    finally:
        results[i] = {"status": status, "seconds": round(time.monotonic() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--mb", type=int, default=57)
    ap.add_argument("--path", default="/v1/admin/clear")
    args = ap.parse_args()
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        state = os.path.join(tmp, "state")
        os.mkdir(state, 0o700)
        env = dict(os.environ, KVGATE_STATE_DIR=state, KVGATE_MEMORY_BYTES=str(64 << 20), KVGATE_CPU_THREADS="1")
        subprocess.run([sys.executable, "-m", "gateway", "migrate"], env=env, check=True, capture_output=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--port", str(port)], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), 1) as s:
                        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                        if b"200" in s.recv(100):
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the server did not start: " + (proc.stderr.read().decode()[-2000:] if proc.poll() is not None else ""))
                time.sleep(0.2)
            time.sleep(1.0)
            idle = _rss(proc.pid)
            results: list = [None] * args.clients
            threads = [
                threading.Thread(target=_send, args=(port, args.path, args.mb << 20, results, i)) for i in range(args.clients)
            ]
            peak = idle["VmRSS"]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                peak = max(peak, _rss(proc.pid)["VmRSS"])
                time.sleep(0.01)
            after = _rss(proc.pid)
            print(json.dumps({
                "clients": args.clients, "body_mb": args.mb, "path": args.path,
                "idle_rss_mib": idle["VmRSS"], "peak_rss_mib": max(peak, after["VmRSS"]), "vm_hwm_mib": after["VmHWM"],
                "results": results,
            }))
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
