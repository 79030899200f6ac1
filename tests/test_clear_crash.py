"""A process killed between clear.requested and clear.completed: the next start resumes the clear
to the same end state as an uninterrupted one (issue 4, item 6)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

from tests.gw import ALL_OPS, gateway_runtime, model_for, random_cache, small_geometry

SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys
    sys.path.insert(0, {root!r})
    from tests.gw import ALL_OPS, gateway_runtime, model_for, random_cache, small_geometry
    from tenancy.registry import Registry

    async def main():
        g = small_geometry(); model = model_for(g)
        async with gateway_runtime({state!r}, {db!r}, migrate_first=False) as rt:
            cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
            real = Registry.update_clear_job
            async def crash(self, job_id, **values):
                await real(self, job_id, **values)
                if values.get("state") == "shredded":
                    await rt.audit.flush(10)
                    os._exit(17)  # killed after the shred, before any deletion
            Registry.update_clear_job = crash
            await rt.admin.clear("acme")
    asyncio.run(main())
    """
)


async def test_killed_mid_clear_is_resumed_at_the_next_start(tmp_path, db_url):
    g = small_geometry()
    model = model_for(g)
    tokens = list(range(48))
    state = tmp_path / "state"
    async with gateway_runtime(state, db_url) as rt:
        for t in ("acme", "globex"):
            await rt.admin.create_tenant(t)
        for t in ("acme", "globex"):
            cap = await rt.gateway.mint_capability(t, "default", ALL_OPS, 600)
            await rt.gateway.store(cap, model, tokens, random_cache(g, 16), block_ids=list(range(12)))
        acme_owner = rt.gateway.deriver.owner_label("acme")
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", SCRIPT.format(root=root, state=str(state), db=db_url)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 17, proc.stderr
    async with gateway_runtime(state, db_url, migrate_first=False) as rt:
        # resumed at start: the job is complete, acme's chunks are gone from every tier
        assert await rt.registry.incomplete_clear_jobs() == []
        for tier in rt.gateway.tiers.tiers:
            assert not [k for k in await tier.list_keys() if k.owner == acme_owner]
        assert all(k.state == "destroyed" for k in await rt.registry.list_keys("acme"))
        fresh = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        assert (await rt.gateway.lookup(fresh, model, tokens)).hit_tokens == 0
        cap_b = await rt.gateway.mint_capability("globex", "default", ALL_OPS, 600)
        assert (await rt.gateway.lookup(cap_b, model, tokens)).hit_tokens == 48  # untouched
        await rt.audit.flush(10)
        actions = [r.event.action async for r in rt.audit.store.iter_records()]
        assert actions.count("clear.requested") == 1 and actions.count("clear.completed") == 1
        assert actions.index("clear.requested") < actions.index("clear.completed")
