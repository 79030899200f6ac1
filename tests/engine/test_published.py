"""Published prefixes on a real vLLM engine (CPU, tiny Llama), the connector in remote mode against a
live ``kvgate serve`` (Postgres registry; memory, disk and Redis tiers).

Four tenants in a scope and one outside it; a system prompt of whole chunks published (as text with the
model's tokenizer) and warmed by the engine itself with the scope's write capability (the publish
answer's). vLLM's own prefix cache is off: every cached token counted came through kvgate. One
module-scoped scenario drives three engine lifetimes; the tests check its pieces:

    engine 1: baselines (no capability) | warm-up | each member's first request | A again |
              B on A's private suffix | the outsider | prompts differing in a chunk's last token
    a member's client tries to store, overwrite and delete the scope's chunks through every route
    engine 2: members hit again, D with its own copies of the prefix stored beside the scope's
    a tenant clear of D (the scope untouched), then the prefix revoked
    engine 3: every member misses (its first request after the revoke)
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine.engine_env import require_vllm
from tests.engine.engine_steps import _ids, _run, _trace
from tests.engine.tiny_model import build_tiny_llama, prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK, BLOCK = 64, 32
SYSTEM = 512  # the published prefix: eight whole chunks
SUFFIX = 160  # each tenant's own question after it


def _base(model_dir: Path, live: Any, trace: Path, caps: dict[str, str]) -> dict[str, Any]:
    ktc = {
        "kv_connector": "KvgateConnector", "kv_connector_module_path": "gateway.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "mode": "remote", "remote_url": live.base_url, "chunk_tokens": CHUNK, "trace_path": str(trace),
            "model_name": "tiny-llama", "load_policy": "always",
        },
    }
    return {"model": str(model_dir), "block_size": BLOCK, "kv_transfer_config": ktc, "settings": {}, "caps": caps}


def _chain(live: Any, tokens: Sequence[int]) -> list[str]:
    """The whole chunks' chained hashes of ``tokens`` as the engine's connector computes them."""
    from tests.engine.engine_run import tiny_kv_model

    chunks = live.gateway.plane.chunks(tiny_kv_model(), list(tokens))
    return [c.chained_hash.hex() for c in chunks if c.num_tokens == CHUNK]


def _forged(scope: str) -> str:
    """A capability of the scope's owner signed with a key the gateway never had."""
    from tenancy.capabilities import CapabilityAuthority
    from tenancy.sharing import SCOPE_NAMESPACE, scope_owner

    return CapabilityAuthority({"k1": os.urandom(32)}, "k1").mint(
        scope_owner(scope), SCOPE_NAMESPACE, ("lookup", "get", "put", "pin"), 60)


def _route_attempts(http: httpx.Client, live: Any, member: str, cap: str, hashes: list[str], prefix_id: str) -> list[int]:
    """Every data and admin route a member's client may try on the scope's chunks with ``cap``."""
    from tests.engine.engine_run import tiny_kv_model

    h0 = hashes[0]
    hdr = live.headers(live.token(member, ("kv.worker", "kv.admin")), cap)
    out = [http.post("/v1/keys/envelopes", json={"purpose": "seal", "hashes": hashes}, headers=hdr).status_code]
    body = b"KVB1" + (1).to_bytes(4, "little") + bytes.fromhex(h0) + (64).to_bytes(8, "little") + b"\x00" * 64
    out.append(http.put("/v1/chunks", content=body, headers={**hdr, "Content-Type": "application/octet-stream"}).status_code)
    out.append(http.post("/v1/chunks/integrity-failures", json={"hash": h0, "envelope_sha256": "0" * 64}, headers=hdr).status_code)
    out.append(http.post("/v1/pins", json={"hash": h0}, headers=hdr).status_code)
    out.append(http.delete(f"/v1/pins/{h0}", headers=hdr).status_code)
    report = {"fingerprint": tiny_kv_model().fingerprint_digest, "hashes": hashes}
    out.append(http.post(f"/v1/admin/prefixes/{prefix_id}/chunks", json=report, headers=hdr).status_code)
    out.append(http.delete(f"/v1/admin/prefixes/{prefix_id}", headers=hdr).status_code)
    return out


