"""Through vLLM's OpenAI server with the tenant middleware, the connector in remote mode.

A live kvgate server (tests/support/server_fixture.py: the development issuer, capabilities, the remote
data plane) and ``python -m vllm.entrypoints.openai.api_server`` with ``--middleware
gateway.vllm.middleware.KvgateMiddleware`` and the connector talking to that server. vLLM's own
prefix cache is on here: the middleware's cache_salt is what keeps tenants apart in it.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import httpx
import pytest

from tests.engine.engine_env import engine_env, openai_server, remote_connector, require_vllm
from tests.engine.tiny_model import build_tiny_llama, prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    require_vllm()
    from tests.support.server_fixture import running_server
    work = tmp_path_factory.mktemp("vllm-http")
    model_dir = build_tiny_llama(work / "model")
    trace = work / "trace.jsonl"
    secret = secrets.token_hex(32)
    with running_server(work / "kvgate", chunk_tokens=64) as live:
        import asyncio

        async def tenants() -> None:
            async with live.client() as http:
                for t in ("acme", "globex"):
                    await live.create_tenant(http, t)

        asyncio.run(tenants())
        ktc = remote_connector(live.base_url, 64, trace)
        env = engine_env(
            KVGATE_VLLM_ISSUER=live.base_url + "/dev-issuer", KVGATE_VLLM_GATEWAY_URL=live.base_url,
            KVGATE_VLLM_SALT_SECRET=secret, KVGATE_REMOTE_TOKEN=live.operator_token(),
        )
        with openai_server(work, model_dir, ktc, env, prefix_caching=True, start_s=240) as url:
            yield {"url": url, "live": live, "secret": bytes.fromhex(secret), "trace": trace}


def _settled(trace: Path, timeout_s: float = 60.0) -> list[dict]:
    """The connector's trace once every store it submitted has ended (stores are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = [json.loads(x) for x in trace.read_text().splitlines()]
        submitted = sum(e["event"] == "store_submit" for e in events)
        if sum(e["event"] == "store" and e["tokens"] > 0 for e in events) >= submitted:
            return events
        if time.monotonic() > deadline:
            raise AssertionError(f"stores still in flight after {timeout_s} s: {events}")
        time.sleep(0.05)


def _complete(stack, token: str | None, prompt: str, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(stack["url"] + "/v1/completions", json=body, headers=headers, timeout=120)


def _cached(r: httpx.Response) -> int:
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_no_or_bad_token_is_401_problem(stack):
    for token in (None, "not-a-jwt"):
        r = _complete(stack, token, prompt_words(10))
        assert r.status_code == 401, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.headers["www-authenticate"].lower().startswith("bearer")


def test_copied_cache_salt_gives_the_other_tenant_no_hit(stack):
    from gateway.vllm.salt import cache_salt

    live = stack["live"]
    a, b = live.token("acme", ("kv.worker",)), live.token("globex", ("kv.worker",))
    prompt = prompt_words(300, seed=7)
    first = _complete(stack, a, prompt)
    second = _complete(stack, a, prompt)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert _cached(second) >= 256  # positive control: A hits (vLLM's cache, kvgate behind it)
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    salt_a = cache_salt(stack["secret"], "acme", "default")
    forged = {"cache_salt": salt_a, "kv_transfer_params": {"kvgate_capability": "forged"}}
    r = _complete(stack, b, prompt, **forged)
    assert r.status_code == 200, r.text
    assert _cached(r) == 0
    assert r.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    events = _settled(stack["trace"])
    # remote mode stored A's prefix: 4 chunks of 64 (and a partial chunk of the prompt's last full blocks)
    assert any(e["event"] == "store" and e["stored_chunks"] >= 4 for e in events)
    lookups = [e for e in events if e["event"] == "lookup"]
    assert lookups[-1]["hit_tokens"] == 0  # B's lookup, in B's namespace, found nothing


def test_worker_without_kvgate_role_is_403(stack):
    live = stack["live"]
    r = _complete(stack, live.token("acme", ("kv.admin",)), prompt_words(10))  # admin cannot mint get/put
    assert r.status_code == 403, r.text


def test_secure_clear_orphans_vllms_own_prefix_cache(stack):
    """Issue 15, point 6: vLLM's prefix cache hits before a secure clear, misses right after it
    (the cache_salt follows the namespace epoch the clear bumps), and hits again after that --
    for a namespace clear and for a tenant clear."""
    import asyncio

    live = stack["live"]

    async def tenant() -> str:
        async with live.client() as http:
            return await live.create_tenant(http, "initech")

    asyncio.run(tenant())
    worker, admin = live.token("initech", ("kv.worker",)), live.admin_token("initech")
    prompt = prompt_words(300, seed=11)
    first = _complete(stack, worker, prompt)
    assert first.status_code == 200, first.text
    hit = _complete(stack, worker, prompt)
    assert _cached(hit) >= 256  # positive control: before the clear, a hit
    text = first.json()["choices"][0]["text"]
    for body in (
        {"scope": "namespace", "tenant": "initech", "namespace": "default"},
        {"scope": "tenant", "tenant": "initech"},
    ):
        r = httpx.post(live.base_url + "/v1/admin/clear", json=body, headers=live.headers(admin), timeout=60)
        assert r.status_code == 200, r.text
        after = _complete(stack, worker, prompt)
        assert after.status_code == 200, after.text
        assert _cached(after) == 0, f"vLLM served {_cached(after)} cached tokens right after a {body['scope']} clear"
        assert after.json()["choices"][0]["text"] == text
        again = _complete(stack, worker, prompt)
        assert _cached(again) >= 256  # positive control: the new epoch's blocks are cached again


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels`` (vLLM adds its own)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def test_the_connectors_counters_are_in_vllms_own_metrics(stack):
    live = stack["live"]
    token = live.token("acme", ("kv.worker",))
    before = httpx.get(stack["url"] + "/metrics", timeout=30).text
    prompt = prompt_words(300, seed=23)
    assert _complete(stack, token, prompt).status_code == 200
    _settled(stack["trace"])  # the store ended on the worker
    # the worker hands its counters over at its next step: one more request carries them
    assert _complete(stack, token, prompt_words(20, seed=24)).status_code == 200
    deadline = time.monotonic() + 30
    while True:
        after = httpx.get(stack["url"] + "/metrics", timeout=30).text
        moved = {
            (event, outcome): _metric(after, "vllm:kvgate_connector_events_total", event=event, outcome=outcome)
            - _metric(before, "vllm:kvgate_connector_events_total", event=event, outcome=outcome)
            for event, outcome in (("lookup", "ok"), ("store", "ok"))
        }
        stored = _metric(after, "vllm:kvgate_connector_tokens_total", kind="stored") - _metric(
            before, "vllm:kvgate_connector_tokens_total", kind="stored")
        if all(n >= 1 for n in moved.values()) and stored >= 256:
            break
        assert time.monotonic() < deadline, f"vLLM's /metrics did not show the connector's counters: {moved}, {stored}"
        time.sleep(0.5)
    # the scheduler's lookup and the worker's store both reached the one engine's metrics; nothing failed
    assert _metric(after, "vllm:kvgate_connector_events_total", event="store", outcome="tenant_unavailable") == 0
