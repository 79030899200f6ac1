"""The gateway core end to end, in process: a real SQLite registry, memory and disk tiers."""

from __future__ import annotations

import pytest
import torch

from gateway.errors import AccessDenied, InvalidRequest, TenantUnavailable
from kernels.layouts import KVLayout
from kernels.pack import pack, slots_from_block_ids
from tests.support.gw import ALL_OPS, gateway_runtime, gathered, model_for, random_cache, small_geometry, zero_cache

NUM_BLOCKS = 64


async def _setup(rt, *tenants):
    caps = []
    for t in tenants:
        await rt.admin.create_tenant(t)
        caps.append(await rt.gateway.mint_capability(t, "default", ALL_OPS, 600))
    return caps


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
async def test_round_trip_is_bit_exact(tmp_path, layout, dtype):
    g = small_geometry(layout, dtype)
    model = model_for(g)
    async with gateway_runtime(tmp_path) as rt:
        (cap,) = await _setup(rt, "acme")
        src = random_cache(g, NUM_BLOCKS)
        n = 16 * 3 + 5  # three full chunks and a partial one
        src_blocks = torch.randperm(NUM_BLOCKS)[:14]  # non-contiguous order
        tokens = list(range(100, 100 + n))
        res = await rt.gateway.store(cap, model, tokens, src, block_ids=src_blocks)
        assert (res.chunks, res.stored, res.skipped) == (4, 4, 0)
        assert (await rt.gateway.lookup(cap, model, tokens)).hit_tokens == n
        dst = zero_cache(g, NUM_BLOCKS)
        dst_blocks = torch.randperm(NUM_BLOCKS)[:14]
        got = await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=dst_blocks)
        assert got.loaded_tokens == n and got.integrity_failures == 0
        assert torch.equal(gathered(src, g, src_blocks, n), gathered(dst, g, dst_blocks, n))
        # storing again skips what is there
        again = await rt.gateway.store(cap, model, tokens, src, block_ids=src_blocks)
        assert (again.stored, again.skipped) == (0, 4)


@pytest.mark.parametrize("layout", [KVLayout.CPU, KVLayout.BLOCK_FIRST])
async def test_write_upto_authenticates_whole_chunks_and_writes_only_the_tokens_before_it(tmp_path, layout):
    """A load straight into an engine's cache leaves the tokens the engine computes itself
    (``write_upto`` on) as they were, yet authenticates the whole chunk that holds them: a chunk
    tampered only past the limit still ends the load there."""
    g = small_geometry(layout)
    model = model_for(g)
    async with gateway_runtime(tmp_path) as rt:
        (cap,) = await _setup(rt, "acme")
        src = random_cache(g, NUM_BLOCKS, seed=3)
        n, blocks = 48, list(range(5, 17))  # three chunks of 16 tokens, 12 blocks of 4
        tokens = list(range(700, 700 + n))
        await rt.gateway.store(cap, model, tokens, src, block_ids=blocks)
        dst = random_cache(g, NUM_BLOCKS, seed=4)
        before = [t.clone() for t in dst]
        got = await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=blocks, write_upto=42)
        assert (got.loaded_tokens, got.integrity_failures) == (n, 0)
        assert torch.equal(gathered(src, g, blocks, 42), gathered(dst, g, blocks, 42))
        tail = slots_from_block_ids(blocks, g.block_size, 42, n - 42)
        assert torch.equal(pack(dst, tail, g).view(torch.uint8), pack(before, tail, g).view(torch.uint8))
        full = random_cache(g, NUM_BLOCKS, seed=4)
        await rt.gateway.retrieve(cap, model, tokens, full, block_ids=blocks)  # control: the tail differs
        assert not torch.equal(pack(full, tail, g).view(torch.uint8), pack(before, tail, g).view(torch.uint8))
        for bad in (-1, 1.5, True):
            with pytest.raises(InvalidRequest):
                await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=blocks, write_upto=bad)
        # chunk 2 tampered in every tier: the load from it fails although no token of it past 42 is written
        key = (await rt.gateway.keys_for("acme", "default", model, tokens))[2]
        await rt.tiers.flush()  # the disk copy is written behind: let it land, then spoil both
        for tier in rt.tiers.tiers:
            raw = bytearray((await tier.get(key)).data)
            raw[-20] ^= 0x80
            await tier.put(key, raw)
        got = await rt.gateway.retrieve(cap, model, tokens, random_cache(g, NUM_BLOCKS, seed=4), block_ids=blocks,
                                        write_upto=42)
        assert (got.loaded_tokens, got.integrity_failures) == (32, 1)


