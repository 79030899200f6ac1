"""Admin routes: secure clear, move, tenants, key rotation, audit export and checkpoints (the
"Secure clear" and "Every control action is audited" rules of docs/architecture.md, section 1),
sharing scopes and published prefixes (docs/prefixes.md).

Roles: kv.admin acts on its own tenant only, kv.operator on any tenant (and alone manages
tenants). Every action is audited by the core; every refusal is audited here."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi import Path as FastPath
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, model_validator

from audit import AuditExport, ExportError
from audit.checkpointer import Checkpointer, CheckpointTampered
from audit.signing import AuditSigner
from gateway.chunks.envelopes import parse_hash
from gateway.errors import Conflict, InvalidRequest
from gateway.server.bodylimits import BodySize, takes
from gateway.server.deps import (
    Authorize,
    AuthorizeBody,
    CapabilityDep,
    Name,
    NamePath,
    NameQuery,
    PrincipalDep,
    Scope,
    Scoped,
    ServerState,
    StateDep,
    Strict,
    authorize_action,
    on_every_tenant,
    on_own_tenant,
    on_path,
)
from gateway.server.jsonbody import JsonBodyRoute
from gateway.server.problems import COMMON_PROBLEMS, problem_responses
from gateway.services.prefixes import tokenize
from gateway.services.warmup import WarmUpFailed, warm_up
from storage.types import ChunkKey
from tenancy.roles import Action, Role, parse_roles
from tenancy.types import Principal

router = APIRouter(prefix="/v1/admin", route_class=JsonBodyRoute, responses=problem_responses(*COMMON_PROBLEMS))

Hash = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class ClearRequest(Strict):
    """A destructive request names everything it destroys: the scope, and the tenant even when it
    is the caller's own. Nothing defaults; a field the scope does not take is refused."""

    scope: Literal["tenant", "namespace", "chunks"]
    tenant: Name
    namespace: Name | None = Field(default=None, description="scope namespace and chunks: required; scope tenant: absent")
    hashes: list[Hash] | None = Field(default=None, min_length=1, max_length=100_000, description="scope chunks: required")

    @model_validator(mode="after")
    def _scope_fields(self) -> ClearRequest:
        want_ns, want_hashes = self.scope != "tenant", self.scope == "chunks"
        if (self.namespace is not None) != want_ns:
            raise ValueError(f"scope {self.scope!r} {'needs' if want_ns else 'takes no'} namespace")
        if (self.hashes is not None) != want_hashes:
            raise ValueError(f"scope {self.scope!r} {'needs' if want_hashes else 'takes no'} hashes")
        return self


class ClearResponse(BaseModel):
    job_id: str
    tenant: str
    namespace: str | None
    scope: str
    deleted_chunk_copies: int
    destroyed_key_versions: list[int]
    epochs: dict[str, int]


class MoveRequest(Strict):
    tenant: Name
    namespace: Name
    hashes: list[Hash] = Field(min_length=1, max_length=100_000)
    source: Literal["memory", "disk", "redis"] = Field(alias="from")
    destination: Literal["memory", "disk", "redis"] = Field(alias="to")


class MoveResponse(BaseModel):
    requested: int
    moved: int


class TenantRequest(Strict):
    tenant: Name


class TenantResponse(BaseModel):
    tenant: str
    status: str
    key_version: int | None = None


class RotateResponse(BaseModel):
    tenant: str
    key_version: int