async def _client_poisoning(live: Any, member: str, caps: Sequence[str], own: str, tokens: list[int]) -> dict[str, Any]:
    """A member's modified client stores other KV for the published tokens: with the scope's
    capabilities (forged, or the publisher's in its hands) and with its own, every chunk again."""
    from gateway.errors import AccessDenied
    from gateway.remote.client import RemoteGateway
    from tests.engine.engine_run import tiny_kv_model
    from tests.support.gw import random_cache

    model = tiny_kv_model()
    blocks = list(range(len(tokens) // BLOCK))
    poison = random_cache(model.geometry, len(blocks) + 4, seed=4242)
    refused = 0
    for cap in caps:
        client = RemoteGateway(live.base_url, live.worker_token(member), chunk_tokens=CHUNK)

        async def held(c: str = cap) -> str:
            return c

        client.capability = held  # type: ignore[method-assign]
        try:
            await client.store(model, tokens, poison, block_ids=blocks, skip_existing=False)
        except AccessDenied:
            refused += 1
        finally:
            await client.aclose()
    client = RemoteGateway(live.base_url, live.worker_token(member), chunk_tokens=CHUNK)

    async def held_own() -> str:
        return own

    client.capability = held_own  # type: ignore[method-assign]
    try:
        default = await client.store(model, tokens, poison, block_ids=blocks)
        forced = await client.store(model, tokens, poison, block_ids=blocks, skip_existing=False)
    finally:
        await client.aclose()
    return {"refused": refused, "own_default_stored": default.stored, "own_forced_stored": forced.stored}


def _scope_copies(live: Any, scope: str) -> int:
    """Envelopes of the scope's owner held by any tier of the server (its owner label)."""
    from tenancy.sharing import scope_owner

    rt = live.runtime

    async def count() -> int:
        await rt.tiers.flush()
        owner = rt.resolver.owner_label(scope_owner(scope))
        n = 0
        for tier in rt.tiers.tiers:
            n += sum(1 for k in await tier.list_keys() if k.owner == owner)
        return n

    async def go() -> int:
        return await live.call(count)

    return asyncio.run(go())


def _audit(live: Any, action: str) -> list[dict[str, Any]]:
    from tests.support.audit_events import live_rows

    return asyncio.run(live_rows(live, action))


def _mint(http: httpx.Client, live: Any, tenants: dict[str, str]) -> dict[str, str]:
    """Fresh capabilities (lookup, get, put) of each tenant, as its own worker mints them."""
    out = {}
    for name, tenant in tenants.items():
        r = http.post("/v1/capabilities", json={"namespace": "default", "ops": ["lookup", "get", "put"], "ttl": 600},
                      headers=live.headers(live.worker_token(tenant)))
        assert r.status_code == 201, r.text
        out[name] = r.json()["capability"]
    return out


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    import redis

    from tests.engine.engine_env import redis_or_fail
    from tests.engine.engine_run import tiny_kv_model
    from tests.support.server_fixture import running_server, scratch_pg_database

    redis_url = redis_or_fail()
    work = tmp_path_factory.mktemp("vllm-published")
    model_dir = build_tiny_llama(work / "model")
    trace = work / "trace.jsonl"
    rprefix = f"kvgate-published-{secrets.token_hex(4)}:"
    try:
        with scratch_pg_database() as db, running_server(
            work / "kvgate", db, tiers=["memory", "disk", "redis"], redis_url=redis_url, redis_prefix=rprefix,
            chunk_tokens=CHUNK,
        ) as live, httpx.Client(base_url=live.base_url, timeout=60) as http, pytest.MonkeyPatch.context() as mp:
            op = live.headers(live.operator_token())
            tenants = {k: f"{k.lower()}-{secrets.token_hex(3)}" for k in ("A", "B", "C", "D", "O")}
            for tenant in tenants.values():
                assert http.post("/v1/admin/tenants", json={"tenant": tenant}, headers=op).status_code == 201
            scope = f"support-{secrets.token_hex(3)}"
            members = [tenants[k] for k in "ABCD"]
            r = http.post("/v1/admin/scopes", json={"name": scope, "members": members}, headers=op)
            assert r.status_code == 201, r.text
            sys_ids = _ids(model_dir, SYSTEM, 101)
            # published as text with the model's tokenizer (a directory on the server's host)
            r = http.post("/v1/admin/prefixes", json={
                "scope": scope, "model": "tiny-llama", "text": prompt_words(SYSTEM, 101), "tokenizer": str(model_dir),
                "add_special_tokens": False,
            }, headers=op)
            assert r.status_code == 201, r.text
            pub = r.json()
            assert pub["digest"] == hashlib.sha256(struct.pack(f"<{SYSTEM}i", *sys_ids)).hexdigest()
            hashes = _chain(live, sys_ids)
            # the warm-up's report: the chunks it is about to store (checked against the tokens)
            r = http.post(f"/v1/admin/prefixes/{pub['id']}/chunks",
                          json={"fingerprint": tiny_kv_model().fingerprint_digest, "hashes": hashes},
                          headers=live.headers(live.operator_token(), pub["capability"]))
            assert r.status_code == 200 and r.json()["recorded"] == SYSTEM // CHUNK, r.text

            suffix = {k: _ids(model_dir, SUFFIX, seed) for k, seed in (("A", 11), ("B", 12), ("C", 13), ("D", 14))}
            P = {k: sys_ids + s for k, s in suffix.items()}
            off0, off3 = list(P["A"]), list(P["A"])
            off0[CHUNK - 1] = sys_ids[CHUNK - 2]  # the last token of chunk 0 differs
            off3[4 * CHUNK - 1] = sys_ids[4 * CHUNK - 2]  # the last token of chunk 3 differs
            assert off0[CHUNK - 1] != sys_ids[CHUNK - 1] and off3[4 * CHUNK - 1] != sys_ids[4 * CHUNK - 1]
            later = {k: sys_ids + _ids(model_dir, SUFFIX, seed) for k, seed in (("A", 21), ("B", 22), ("C", 23), ("D", 24))}

            # the engine's service token is an operator's: it carries every tenant's capability
            mp.setenv("KVGATE_REMOTE_TOKEN", live.operator_token())
            caps = {**_mint(http, live, tenants), "W": pub["capability"]}
            denied_0 = len(_audit(live, "authz.denied"))
            first = _run({**_base(model_dir, live, trace, caps), "steps": [
                *({"op": "gen", "name": f"base_{k}", "ids": P[k]} for k in "ABCD"),
                {"op": "gen", "name": "base_off0", "ids": off0},
                {"op": "gen", "name": "base_off3", "ids": off3},
                {"op": "gen", "name": "warm", "ids": sys_ids, "cap": "W", "max_tokens": 1},
                *({"op": "gen", "name": f"{k}1", "ids": P[k], "cap": k} for k in "ABCD"),
                {"op": "gen", "name": "A2", "ids": P["A"], "cap": "A"},
                {"op": "gen", "name": "B_on_A", "ids": P["A"], "cap": "B"},
                {"op": "gen", "name": "O_on_A", "ids": P["A"], "cap": "O"},
                {"op": "gen", "name": "C_off0", "ids": off0, "cap": "C"},
                {"op": "gen", "name": "C_off3", "ids": off3, "cap": "C"},
            ]}, work, "engine1")
            copies_warm = _scope_copies(live, scope)
            metrics = http.get("/metrics", headers=op).text
            runs = {"engine1": len(_trace(trace))}

            # poisoning: member D's client, the scope's hash, forged, stolen and own capabilities
            own_d = _mint(http, live, {"D": tenants["D"]})["D"]
            statuses = {
                "forged": _route_attempts(http, live, tenants["D"], _forged(scope), hashes, pub["id"]),
                "stolen": _route_attempts(http, live, tenants["D"], pub["capability"], hashes, pub["id"]),
                "own": _route_attempts(http, live, tenants["D"], own_d, hashes, pub["id"]),
            }
            clear_scope = http.post("/v1/admin/clear", json={"scope": "tenant", "tenant": f"scope:{scope}"},
                                    headers=live.headers(live.admin_token(tenants["D"]))).status_code
            client = asyncio.run(_client_poisoning(live, tenants["D"], [_forged(scope), pub["capability"]], own_d, sys_ids))
            denied_1 = len(_audit(live, "authz.denied"))
            copies_poisoned = _scope_copies(live, scope)

            caps2 = _mint(http, live, tenants)
            second = _run({**_base(model_dir, live, trace, caps2), "steps": [
                *({"op": "gen", "name": f"base_later_{k}", "ids": later[k]} for k in "CD"),
                {"op": "gen", "name": "D_after_poison", "ids": P["D"], "cap": "D"},
                {"op": "gen", "name": "D_later", "ids": later["D"], "cap": "D"},
                {"op": "gen", "name": "C_later", "ids": later["C"], "cap": "C"},
            ]}, work, "engine2")
            runs["engine2"] = len(_trace(trace))

            # D's own copies go with a clear of D; the scope stays whole
            r = http.post("/v1/admin/clear", json={"scope": "tenant", "tenant": tenants["D"]},
                          headers=live.headers(live.admin_token(tenants["D"])))
            assert r.status_code == 200, r.text
            copies_after_clear = _scope_copies(live, scope)
            r = http.delete(f"/v1/admin/prefixes/{pub['id']}", headers=op)
            assert r.status_code == 200, r.text
            revoked = r.json()
            copies_revoked = _scope_copies(live, scope)
            fresh = {k: sys_ids + _ids(model_dir, SUFFIX, seed) for k, seed in (("B", 32), ("C", 33), ("D", 34))}
            caps3 = _mint(http, live, tenants)
            third = _run({**_base(model_dir, live, trace, caps3), "steps": [
                *({"op": "gen", "name": f"base_fresh_{k}", "ids": fresh[k]} for k in "BCD"),
                # each member's first request after the revoke (a miss stores the prefix in the
                # member's own namespace, which its later requests then hit): A on its own prompt
                {"op": "gen", "name": "A_revoked_own", "ids": P["A"], "cap": "A"},
                *({"op": "gen", "name": f"{k}_revoked", "ids": fresh[k], "cap": k} for k in "BCD"),
            ]}, work, "engine3")
            events = _trace(trace)
            audit = {a: _audit(live, a) for a in ("prefix.publish", "prefix.warm", "prefix.revoke")}
            yield {
                "r": {row["name"]: row for row in first + second + third}, "trace": events, "runs": runs,
                "pub": pub, "scope": scope, "statuses": statuses, "clear_scope": clear_scope, "client": client,
                "denied": (denied_0, denied_1), "copies": (copies_warm, copies_poisoned, copies_after_clear, copies_revoked),
                "revoked": revoked, "audit": audit, "sys_ids": sys_ids, "metrics": metrics,
            }
    finally:
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(match=rprefix + "*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()


def _hit(row: dict[str, Any]) -> int:
    return int(row["kv"]["kvgate"]["hit_tokens"])


def test_published_warm_up_through_the_engine_stores_the_scope(scenario):
    r = scenario["r"]
    assert _hit(r["warm"]) == 0  # nothing of the scope before its warm-up
    assert scenario["copies"][0] >= SYSTEM // CHUNK  # its eight chunks, in each tier that took them
    # the engine's first store is the warm-up's (the baselines before it carry no capability)
    stores = [e for e in scenario["trace"][: scenario["runs"]["engine1"]] if e["event"] == "store" and e["tokens"] > 0]
    assert stores and stores[0]["stored_chunks"] == SYSTEM // CHUNK


def test_published_each_member_hits_the_prefix_with_the_output_of_no_connector(scenario):
    r = scenario["r"]
    for k in "ABCD":
        assert _hit(r[f"{k}1"]) == SYSTEM and r[f"{k}1"]["cached"] == SYSTEM, k  # whole chunks, from the scope
        assert r[f"{k}1"]["tokens"] == r[f"base_{k}"]["tokens"], k
    # the connector's trace: the engine's first four loads are the members' first requests
    first = [e for e in scenario["trace"] if e["event"] == "load"][:4]
    assert len(first) == 4 and all(e["loaded_tokens"] == SYSTEM and e["failed_blocks"] == 0 for e in first)
    # the server counts what it read from the scope: the members' first loads, A's second and
    # B's on A's prompt (eight chunks each) and the three of the prompt that differs in chunk 3
    shared = [line for line in scenario["metrics"].splitlines() if line.startswith("kvgate_shared_chunks_loaded_total")]
    assert shared and float(shared[0].rsplit(" ", 1)[1]) >= 6 * SYSTEM // CHUNK + 3, shared
    # positive control: A's second request hits its own suffix too, in its own namespace
    full = (SYSTEM + SUFFIX - 1) // BLOCK * BLOCK
    assert _hit(r["A2"]) == full and r["A2"]["tokens"] == r["base_A"]["tokens"]


def test_published_member_never_hits_anothers_private_suffix_and_the_outsider_misses(scenario):
    r = scenario["r"]
    assert _hit(r["A2"]) > SYSTEM  # A's suffix is stored (positive control)
    assert _hit(r["B_on_A"]) == SYSTEM and r["B_on_A"]["cached"] == SYSTEM  # the prefix, never A's suffix
    assert r["B_on_A"]["tokens"] == r["base_A"]["tokens"]
    assert _hit(r["O_on_A"]) == 0 and r["O_on_A"]["cached"] == 0
    assert r["O_on_A"]["tokens"] == r["base_A"]["tokens"]


def test_published_prompt_differing_in_a_chunks_last_token_loads_nothing_from_that_chunk_on(scenario):
    r = scenario["r"]
    assert _hit(r["C_off0"]) == 0 and r["C_off0"]["cached"] == 0
    assert _hit(r["C_off3"]) == 3 * CHUNK and r["C_off3"]["cached"] == 3 * CHUNK  # chunks 0..2 only
    assert r["C_off0"]["tokens"] == r["base_off0"]["tokens"] and r["C_off3"]["tokens"] == r["base_off3"]["tokens"]


def test_published_member_poisoning_is_refused_audited_and_the_next_hit_is_still_right(scenario):
    s, r = scenario, scenario["r"]
    assert all(code == 403 for code in s["statuses"]["forged"]), s["statuses"]
    assert all(code == 403 for code in s["statuses"]["stolen"]), s["statuses"]
    assert s["statuses"]["own"][-2:] == [403, 403], s["statuses"]  # warm report and revoke: operators only
    assert s["clear_scope"] == 422  # a scope's owner is no tenant name
    assert s["client"]["refused"] == 2  # the modified client's stores with the scope's capabilities
    assert s["client"]["own_default_stored"] == 0  # its own: the scope's chunks are there, nothing stored
    assert s["client"]["own_forced_stored"] == SYSTEM // CHUNK  # ... or into its own namespace only
    denied_0, denied_1 = s["denied"]
    assert denied_1 >= denied_0 + 16
    copies_warm, copies_poisoned, copies_after_clear, _ = s["copies"]
    assert copies_poisoned == copies_warm == copies_after_clear  # the scope holds what the warm-up stored
    # the next member hits, D's with its own poisoned copies beside the scope's: the published bytes
    assert _hit(r["D_after_poison"]) == (SYSTEM + SUFFIX - 1) // BLOCK * BLOCK
    assert r["D_after_poison"]["tokens"] == r["base_D"]["tokens"]
    for k in "CD":
        assert _hit(r[f"{k}_later"]) == SYSTEM and r[f"{k}_later"]["tokens"] == r[f"base_later_{k}"]["tokens"]


def test_published_revoke_every_member_misses_and_no_scope_ciphertext_is_left(scenario):
    s, r = scenario, scenario["r"]
    assert s["revoked"]["scope_shredded"] is True and s["revoked"]["destroyed_key_versions"]
    assert s["copies"][-1] == 0  # no ciphertext of the scope in any tier
    for k in "BCD":
        assert _hit(r[f"{k}_revoked"]) == 0 and r[f"{k}_revoked"]["cached"] == 0, k
        assert r[f"{k}_revoked"]["tokens"] == r[f"base_fresh_{k}"]["tokens"], k
    # A's own suffix chunks chain from the prefix it no longer reads: nothing of them either
    assert _hit(r["A_revoked_own"]) == 0 and r["A_revoked_own"]["cached"] == 0
    assert r["A_revoked_own"]["tokens"] == r["base_A"]["tokens"]
    pid = s["pub"]["id"]
    for action in ("prefix.publish", "prefix.warm", "prefix.revoke"):
        assert len([e for e in s["audit"][action] if e["details"].get("prefix_id") == pid]) == 1, action
    publish = next(e for e in s["audit"]["prefix.publish"] if e["details"]["prefix_id"] == pid)
    assert publish["details"]["digest"] == s["pub"]["digest"] and publish["details"]["tokenizer"]