async def test_slot_mapping_with_gaps(tmp_path):
    g = small_geometry()
    model = model_for(g)
    async with gateway_runtime(tmp_path) as rt:
        (cap,) = await _setup(rt, "acme")
        src = random_cache(g, NUM_BLOCKS)
        slots = torch.randperm(NUM_BLOCKS * g.block_size)[:40]
        tokens = list(range(40))
        await rt.gateway.store(cap, model, tokens, src, slot_mapping=slots)
        dst = zero_cache(g, NUM_BLOCKS)
        dslots = torch.randperm(NUM_BLOCKS * g.block_size)[:40]
        assert (await rt.gateway.retrieve(cap, model, tokens, dst, slot_mapping=dslots)).loaded_tokens == 40
        from kernels.pack import pack

        assert torch.equal(pack(src, slots, g).view(torch.uint8), pack(dst, dslots, g).view(torch.uint8))


async def test_other_tenant_misses_beside_a_same_tenant_hit(tmp_path):
    g = small_geometry()
    model = model_for(g)
    async with gateway_runtime(tmp_path) as rt:
        cap_a, cap_b = await _setup(rt, "acme", "globex")
        src = random_cache(g, NUM_BLOCKS)
        blocks = list(range(8))
        tokens = list(range(32))
        await rt.gateway.store(cap_a, model, tokens, src, block_ids=blocks)
        keys_a = await rt.gateway.keys_for("acme", "default", model, tokens)
        keys_b = await rt.gateway.keys_for("globex", "default", model, tokens)
        assert not {k.digest for k in keys_a} & {k.digest for k in keys_b}
        assert (await rt.gateway.lookup(cap_a, model, tokens)).hit_tokens == 32  # positive control
        assert (await rt.gateway.lookup(cap_b, model, tokens)).hit_tokens == 0
        dst = zero_cache(g, NUM_BLOCKS)
        assert (await rt.gateway.retrieve(cap_b, model, tokens, dst, block_ids=blocks)).loaded_tokens == 0
        assert all(not x.any() for x in dst)
        # another namespace of the same tenant is isolated too
        cap_a2 = await rt.gateway.mint_capability("acme", "other", ALL_OPS, 600)
        assert (await rt.gateway.lookup(cap_a2, model, tokens)).hit_tokens == 0


async def test_tampered_envelope_on_disk_is_a_counted_audited_miss(tmp_path):
    g = small_geometry()
    model = model_for(g)
    tokens = list(range(48))
    blocks = list(range(12))
    async with gateway_runtime(tmp_path, tiers=["disk"]) as rt:
        (cap,) = await _setup(rt, "acme")
        await rt.gateway.store(cap, model, tokens, random_cache(g, NUM_BLOCKS), block_ids=blocks)
        keys = await rt.gateway.keys_for("acme", "default", model, tokens)
        # an attacker with write access to the tier rewrites the file consistently (the disk
        # tier's own checksum is for bit rot, not for attackers)
        disk = rt.tiers.tier("disk")
        raw = bytearray((await disk.get(keys[1])).data)
        raw[-20] ^= 0x80  # inside the last segment's ciphertext or tag
        await disk.put(keys[1], raw)
        dst = zero_cache(g, NUM_BLOCKS)
        got = await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=blocks)
        assert got.loaded_tokens == 16 and got.integrity_failures == 1
        assert rt.metrics.integrity_failures == 1
        await rt.audit.flush(10)
        actions = [r.event.action async for r in rt.audit.store.iter_records()]
        assert "integrity.failure" in actions
        # the bad copy is gone: the next lookup stops before it, and nothing unauthenticated was unpacked
        assert (await rt.gateway.lookup(cap, model, tokens)).hit_tokens == 16
        assert not any(x[:, 4:8].any() for x in dst)  # block ids 4..7 held chunk 1


