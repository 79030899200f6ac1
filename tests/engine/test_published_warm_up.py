"""Publishing starts the warm-up on a named engine: ``kvgate prefixes publish --warm-engine``.

A live kvgate server (Postgres, memory and disk tiers) and vLLM's OpenAI server (CPU, tiny Llama)
with the tenant middleware and the connector in remote mode, its service token an operator's; the
middleware trusts its own loopback address (``KVGATE_VLLM_TRUSTED_PEERS``). vLLM's own prefix cache
is off: every cached token counted came through kvgate. The command publishes a prefix of eight
chunks and sends the engine its one warm-up request; nothing else is done by hand (no chunk
report, no capability injected): the connector reports the chunks and stores them, and the
command says the prefix is warm. Then a member's first request loads the prefix with the output
of an outsider's (which loads nothing), and a warm-up sent beside X-Forwarded-For, which may carry
any address as the peer's, is refused.
"""

from __future__ import annotations

import importlib
import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.engine.engine_env import engine_env, openai_server, remote_connector, require_vllm
from tests.engine.engine_steps import _ids
from tests.engine.tiny_model import build_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 64
SYSTEM = 512  # eight whole chunks
SUFFIX = 96


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    from tests.support.server_fixture import running_server, scratch_pg_database
    work = tmp_path_factory.mktemp("vllm-warm-up")
    model_dir = build_tiny_llama(work / "model")
    trace = work / "trace.jsonl"
    with scratch_pg_database() as db, running_server(work / "kvgate", db, chunk_tokens=CHUNK) as live:
        ktc = remote_connector(live.base_url, CHUNK, trace)
        env = engine_env(
            KVGATE_VLLM_ISSUER=live.base_url + "/dev-issuer", KVGATE_VLLM_GATEWAY_URL=live.base_url,
            KVGATE_VLLM_SALT_SECRET=secrets.token_hex(32), KVGATE_REMOTE_TOKEN=live.operator_token(),
            KVGATE_VLLM_TRUSTED_PEERS="127.0.0.1",
        )
        with openai_server(work, model_dir, ktc, env, prefix_caching=False) as url:
            yield {"url": url, "live": live, "trace": trace, "model_dir": model_dir, "work": work}


