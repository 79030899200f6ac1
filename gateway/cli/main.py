"""The `kvgate` command line. Every command reads the same settings (KVGATE_* and KVGATE_CONFIG)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Optional, TypeVar

import typer
from rich.console import Console
from rich.table import Column, Table

from gateway.config import Settings, load_settings

if TYPE_CHECKING:
    from datetime import datetime

    from audit.checkpoint import Checkpoint
    from audit.checkpointer import Checkpointer
    from audit.signing import AuditSigner
    from audit.writer import AuditWriter
    from gateway.services.runtime import Runtime

_T = TypeVar("_T")

app = typer.Typer(
    help="kvgate: a secure, multi-tenant KV-cache gateway", no_args_is_help=True, pretty_exceptions_enable=False
)
tenants_app = typer.Typer(help="Tenant lifecycle", no_args_is_help=True)
keys_app = typer.Typer(help="Data-key management", no_args_is_help=True)
audit_app = typer.Typer(help="Audit export and offline verification", no_args_is_help=True)
token_app = typer.Typer(help="Development tokens", no_args_is_help=True)
prefixes_app = typer.Typer(help="Sharing scopes and published prefixes (docs/prefixes.md)", no_args_is_help=True)
app.add_typer(tenants_app, name="tenants")
app.add_typer(keys_app, name="keys")
app.add_typer(audit_app, name="audit")
app.add_typer(token_app, name="token")
app.add_typer(prefixes_app, name="prefixes")

console = Console()
_DEBUG = {"on": os.environ.get("KVGATE_DEBUG", "") not in ("", "0", "false")}


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks (also KVGATE_DEBUG=1)")] = False,
) -> None:
    """kvgate: a secure, multi-tenant KV-cache gateway. Errors are one line and exit 2; --debug
    shows the traceback."""
    if debug:
        _DEBUG["on"] = True


def _name(value: Optional[str]) -> Optional[str]:
    """Every tenant and namespace a command takes meets the one name rule (tenancy.names),
    checked before any work (exit 2)."""
    from tenancy.names import InvalidName, check_name

    if value is None:
        return None
    try:
        return check_name(value)
    except InvalidName as exc:
        raise typer.BadParameter(str(exc)) from None


TenantArg = Annotated[str, typer.Argument(callback=_name, help="tenant name")]


def _settings(**overrides: object) -> Settings:
    return load_settings(**overrides)  # a bad setting: main() says which, in one line


def _fail(exc: BaseException) -> typer.Exit:
    """Print the one line for ``exc`` (cause and fix) on stderr; the Exit(2) to raise."""
    from rich.markup import escape

    from gateway.cli.errors import explain

    Console(stderr=True).print(f"[red]kvgate:[/red] {escape(explain(exc))}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


async def _with_runtime(settings: Settings, fn: Callable[[Runtime], Awaitable[_T]]) -> _T:
    from gateway.services.runtime import open_runtime

    try:  # Postgres behind the schema: SchemaBehind names `kvgate migrate`; loose modes: chmod
        rt = await open_runtime(settings, auto_migrate=True)
    except Exception as exc:
        if _DEBUG["on"]:
            raise
        raise _fail(exc) from None
    try:
        return await fn(rt)
    finally:
        await rt.aclose()


@app.command()
def migrate(
    revision: Annotated[str, typer.Option(help="target revision")] = "head",
    downgrade: Annotated[bool, typer.Option(help="downgrade to --revision (default base)")] = False,
) -> None:
    """Upgrade (or downgrade) the registry and audit schema."""
    from gateway.services import dbschema
    from gateway.services.statefiles import InsecureStateFiles, prepare_state

    settings = _settings()
    try:
        prepare_state(settings)
    except InsecureStateFiles as exc:
        raise _fail(exc) from None
    if downgrade:
        dbschema.downgrade(settings.db_url, "base" if revision == "head" else revision)
    else:
        dbschema.upgrade(settings.db_url, revision)
    console.print(f"schema {'downgraded' if downgrade else 'upgraded'} to {revision if not downgrade or revision != 'head' else 'base'}")


@app.command()
def demo(
    tokens: Annotated[int, typer.Option(help="prefix length in tokens")] = 8192,
    layers: int = 32,
    kv_heads: int = 8,
    head_size: int = 128,
    block_size: int = 16,
    state_dir: Annotated[Optional[Path], typer.Option(help="state directory (default: a fresh temporary one)")] = None,
) -> None:
    """Run the whole story on the embedded default: isolation, integrity, secure clear, figures."""
    from gateway.cli.demo import run_demo

    ok = asyncio.run(run_demo(tokens=tokens, layers=layers, kv_heads=kv_heads, head_size=head_size,
                              block_size=block_size, state_dir=state_dir, console=console))
    raise typer.Exit(0 if ok else 1)


@app.command()
def bench(
    json_path: Annotated[Optional[Path], typer.Option("--json", help="write results as JSON here")] = None,
    quick: Annotated[bool, typer.Option(help="fewer repetitions and sizes (smoke run)")] = False,
    reps: Annotated[int, typer.Option(help="repetitions per figure (median is reported)")] = 7,
    no_peers: Annotated[bool, typer.Option("--no-peers", help="skip the peers (LMCache) on purpose")] = False,
    lmcache_python: Annotated[Optional[Path], typer.Option(
        envvar="KVGATE_BENCH_LMCACHE_PYTHON",
        help="python of the LMCache environment (default .venv-lmcache/bin/python under the current directory, "
             "skipped with a note when absent; once named it must run)")] = None,
    lmcache_runner: Annotated[Path, typer.Option(
        envvar="KVGATE_BENCH_LMCACHE_RUNNER", help="the LMCache runner script (relative to the current directory)",
    )] = Path("scripts/lmcache_runner.py"),
) -> None:
    """Store and load throughput through the gateway core beside ceilings measured in the same run,
    and beside LMCache on the same bytes (a peer that fails to run fails the command)."""
    from gateway.cli.errors import require_extra

    try:
        require_extra("scipy")  # the bench extra, checked before the bench package is imported
        from gateway.bench import run_bench
        from gateway.bench.peers import PeerConfig, PeerFailed
    except Exception as exc:
        raise _fail(exc) from None
    peers = PeerConfig(enabled=not no_peers, lmcache_python=lmcache_python, lmcache_runner=lmcache_runner)
    try:
        results = asyncio.run(run_bench(quick=quick, reps=reps, console=console, peers=peers))
    except PeerFailed as exc:  # the peer's error in one line, exit 2
        raise _fail(exc) from None
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=2) + "\n")
        console.print(f"wrote {json_path}")


@app.command()
def serve(
    host: Annotated[Optional[str], typer.Option(help="bind address (default from settings: 127.0.0.1)")] = None,
    port: Annotated[Optional[int], typer.Option(help="port (default from settings: 8420)")] = None,
    uds: Annotated[
        Optional[Path], typer.Option(help="also serve on this Unix socket, for workers on this host (default from settings: none)")
    ] = None,
) -> None:
    """Run the REST server under uvicorn (graceful shutdown drains requests and flushes the audit queue)."""
    import uvicorn

    from gateway.logs import configure_logging
    from gateway.server import create_app

    settings = _settings()
    configure_logging(settings.log_level, settings.log_format)
    h, p = host or settings.host, port or settings.port
    overrides = {}
    if settings.public_url == "http://127.0.0.1:8420" and (h, p) != ("127.0.0.1", 8420):
        overrides["public_url"] = f"http://{'127.0.0.1' if h in ('0.0.0.0', '::') else h}:{p}"
    if overrides:
        settings = settings.model_copy(update=overrides)
    # pre-flight, so a problem is one line here and not a traceback from the server's lifespan:
    # the database (SQLite is migrated, Postgres must be), the KEK, the tiers, the port
    asyncio.run(_with_runtime(settings, _noop))
    _check_port_free(h, p)
    from gateway.server.gatekeeper import uvicorn_options
    from gateway.services.serverinfo import publish_server, unpublish_server

    publish_server(settings, h, p)
    # uvicorn re-raises SIGTERM after its graceful shutdown; exit normally instead, so the
    # finally below runs (and the published URL of this server is withdrawn)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uds_path = uds or settings.uds
    # on SIGTERM uvicorn closes its listeners, waits this long for the requests in flight, then
    # cancels them; the lifespan's shutdown writes the audit queue either way
    options = {**uvicorn_options(settings), "timeout_graceful_shutdown": settings.shutdown_timeout_s}
    try:
        if uds_path is None:
            uvicorn.run(create_app(settings), host=h, port=p, log_level="info", **options)
        else:
            _serve_with_uds(create_app(settings), h, p, uds_path, settings.uds_mode, options)
    finally:
        unpublish_server(settings)


def _serve_with_uds(app: Any, host: str, port: int, path: Path, mode: int, options: dict[str, Any]) -> None:
    """uvicorn on host:port and on the Unix socket ``path`` at once (one server, two listeners)."""
    import uvicorn

    from gateway.cli.errors import CliError
    from gateway.errors import InvalidRequest
    from gateway.server.listen import unix_listener

    try:
        listener = unix_listener(path, mode)
    except InvalidRequest as exc:
        raise CliError(f"--uds: {exc}") from None
    try:
        config = uvicorn.Config(app, host=host, port=port, log_level="info", **options)
        tcp = config.bind_socket()
        try:
            logging.getLogger("kvgate").info("also serving on the Unix socket %s", path)
            uvicorn.Server(config).run(sockets=[tcp, listener.sock])
        finally:
            tcp.close()
    finally:
        listener.close()


@app.command()
def doctor() -> None:
    """Check settings, files, database and schema, Redis, the KEK, the OIDC issuers and the
    signing key; a table of what is fine and what is not, with the fix. Exit 1 if anything fails."""
    from rich.markup import escape

    from gateway.cli.doctor import FAIL, WARN, run_checks

    checks = asyncio.run(run_checks(load_settings))
    # long URLs and paths fold onto the next line instead of being cut on a narrow terminal
    table = Table("check", "status", Column("detail", overflow="fold"), Column("fix", overflow="fold"))
    colour = {FAIL: "red", WARN: "yellow"}
    for c in checks:
        table.add_row(escape(c.name), f"[{colour.get(c.status, 'green')}]{c.status}[/]", escape(c.detail), escape(c.fix))
    console.print(table)
    failed = sum(c.status == FAIL for c in checks)
    console.print(f"{len(checks)} checks: {failed} failed, {sum(c.status == WARN for c in checks)} warnings")
    raise typer.Exit(1 if failed else 0)


async def _noop(rt: Runtime) -> None:
    return None


def _check_port_free(host: str, port: int) -> None:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            from gateway.cli.errors import CliError

            raise CliError(f"cannot listen on {host}:{port} ({exc.strerror}): another process uses it; pick --port") from None


@token_app.command("mint")
def token_mint(
    tenant: Annotated[str, typer.Option(callback=_name, help="tenant claim")],
    roles: Annotated[list[str], typer.Option("--roles", "--role", help="kv.worker, kv.admin, kv.operator")] = ["kv.worker"],  # noqa: B006 - typer reads the default, never mutates it
    ttl: Annotated[int, typer.Option(help="seconds")] = 3600,
    subject: Annotated[Optional[str], typer.Option(help="sub claim")] = None,
) -> None:
    """Mint an access token from the development issuer (refused in production)."""
    from gateway.server.app import dev_issuer_for
    from gateway.services.serverinfo import published_public_url

    settings = _settings()
    url = published_public_url(settings)  # the running `kvgate serve` of this state dir, if any
    if url is not None:
        settings = settings.model_copy(update={"public_url": url})
    dev = dev_issuer_for(settings)  # refused in production: main() says so in one line
    token = dev.mint(tenant, roles, subject=subject, ttl=ttl)
    print(token)


@tenants_app.command("create")
def tenants_create(tenant: TenantArg) -> None:
    async def go(rt: Runtime) -> None:
        version = await rt.admin.create_tenant(tenant)
        console.print(f"tenant {tenant} created with data key version {version}")

    asyncio.run(_with_runtime(_settings(), go))


@tenants_app.command("list")
def tenants_list() -> None:
    async def go(rt: Runtime) -> None:
        table = Table("tenant", "status")
        for t, status in await rt.registry.list_tenants():
            table.add_row(t, status)
        console.print(table)

    asyncio.run(_with_runtime(_settings(), go))


@tenants_app.command("disable")
def tenants_disable(tenant: TenantArg) -> None:
    async def go(rt: Runtime) -> None:
        await rt.admin.disable_tenant(tenant)
        console.print(f"tenant {tenant} disabled; its capabilities are revoked")

    asyncio.run(_with_runtime(_settings(), go))


@keys_app.command("rotate")
def keys_rotate(tenant: TenantArg) -> None:
    async def go(rt: Runtime) -> None:
        version = await rt.admin.rotate_key(tenant)
        console.print(f"tenant {tenant}: data key version {version} is active")

    asyncio.run(_with_runtime(_settings(), go))


@keys_app.command("rotate-kek")
def keys_rotate_kek(
    from_kek_file: Annotated[list[Path], typer.Option(help="an old KEK key file that may still unwrap rows (repeatable)")] = [],  # noqa: B006 - typer reads the default
    batch_size: Annotated[int, typer.Option(min=1, help="rows per transaction")] = 500,
) -> None:
    """Rewrap every data key, gateway secret and namespace salt under the configured KEK (resumable;
    chunk envelopes are not touched). Exit 1 if some rows could not be rewrapped: run it again."""
    from crypto.errors import KekError
    from gateway.services.dbschema import SchemaBehind
    from gateway.services.kekrotate import rotate_from_settings

    settings = _settings()
    try:
        report = asyncio.run(rotate_from_settings(settings, previous_kek_files=from_kek_file, batch_size=batch_size))
    except (KekError, SchemaBehind) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(3) from None
    console.print_json(json.dumps({
        "kek_id": report.kek_id, "data_keys": report.data_keys, "secrets": report.secrets, "salts": report.salts,
        "already_current": report.already_current, "failed": report.failed[:50], "complete": report.complete,
    }))
    raise typer.Exit(0 if report.complete else 1)


ScopeArg = Annotated[str, typer.Argument(callback=_name, help="sharing scope name")]


def _token_ids(tokens: Optional[str], tokens_file: Optional[Path]) -> list[int]:
    """The prefix's token ids: ``--tokens 1,2,3`` or ``--tokens-file`` (a JSON list)."""
    if (tokens is None) == (tokens_file is None):
        raise typer.BadParameter("give the prefix's token ids with --tokens or --tokens-file (one of them)")
    try:
        if tokens_file is not None:
            ids = json.loads(tokens_file.read_text())
        else:
            assert tokens is not None
            ids = [int(t) for t in tokens.split(",") if t.strip()]
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"token ids: {exc}") from None
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise typer.BadParameter("token ids: a list of integers")
    return ids


