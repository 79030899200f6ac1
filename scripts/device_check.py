"""One device check for ``kernels``: the GPU tests and the data path's throughput, one JSON summary.

    python scripts/device_check.py                  # on the CUDA device (a few minutes)
    python scripts/device_check.py --device cpu     # the same plumbing on the CPU (figures labelled;
                                                    # the Triton kernels under TRITON_INTERPRET=1)

Prints exactly one JSON object on stdout (progress goes to stderr); exits 1 if a test failed or a
section raised, 0 otherwise. Sections: ``tests`` (the ``-m cuda`` tests of tests/kernels and
tests/gateway/test_remote_device.py in a subprocess; skipped on a CPU-only host, as the counts
say), ``pack_unpack`` (beside a plain device copy), ``aes_gcm`` (``TorchAesGcm`` in place),
``store`` / ``load`` (one chunk end to end, beside the CPU AEAD route), ``triton`` (the fused
Triton AES-GCM beside the torch-ops one, encrypted vs plaintext offload, bit-identity against
``cryptography``, and its tests). On the CPU the Triton section runs on a small chunk: its figures
then say nothing about a GPU, its bit-identity does. Design notes: docs/architecture.md, section 5."""

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
if "--device=cpu" in sys.argv or ("--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (kernels decorate at import)

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gateway.bench.pack import NUM_BLOCKS, llama3_8b, measure
from kernels import KVLayout, PagedKV, pack, slots_from_block_ids, unpack
from kernels.aes_gcm import TorchAesGcm

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
           "tests/kernels/test_aes_gcm.py", "tests/kernels/test_kernels.py", "tests/gateway/test_remote_device.py"]
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


def _gbps(nbytes: int, seconds: float) -> float:
    """GB/s to 4 significant digits (interpreter figures are tiny, GPU ones large)."""
    return float(f"{nbytes / seconds / 1e9:.4g}")


def run_triton_tests(timeout: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider", "tests/kernels/test_triton_gcm.py"]
    _log("running " + " ".join(cmd[1:]))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout}s"}
    out = proc.stdout + proc.stderr
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error|errors)", out)}
    ok = proc.returncode == 0 and counts.get("failed", 0) == 0 and counts.get("passed", 0) > 0
    result: dict[str, Any] = {"ok": ok, "counts": counts, "seconds": round(time.perf_counter() - t0, 1)}
    if not ok:
        result["tail"] = out[-3000:]
    return result