async def test_envelope_moved_to_another_key_fails(tmp_path):
    g = small_geometry()
    model = model_for(g)
    async with gateway_runtime(tmp_path, tiers=["memory"]) as rt:
        (cap,) = await _setup(rt, "acme")
        tokens = list(range(32))
        await rt.gateway.store(cap, model, tokens, random_cache(g, NUM_BLOCKS), block_ids=list(range(8)))
        k0, k1 = await rt.gateway.keys_for("acme", "default", model, tokens)
        mem = rt.tiers.tier("memory")
        await mem.put(k1, bytes((await mem.get(k0)).data))  # a valid envelope under the wrong key
        got = await rt.gateway.retrieve(cap, model, tokens, zero_cache(g, NUM_BLOCKS), block_ids=list(range(8)))
        assert got.loaded_tokens == 16 and got.integrity_failures == 1


@pytest.mark.parametrize(
    "case",
    ["dtype", "shape", "layers", "blocks_short", "block_out_of_range", "empty_tokens", "token_range", "both_slots", "slots_len"],
)
async def test_bad_input_is_refused_and_stores_nothing(tmp_path, case):
    g = small_geometry()
    model = model_for(g)
    async with gateway_runtime(tmp_path) as rt:
        (cap,) = await _setup(rt, "acme")
        kv = random_cache(g, NUM_BLOCKS)
        tokens: list[int] = list(range(40))
        kw: dict = {"block_ids": list(range(10))}
        if case == "dtype":
            kv = [x.float() for x in kv]
        elif case == "shape":
            kv = [x[..., :8].contiguous() for x in kv]
        elif case == "layers":
            kv = kv[:-1]
        elif case == "blocks_short":
            kw = {"block_ids": list(range(5))}
        elif case == "block_out_of_range":
            kw = {"block_ids": list(range(9)) + [NUM_BLOCKS]}
        elif case == "empty_tokens":
            tokens = []
        elif case == "token_range":
            tokens = list(range(39)) + [-5]
        elif case == "both_slots":
            kw = {"block_ids": list(range(10)), "slot_mapping": list(range(40))}
        elif case == "slots_len":
            kw = {"slot_mapping": list(range(39))}
        with pytest.raises(InvalidRequest):
            await rt.gateway.store(cap, model, tokens, kv, **kw)
        assert rt.metrics.chunks_stored == 0
        assert await rt.tiers.tier("memory").list_keys() == []
        assert await rt.tiers.tier("disk").list_keys() == []


async def test_unknown_tenant_and_bad_capabilities(tmp_path):
    g = small_geometry()
    model = model_for(g)
    async with gateway_runtime(tmp_path) as rt:
        (cap,) = await _setup(rt, "acme")
        with pytest.raises(TenantUnavailable):
            await rt.gateway.mint_capability("nobody", "default", ALL_OPS, 600)
        with pytest.raises(AccessDenied):
            await rt.gateway.lookup("not-a-capability", model, [1, 2, 3])
        read_only = await rt.gateway.mint_capability("acme", "default", ["lookup"], 600)
        with pytest.raises(AccessDenied):
            await rt.gateway.store(read_only, model, list(range(16)), random_cache(g, NUM_BLOCKS), block_ids=range(4))
        assert rt.metrics.chunks_stored == 0
        await rt.audit.flush(10)
        denied = [r async for r in rt.audit.store.iter_records() if r.event.action == "authz.denied"]
        assert len(denied) == 2


