"""``kvgate prefixes publish --warm-engine``: the command line's side of the warm-up, on the CPU suite.

The command runs as an operator runs it (a subprocess on an embedded state directory); the engine
is an HTTP server in this process that does what the kvgate connector does with the request it is
sent, through the real embedded backend on the same state (``EmbeddedBackend.report_warm``, then
``store`` with the capability the request carried). ``POST /v1/admin/prefixes`` with
``warm_engine`` on a live server, whose engine stand-in uses the remote backend (the admin route
with an operator's service token, then the data plane). The vLLM engine itself is in
``tests/engine/test_published_warm_up.py``. Checked: the one request (its prompt, headers, body),
the answer's ``warm`` once the chunks are recorded and stored; an engine that refuses, one that
answers without storing, and one that cannot be reached exit 1 with the prefix still published.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.chunking import chain_hashes
from gateway.vllm.backend import Backend, EmbeddedBackend, RemoteBackend, close, start
from gateway.vllm.relay import read_body
from tests.gateway.test_cli import run
from tests.gateway.vllm.test_tenant_header import serve
from tests.support.gw import model_for, random_cache, small_geometry

CHUNK = 256  # the default chunk_tokens
PREFIX = list(range(1, 2 * CHUNK + 90))  # two whole chunks and a tail that is not shared


class Worker:
    """An engine's stand-in: answers ``status`` and, when ``warms``, reports and stores the
    prompt's chunks with the request's capability, as the connector does."""

    def __init__(self, backend: Backend, chunk: int = CHUNK, status: int = 200, warms: bool = True) -> None:
        self.backend, self.chunk = backend, chunk
        self.status, self.warms = status, warms
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.model = model_for(small_geometry())

    def _warm(self, cap: str, prefix_id: str, ids: list[int]) -> None:
        hashes = [c.chained_hash.hex() for c in chain_hashes(ids, self.model.fingerprint, self.chunk)]
        b = self.backend
        assert b.loop.call(b.report_warm(cap, prefix_id, self.model.fingerprint_digest, hashes)) == len(hashes)
        blocks = len(ids) // self.model.geometry.block_size
        layers = random_cache(self.model.geometry, blocks)
        assert b.loop.call(b.store(cap, self.model, ids, layers, list(range(blocks)))).stored == len(hashes)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = json.loads(await read_body(receive))
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.requests.append((headers, body))
        if self.status == 200 and self.warms:
            await asyncio.to_thread(self._warm, headers["x-kv-capability"], headers["x-kv-warm-up"], body["prompt"])
        answer = json.dumps({"detail": "the engine says no"} if self.status != 200 else {"choices": []}).encode()
        await send({"type": "http.response.start", "status": self.status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    run(tmp_path, "tenants", "create", "acme")
    run(tmp_path, "prefixes", "scope-create", "team", "--member", "acme")
    (tmp_path / "prefix.json").write_text(json.dumps(PREFIX))
    yield tmp_path


@pytest.fixture
def worker(state: Path) -> Iterator[Worker]:
    w = Worker(EmbeddedBackend({"state_dir": str(state), "memory_bytes": 64 << 20}))
    start(w.backend)
    try:
        yield w
    finally:
        close(w.backend)


def _publish(state: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    proc = run(state, "prefixes", "publish", "team", "--model", "m", "--tokens-file", str(state / "prefix.json"), *args,
               check=False)
    out = proc.stdout
    return proc.returncode, json.loads(out[out.index("{"):]) if "{" in out else {}, proc.stderr


def test_published_warm_engine_sends_one_request_and_reports_the_prefix_warm(state: Path, worker: Worker):
    with serve(worker) as eng:
        code, doc, err = _publish(state, "--warm-engine", eng.tcp, "--warm-model", "served", "--warm-timeout", "60")
    assert code == 0, err
    assert doc["warm"]["warm"] is True and doc["warm"]["recorded"] == doc["warm"]["stored"] == 2 == doc["whole_chunks"]
    [(headers, body)] = worker.requests  # one request
    assert headers["x-kv-warm-up"] == doc["id"] and headers["x-kv-capability"] == doc["capability"]
    assert "authorization" not in headers  # no token unless one is given
    assert body == {"prompt": PREFIX[: 2 * CHUNK], "max_tokens": 1, "temperature": 0, "model": "served"}


def test_published_warm_engine_that_refuses_or_stores_nothing_exits_1_and_the_prefix_stays(state: Path, worker: Worker):
    token = state / "op.token"
    token.write_text("operator-token\n")
    worker.status = 403
    with serve(worker) as eng:
        code, doc, err = _publish(state, "--warm-engine", eng.tcp, "--warm-token-file", str(token))
    assert code == 1 and doc["warm"]["warm"] is False and "403" in err and "the engine says no" in err, (doc, err)
    assert worker.requests[-1][0]["authorization"] == "Bearer operator-token"
    worker.status, worker.warms = 200, False  # an engine without kvgate's connector: nothing reported
    with serve(worker) as eng:
        code, doc, err = _publish(state, "--warm-engine", eng.tcp, "--warm-timeout", "2")
    assert code == 1 and "0 of 2 chunks were reported" in doc["warm"]["error"], (doc, err)
    code, doc, err = _publish(state, "--warm-engine", "http://127.0.0.1:9", "--warm-timeout", "2")
    assert code == 1 and "could not be reached" in doc["warm"]["error"] and doc["capability"], (doc, err)
    listed = run(state, "prefixes", "list").stdout
    assert listed.count("active") == 3  # each publication stands; its capability can warm it later
    # --warm-model without --warm-engine is a usage error, before anything is published
    code, _, err = _publish(state, "--warm-model", "x")
    assert code == 2 and "--warm-engine" in err


def test_published_rest_warm_engine_warms_through_the_remote_backend(tmp_path: Path):
    from tests.support.server_fixture import running_server

    chunk, prefix = 64, list(range(1, 2 * 64 + 10))
    with running_server(tmp_path / "kvgate", chunk_tokens=chunk) as live:
        op = live.headers(live.operator_token())
        with httpx.Client(base_url=live.base_url, timeout=120) as http:
            assert http.post("/v1/admin/tenants", json={"tenant": "acme"}, headers=op).status_code == 201
            assert http.post("/v1/admin/scopes", json={"name": "team", "members": ["acme"]}, headers=op).status_code == 201
            backend = RemoteBackend(live.base_url, live.operator_token(), chunk)
            worker = Worker(backend, chunk)
            start(backend)
            try:
                with serve(worker) as eng:
                    r = http.post("/v1/admin/prefixes", headers=op, json={
                        "scope": "team", "model": "m", "token_ids": prefix, "warm_engine": eng.tcp, "warm_timeout": 60})
                    assert r.status_code == 201, r.text
                    doc = r.json()
                    assert doc["warm"]["warm"] is True and doc["warm"]["recorded"] == doc["warm"]["stored"] == 2, doc
                    [(headers, body)] = worker.requests
                    assert headers["x-kv-warm-up"] == doc["id"] and body["prompt"] == prefix[: 2 * chunk]
                    # an engine that answers without reporting: published, not warm, and the answer says why
                    worker.warms = False
                    r = http.post("/v1/admin/prefixes", headers=op, json={
                        "scope": "team", "model": "m", "token_ids": prefix[:-1], "warm_engine": eng.tcp, "warm_timeout": 1})
                    assert r.status_code == 201 and r.json()["warm"]["warm"] is False, r.text
                    assert "0 of 2 chunks were reported" in r.json()["warm"]["error"]
            finally:
                close(backend)
            # a member's own capability reads the warmed prefix from the scope: its first lookup hits
            cap = http.post("/v1/capabilities", json={"namespace": "default", "ops": ["lookup", "get", "put"]},
                            headers=live.headers(live.worker_token("acme"))).json()["capability"]

        async def lookup() -> int:
            return (await live.gateway.lookup(cap, worker.model, prefix)).hit_tokens

        assert asyncio.run(_on(live, lookup)) == 2 * chunk


async def _on(live: Any, fn: Any) -> Any:
    return await live.call(fn)