@prefixes_app.command("scope-create")
def prefixes_scope_create(
    scope: ScopeArg,
    member: Annotated[list[str], typer.Option(help="a member tenant (repeatable)")] = [],  # noqa: B006 - typer reads the default
    everyone: Annotated[bool, typer.Option(help="every tenant is a member")] = False,
) -> None:
    """Create a sharing scope: named member tenants, or every tenant."""
    members = [m for m in (_name(m) for m in member) if m is not None]

    async def go(rt: Runtime) -> None:
        rec = await rt.prefixes.create_scope(scope, everyone=everyone, members=members)
        console.print_json(json.dumps({"scope": rec.name, "everyone": rec.everyone, "members": list(rec.members)}))

    asyncio.run(_with_runtime(_settings(), go))


@prefixes_app.command("scope-add")
def prefixes_scope_add(scope: ScopeArg, tenant: TenantArg) -> None:
    """Add a member tenant to a scope."""

    async def go(rt: Runtime) -> None:
        changed = await rt.prefixes.set_member(scope, tenant, member=True)
        console.print(f"tenant {tenant} {'added to' if changed else 'was already in'} scope {scope}")

    asyncio.run(_with_runtime(_settings(), go))


@prefixes_app.command("scope-remove")
def prefixes_scope_remove(scope: ScopeArg, tenant: TenantArg) -> None:
    """Remove a member tenant from a scope: it reads nothing of the scope from its next request on."""

    async def go(rt: Runtime) -> None:
        changed = await rt.prefixes.set_member(scope, tenant, member=False)
        console.print(f"tenant {tenant} {'removed from' if changed else 'was not in'} scope {scope}")

    asyncio.run(_with_runtime(_settings(), go))


