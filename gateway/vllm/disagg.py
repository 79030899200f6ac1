"""A prefill/decode proxy in vLLM's documented pattern, carrying the caller's identity to both
engines.

    python -m gateway.vllm.disagg --prefill unix:/run/vllm/prefill.sock --decode http://10.0.0.7:8000 \\
        --port 9000 --tenant-header x-tenant-id --trusted-peers unix

A completion or chat request goes to a prefill engine with ``max_tokens`` 1, ``stream`` false and
``kv_transfer_params`` asking for a remote decode; the ``kv_transfer_params`` of its answer (the
kvgate producer's receipt) go with the original request to a decode engine, whose answer is
streamed back. Engines are taken in turn. The caller's ``Authorization``, ``X-Request-Id`` (one is
made where none came: both legs share it) and the configured tenant and namespace headers are
passed to both legs, where each engine's ``KvgateMiddleware`` decides. The tenant header is passed
on only from this proxy's own trusted peers (the authenticating gateway): from anyone else it is
a 403, logged and audited (``KVGATE_VLLM_AUDIT_DATABASE_URL``), since the engines trust this proxy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

from audit.types import Actions, Actor, AuditEvent, AuditSink, Target, record_durably
from audit.writer import AuditWriter
from gateway.vllm.guard import problem
from gateway.vllm.peers import TrustedPeers, peer_of
from gateway.vllm.relay import end_to_end, read_body, relay, target
from tenancy.names import escape, is_name

__all__ = ["PD_PATHS", "create_pd_proxy", "main"]

log = logging.getLogger("kvgate.vllm")
PD_PATHS = ("/v1/completions", "/v1/chat/completions")
# vLLM's disaggregation proxy asks the prefill engine for a remote decode with these
_REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _client(url: str, timeout: float) -> tuple[httpx.AsyncClient, str]:
    """An HTTP client and base URL for ``http(s)://...`` or ``unix:/path`` (the engine's --uds)."""
    if url.startswith("unix:"):
        transport = httpx.AsyncHTTPTransport(uds=url[len("unix:"):])
        return httpx.AsyncClient(transport=transport, timeout=timeout), "http://engine"
    return httpx.AsyncClient(timeout=timeout), url.rstrip("/")


def create_pd_proxy(
    prefill: Sequence[str], decode: Sequence[str], *, tenant_header: str | None = None,
    namespace_header: str | None = None, trusted_peers: TrustedPeers | None = None,
    audit: AuditSink | None = None, timeout: float = 600.0,
) -> Any:
    """The ASGI app (``prefill``, ``decode``: engine URLs, ``unix:/path`` for a Unix socket)."""
    if not prefill or not decode:
        raise ValueError("give at least one prefill and one decode engine")
    pre = itertools.cycle([_client(u, timeout) for u in prefill])
    dec = itertools.cycle([_client(u, timeout) for u in decode])
    trusted = trusted_peers or TrustedPeers()
    tenant_key = tenant_header.lower().encode() if tenant_header else None
    passed = {b"authorization", b"x-request-id", b"content-type", b"accept"}
    passed |= {h.lower().encode() for h in (tenant_header, namespace_header) if h}

    async def refuse(send: Any, status: int, title: str, detail: str) -> None:
        headers, body = problem(status, title, detail)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                if isinstance(audit, AuditWriter):
                    await audit.start()
                await send({"type": "lifespan.startup.complete"})
            if isinstance(audit, AuditWriter):
                await audit.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        headers = dict(scope["headers"])
        peer = peer_of(scope)
        if tenant_key is not None and tenant_key in headers and not trusted.trusts(peer):
            claimed = headers[tenant_key].decode("latin-1")
            log.warning("refused a request from %s: tenant header from an untrusted peer", peer)
            if audit is not None:
                event = AuditEvent(
                    Actions.AUTHZ_DENIED, outcome="denied", actor=Actor(source=str(peer)[:200]),
                    target=Target(tenant=claimed if is_name(claimed) else None),
                    details={"reason": "tenant header from an untrusted peer", "claimed_tenant": escape(claimed, 80),
                             "at": "pd-proxy"},
                )
                await record_durably(audit, event)
            await refuse(send, 403, "Forbidden", f"{tenant_header} is accepted only from a trusted gateway")
            return
        body = await read_body(receive)
        out = [(k, v) for k, v in scope["headers"] if k.lower() in passed]
        if b"x-request-id" not in headers:
            out.append((b"x-request-id", uuid.uuid4().hex.encode()))
        path = target(scope)
        if scope["method"] == "POST" and scope["path"] in PD_PATHS:
            try:
                doc = json.loads(body)
            except ValueError:
                doc = None
            if not isinstance(doc, dict):
                await refuse(send, 400, "Bad Request", "the request body must be a JSON object")
                return
            first = dict(doc, max_tokens=1, stream=False, kv_transfer_params=dict(_REMOTE_DECODE))
            first.pop("stream_options", None)
            if "max_completion_tokens" in first:
                first["max_completion_tokens"] = 1
            client, base = next(pre)
            try:
                r = await client.post(base + path, headers=out, content=json.dumps(first).encode())
            except httpx.HTTPError:
                await refuse(send, 502, "Bad Gateway", "the prefill engine could not be reached")
                return
            if r.status_code != 200:  # the engine's answer (a 401 or 403 of its middleware) as it is
                await send({"type": "http.response.start", "status": r.status_code, "headers": end_to_end(r.headers.raw)})
                await send({"type": "http.response.body", "body": r.content})
                return
            try:
                answer = r.json()
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                await refuse(send, 502, "Bad Gateway", "the prefill engine's answer is not a JSON object")
                return
            params = answer.get("kv_transfer_params")
            body = json.dumps(dict(doc, kv_transfer_params=params) if params else doc).encode()
        client, base = next(dec)
        req = client.build_request(scope["method"], base + path, headers=out, content=body)
        if not await relay(client, req, send):
            await refuse(send, 502, "Bad Gateway", "the decode engine could not be reached")

    return app


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m gateway.vllm.disagg", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="a prefill engine: http(s)://host:port or unix:/path")
    ap.add_argument("--decode", action="append", required=True, help="a decode engine: http(s)://host:port or unix:/path")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--uds", help="listen on this Unix socket instead of host:port")
    ap.add_argument("--tenant-header", help="the tenant header passed on (e.g. x-tenant-id)")
    ap.add_argument("--namespace-header", help="the namespace header passed on (e.g. x-kvgate-namespace)")
    ap.add_argument("--trusted-peers", default="", help="who may send the tenant header: unix, unix:/path, CIDRs")
    ap.add_argument("--audit-spool-dir", default=f"{tempfile.gettempdir()}/kvgate-pd-audit-spool")
    args = ap.parse_args(argv)
    trusted = TrustedPeers.parse(args.trusted_peers, "--trusted-peers")
    audit_url = os.environ.get("KVGATE_VLLM_AUDIT_DATABASE_URL")
    if args.tenant_header and (not trusted or not audit_url):
        ap.error("--tenant-header needs --trusted-peers (the gateway whose header is believed) and "
                 "KVGATE_VLLM_AUDIT_DATABASE_URL (where refused headers are audited)")
    writer = AuditWriter(audit_url, spool_dir=args.audit_spool_dir) if audit_url else None
    app = create_pd_proxy(args.prefill, args.decode, tenant_header=args.tenant_header,
                          namespace_header=args.namespace_header, trusted_peers=trusted, audit=writer)
    uvicorn.run(app, host=args.host, port=args.port, uds=args.uds, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