def _complete(stack: dict[str, Any], token: str, ids: list[int]) -> httpx.Response:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0}
    return httpx.post(stack["url"] + "/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=120)


def _cached(r: httpx.Response) -> int:
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _publish(stack: dict[str, Any], scope: str, ids: list[int], *extra: str) -> tuple[int, dict[str, Any], str]:
    """``kvgate prefixes publish`` as an operator runs it, on the server's settings."""
    from typer.testing import CliRunner

    cli = importlib.import_module("gateway.cli.main")  # the package's ``main`` is the entry function

    tokens = stack["work"] / f"{scope}.json"
    tokens.write_text(json.dumps(ids))
    mp = pytest.MonkeyPatch()
    mp.setattr(cli, "_settings", lambda **kw: stack["live"].settings)
    try:
        res = CliRunner().invoke(cli.app, [
            "prefixes", "publish", scope, "--model", "tiny-llama", "--tokens-file", str(tokens), *extra,
        ])
    finally:
        mp.undo()
    out = res.stdout
    return res.exit_code, json.loads(out[out.index("{"):]) if "{" in out else {}, res.output


def _scope(live: Any, members: list[str]) -> str:
    scope = f"support-{secrets.token_hex(3)}"
    r = httpx.post(live.base_url + "/v1/admin/scopes", json={"name": scope, "members": members},
                   headers=live.headers(live.operator_token()), timeout=30)
    assert r.status_code == 201, r.text
    return scope


@pytest.fixture(scope="module")
def tenants(stack: dict[str, Any]) -> dict[str, str]:
    live = stack["live"]
    out = {k: f"{k.lower()}-{secrets.token_hex(3)}" for k in ("A", "B", "O", "P")}
    for t in out.values():
        r = httpx.post(live.base_url + "/v1/admin/tenants", json={"tenant": t}, headers=live.headers(live.operator_token()), timeout=30)
        assert r.status_code == 201, r.text
    return out


def test_published_with_warm_engine_stores_the_prefix_and_a_members_first_request_hits_it(stack, tenants):
    live, model_dir = stack["live"], stack["model_dir"]
    sys_ids = _ids(model_dir, SYSTEM, 101)
    prompt = sys_ids + _ids(model_dir, SUFFIX, 11)
    scope = _scope(live, [tenants["A"], tenants["B"]])
    # the outsider first: nothing of the scope exists, and it never reads it (the output of no connector)
    base = _complete(stack, live.worker_token(tenants["O"]), prompt)
    assert base.status_code == 200 and _cached(base) == 0, base.text
    code, doc, out = _publish(stack, scope, sys_ids, "--warm-engine", stack["url"], "--warm-timeout", "120")
    assert code == 0, out
    assert doc["warm"]["warm"] is True and doc["warm"]["engine"] == stack["url"], doc
    assert doc["warm"]["recorded"] == doc["warm"]["stored"] == SYSTEM // CHUNK == doc["whole_chunks"]
    # the connector's trace: its chunk report, then the store under the scope's capability
    events = [json.loads(line) for line in stack["trace"].read_text().splitlines()]
    reports = [e for e in events if e["event"] == "warm_report"]
    assert len(reports) == 1 and reports[0]["prefix"] == doc["id"] and reports[0]["recorded"] == SYSTEM // CHUNK
    assert any(e["event"] == "store" and e.get("stored_chunks") == SYSTEM // CHUNK for e in events)
    # a member's first request loads the prefix, with the outsider's output
    first = _complete(stack, live.worker_token(tenants["A"]), prompt)
    assert first.status_code == 200, first.text
    assert _cached(first) == SYSTEM
    assert first.json()["choices"][0]["text"] == base.json()["choices"][0]["text"]
    # an outsider's first request on the same prompt loads nothing (the first one stored its own copy)
    outsider = _complete(stack, live.worker_token(tenants["P"]), prompt)
    assert outsider.status_code == 200 and _cached(outsider) == 0
    assert outsider.json()["choices"][0]["text"] == base.json()["choices"][0]["text"]


def test_published_warm_up_beside_x_forwarded_for_is_refused_and_a_failed_warm_up_exits_non_zero(stack, tenants):
    live, model_dir = stack["live"], stack["model_dir"]
    sys_ids = _ids(model_dir, SYSTEM, 202)
    scope = _scope(live, [tenants["B"]])
    # publish without a warm-up, then a member holding the capability sends it as a warm-up from a
    # peer that says it forwards for the trusted address: refused before the engine sees it
    code, doc, out = _publish(stack, scope, sys_ids)
    assert code == 0 and "warm" not in doc, out
    r = httpx.post(stack["url"] + "/v1/completions", json={"model": "tiny", "prompt": sys_ids, "max_tokens": 1},
                   headers={"X-KV-Warm-Up": doc["id"], "X-KV-Capability": doc["capability"], "X-Forwarded-For": "127.0.0.1",
                            "Authorization": f"Bearer {live.worker_token(tenants['B'])}"}, timeout=60)
    assert r.status_code == 403, r.text
    member = _complete(stack, live.worker_token(tenants["B"]), sys_ids + _ids(model_dir, SUFFIX, 13))
    assert member.status_code == 200 and _cached(member) == 0  # nothing of the scope was stored
    # a warm-up aimed at an engine that is not there: the prefix is published, the command fails
    code, doc, out = _publish(stack, scope, sys_ids, "--warm-engine", "http://127.0.0.1:9", "--warm-timeout", "5")
    assert code == 1, out
    assert doc["warm"]["warm"] is False and "could not be reached" in doc["warm"]["error"]