@prefixes_app.command("scopes")
def prefixes_scopes() -> None:
    """List the sharing scopes and their members."""

    async def go(rt: Runtime) -> None:
        table = Table("scope", "members")
        for rec in await rt.prefixes.list_scopes():
            table.add_row(rec.name, "*" if rec.everyone else ", ".join(rec.members))
        console.print(table)

    asyncio.run(_with_runtime(_settings(), go))


@prefixes_app.command("publish")
def prefixes_publish(
    scope: ScopeArg,
    model: Annotated[str, typer.Option(help="the model id the prefix is for")],
    tokens: Annotated[Optional[str], typer.Option(help="the token ids, comma-separated")] = None,
    tokens_file: Annotated[Optional[Path], typer.Option(help="a JSON list of the token ids")] = None,
    text_file: Annotated[Optional[Path], typer.Option(help="the prefix as text (UTF-8), with --tokenizer")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(
        help="the text's Hugging Face tokenizer (a hub name or a directory); needs transformers")] = None,
    add_special_tokens: Annotated[bool, typer.Option(
        help="text: with the tokenizer's special tokens, as vLLM tokenizes a completion prompt")] = True,
    ttl: Annotated[Optional[int], typer.Option(min=1, help="the warm-up capability's lifetime (seconds)")] = None,
    warm_engine: Annotated[Optional[str], typer.Option(
        help="warm the prefix up on this vLLM engine's OpenAI server (URL) through its kvgate connector")] = None,
    warm_model: Annotated[Optional[str], typer.Option(
        help="--warm-engine: the engine's served model name (default: the engine's own)")] = None,
    warm_token_file: Annotated[Optional[Path], typer.Option(
        help="--warm-engine: a file holding an operator's bearer token, for an engine that does not trust this host")] = None,
    warm_timeout: Annotated[float, typer.Option(
        min=1, help="--warm-engine: seconds until the prefix must be warm (recorded and stored)")] = 120.0,
) -> None:
    """Publish a prefix into a scope, as token ids or as text with its tokenizer; prints its id
    and the warm-up's write capability (JSON). With --warm-engine, the engine warms it up at once
    and the answer says so under "warm"; a warm-up that fails exits 1 (the prefix stays published)."""
    if text_file is not None or tokenizer is not None:
        if text_file is None or tokenizer is None or tokens is not None or tokens_file is not None:
            raise typer.BadParameter("give --text-file with --tokenizer, and no token ids")
        try:
            text = text_file.read_text(encoding="utf-8")
        except (OSError, UnicodeError) as exc:
            raise typer.BadParameter(f"text: {exc}") from None
        from gateway.errors import InvalidRequest
        from gateway.services.prefixes import tokenize

        try:
            ids = tokenize(text, tokenizer, add_special_tokens=add_special_tokens)
        except InvalidRequest as exc:
            raise typer.BadParameter(str(exc)) from None
    else:
        ids = _token_ids(tokens, tokens_file)
    if warm_engine is None and (warm_model is not None or warm_token_file is not None):
        raise typer.BadParameter("--warm-model and --warm-token-file go with --warm-engine")
    warm_token: Optional[str] = None
    if warm_token_file is not None:
        try:
            warm_token = warm_token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeError) as exc:
            raise typer.BadParameter(f"--warm-token-file: {exc}") from None

    async def go(rt: Runtime) -> Optional[BaseException]:
        from gateway.services.warmup import WarmUpFailed, warm_up

        got = await rt.prefixes.publish(scope, model, ids, ttl=ttl, tokenizer=tokenizer)
        p = got.publication
        doc: dict[str, Any] = {
            "id": p.id, "scope": p.scope, "model": p.model, "digest": p.digest, "num_tokens": p.num_tokens,
            "whole_chunks": got.whole_chunks, "chunk_tokens": rt.settings.chunk_tokens, "key_version": p.key_version,
            "capability": got.capability, "expires_at": got.expires_at,
        }
        failed: Optional[BaseException] = None
        if warm_engine is not None:
            try:
                done = await warm_up(rt.prefixes, got, warm_engine, model=warm_model, token=warm_token, timeout_s=warm_timeout)
                doc["warm"] = done.as_dict()
            except WarmUpFailed as exc:
                failed = exc
                doc["warm"] = {"engine": warm_engine, "warm": False, "error": str(exc)}
        console.print_json(json.dumps(doc))
        return failed

    failed = asyncio.run(_with_runtime(_settings(), go))
    if failed is not None:
        _fail(failed)
        raise typer.Exit(1)


