"""The server's count of published chunks read from their scope (``kvgate_shared_chunks_loaded``),
through a live ``kvgate serve``: a member's load counts the prefix's chunks, an outsider's load of
the same prompt and a member's prompt that matches nothing count none."""

from __future__ import annotations

import pytest

from tests.gateway.test_published import NUM_BLOCKS, Published, Remote
from tests.support.gw import model_for, small_geometry, zero_cache
from tests.support.server_fixture import LiveServer, running_server


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    with running_server(tmp_path_factory.mktemp("kvgate-published-metrics")) as server:
        yield server


async def _shared_loaded(live: LiveServer, http) -> float:
    r = await http.get("/metrics", headers=live.headers(live.operator_token()))
    assert r.status_code == 200, r.text
    lines = [x for x in r.text.splitlines() if x.startswith("kvgate_shared_chunks_loaded_total")]
    assert len(lines) == 1, lines  # exported from the start, zero included
    return float(lines[0].rsplit(" ", 1)[1])


async def test_published_chunks_read_from_the_scope_are_counted(live: LiveServer):
    model = model_for(small_geometry())
    async with live.client() as http:
        before = await _shared_loaded(live, http)
        pub = Published(live, http, model)
        await pub.setup("remote")
        prompt = pub.prompt(65_000)
        outsider, member = Remote(live, pub.outsider), Remote(live, pub.members[0])
        try:
            assert (await outsider.retrieve(model, prompt, zero_cache(model.geometry, NUM_BLOCKS))).loaded_tokens == 0
            off = list(prompt)
            off[15] += 1  # the first chunk's last token differs: nothing of the scope
            assert (await member.retrieve(model, off, zero_cache(model.geometry, NUM_BLOCKS))).loaded_tokens == 0
            assert await _shared_loaded(live, http) == before
            got = await member.retrieve(model, prompt, zero_cache(model.geometry, NUM_BLOCKS))
            assert got.loaded_tokens == 32  # positive control: the two published chunks
            assert await _shared_loaded(live, http) == before + 2
        finally:
            await outsider.aclose()
            await member.aclose()
