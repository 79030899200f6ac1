"""A published prefix's warm-up through the tenant middleware and the connector's scheduler side.

The middleware over a real uvicorn server on a TCP port and a Unix socket (the trusted peer), in
front of an app that echoes the body it was given, with a live kvgate server on Postgres that
published the prefix. As the attacker would run it: a member (its own valid token, or none) that
sends the publish answer's capability as a warm-up from an untrusted peer, or beside
X-Forwarded-For, is refused (403, audited, nothing reaches the app), and the same capability in a
member request's body is replaced by the member's own; beside it, the trusted peer's warm-up and an
operator's reach the engine with the scope's capability and a fresh cache_salt.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.errors import AccessDenied
from gateway.vllm.scheduler import RequestView, SchedulerSide, warm_up_of
from tenancy.capabilities import read_unverified
from tests.gateway.vllm.test_tenant_header import _env, serve
from tests.support.audit_events import live_rows
from tests.support.server_fixture import LiveServer, running_server, scratch_pg_database

CHUNK = 64


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with scratch_pg_database() as url, running_server(tmp_path_factory.mktemp("warm-up"), url, chunk_tokens=CHUNK) as server:
        yield server


@pytest.fixture
async def published(live: LiveServer) -> dict[str, Any]:
    """A member tenant, a scope of it and a prefix of two chunks published there."""
    member, scope = f"m-{secrets.token_hex(3)}", f"s-{secrets.token_hex(3)}"
    op = live.headers(live.operator_token())
    async with live.client() as http:
        await live.create_tenant(http, member)
        r = await http.post("/v1/admin/scopes", json={"name": scope, "members": [member]}, headers=op)
        assert r.status_code == 201, r.text
        r = await http.post("/v1/admin/prefixes", json={"scope": scope, "model": "m", "token_ids": list(range(1, 2 * CHUNK + 1))},
                            headers=op)
        assert r.status_code == 201, r.text
    return {"member": member, "scope": scope, **r.json()}


def _warm_headers(pub: dict[str, Any], **extra: str) -> dict[str, str]:
    return {"X-KV-Warm-Up": pub["id"], "X-KV-Capability": pub["capability"], **extra}


async def _complete(c: httpx.AsyncClient, headers: dict[str, str], **body: Any) -> httpx.Response:
    doc = {"prompt": list(range(1, 2 * CHUNK + 1)), "max_tokens": 1, **body}
    return await c.post("/v1/completions", json=doc, headers=headers)


def _refused(r: httpx.Response, status: int = 403) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert "prompt" not in r.text  # nothing reached the app


def _warm_up_served(r: httpx.Response, pub: dict[str, Any]) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    body: dict[str, Any] = json.loads(r.content)
    assert body["kv_transfer_params"] == {"kvgate_capability": pub["capability"], "kvgate_warm_up": pub["id"]}
    assert body["cache_salt"].startswith("warm-up:")
    return body


async def _warm_denials(live: LiveServer) -> list[dict[str, Any]]:
    return [row for row in await live_rows(live, "authz.denied") if str(row["details"].get("reason", "")).startswith("warm-up")]


async def test_published_warm_up_from_an_untrusted_peer_is_refused_and_audited_beside_the_trusted_socket(live, published, tmp_path):
    pub, member = published, published["member"]
    before = len(await _warm_denials(live))
    with serve(_middleware(live, tmp_path)) as eng:
        async with httpx.AsyncClient(base_url=eng.tcp, timeout=30) as c:
            # a member holding the scope's capability (stolen, or the publisher's leaked) sends it as a warm-up
            _refused(await _complete(c, _warm_headers(pub, Authorization=f"Bearer {live.worker_token(member)}")))
            _refused(await _complete(c, _warm_headers(pub)))  # and with no token at all
            _refused(await _complete(c, {"X-KV-Capability": pub["capability"]}))  # the capability header alone
            # the same capability in the body of its own request: replaced by the member's own, no warm-up
            r = await _complete(c, {"Authorization": f"Bearer {live.worker_token(member)}"},
                                kv_transfer_params={"kvgate_capability": pub["capability"], "kvgate_warm_up": pub["id"]})
            assert r.status_code == 200, r.text
            params = json.loads(r.content)["kv_transfer_params"]
            assert read_unverified(params["kvgate_capability"]).tenant == member and "kvgate_warm_up" not in params
            assert warm_up_of(params) is None
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=eng.uds), base_url="http://engine", timeout=30) as c:
            # positive control: the trusted peer's warm-up reaches the engine, with a salt of its own each time
            first = _warm_up_served(await _complete(c, _warm_headers(pub), cache_salt="chosen",
                                                    kv_transfer_params={"kvgate_capability": "other"}), pub)
            second = _warm_up_served(await _complete(c, _warm_headers(pub)), pub)
            assert first["cache_salt"] != second["cache_salt"]
            # a warm-up is a completion of a scope's capability for a prefix id
            _refused(await c.post("/v1/chat/completions", json={"messages": []}, headers=_warm_headers(pub)), 400)
            _refused(await _complete(c, _warm_headers(pub, **{"X-KV-Warm-Up": "not-an-id"})), 400)
            own = (await live_capability(live, member))
            _refused(await _complete(c, _warm_headers(pub, **{"X-KV-Capability": own})), 400)
    rows = (await _warm_denials(live))[before:]
    assert sorted(row["details"]["reason"] for row in rows) == ["warm-up from an untrusted peer"] * 3
    assert all(row["outcome"] == "denied" for row in rows)


async def test_published_warm_up_beside_x_forwarded_for_is_refused_and_an_operator_token_passes(live, published, tmp_path):
    pub = published
    before = len(await _warm_denials(live))
    # the engine trusts its loopback address too: a request naming another address in
    # X-Forwarded-For may carry that address as its peer, so it is never trusted
    with serve(_middleware(live, tmp_path, KVGATE_VLLM_TRUSTED_PEERS="unix,127.0.0.1")) as eng:
        async with httpx.AsyncClient(base_url=eng.tcp, timeout=30) as c:
            _refused(await _complete(c, _warm_headers(pub, **{"X-Forwarded-For": "127.0.0.1"})))
            _warm_up_served(await _complete(c, _warm_headers(pub)), pub)  # the allowlisted address itself
    with serve(_middleware(live, tmp_path)) as eng:
        async with httpx.AsyncClient(base_url=eng.tcp, timeout=30) as c:
            # from an untrusted peer an operator's token admits it; an admin's of the member does not
            _warm_up_served(await _complete(c, _warm_headers(pub, Authorization=f"Bearer {live.operator_token()}")), pub)
            _refused(await _complete(c, _warm_headers(pub, Authorization=f"Bearer {live.admin_token(pub['member'])}")))
    rows = (await _warm_denials(live))[before:]
    assert sorted(row["details"]["reason"] for row in rows) == [
        "warm-up beside X-Forwarded-For on TCP", "warm-up from an untrusted peer"]


def _middleware(live: LiveServer, spool: Path, **over: str) -> Any:
    from gateway.vllm.middleware import KvgateMiddleware
    from tests.support.asgi import echo_body

    return KvgateMiddleware(echo_body, env=_env(live, spool, **over))


async def live_capability(live: LiveServer, tenant: str) -> str:
    async with live.client() as http:
        return await live.capability(http, tenant)


# -- the connector's scheduler side ---------------------------------------------------------------


class _Reports:
    def __init__(self, fail: BaseException | None = None) -> None:
        self.calls: list[tuple[str, str, list[int]]] = []
        self.fail = fail

    def __call__(self, cap: str, prefix_id: str, prompt: Sequence[int]) -> int:
        self.calls.append((cap, prefix_id, list(prompt)))
        if self.fail is not None:
            raise self.fail
        return len(prompt) // CHUNK


def _side(report: _Reports, **kw: Any) -> SchedulerSide:
    return SchedulerSide(CHUNK, 32, lambda cap, tokens: (0, ""), report=report, **kw)


def test_published_warm_up_reports_its_chunks_once_before_the_lookup_and_a_member_request_reports_nothing():
    report = _Reports()
    side = _side(report)
    prompt = list(range(2 * CHUNK))
    warm = RequestView("w", prompt, "scope-cap", warm_up="a" * 24)
    assert side.matched_tokens(warm, 0) == 0
    assert side.matched_tokens(warm, 0) == 0  # asked again (a preemption): reported once
    assert report.calls == [("scope-cap", "a" * 24, prompt)]
    assert side.stats.get("warm_report") == 1
    side.finish("w")
    side.matched_tokens(RequestView("m", prompt, "member-cap"), 0)  # a member's request
    side.matched_tokens(RequestView("n", prompt, None, warm_up="a" * 24), 0)  # no capability: nothing
    assert len(report.calls) == 1
    # a consumer that never stores reports nothing either
    consumer = _side(report, stores=False)
    consumer.matched_tokens(RequestView("c", prompt, "scope-cap", warm_up="a" * 24), 0)
    assert len(report.calls) == 1


def test_published_warm_up_report_refused_is_counted_and_the_request_goes_on():
    report = _Reports(AccessDenied("chunk not published"))
    side = _side(report)
    assert side.matched_tokens(RequestView("w", list(range(2 * CHUNK)), "cap", warm_up="b" * 24), 0) == 0
    assert side.stats.get("warm_report", "denied") == 1 and side.stats.get("warm_report") == 0


def test_published_warm_up_param_must_name_a_prefix_id():
    assert warm_up_of({"kvgate_warm_up": "c" * 24}) == "c" * 24
    for bad in ({"kvgate_warm_up": "C" * 24}, {"kvgate_warm_up": 1}, {"kvgate_warm_up": "c" * 25}, {}, None, "x"):
        assert warm_up_of(bad) is None