# The verified scope of each admin action (kv.admin: its own tenant; kv.operator: any tenant).
ClearScope = Annotated[Scoped[ClearRequest], Depends(AuthorizeBody(Action.CLEAR, ClearRequest))]
MoveScope = Annotated[Scoped[MoveRequest], Depends(AuthorizeBody(Action.MOVE, MoveRequest))]
CreateTenantScope = Annotated[Scoped[TenantRequest], Depends(AuthorizeBody(Action.MANAGE_TENANTS, TenantRequest))]
TenantScope = Annotated[Scope, Depends(Authorize(Action.MANAGE_TENANTS, on=on_path))]
RotateScope = Annotated[Scope, Depends(Authorize(Action.ROTATE_KEYS, on=on_path))]
OwnAuditScope = Annotated[Scope, Depends(Authorize(Action.EXPORT_AUDIT, on=on_own_tenant))]
# Checkpoints cover every tenant's rows: writing one is for operators.
WholeAuditScope = Annotated[Scope, Depends(Authorize(Action.EXPORT_AUDIT, on=on_every_tenant))]


async def _keys(state: ServerState, tenant: str, namespace: str, hashes: list[str]) -> list[ChunkKey]:
    resolver = state.runtime.resolver
    return resolver.chunk_keys(await resolver.keys(tenant, namespace), [parse_hash(h) for h in hashes])


@router.post("/clear", response_model=ClearResponse)
@takes(BodySize.BULK)
async def clear(call: ClearScope, state: StateDep) -> ClearResponse:
    """Secure clear of a tenant, a namespace or a list of chunks: crypto-shred, delete, audit."""
    body, tenant = call.body, call.scope.tenant
    chunks = None
    if body.scope == "chunks":
        assert body.namespace is not None and body.hashes is not None  # the model's rule
        chunks = await _keys(state, tenant, body.namespace, body.hashes)
    res = await state.runtime.admin.clear(
        tenant, body.namespace if body.scope == "namespace" else None, chunks=chunks, actor=call.scope.actor
    )
    return ClearResponse(
        job_id=res.job_id, tenant=res.tenant, namespace=body.namespace, scope=body.scope,
        deleted_chunk_copies=res.deleted_chunks, destroyed_key_versions=res.destroyed_key_versions, epochs=res.epochs,
    )


@router.post("/move", response_model=MoveResponse)
@takes(BodySize.BULK)
async def move(call: MoveScope, state: StateDep) -> MoveResponse:
    body = call.body
    keys = await _keys(state, call.scope.tenant, body.namespace, body.hashes)
    moved = await state.runtime.admin.move(keys, body.source, body.destination, actor=call.scope.actor)
    return MoveResponse(requested=len(keys), moved=moved)


@router.post("/tenants", response_model=TenantResponse, status_code=201, responses=problem_responses(409))
async def create_tenant(call: CreateTenantScope, state: StateDep) -> TenantResponse:
    """Register a tenant and its first data key; a name already registered is a 409."""
    scope = call.scope
    version = await state.runtime.admin.create_tenant(scope.tenant, actor=scope.actor)
    return TenantResponse(tenant=scope.tenant, status="active", key_version=version)


@router.delete("/tenants/{tenant}", response_model=TenantResponse)
async def disable_tenant(scope: TenantScope, state: StateDep) -> TenantResponse:
    await state.runtime.admin.disable_tenant(scope.tenant, actor=scope.actor)
    return TenantResponse(tenant=scope.tenant, status="disabled")


@router.post("/tenants/{tenant}/keys/rotate", response_model=RotateResponse)
@takes(BodySize.NONE)  # its tenant is in the path
async def rotate(scope: RotateScope, state: StateDep) -> RotateResponse:
    version = await state.runtime.admin.rotate_key(scope.tenant, actor=scope.actor)
    return RotateResponse(tenant=scope.tenant, key_version=version)