def bench_triton(dev: torch.device, repeats: int, tokens: int | None) -> dict[str, Any]:
    """The fused Triton AES-GCM: throughput beside torch-ops AES-GCM and a plain D2H copy, encrypted
    vs plaintext offload of one chunk, and bit-identity with cryptography."""
    from kernels.device_aead import triton_available

    if not triton_available():
        return {"error": "triton is not installed"}
    from kernels.pack import chunk_rows
    from kernels.transfer import SegmentCopier
    from kernels.triton_gcm import TritonAesGcm

    cuda = dev.type == "cuda"
    timed = _timer(dev)
    key, nonce, aad = os.urandom(32), os.urandom(12), os.urandom(200)
    tri = TritonAesGcm(key, dev)
    ref = TorchAesGcm(key, dev)
    out: dict[str, Any] = {"mode": "compiled" if cuda else "interpreter (TRITON_INTERPRET=1)"}
    # bit-identity on a sample: odd length, AAD, every byte against cryptography
    sample = os.urandom(4111 if cuda else 1041)
    buf = torch.frombuffer(bytearray(sample), dtype=torch.uint8).to(dev)
    tag = tri.encrypt_(buf, nonce, aad)
    identical = bytes(buf.cpu().numpy().tobytes()) + tag == AESGCM(key).encrypt(nonce, sample, aad)
    # AES-GCM on the same bytes: Triton, torch-ops, a plain D2H copy
    sizes = (2 << 20, 32 << 20) if cuda else (4096,)
    for nbytes in sizes:
        _log(f"triton AES-GCM on {nbytes} bytes")
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        t_tri = timed(lambda: tri.encrypt_(data, nonce, aad), repeats)
        t_ref = timed(lambda: ref.encrypt_(data, nonce, aad), repeats)
        t_d2h = timed(lambda: host.copy_(data), repeats)
        out[f"{nbytes}_bytes"] = {
            "triton_encrypt_gbps": _gbps(nbytes, t_tri),
            "torch_ops_encrypt_gbps": _gbps(nbytes, t_ref),
            "d2h_copy_gbps": _gbps(nbytes, t_d2h),
        }
    # offload of one Llama-3-8B-shaped chunk: fused gather+encrypt+D2H vs pack+D2H
    g = llama3_8b(KVLayout.KV_FIRST)
    n_tok = tokens or (TOKENS if cuda else 2)
    if not cuda:
        g = type(g)(num_layers=2, num_kv_heads=g.num_kv_heads, head_size=g.head_size, dtype=g.dtype,
                    block_size=g.block_size, layout=g.layout)
    blocks_needed = -(-n_tok // g.block_size)
    num_blocks = max(4 * blocks_needed, 8) if not cuda else NUM_BLOCKS
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(g.layer_shape(num_blocks), dtype=g.dtype, device=dev) for _ in range(g.num_layers)]
    block_ids = torch.randperm(num_blocks, generator=gen)[:blocks_needed].to(dev)
    slots = slots_from_block_ids(block_ids, g.block_size, 0, n_tok, device=dev)
    kv, rows = chunk_rows(layers, slots, g)
    stage = torch.empty(g.chunk_nbytes(n_tok), dtype=torch.uint8, device=dev)
    chunk = stage.view(g.dtype).view(g.chunk_shape(n_tok))
    nbytes = stage.numel()
    seg = (2 << 20) if cuda else max(64, nbytes // 3)
    segs = [(s, min(s + seg, nbytes), i.to_bytes(12, "big"), aad) for i, s in enumerate(range(0, nbytes, seg))]
    copier = SegmentCopier(dev, nbytes)
    envelope = bytearray(nbytes)
    env_view = memoryview(envelope)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    tags: list[bytes] = []

    def offload_plain() -> None:
        pack(kv, slots, g, out=chunk)
        host.copy_(stage)

    def offload_encrypted() -> None:
        tags[:] = tri.gather_encrypt_(kv, rows, stage, segs, on_segment=lambda a, b: copier.issue_d2h(stage, a, b))
        for a, b, _, _ in segs:
            copier.fetch_d2h(stage, a, b, env_view[a:b])

    def load_plain() -> None:
        stage.copy_(host, non_blocking=cuda)
        unpack(chunk, kv, slots, g)

    def load_encrypted() -> None:
        for a, b, _, _ in segs:
            copier.h2d(env_view[a:b], stage, a, b)
        tri.decrypt_scatter_(stage, kv, rows, [(*s, t) for s, t in zip(segs, tags, strict=True)])

    _log(f"offload of a {nbytes}-byte chunk ({n_tok} tokens, {g.num_layers} layers)")
    res: dict[str, Any] = {"chunk_bytes": nbytes, "tokens": n_tok, "layers": g.num_layers, "segments": len(segs)}
    for name, fn in (("store_plaintext", offload_plain), ("store_encrypted", offload_encrypted)):
        t = timed(fn, repeats)
        res[name] = {"ms": round(t * 1e3, 3), "gbps": _gbps(nbytes, t)}
    want = pack(kv, slots, g).view(-1).view(torch.uint8).cpu().numpy().tobytes()
    offload_encrypted()
    fused_ok = all(
        bytes(env_view[a:b]) + t == AESGCM(key).encrypt(n, want[a:b], ad) for (a, b, n, ad), t in zip(segs, tags, strict=True)
    )
    host.copy_(stage)  # ciphertext: loads below decrypt it back into the cache (same plaintext)
    t = timed(load_encrypted, repeats)
    res["load_encrypted"] = {"ms": round(t * 1e3, 3), "gbps": _gbps(nbytes, t)}
    host.copy_(torch.frombuffer(bytearray(want), dtype=torch.uint8))
    t = timed(load_plain, repeats)
    res["load_plaintext"] = {"ms": round(t * 1e3, 3), "gbps": _gbps(nbytes, t)}
    res["store_encrypted_vs_plaintext"] = float(f'{res["store_plaintext"]["ms"] / res["store_encrypted"]["ms"]:.4g}')
    res["load_encrypted_vs_plaintext"] = float(f'{res["load_plaintext"]["ms"] / res["load_encrypted"]["ms"]:.4g}')
    res["round_trip_ok"] = pack(kv, slots, g).view(-1).view(torch.uint8).cpu().numpy().tobytes() == want
    out["offload"] = res
    out["bit_identical_to_cryptography"] = bool(identical and fused_ok)
    return out


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
    parser.add_argument("--triton-only", action="store_true", help="only the Triton section (and its tests)")
    parser.add_argument("--triton-tokens", type=int, default=None, help="chunk tokens of the Triton offload (default 256 on cuda, 2 on cpu)")
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
    if args.triton_only:
        sections = []
    sections.append(("triton", lambda: bench_triton(dev, repeats if dev.type == "cuda" else 1, args.triton_tokens)))
    if not args.skip_tests:
        if not args.triton_only:
            sections.insert(0, ("tests", lambda: run_tests(args.test_timeout)))
        sections.insert(0, ("triton_tests", lambda: run_triton_tests(args.test_timeout)))
    for name, fn in sections:
        try:
            summary[name] = fn()
            failed |= name in ("tests", "triton_tests") and not summary[name]["ok"]
            failed |= name == "triton" and not summary[name].get("bit_identical_to_cryptography", False)
        except Exception as exc:
            summary[name] = {"error": f"{type(exc).__name__}: {exc}"}
            failed = True
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    round_trips = [summary.get(k, {}) for k in ("end_to_end",) if not args.triton_only]
    round_trips.append(summary.get("triton", {}).get("offload", {}))
    summary["ok"] = not failed and all(r.get("round_trip_ok", False) for r in round_trips)
    summary["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