@prefixes_app.command("list")
def prefixes_list(
    scope: Annotated[Optional[str], typer.Option(callback=_name, help="one scope's prefixes only")] = None,
) -> None:
    """List the published prefixes (active, revoking, revoked)."""

    async def go(rt: Runtime) -> None:
        table = Table("id", "scope", "model", "tokens", "digest", "state")
        for p in await rt.prefixes.publications(scope):
            table.add_row(p.id, p.scope, p.model, str(p.num_tokens), p.digest[:16], p.state)
        console.print(table)

    asyncio.run(_with_runtime(_settings(), go))


@prefixes_app.command("revoke")
def prefixes_revoke(prefix_id: Annotated[str, typer.Argument(help="the prefix's id (kvgate prefixes list)")]) -> None:
    """Revoke a prefix: crypto-shred its key version (the scope's keys with its last prefix), delete its chunks."""

    async def go(rt: Runtime) -> None:
        res = await rt.prefixes.revoke(prefix_id)
        console.print_json(json.dumps({
            "id": res.prefix_id, "scope": res.scope, "deleted_chunks": res.deleted_chunks,
            "destroyed_key_versions": res.destroyed_key_versions, "scope_shredded": res.scope_shredded,
        }))

    asyncio.run(_with_runtime(_settings(), go))