def _export_params(
    principal: Principal, state: ServerState, request: Request,
    since: datetime | None, until: datetime | None, tenant: str | None,
) -> dict[str, Any]:
    is_operator = Role.OPERATOR in parse_roles(principal.roles)
    if tenant is None and not is_operator:
        tenant = principal.tenant
    authorize_action(state, principal, tenant or principal.tenant, Action.EXPORT_AUDIT, request)
    if tenant is None and not is_operator:  # pragma: no cover - guarded above
        raise InvalidRequest("tenant required")
    # A fixed window makes the export reproducible, so its manifest can be fetched separately.
    until = until or (datetime.now(UTC) - timedelta(seconds=1)).replace(microsecond=0)
    for name, t in (("since", since), ("until", until)):
        if t is not None and t.tzinfo is None:
            raise InvalidRequest(f"{name} must carry a time zone")
    if since is not None and since >= until:
        raise InvalidRequest("since must be before until")
    # a tenant's own export names its own principals only: other tenants' (and unauthenticated)
    # actors are keyed pseudonyms there; the operator's export keeps them
    return {"since": since, "until": until, "tenant": tenant, "pseudonymize": not is_operator}


async def _export(state: ServerState, format: str, params: dict[str, Any]) -> AuditExport:
    """The export of a window; a tenant's is proved against a checkpoint first (409 when the
    database no longer holds what that checkpoint signed)."""
    secret = state.runtime.pseudonym_secret
    try:
        export = AuditExport(
            state.runtime.audit.store, _signer(state), format=format, **params,
            pseudonym_secret=secret.reveal() if secret is not None else None,
            checkpoints=_checkpointer(state) if params["tenant"] is not None else None,
        )
        await export.prepare()
    except ExportError as exc:  # a window or format the exporter refuses: the caller's input
        raise InvalidRequest(str(exc)) from None
    except CheckpointTampered as exc:
        raise Conflict(f"the audit log does not hold what its checkpoint signed: {exc}") from None
    return export


ExportFormat = Annotated[Literal["jsonl", "csv"], Query()]


@dataclass(frozen=True)
class _ExportWindow:
    """The query both export routes take, authorized and resolved to a fixed window once."""

    format: str
    params: dict[str, Any]


def _export_window(
    principal: PrincipalDep,
    state: StateDep,
    request: Request,
    since: datetime | None = None,
    until: datetime | None = None,
    tenant: NameQuery = None,
    format: ExportFormat = "jsonl",
) -> _ExportWindow:
    return _ExportWindow(format, _export_params(principal, state, request, since, until, tenant))


ExportWindow = Annotated[_ExportWindow, Depends(_export_window)]


@router.get(
    "/audit/export", response_class=Response,
    responses={200: {"content": {"application/x-ndjson": {}, "text/csv": {}}}, **problem_responses(409)},
)
async def audit_export(window: ExportWindow, state: StateDep) -> Response:
    """The audit rows of a fixed time window, streamed. The signed manifest of the same window is
    at ``/v1/admin/audit/export/manifest`` (the window is echoed in ``X-KV-Until``). Every export
    first writes a signed checkpoint of the whole log (409 if the log no longer extends the last one);
    a tenant's export is proved against a checkpoint (409 if the log no longer holds what it signed)."""
    with contextlib.suppress(TimeoutError):  # what was emitted before the request is in the checkpoint
        await state.runtime.audit.flush(10)
    await _checkpoint(state)
    export = await _export(state, window.format, window.params)
    media = "application/x-ndjson" if window.format == "jsonl" else "text/csv"
    return StreamingResponse(
        export.stream(), media_type=media, headers={"X-KV-Until": window.params["until"].isoformat()}
    )


@router.get("/audit/export/manifest", responses=problem_responses(409))
async def audit_manifest(window: ExportWindow, state: StateDep) -> JSONResponse:
    export = await _export(state, window.format, window.params)
    async for _ in export.stream():
        pass
    return JSONResponse(export.manifest())


@router.get("/audit/public-key", response_class=Response)
async def audit_public_key(_: OwnAuditScope, state: StateDep) -> Response:
    """The public half of the audit signing key (PEM): manifests and checkpoints verify with it."""
    return Response(_signer(state).public_key_pem(), media_type="application/x-pem-file")


def _signer(state: ServerState) -> AuditSigner:
    signer = state.runtime.signer
    if signer is None:
        raise HTTPException(503, "audit signing is not configured")
    return signer


