"""`kvgate demo`: the whole story on the embedded default (SQLite, memory and disk tiers, a local
KEK file), with two tenants and a synthetic model geometry. Each claim is checked, not narrated:
the demo exits non-zero if any check fails."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gateway.config import Settings
from gateway.services import dbschema
from gateway.services.core import KVModel
from gateway.services.runtime import EmbeddedRuntime, open_embedded
from kernels.layouts import KVGeometry, KVLayout

__all__ = ["run_demo"]

STEP_TOKENS = 1024


class _Checks:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.failed = 0

    def __call__(self, ok: bool, what: str) -> None:
        mark = "[green]PASS[/green]" if ok else "[red]FAIL[/red]"
        self.console.print(f"  {mark} {what}")
        self.failed += not ok


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("  {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"),
        TimeElapsedColumn(), console=console, transient=True,
    )


async def _store(
    rt: EmbeddedRuntime, cap: str, model: KVModel, tokens: Sequence[int], kv: list[torch.Tensor], blocks: torch.Tensor,
    console: Console, label: str,
) -> float:
    t0 = time.perf_counter()
    with _progress(console) as progress:
        task = progress.add_task(label, total=len(tokens))
        for end in range(STEP_TOKENS, len(tokens) + STEP_TOKENS, STEP_TOKENS):
            end = min(end, len(tokens))
            await rt.gateway.store(cap, model, tokens[:end], kv, block_ids=blocks)
            progress.update(task, completed=end)
    return time.perf_counter() - t0


async def run_demo(
    *, tokens: int, layers: int, kv_heads: int, head_size: int, block_size: int,
    state_dir: Path | None, console: Console,
) -> bool:
    check = _Checks(console)
    tmp = None
    if state_dir is None:
        tmp = state_dir = Path(tempfile.mkdtemp(prefix="kvgate-demo-"))
    settings = Settings(state_dir=state_dir, tiers=["memory", "disk"], memory_bytes=8 << 30)
    geometry = KVGeometry(layers, kv_heads, head_size, torch.float16, block_size, KVLayout.KV_FIRST)
    model = KVModel("demo-llama-8b-geometry", geometry)
    chunk_bytes = geometry.chunk_nbytes(settings.chunk_tokens)
    console.rule("kvgate demo")
    console.print(f"state directory {state_dir}; model {layers} layers x {kv_heads} KV heads x {head_size}, "
                  f"fp16, block {block_size}; {tokens} tokens = {geometry.chunk_nbytes(tokens) / 2**20:.0f} MiB of KV "
                  f"in chunks of {settings.chunk_tokens} tokens ({chunk_bytes / 2**20:.1f} MiB)")
    try:
        await asyncio.to_thread(dbschema.upgrade, settings.db_url)
        rt = await open_embedded(settings)
        num_blocks = -(-tokens // block_size) + 8
        gen = torch.Generator().manual_seed(7)
        prompt = torch.randint(0, 32000, (tokens,), generator=gen).tolist()
        src = [torch.randn(geometry.layer_shape(num_blocks), generator=gen).to(torch.float16) for _ in range(layers)]
        src_blocks = torch.randperm(num_blocks, generator=gen)[: -(-tokens // block_size)]
        dst_blocks = torch.randperm(num_blocks, generator=gen)[: -(-tokens // block_size)]

        def fresh_cache() -> list[torch.Tensor]:
            return [torch.zeros(geometry.layer_shape(num_blocks), dtype=torch.float16) for _ in range(layers)]

        def same_kv(dst: list[torch.Tensor]) -> bool:
            from kernels.pack import pack, slots_from_block_ids

            a = pack(src, slots_from_block_ids(src_blocks, block_size, 0, tokens), geometry)
            b = pack(dst, slots_from_block_ids(dst_blocks, block_size, 0, tokens), geometry)
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

        for tenant in ("acme", "globex"):
            await rt.admin.create_tenant(tenant)
        cap_a = await rt.gateway.mint_capability("acme", "default", ["lookup", "get", "put", "pin"], 600)
        cap_b = await rt.gateway.mint_capability("globex", "default", ["lookup", "get", "put", "pin"], 600)

        console.print("\n[bold]1. Tenant acme stores a prefix and reuses it[/bold]")
        t_store = await _store(rt, cap_a, model, prompt, src, src_blocks, console, "acme store")
        hit = await rt.gateway.lookup(cap_a, model, prompt)
        check(hit.hit_tokens == tokens, f"acme lookup hits {hit.hit_tokens}/{tokens} tokens")
        dst = fresh_cache()
        t0 = time.perf_counter()
        got = await rt.gateway.retrieve(cap_a, model, prompt, dst, block_ids=dst_blocks)
        t_load = time.perf_counter() - t0
        check(got.loaded_tokens == tokens and same_kv(dst), "acme loads bit-exact KV into other blocks")

        console.print("\n[bold]2. The same prompt in tenant globex[/bold]")
        miss = await rt.gateway.lookup(cap_b, model, prompt)
        check(miss.hit_tokens == 0, f"globex lookup of acme's prompt hits {miss.hit_tokens} tokens (positive control above: {hit.hit_tokens})")
        got_b = await rt.gateway.retrieve(cap_b, model, prompt, fresh_cache(), block_ids=dst_blocks)
        check(got_b.loaded_tokens == 0, "globex loads nothing of acme's")

        console.print("\n[bold]3. An envelope tampered with on disk[/bold]")
        await rt.aclose()  # restart: the memory tier is gone, the disk tier reindexes
        rt = await open_embedded(settings)
        disk = rt.tiers.tier("disk")
        keys = await rt.gateway.keys_for("acme", "default", model, prompt)
        victim = keys[len(keys) // 2]
        raw = bytearray((await disk.get(victim)).data)
        raw[-100] ^= 0x01
        await disk.put(victim, raw)  # rewritten as an attacker with write access would
        console.print(f"  flipped one bit of chunk {len(keys) // 2} in the disk tier (file rewritten consistently)")
        dst = fresh_cache()
        got = await rt.gateway.retrieve(cap_a, model, prompt, dst, block_ids=dst_blocks)
        check(got.integrity_failures == 1 and got.loaded_tokens < tokens,
              f"tamper detected: loaded {got.loaded_tokens} tokens, then a miss (integrity failures: {got.integrity_failures})")
        check(rt.metrics.integrity_failures == 1, "integrity failure counted (and audited)")

        console.print("\n[bold]4. Secure clear of tenant acme[/bold]")
        before = await rt.gateway.lookup(cap_a, model, prompt)
        res = await rt.admin.clear("acme")
        console.print(f"  job {res.job_id}: destroyed key versions {res.destroyed_key_versions}, "
                      f"epochs now {res.epochs}, deleted {res.deleted_chunks} chunk copies")
        try:
            await rt.gateway.lookup(cap_a, model, prompt)
            check(False, "acme's old capability is revoked")
        except Exception as exc:
            check(type(exc).__name__ == "AccessDenied", "acme's old capability is revoked")
        cap_a2 = await rt.gateway.mint_capability("acme", "default", ["lookup", "get"], 600)
        after = await rt.gateway.lookup(cap_a2, model, prompt)
        check(before.hit_tokens > 0 and after.hit_tokens == 0,
              f"acme hits {before.hit_tokens} tokens before the clear, {after.hit_tokens} after")
        left = list(settings.chunk_dir.rglob("*.kvc"))
        check(len(left) == 0, f"no ciphertext left on disk ({len(left)} files)")
        await rt.aclose()

        # the same store into the memory tier alone, in the same run: what the default tiers cost
        # on the store path (with write-behind, the disk copy is written after the store returns)
        mem_settings = Settings(state_dir=state_dir / "memory-only", tiers=["memory"], memory_bytes=8 << 30)
        await asyncio.to_thread(dbschema.upgrade, mem_settings.db_url)
        rt = await open_embedded(mem_settings)
        await rt.admin.create_tenant("acme")
        cap_m = await rt.gateway.mint_capability("acme", "default", ["lookup", "put"], 600)
        t_mem = await _store(rt, cap_m, model, prompt, src, src_blocks, console, "acme store, memory tier only")
        await rt.aclose()

        console.print()
        table = Table("operation", "bytes", "seconds", "GB/s", title="Throughput (this machine, one run)")
        nbytes = geometry.chunk_nbytes(tokens)
        mode = settings.tier_write_mode.replace("_", "-")
        for what, secs in (
            (f"store ({'+'.join(settings.tiers)}, encrypted, {mode})", t_store),
            ("store (memory only, encrypted)", t_mem),
            ("load (memory, authenticated)", t_load),
        ):
            table.add_row(what, f"{nbytes / 2**20:.0f} MiB", f"{secs:.2f}", f"{nbytes / secs / 1e9:.2f}")
        console.print(table)
        console.print(f"[dim]store with the default tiers / memory only: {t_mem / t_store:.2f}. "
                      "`kvgate bench` measures these against AES-GCM and memcpy ceilings.[/dim]")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    console.rule("all checks passed" if not check.failed else f"{check.failed} check(s) FAILED")
    return check.failed == 0
