"""On a real vLLM engine (CPU, tiny Llama): the connector in remote mode through the server's Unix
socket, loads borrowing a shared-memory region (``remote_shm_mb``; ``gateway/server/shm.py``).

The server is the real CLI (``kvgate serve --uds``) in its own process. Tenant A's second request
hits with the output of the no-connector run, its envelopes read in place from the region (the
server's byte counters say which way they went); tenant B on the same prompt gets nothing."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.engine.engine_env import require_vllm
from tests.engine.engine_steps import _ids, _run, _trace
from tests.engine.tiny_model import build_tiny_llama
from tests.support.uds_server import NOWHERE, serve, stop, wait_up

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK, BLOCK = 64, 32


def _shm_bytes_out(metrics: str, via: str = "shm") -> float:
    """Envelope bytes the server sent through shared memory (its OpenTelemetry byte counter):
    ``via`` "shm", copied into the worker's region, or "arena", lent in place."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("kvgate_chunk_bytes") and f'via="{via}"' in line and 'direction="out"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_remote_hits_through_shared_memory_match_the_engine_and_stay_with_their_tenant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_vllm()
    from tenancy.devissuer import DevIssuer

    sock = tmp_path / "kvgate.sock"
    proc, url, log = serve(tmp_path, sock, extra_env={"KVGATE_CHUNK_TOKENS": str(CHUNK)})
    try:
        wait_up(sock, proc, log)
        issuer = DevIssuer(tmp_path / "state", issuer_url=url + "/dev-issuer")
        operator = issuer.mint("platform", ["kv.operator"])
        caps = {}
        with httpx.Client(base_url=NOWHERE, transport=httpx.HTTPTransport(uds=str(sock)), timeout=30,
                          headers={"Authorization": f"Bearer {operator}"}) as http:
            for tenant, name in (("acme", "A"), ("globex", "B")):
                assert http.post("/v1/admin/tenants", json={"tenant": tenant}).status_code == 201
                r = http.post("/v1/capabilities", json={"tenant": tenant, "namespace": "default", "ops": ["lookup", "get", "put"], "ttl": 600})
                assert r.status_code == 201, r.text
                caps[name] = r.json()["capability"]
        model_dir = build_tiny_llama(tmp_path / "model")
        trace = tmp_path / "trace.jsonl"
        ktc = {
            "kv_connector": "KvgateConnector", "kv_connector_module_path": "gateway.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "mode": "remote", "remote_url": url, "remote_uds": str(sock), "remote_shm_mb": 16,
                "chunk_tokens": CHUNK, "trace_path": str(trace), "model_name": "tiny-llama", "load_policy": "always",
            },
        }
        monkeypatch.setenv("KVGATE_REMOTE_TOKEN", operator)
        P = _ids(model_dir, 300, 1)
        rows = _run({"model": str(model_dir), "block_size": BLOCK, "kv_transfer_config": ktc, "settings": {}, "caps": caps, "steps": [
            {"op": "gen", "name": "base_P", "ids": P},
            {"op": "gen", "name": "A_P1", "ids": P, "cap": "A"},
            {"op": "gen", "name": "A_P2", "ids": P, "cap": "A"},
            {"op": "gen", "name": "A_P3", "ids": P, "cap": "A"},
            {"op": "gen", "name": "B_P", "ids": P, "cap": "B"},
        ]}, tmp_path, "engine")
        r = {row["name"]: row for row in rows}
        with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {operator}"}) as tcp:
            metrics = tcp.get("/metrics").text
    finally:
        stop(proc)
    full = (300 - 1) // BLOCK * BLOCK  # 288: every full block before the last token
    for name in ("A_P2", "A_P3"):  # hits, and the one after it (the region lent again)
        assert r[name]["kv"]["kvgate"]["hit_tokens"] == full and r[name]["cached"] == full
        assert r[name]["tokens"] == r["base_P"]["tokens"]
    loads = [e for e in _trace(trace) if e["event"] == "load"]
    assert [e["loaded_tokens"] for e in loads] == [full, full] and all(e["failed_blocks"] == 0 for e in loads)
    # read in place from the arena, layer by layer beside the forward (RemoteBackend.layerwise)
    assert all(e.get("layerwise") for e in loads), loads
    # the trace says so too: each load line carries the worker's counts so far, and every envelope
    # of the two loads came in place (none through the stream, the region never found busy)
    assert loads[0]["arena_envelopes"] > 0 and loads[1]["arena_envelopes"] == 2 * loads[0]["arena_envelopes"], loads
    assert all(e["shm_region_busy"] == 0 and e["shm_envelopes"] == e["arena_envelopes"] for e in loads), loads
    # both loads' envelopes were read in place in the namespace's arena of the server's memory tier:
    # 288 tokens' KV (2 layers, 2 KV heads of 32, float32: 512 bytes a token) and the envelopes'
    # headers and tags, twice; nothing was copied into the region
    assert _shm_bytes_out(metrics, "arena") >= 2 * full * 512, re.findall(r"kvgate_chunk_bytes.*", metrics)
    assert _shm_bytes_out(metrics, "shm") == 0
    # the other tenant, the same prompt, on the same socket: nothing
    assert r["B_P"]["kv"]["kvgate"]["hit_tokens"] == 0 and r["B_P"]["cached"] == 0
    assert r["B_P"]["tokens"] == r["base_P"]["tokens"]
