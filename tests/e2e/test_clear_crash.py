"""A process killed between clear.requested and clear.completed: the next start resumes the clear
to the same end state as an uninterrupted one (issue 4, item 6)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

from tests.support.gw import ALL_OPS, gateway_runtime, model_for, random_cache, small_geometry
from tests.support.paths import REPO

SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys
    sys.path.insert(0, {root!r})
    from tests.support.gw import ALL_OPS, gateway_runtime, model_for, random_cache, small_geometry
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
        acme_owner = rt.deriver.owner_label("acme")

    root = str(REPO)
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", SCRIPT.format(root=root, state=str(state), db=db_url)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 17, proc.stderr
    async with gateway_runtime(state, db_url, migrate_first=False) as rt:
        # resumed at start: the job is complete, acme's chunks are gone from every tier
        assert await rt.registry.incomplete_clear_jobs() == []
        for tier in rt.tiers.tiers:
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


REQUESTED_SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys
    sys.path.insert(0, {root!r})
    from audit.types import Actor
    from gateway.services.admin import Admin
    from tests.support.gw import gateway_runtime
    from tenancy.keyring import Keyring
    from tenancy.registry import Registry

    async def main():
        async with gateway_runtime({state!r}, {db!r}, migrate_first=False) as rt:
            if {where!r} == "before-requested":
                async def crash(self, job, requester, *, resumed):
                    os._exit(17)  # the job row is written; clear.requested is not yet recorded
                Admin._record_requested = crash
            else:
                async def crash(self, *a, **kw):
                    os._exit(17)  # clear.requested returned (durable); the first shred step dies
                Registry.bump_epoch = crash  # the first destructive step: an epoch bump,
                Keyring.destroy = crash  # or the key destruction when there is no namespace yet
            await rt.admin.clear("acme", actor=Actor(subject="alice", tenant="acme", source="10.0.0.7"))
    asyncio.run(main())
    """
)


import pytest  # noqa: E402


@pytest.mark.parametrize("where", ["before-requested", "after-requested"])
async def test_clear_requested_keeps_its_requester_across_a_crash(tmp_path, db_url, where):
    """Issue 16: clear.requested is durable before the first destructive step and names who asked,
    whether the process died before or after recording it; the log holds it exactly once."""
    state = tmp_path / "state"
    async with gateway_runtime(state, db_url) as rt:
        await rt.admin.create_tenant("acme")
        await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)

    root = str(REPO)
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", REQUESTED_SCRIPT.format(root=root, state=str(state), db=db_url, where=where)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 17, proc.stderr
    async with gateway_runtime(state, db_url, migrate_first=False) as rt:
        assert await rt.registry.incomplete_clear_jobs() == []
        await rt.audit.flush(10)
        rows = [r async for r in rt.audit.store.iter_records()]
    requested = [r for r in rows if r.event.action == "clear.requested"]
    assert len(requested) == 1
    req = requested[0].event
    assert (req.actor.subject, req.actor.tenant, req.actor.source) == ("alice", "acme", "10.0.0.7")
    assert ('"resumed":true' in req.details) == (where == "before-requested")
    actions = [r.event.action for r in rows]
    assert actions.index("clear.requested") < actions.index("key.destroy") < actions.index("clear.completed")