def _checkpointer(state: ServerState) -> Checkpointer:
    checkpointer = state.runtime.checkpointer
    if checkpointer is None:
        raise HTTPException(503, "audit checkpoints are not configured")
    return checkpointer


async def _checkpoint(state: ServerState) -> dict[str, Any]:
    try:
        cp = await _checkpointer(state).checkpoint()
    except CheckpointTampered as exc:
        raise Conflict(f"the audit log does not extend its last checkpoint: {exc}") from None
    return dict(cp.document)


@router.post("/audit/checkpoints", status_code=201, responses=problem_responses(409))
async def audit_checkpoint(_: WholeAuditScope, state: StateDep) -> JSONResponse:
    """Write a signed checkpoint (tree size, RFC 9162 root, time) now: into the checkpoint
    directory and into the log; returns it (``kvgate audit verify --checkpoint`` takes it)."""
    return JSONResponse(await _checkpoint(state), status_code=201)


@router.get("/audit/checkpoints/latest", responses=problem_responses(404))
async def audit_latest_checkpoint(_: OwnAuditScope, state: StateDep) -> JSONResponse:
    """The newest signed checkpoint in the checkpoint directory."""
    import asyncio

    cp = await asyncio.to_thread(_checkpointer(state).latest)
    if cp is None:
        raise HTTPException(404, "no checkpoint yet")
    return JSONResponse(dict(cp.document))


@router.get("/audit/consistency")
async def audit_consistency(
    _: OwnAuditScope, state: StateDep,
    first: Annotated[int, Query(ge=1, le=2**62)], second: Annotated[int, Query(ge=1, le=2**62)],
) -> JSONResponse:
    """An RFC 9162 consistency proof between two tree sizes of the stored log (two checkpoints'
    ``tree_size``): ``kvgate audit verify-consistency OLD NEW PROOF`` checks it offline against
    the two signed roots, without the log."""
    if first > second:
        raise InvalidRequest("first must not be larger than second")
    try:
        proof = await _checkpointer(state).consistency(first, second)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return JSONResponse(proof)


# -- published prefixes (docs/prefixes.md) ------------------------------------------------------
# Scopes and publications reach every member tenant: operators only (``*``).
PrefixesScope = Annotated[Scope, Depends(Authorize(Action.MANAGE_PREFIXES, on=on_every_tenant))]
_MAX_PREFIX_TOKENS = 1 << 19


class ScopeRequest(Strict):
    name: Name
    members: list[Name] = Field(default_factory=list, max_length=10_000, description="member tenants")
    everyone: bool = Field(default=False, description="every tenant is a member (then name no members)")


class ScopeResponse(BaseModel):
    name: str
    everyone: bool
    members: list[str]


class MemberResponse(BaseModel):
    scope: str
    tenant: str
    member: bool
    changed: bool


class PublishRequest(Strict):
    scope: Name
    model: str = Field(min_length=1, max_length=256, description="the model id the prefix is for")
    token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(
        default=None, min_length=1, max_length=_MAX_PREFIX_TOKENS,
        description="the prefix's token ids; its whole chunks are shared (or: text with tokenizer)",
    )
    text: str | None = Field(default=None, min_length=1, max_length=4 << 20, description="the prefix as text, with tokenizer")
    tokenizer: str | None = Field(
        default=None, min_length=1, max_length=512,
        description="text's Hugging Face tokenizer (a hub name or a directory on the server); needs transformers there",
    )
    add_special_tokens: bool = Field(default=True, description="text: with the tokenizer's special tokens, as vLLM "
                                     "tokenizes a completion prompt (a leading BOS)")
    ttl: int | None = Field(default=None, ge=1, le=86400, description="the warm-up capability's lifetime (seconds)")
    warm_engine: str | None = Field(
        default=None, min_length=8, max_length=2048, pattern=r"^https?://[^\s]+$",
        description="a vLLM engine's OpenAI server (URL) that warms the prefix up through its kvgate connector; its "
        "middleware must trust this server's address (KVGATE_VLLM_TRUSTED_PEERS)",
    )
    warm_model: str | None = Field(default=None, min_length=1, max_length=256, description="warm_engine's served model name")
    warm_timeout: float = Field(default=120.0, ge=1, le=600, description="seconds until the prefix must be warm")

    @model_validator(mode="after")
    def _one_source(self) -> PublishRequest:
        if (self.token_ids is None) == (self.text is None):
            raise ValueError("give the prefix as token_ids or as text (one of them)")
        if (self.text is None) != (self.tokenizer is None):
            raise ValueError("text and tokenizer go together")
        if self.warm_engine is None and self.warm_model is not None:
            raise ValueError("warm_model goes with warm_engine")
        return self