@app.command()
def clear(
    tenant: TenantArg,
    namespace: Annotated[Optional[str], typer.Option(callback=_name, help="clear one namespace only")] = None,
) -> None:
    """Secure clear: crypto-shred (epoch bump, key destruction) then delete from every tier."""

    async def go(rt: Runtime) -> None:
        res = await rt.admin.clear(tenant, namespace)
        console.print_json(json.dumps({
            "job_id": res.job_id, "tenant": res.tenant, "namespace": res.namespace,
            "deleted_chunk_copies": res.deleted_chunks, "destroyed_key_versions": res.destroyed_key_versions,
            "epochs": res.epochs,
        }))

    asyncio.run(_with_runtime(_settings(), go))


def _parse_time(value: str | None) -> datetime | None:
    from datetime import UTC, datetime

    if value is None:
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        console.print(f"[red]not an ISO 8601 time:[/red] {value}")
        raise typer.Exit(2) from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


@contextlib.asynccontextmanager
async def _audit_parts(settings: Settings) -> AsyncIterator[tuple[AuditWriter, AuditSigner, Checkpointer]]:
    """The audit writer, signer and checkpointer of the CLI's audit commands (no tiers, no core)."""
    from audit import AuditWriter
    from gateway.services.auditing import close_signer, make_audit_signer, make_checkpointer

    writer = AuditWriter(settings.db_url, spool_dir=settings.state_dir / "audit-spool")
    await writer.start()
    signer = close = None
    try:
        signer = make_audit_signer(settings)
        checkpointer, close = make_checkpointer(settings, writer.store, signer, writer)
        yield writer, signer, checkpointer
    finally:
        await writer.aclose()
        if close is not None:
            await close()
        if signer is not None:
            close_signer(signer)


