"""One device check for ``kernels``: the GPU tests and the data path's throughput, one JSON summary.

    python scripts/device_check.py                  # on the CUDA device (< 5 minutes on one H200)
    python scripts/device_check.py --device cpu     # the same plumbing on the CPU (figures labelled)

Prints exactly one JSON object on stdout (progress goes to stderr); exits 1 if a test failed or a
section raised, 0 otherwise. Sections:

- ``tests``: ``pytest -m cuda tests/test_device_aes.py tests/test_kernels.py`` in a subprocess
  (on a CPU-only host they are all skipped; the counts say so).
- ``pack_unpack``: ``kernels.bench.measure`` for a 256-token Llama-3-8B chunk (32 layers, 8 KV
  heads, head size 128, fp16: 33.5 MB), both paged layouts, beside a plain contiguous device copy.
- ``aes_gcm``: ``TorchAesGcm.encrypt_`` / ``decrypt_`` in place on a 2 MiB and the 33.5 MB buffer.
- ``store`` / ``load``: end to end for one chunk. Store: pack, [encrypt on the device,] copy to
  (pinned) host memory. Load: copy to the device, [check the tag and decrypt,] unpack. Plus, for
  comparison, the CPU AEAD route (pack, copy to host, ``cryptography`` AES-GCM on the host; load
  the reverse). GB/s counts the chunk's plaintext bytes; times are medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kernels import KVLayout, PagedKV, pack, slots_from_block_ids, unpack
from kernels.aes_gcm import TorchAesGcm
from kernels.bench import NUM_BLOCKS, llama3_8b, measure

TOKENS = 256


def _log(msg: str) -> None:
    print(f"[device_check] {msg}", file=sys.stderr, flush=True)


def _timer(dev: torch.device) -> Callable[..., float]:
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def median_seconds(
        fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None
    ) -> float:
        """Median wall time of ``fn`` (device synchronised); ``setup`` runs untimed before each."""
        times = []
        for i in range(repeats + 1):  # the first run warms up (allocator, lazy constants)
            if setup is not None:
                setup()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return median_seconds


def run_tests(timeout: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
           "tests/test_device_aes.py", "tests/test_kernels.py"]
    _log("running " + " ".join(cmd[1:]))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return {"ok": False, "error": f"timed out after {timeout}s", "tail": out[-3000:]}
    out = proc.stdout + proc.stderr
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error|errors)", out)}
    ok = proc.returncode == 0 and counts.get("failed", 0) == 0 and "error" not in counts
    result: dict[str, Any] = {"ok": ok, "returncode": proc.returncode, "counts": counts,
                              "seconds": round(time.perf_counter() - t0, 1)}
    if not ok:
        result["tail"] = out[-3000:]
    return result


def bench_pack(dev: torch.device, repeats: int) -> dict[str, Any]:
    _log("pack/unpack vs copy")
    res = measure(TOKENS, device=str(dev), repeats=repeats)
    return {name.strip(): {"median_gbps": round(med, 3), "best_gbps": round(best, 3)}
            for name, (med, best) in res.items()}


def _aes_case(aes: TorchAesGcm, dev: torch.device, nbytes: int, repeats: int) -> dict[str, float]:
    timed = _timer(dev)
    nonce, aad = os.urandom(12), os.urandom(200)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    enc = timed(lambda: aes.encrypt_(buf, nonce, aad), repeats)
    ct = buf.clone()
    tag = aes.encrypt_(ct, nonce, aad)
    dec = timed(lambda: aes.decrypt_(buf, nonce, aad, tag), repeats, lambda: buf.copy_(ct))
    return {"encrypt_gbps": round(nbytes / enc / 1e9, 3), "decrypt_gbps": round(nbytes / dec / 1e9, 3)}


def bench_aes(dev: torch.device, repeats: int) -> dict[str, Any]:
    aes = TorchAesGcm(os.urandom(32), dev)
    out: dict[str, Any] = {}
    for nbytes in (2 << 20, llama3_8b(KVLayout.KV_FIRST).chunk_nbytes(TOKENS)):
        _log(f"AES-GCM on {nbytes} bytes")
        out[f"{nbytes}_bytes"] = _aes_case(aes, dev, nbytes, repeats)
    host, nonce, aad = os.urandom(2 << 20), os.urandom(12), os.urandom(200)
    cpu = AESGCM(os.urandom(32))
    sealed = bytearray(len(host) + 16)
    t = _timer(torch.device("cpu"))(lambda: cpu.encrypt_into(nonce, host, aad, sealed), repeats)
    out["cryptography_cpu_2MiB_encrypt_gbps"] = round(len(host) / t / 1e9, 3)
    return out


def bench_end_to_end(dev: torch.device, repeats: int) -> dict[str, Any]:
    timed = _timer(dev)
    g = llama3_8b(KVLayout.KV_FIRST)
    gen = torch.Generator().manual_seed(0)
    num_blocks = NUM_BLOCKS if dev.type == "cuda" else 4 * TOKENS // g.block_size  # RAM on CPU
    blocks = torch.randperm(num_blocks, generator=gen)[: TOKENS // g.block_size].to(dev)
    layers = [torch.randn(g.layer_shape(num_blocks), dtype=g.dtype, device=dev) for _ in range(g.num_layers)]
    kv = PagedKV(layers, g)
    slots = slots_from_block_ids(blocks, g.block_size, 0, TOKENS, device=dev)
    stage = torch.empty(g.chunk_shape(TOKENS), dtype=g.dtype, device=dev)
    stage_bytes = stage.view(-1).view(torch.uint8)
    nbytes = stage_bytes.numel()
    pin = dev.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    aes = TorchAesGcm(os.urandom(32), dev)
    cpu_aead = AESGCM(os.urandom(32))
    nonce, aad = os.urandom(12), os.urandom(200)
    sealed = bytearray(nbytes + 16)
    opened = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    tags: dict[str, bytes] = {}

    def store_plain() -> None:
        pack(kv, slots, g, out=stage)
        host.copy_(stage_bytes)

    def store_encrypted() -> None:
        pack(kv, slots, g, out=stage)
        tags["dev"] = aes.encrypt_(stage_bytes, nonce, aad)
        host.copy_(stage_bytes)

    def store_cpu_aead() -> None:
        pack(kv, slots, g, out=stage)
        host.copy_(stage_bytes)
        cpu_aead.encrypt_into(nonce, host.numpy().data, aad, sealed)

    def load_plain() -> None:
        stage_bytes.copy_(host, non_blocking=pin)
        unpack(stage, kv, slots, g)

    def load_encrypted() -> None:
        stage_bytes.copy_(host, non_blocking=pin)
        aes.decrypt_(stage_bytes, nonce, aad, tags["dev"])
        unpack(stage, kv, slots, g)

    def load_cpu_aead() -> None:
        cpu_aead.decrypt_into(nonce, sealed, aad, opened.numpy().data)
        stage_bytes.copy_(opened, non_blocking=pin)
        unpack(stage, kv, slots, g)

    out: dict[str, Any] = {"chunk_bytes": nbytes, "paged_blocks_per_layer": num_blocks,
                           "host_memory": "pinned" if pin else "pageable"}
    for section, cases in (
        ("store", {"plaintext": store_plain, "encrypted_on_device": store_encrypted,
                   "encrypted_on_host_cpu_aead": store_cpu_aead}),
        ("load", {"plaintext": load_plain, "encrypted_on_device": None,
                  "encrypted_on_host_cpu_aead": load_cpu_aead}),
    ):
        out[section] = {}
        for name, fn in cases.items():
            if section == "load" and name == "encrypted_on_device":
                store_encrypted()  # host holds the device ciphertext; loads leave it as it is
                fn = load_encrypted
            _log(f"{section}: {name}")
            t = timed(fn, repeats)
            out[section][name] = {"ms": round(t * 1e3, 3), "gbps": round(nbytes / t / 1e9, 3)}
    pack(kv, slots, g, out=stage)  # round trip check: what the device cipher stored loads back
    want = stage.clone()
    store_encrypted()
    stage.zero_()
    stage_bytes.copy_(host)
    aes.decrypt_(stage_bytes, nonce, aad, tags["dev"])
    out["round_trip_ok"] = bool(torch.equal(stage, want))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--repeats", type=int, default=None, help="default: 20 on cuda, 2 on cpu")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--test-timeout", type=int, default=200)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    dev = torch.device(args.device)
    summary: dict[str, Any] = {"device": str(dev), "torch": torch.__version__}
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            summary["error"] = "CUDA requested but torch.cuda.is_available() is False"
            print(json.dumps(summary))
            return 1
        summary["device_name"] = torch.cuda.get_device_name(dev)
    else:
        summary["note"] = f"CPU figures ({torch.get_num_threads()} torch threads), not GPU figures"
    repeats = args.repeats or (20 if dev.type == "cuda" else 2)
    failed = False
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("pack_unpack", lambda: bench_pack(dev, repeats)),
        ("aes_gcm", lambda: bench_aes(dev, repeats)),
        ("end_to_end", lambda: bench_end_to_end(dev, repeats)),
    ]
    if not args.skip_tests:
        sections.insert(0, ("tests", lambda: run_tests(args.test_timeout)))
    for name, fn in sections:
        try:
            summary[name] = fn()
            failed |= name == "tests" and not summary[name]["ok"]
        except Exception as exc:  # noqa: BLE001 -- a broken section is reported, the rest run
            summary[name] = {"error": f"{type(exc).__name__}: {exc}"}
            failed = True
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    summary["ok"] = not failed and summary.get("end_to_end", {}).get("round_trip_ok", False)
    summary["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