class PrefixResponse(BaseModel):
    id: str
    scope: str
    model: str
    digest: str = Field(description="sha256 of the token ids (int32 little endian), hex")
    num_tokens: int
    state: str = Field(description="active, revoking or revoked")
    key_version: int


class PublishResponse(PrefixResponse):
    whole_chunks: int
    chunk_tokens: int
    capability: str = Field(description="the warm-up's capability: ops lookup and put on the scope, for the "
                            "chunks POST /v1/admin/prefixes/{id}/chunks records")
    cap_id: str
    expires_at: float
    warm: dict[str, Any] | None = Field(
        default=None, description="with warm_engine: {engine, warm, whole_chunks, recorded, stored, seconds}, or "
        "{engine, warm: false, error} (the prefix stays published)",
    )


class WarmRequest(Strict):
    fingerprint: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the model fingerprint")]
    hashes: list[Hash] = Field(min_length=1, max_length=100_000, description="the whole chunks' chained hashes")


class WarmResponse(BaseModel):
    id: str
    recorded: int


class RevokeResponse(BaseModel):
    id: str
    scope: str
    deleted_chunks: int
    destroyed_key_versions: list[int]
    scope_shredded: bool = Field(description="the scope's last prefix: every key of the scope destroyed")


def _prefix(p: Any) -> dict[str, Any]:
    return {"id": p.id, "scope": p.scope, "model": p.model, "digest": p.digest, "num_tokens": p.num_tokens,
            "state": p.state, "key_version": p.key_version}


@router.post("/scopes", response_model=ScopeResponse, status_code=201, responses=problem_responses(409))
async def create_scope(body: ScopeRequest, scope: PrefixesScope, state: StateDep) -> ScopeResponse:
    """A sharing scope: named member tenants, or every tenant."""
    rec = await state.runtime.prefixes.create_scope(body.name, everyone=body.everyone, members=body.members, actor=scope.actor)
    return ScopeResponse(name=rec.name, everyone=rec.everyone, members=list(rec.members))


@router.get("/scopes", response_model=list[ScopeResponse])
async def list_scopes(_: PrefixesScope, state: StateDep) -> list[ScopeResponse]:
    return [ScopeResponse(name=r.name, everyone=r.everyone, members=list(r.members))
            for r in await state.runtime.prefixes.list_scopes()]


@router.put("/scopes/{name}/members/{tenant}", response_model=MemberResponse)
async def add_member(name: NamePath, tenant: NamePath, scope: PrefixesScope, state: StateDep) -> MemberResponse:
    changed = await state.runtime.prefixes.set_member(name, tenant, member=True, actor=scope.actor)
    return MemberResponse(scope=name, tenant=tenant, member=True, changed=changed)


@router.delete("/scopes/{name}/members/{tenant}", response_model=MemberResponse)
async def remove_member(name: NamePath, tenant: NamePath, scope: PrefixesScope, state: StateDep) -> MemberResponse:
    """The tenant reads nothing of the scope from its next request on."""
    changed = await state.runtime.prefixes.set_member(name, tenant, member=False, actor=scope.actor)
    return MemberResponse(scope=name, tenant=tenant, member=False, changed=changed)