def _audit_failure(exc: Exception) -> NoReturn:
    if _DEBUG["on"]:
        raise exc
    raise _fail(exc) from None  # one line, the most specific cause in the chain, exit 2


@audit_app.command("export")
def audit_export(
    output: Annotated[Path, typer.Option("--output", "-o", help="export file (manifest beside it)")] = Path("audit.jsonl"),
    fmt: Annotated[str, typer.Option("--format", help="jsonl or csv")] = "jsonl",
    since: Annotated[Optional[str], typer.Option(help="ISO 8601, inclusive (recorded time)")] = None,
    until: Annotated[Optional[str], typer.Option(help="ISO 8601, exclusive (recorded time)")] = None,
    tenant: Annotated[Optional[str], typer.Option(callback=_name, help="only events of this tenant")] = None,
    public_key: Annotated[Optional[Path], typer.Option(help="also write the audit public key (PEM) here")] = None,
) -> None:
    """Write a signed checkpoint, then stream the audit log to a file with a signed manifest. A
    tenant's export is proved against a checkpoint: exit 4 if the log no longer holds what it signed."""
    from audit import AuditError, CheckpointTampered, export_to_files, manifest_path_for

    if fmt not in ("jsonl", "csv"):
        console.print("[red]--format must be jsonl or csv[/red]")
        raise typer.Exit(2)
    settings = _settings()

    async def go() -> dict[str, Any]:
        async with _audit_parts(settings) as (writer, signer, checkpointer):
            if public_key is not None:
                public_key.write_bytes(signer.public_key_pem())
            await checkpointer.checkpoint()
            await writer.flush(30)
            return await export_to_files(
                writer.store, signer, output, manifest_path_for(output), format=fmt,
                since=_parse_time(since), until=_parse_time(until), tenant=tenant,
                checkpoints=checkpointer if tenant is not None else None,
            )

    try:
        manifest = asyncio.run(go())
    except CheckpointTampered as exc:
        console.print(f"[red]TAMPERED[/red]: the audit log does not hold what its checkpoints signed: {exc}")
        raise typer.Exit(4) from None
    except AuditError as exc:
        _audit_failure(exc)
    console.print(f"wrote {output} and {manifest_path_for(output)}: {manifest.get('count')} rows")