async def test_secure_clear_tenant_and_namespace(tmp_path):
    g = small_geometry()
    model = model_for(g)
    tokens = list(range(32))
    blocks = list(range(8))
    async with gateway_runtime(tmp_path) as rt:
        cap_a, cap_b = await _setup(rt, "acme", "globex")
        cap_a_ns = await rt.gateway.mint_capability("acme", "scratch", ALL_OPS, 600)
        src = random_cache(g, NUM_BLOCKS)
        for cap in (cap_a, cap_b, cap_a_ns):
            await rt.gateway.store(cap, model, tokens, src, block_ids=blocks)
        envelope_before = bytes((await rt.tiers.get((await rt.gateway.keys_for("acme", "default", model, tokens))[0])).data)

        res = await rt.admin.clear("acme", "scratch")  # namespace clear
        assert res.epochs == {"scratch": 1} and res.destroyed_key_versions == []
        cap_a_ns2 = await rt.gateway.mint_capability("acme", "scratch", ALL_OPS, 600)
        assert (await rt.gateway.lookup(cap_a_ns2, model, tokens)).hit_tokens == 0
        assert (await rt.gateway.lookup(cap_a, model, tokens)).hit_tokens == 32  # default untouched

        res = await rt.admin.clear("acme")  # tenant clear
        assert res.destroyed_key_versions == [1]
        with pytest.raises(AccessDenied):  # every capability of the tenant is revoked
            await rt.gateway.lookup(cap_a, model, tokens)
        fresh = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        assert (await rt.gateway.lookup(fresh, model, tokens)).hit_tokens == 0
        assert (await rt.gateway.retrieve(fresh, model, tokens, zero_cache(g, NUM_BLOCKS), block_ids=blocks)).loaded_tokens == 0
        owner = rt.deriver.owner_label("acme")
        for tier in rt.tiers.tiers:
            assert not [k for k in await tier.list_keys() if k.owner == owner]
        # the old ciphertext, put back, cannot be opened: its key version is destroyed
        from crypto.errors import KeyUnavailable

        with pytest.raises(KeyUnavailable):
            await rt.keyring.decryption_key("acme", 1)
        assert envelope_before[:3] == b"KVG"
        # globex was never affected
        assert (await rt.gateway.lookup(cap_b, model, tokens)).hit_tokens == 32
        await rt.audit.flush(10)
        actions = [r.event.action async for r in rt.audit.store.iter_records()]
        assert actions.count("clear.requested") == 2 and actions.count("clear.completed") == 2
        assert actions.index("clear.requested") < actions.index("clear.completed")


async def test_interrupted_clear_is_resumed_at_start(tmp_path):
    g = small_geometry()
    model = model_for(g)
    tokens = list(range(32))
    async with gateway_runtime(tmp_path) as rt:
        (cap,) = await _setup(rt, "acme")
        await rt.gateway.store(cap, model, tokens, random_cache(g, NUM_BLOCKS), block_ids=list(range(8)))
        # the crash: the job is recorded (as clear() does first), nothing else happened
        nss = await rt.registry.list_namespaces("acme")
        await rt.registry.create_clear_job(
            "acme", None, "tenant", {"epochs": {n.name: n.epoch for n in nss}, "key_versions": [1]}
        )
    async with gateway_runtime(tmp_path, migrate_first=False) as rt:  # restart resumes it
        assert await rt.registry.incomplete_clear_jobs() == []
        fresh = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        assert (await rt.gateway.lookup(fresh, model, tokens)).hit_tokens == 0
        assert [k.state for k in await rt.registry.list_keys("acme")][0] == "destroyed"
        assert await rt.tiers.tier("disk").list_keys() == []