@router.post("/prefixes", response_model=PublishResponse, status_code=201)
@takes(BodySize.BULK)
async def publish_prefix(body: PublishRequest, scope: PrefixesScope, state: StateDep) -> PublishResponse:
    """Publish a prefix into a scope, as token ids or as text with its tokenizer (audited
    ``prefix.publish`` with the digest of the token ids): the answer's
    capability is the only one that may write its chunks, for a warm-up that reports them first
    (``POST /v1/admin/prefixes/{id}/chunks``) and then stores them as any worker does; with
    ``warm_engine`` the server sends that engine the warm-up and answers ``warm``."""
    ids = body.token_ids
    if ids is None:  # text and its tokenizer (the validator asks for both)
        assert body.text is not None and body.tokenizer is not None
        ids = await asyncio.to_thread(tokenize, body.text, body.tokenizer, add_special_tokens=body.add_special_tokens)
    got = await state.runtime.prefixes.publish(
        body.scope, body.model, ids, ttl=body.ttl, actor=scope.actor, tokenizer=body.tokenizer,
    )
    warm: dict[str, Any] | None = None
    if body.warm_engine is not None:  # docs/prefixes.md, "The warm-up"
        try:
            done = await warm_up(state.runtime.prefixes, got, body.warm_engine, model=body.warm_model,
                                 timeout_s=body.warm_timeout)
            warm = done.as_dict()
        except WarmUpFailed as exc:
            warm = {"engine": body.warm_engine, "warm": False, "error": str(exc)}
    return PublishResponse(
        **_prefix(got.publication), whole_chunks=got.whole_chunks, chunk_tokens=state.settings.chunk_tokens,
        capability=got.capability, cap_id=got.cap_id, expires_at=got.expires_at, warm=warm,
    )


@router.get("/prefixes", response_model=list[PrefixResponse])
async def list_prefixes(_: PrefixesScope, state: StateDep, scope: NameQuery = None) -> list[PrefixResponse]:
    return [PrefixResponse(**_prefix(p)) for p in await state.runtime.prefixes.publications(scope)]


@router.post("/prefixes/{prefix_id}/chunks", response_model=WarmResponse, responses=problem_responses(404, 409))
@takes(BodySize.BULK)
async def warm_prefix(
    prefix_id: Annotated[str, FastPath(pattern=r"^[0-9a-f]{24}$")], body: WarmRequest, scope: PrefixesScope,
    state: StateDep, capability: CapabilityDep,
) -> WarmResponse:
    """A warm-up's report of the chunks it stores (``X-KV-Capability``: the publish answer's):
    they must be the published tokens' whole chunks chained under ``fingerprint``; recorded, they
    are what the capability may write and what members match."""
    got = await state.runtime.prefixes.warm(capability, prefix_id, body.fingerprint, body.hashes, actor=scope.actor)
    return WarmResponse(id=prefix_id, recorded=len(got))


@router.delete("/prefixes/{prefix_id}", response_model=RevokeResponse, responses=problem_responses(404, 409))
async def revoke_prefix(
    prefix_id: Annotated[str, FastPath(pattern=r"^[0-9a-f]{24}$")], scope: PrefixesScope, state: StateDep,
) -> RevokeResponse:
    """Revoke a prefix: no member matches it any more, its key version (or, with the scope's last
    prefix, every key of the scope) is destroyed, its chunks deleted from every tier; audited
    ``prefix.revoke``."""
    res = await state.runtime.prefixes.revoke(prefix_id, actor=scope.actor)
    return RevokeResponse(
        id=res.prefix_id, scope=res.scope, deleted_chunks=res.deleted_chunks,
        destroyed_key_versions=res.destroyed_key_versions, scope_shredded=res.scope_shredded,
    )