@audit_app.command("checkpoint")
def audit_checkpoint(
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="also copy the checkpoint here")] = None,
    public_key: Annotated[Optional[Path], typer.Option(help="also write the audit public key (PEM) here")] = None,
) -> None:
    """Sign a checkpoint of the audit log now (tree size, RFC 9162 root, time): into the
    checkpoint directory and into the log. Exit 4 if the log no longer extends the last one."""
    from audit import AuditError, CheckpointTampered

    settings = _settings()

    async def go() -> Checkpoint:
        async with _audit_parts(settings) as (_writer, signer, checkpointer):
            if public_key is not None:
                public_key.write_bytes(signer.public_key_pem())
            return await checkpointer.checkpoint()

    try:
        cp = asyncio.run(go())
    except CheckpointTampered as exc:
        console.print(f"[red]TAMPERED[/red]: the audit log does not extend its last checkpoint: {exc}")
        raise typer.Exit(4) from None
    except AuditError as exc:
        _audit_failure(exc)
    if output is not None:
        output.write_text(json.dumps(dict(cp.document), indent=2, sort_keys=True) + "\n")
    console.print(f"checkpoint: {cp.tree_size} rows, root {cp.root_hash}")


@audit_app.command("verify")
def audit_verify(
    path: Path,
    manifest: Annotated[Optional[Path], typer.Option(help="manifest (default: <export>.manifest.json)")] = None,
    public_key: Annotated[Path, typer.Option(help="the audit public key (PEM)")] = Path("audit_public.pem"),
    checkpoint: Annotated[list[Path], typer.Option(help="a signed checkpoint the export must extend (repeatable)")] = [],  # noqa: B006 - typer reads the default
) -> None:
    """Check an export offline: manifest signature, digest, count, the hash chain and, with
    --checkpoint, consistency with earlier signed checkpoints (RFC 9162 Merkle tree)."""
    from audit import manifest_path_for, verify_export

    report = verify_export(path, manifest or manifest_path_for(path), public_key, checkpoints=checkpoint)
    if report.ok:
        console.print(f"[green]OK[/green]: {report.rows} rows, chain and signature verified")
        if report.tree_size is not None:
            console.print(f"tree size {report.tree_size}, root {report.root_hash}")
        m = report.manifest or {}
        if m.get("manifest_version") == 2:
            span = m.get("range") or {}
            console.print(
                f"tenant {m['filter']['tenant']}: every one of its rows in seq {span.get('first_seq')}..{span.get('last_seq')}, "
                "each proved to be in the checkpointed log"
            )
        for line in report.checkpoints:
            console.print(f"consistent with checkpoint {line}")
        return
    console.print(f"[red]FAILED[/red]: first bad row at line {report.first_bad_line} (seq {report.first_bad_seq})")
    for problem in report.problems[:20]:
        console.print(f"  - {problem}")
    raise typer.Exit(1)


@audit_app.command("verify-consistency")
def audit_verify_consistency(
    old: Path,
    new: Path,
    proof: Path,
    public_key: Annotated[Path, typer.Option(help="the audit public key (PEM)")] = Path("audit_public.pem"),
) -> None:
    """Check offline that checkpoint NEW extends checkpoint OLD, with the consistency PROOF (JSON
    from GET /v1/admin/audit/consistency?first=OLD.tree_size&second=NEW.tree_size)."""
    from audit import AuditError, load_public_key, read_checkpoint
    from audit.checkpoint import verify_checkpoint_consistency

    try:
        key = load_public_key(public_key)
        a, b = read_checkpoint(old, key), read_checkpoint(new, key)
        doc = json.loads(proof.read_text())
    except (AuditError, OSError, ValueError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    bad = verify_checkpoint_consistency(a, b, doc)
    if bad is None:
        console.print(f"[green]OK[/green]: tree size {a.tree_size} -> {b.tree_size} is consistent")
        return
    console.print(f"[red]FAILED[/red]: {bad}")
    raise typer.Exit(1)


def main() -> None:  # console script entry point
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if _DEBUG["on"]:
            raise
        _fail(exc)
        sys.exit(2)