async def test_restart_hits_from_disk_and_pins_and_move(tmp_path):
    g = small_geometry()
    model = model_for(g)
    tokens = list(range(32))
    src = random_cache(g, NUM_BLOCKS)
    async with gateway_runtime(tmp_path) as rt:
        (cap,) = await _setup(rt, "acme")
        await rt.gateway.store(cap, model, tokens, src, block_ids=list(range(8)))
        assert await rt.gateway.pin(cap, model, tokens) == 2
    async with gateway_runtime(tmp_path, migrate_first=False) as rt:
        cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        assert await rt.tiers.tier("memory").list_keys() == []
        dst = zero_cache(g, NUM_BLOCKS)
        assert (await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=list(range(8)))).loaded_tokens == 32
        assert torch.equal(gathered(src, g, list(range(8)), 32), gathered(dst, g, list(range(8)), 32))
        assert len(await rt.registry.list_pins("acme")) == 2
        keys = await rt.gateway.keys_for("acme", "default", model, tokens)
        # promoted into memory on the hit; move it back out to disk only
        assert len(await rt.tiers.tier("memory").list_keys()) == 2
        assert await rt.admin.move(keys, "memory", "disk") == 2
        assert await rt.tiers.tier("memory").list_keys() == []


async def test_invocation_limit_forces_a_new_key_version(tmp_path):
    g = small_geometry()
    model = model_for(g)
    async with gateway_runtime(tmp_path, invocation_limit=3, tiers=["memory"]) as rt:
        rt.keyring._block = 2
        (cap,) = await _setup(rt, "acme")
        tokens = list(range(16 * 8))
        src = random_cache(g, NUM_BLOCKS)
        await rt.gateway.store(cap, model, tokens, src, block_ids=list(range(32)))
        keys = await rt.registry.list_keys("acme")
        assert len(keys) >= 3  # 8 envelopes, at most 3 per version
        assert all(k.invocations <= 3 for k in keys)
        dst = zero_cache(g, NUM_BLOCKS)
        assert (await rt.gateway.retrieve(cap, model, tokens, dst, block_ids=list(range(32)))).loaded_tokens == 128


async def test_revocations_survive_a_restart(tmp_path):
    g = small_geometry()
    model = model_for(g)
    async with gateway_runtime(tmp_path) as rt:
        (cap,) = await _setup(rt, "acme")
        assert (await rt.gateway.lookup(cap, model, [1, 2, 3])).hit_tokens == 0  # valid now
        await rt.admin.clear("acme")
    async with gateway_runtime(tmp_path, migrate_first=False) as rt:
        with pytest.raises(AccessDenied):
            await rt.gateway.lookup(cap, model, [1, 2, 3])


async def test_spans_for_store_load_and_clear_carry_no_tenant_name(tmp_path, monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import gateway.services.admin
    import gateway.services.core

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(gateway.services.core, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(gateway.services.admin, "_tracer", provider.get_tracer("test"))
    g = small_geometry()
    model = model_for(g)
    async with gateway_runtime(tmp_path) as rt:
        (cap,) = await _setup(rt, "acme")
        await rt.gateway.store(cap, model, list(range(32)), random_cache(g, NUM_BLOCKS), block_ids=list(range(8)))
        await rt.gateway.retrieve(cap, model, list(range(32)), zero_cache(g, NUM_BLOCKS), block_ids=list(range(8)))
        await rt.admin.clear("acme")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"kvgate.store", "kvgate.load", "kvgate.clear"} <= set(spans)
    assert spans["kvgate.store"].attributes["kvgate.stored"] == 2
    assert spans["kvgate.load"].attributes["kvgate.loaded_chunks"] == 2
    for span in spans.values():
        values = " ".join(str(v) for v in span.attributes.values())
        assert "acme" not in values and span.attributes.get("kvgate.tenant")
