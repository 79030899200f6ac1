"""A Redis master lost under `kvgate serve` in remote mode, as an operator tries it: a real 6-node
cluster (tests/support/redis_cluster.py), tiers ["redis"], two tenants storing and loading through
the remote worker client, then kill -9 of the master holding most of tenant A's chunks.

Checked through the public surface: no wrong byte in any load (remote and embedded); the loads
the dead master ended say ``tier_unavailable`` or ``tier_timeout`` and move
``kvgate_load_failures_total`` by that reason and the breaker series on ``/metrics``; two-chunk
batches (the worker's store, and an upload frame whose second chunk lies on the dead master) are
refused and leave neither chunk in the cluster; and ``KvgateTierUnavailable`` fires in a ``promtool test rules`` case built from the
counter values this failover produced."""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from gateway.errors import GatewayError
from gateway.protocol import frames
from gateway.remote.client import RemoteGateway
from gateway.types import RetrieveResult
from storage._cluster_client import node_of
from storage.redis_cluster import RedisClusterTier
from tests.support.gw import gathered, model_for, random_cache, small_geometry, zero_cache
from tests.support.paths import REPO
from tests.support.redis_cluster import Cluster, own_redis_cluster, replication_caught_up
from tests.support.server_fixture import LiveServer, fake_envelope, random_hash, running_server

pytestmark = [pytest.mark.redis, pytest.mark.slow]
own_redis_cluster = own_redis_cluster  # a fixture, registered in this module

TOKENS_PER_PROMPT, BLOCKS = 64, list(range(16))  # 4 chunks of 16 tokens, block size 4
PROMPTS = 12
_SERIES = re.compile(r'^(kvgate_[a-z_]+)\{([^}]*)\} ([0-9.e+]+)$')


async def metrics(live: LiveServer, http: httpx.AsyncClient) -> dict[tuple[str, str], float]:
    """``/metrics`` as an operator scrapes it: ``(name, labels) -> value``."""
    r = await http.get("/metrics", headers=live.headers(live.operator_token()))
    assert r.status_code == 200, r.text
    out: dict[tuple[str, str], float] = {}
    for line in r.text.splitlines():
        m = _SERIES.match(line)
        if m:
            out[(m[1], m[2])] = float(m[3])
    return out


def tier_failures(m: dict[tuple[str, str], float]) -> float:
    return sum(v for (name, labels), v in m.items()
               if name == "kvgate_load_failures_total" and re.search(r'reason="tier_(timeout|unavailable)"', labels))


def series(m: dict[tuple[str, str], float], name: str, label: str) -> float:
    return sum(v for (n, labels), v in m.items() if n == name and label in labels)


Retrieve = Callable[[list[int], list[torch.Tensor]], Awaitable[RetrieveResult]]


class Loads:
    """Loads of every stored prompt of both tenants, round and round, each checked bit-exact;
    the results' reasons by mode (``remote``: the worker client, ``embedded``: the core in process)."""

    def __init__(self, loaders: list[tuple[str, Retrieve, list[tuple[list[int], list[torch.Tensor]]]]]) -> None:
        self.loaders = loaders
        self.g = small_geometry()
        self.reasons: dict[str, dict[str, int]] = {"remote": {}, "embedded": {}}
        self.wrong = 0
        self.stop = False

    async def run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop:
            mode, retrieve, prompts = rng.choice(self.loaders)
            tokens, src = rng.choice(prompts)
            dst = zero_cache(self.g, len(BLOCKS))
            got = await retrieve(tokens, dst)
            n = got.loaded_tokens
            if n and not torch.equal(gathered(src, self.g, BLOCKS, n), gathered(dst, self.g, BLOCKS, n)):
                self.wrong += 1
            why = self.reasons[mode]
            why[got.reason or "full"] = why.get(got.reason or "full", 0) + 1
            await asyncio.sleep(0)

    def on_tier(self, mode: str) -> int:
        return self.reasons[mode].get("tier_unavailable", 0) + self.reasons[mode].get("tier_timeout", 0)


def promtool_case(rules: Path, before: float, after: float) -> str:
    """A promtool test: the tier-failure counter as a 1-minute scrape saw this failover (``before``
    for five scrapes, then ``after``), and the alert expected to fire on it."""
    values = " ".join([f"{before:.0f}"] * 5 + [f"{after:.0f}"] * 10)
    return f"""rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'kvgate_load_failures_total{{instance="a", reason="tier_unavailable"}}'
        values: '{values}'
    alert_rule_test:
      - eval_time: 5m
        alertname: KvgateTierUnavailable
        exp_alerts: []
      - eval_time: 8m
        alertname: KvgateTierUnavailable
        exp_alerts:
          - exp_labels: {{severity: warning, instance: a}}
      - eval_time: 12m
        alertname: KvgateTierUnavailable
        exp_alerts: []
"""


def shipped_rules_without_annotations(dest: Path) -> Path:
    """The shipped rules, expressions, ``for`` and labels unchanged, without annotations (their
    text carries the measured rate, which this case does not predict)."""
    rules = yaml.safe_load((REPO / "deploy/prometheus/kvgate-alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    dest.write_text(yaml.safe_dump(rules))
    return dest


async def test_a_master_killed_under_remote_loads_and_mid_batch(own_redis_cluster: Cluster, tmp_path: Path):
    cluster = own_redis_cluster
    g = small_geometry()
    model = model_for(g)
    with running_server(tmp_path / "state", tiers=["redis"], redis_url=cluster.url, redis_prefix="kvf:") as live:
        tier = live.runtime.tiers.tiers[0]
        assert isinstance(tier, RedisClusterTier)

        def node(key: object) -> str:
            return node_of(tier._redis, tier._head(key))  # type: ignore[arg-type]

        async with live.client() as http:
            a = await live.create_tenant(http, "acme")
            b = await live.create_tenant(http, "globex")
        gw = live.gateway
        ra = RemoteGateway(live.base_url, live.worker_token(a), chunk_tokens=16)
        rb = RemoteGateway(live.base_url, live.worker_token(b), chunk_tokens=16)
        async with ra, rb, live.client() as http:
            stored: dict[str, list[tuple[list[int], list[torch.Tensor]]]] = {a: [], b: []}
            for t, client in ((a, ra), (b, rb)):
                for p in range(PROMPTS):
                    tokens = [random.randrange(1, 30000) for _ in range(TOKENS_PER_PROMPT)]
                    src = random_cache(g, len(BLOCKS), seed=p + (1000 if t == b else 0))
                    res = await client.store(model, tokens, src, block_ids=BLOCKS)
                    assert res.stored == 4, res
                    stored[t].append((tokens, src))
            replication_caught_up(cluster)  # what was stored is on the replicas: loads after the failover hit
            a_nodes = [node(k) for tokens, _ in stored[a] for k in await live.call(gw.keys_for, a, "default", model, tokens)]
            victim_name = max(set(a_nodes), key=a_nodes.count)
            victim = int(victim_name.rsplit(":", 1)[1])
            assert victim in cluster.masters()
            # a two-chunk prompt of tenant A whose first chunk lies on a live master, its second on the victim
            while True:
                split = [random.randrange(1, 30000) for _ in range(32)]
                first, second = (node(k) for k in await live.call(gw.keys_for, a, "default", model, split))
                if first != victim_name and second == victim_name:
                    break
            split_src = random_cache(g, 8, seed=77)

            cap = await live.call(gw.mint_capability, a, "default", ["lookup", "get", "put"], 600)
            # and a raw upload frame in that order: its first envelope is stored before the second fails
            while True:
                raw = [random_hash(), random_hash()]
                _c, raw_keys = await live.call(live.state.plane.keys_for, cap, "put", raw)
                if node(raw_keys[0]) != victim_name and node(raw_keys[1]) == victim_name:
                    break
            envelopes = [fake_envelope(3000), fake_envelope(5000)]
            frame = frames.encode_index([(bytes.fromhex(h), len(e)) for h, e in zip(raw, envelopes)]) + b"".join(envelopes)
            upload = {**live.headers(live.worker_token(a), cap), "Content-Type": "application/octet-stream"}

            def remote(client: RemoteGateway) -> Retrieve:
                return lambda tokens, dst: client.retrieve(model, tokens, dst, block_ids=BLOCKS)

            def embedded(tokens: list[int], dst: list[torch.Tensor]) -> Awaitable[RetrieveResult]:
                return live.call(gw.retrieve, cap, model, tokens, dst, block_ids=BLOCKS)

            loads = Loads([("remote", remote(ra), stored[a]), ("remote", remote(rb), stored[b]),
                           ("embedded", embedded, stored[a])])
            before = await metrics(live, http)
            tasks = [asyncio.create_task(loads.run(s)) for s in range(4)]
            try:
                await asyncio.sleep(0.5)
                await asyncio.to_thread(cluster.kill, victim)
                killed_at = time.monotonic()
                raw_answer = await http.put("/v1/chunks", content=frame, headers=upload)
                refused = None
                try:  # the worker's batch, while the master is down (its replica is promoted after ~1 s)
                    await ra.store(model, split, split_src, block_ids=list(range(8)))
                except GatewayError as exc:
                    refused = exc
                breaker_seen = 0.0
                recovered = asyncio.create_task(asyncio.to_thread(cluster.wait_ok))  # the replica promoted
                while not recovered.done():  # the breaker as scrapes see it meanwhile
                    breaker_seen = max(breaker_seen, series(await metrics(live, http), "kvgate_tier_breaker_open", 'tier="redis"'))
                    await asyncio.sleep(0.1)
                await recovered
                recovered_s = time.monotonic() - killed_at
                await asyncio.sleep(1.0)  # loads go on against the recovered cluster
            finally:
                loads.stop = True
                await asyncio.gather(*tasks)
            after = await metrics(live, http)
            split_keys = await live.call(gw.keys_for, a, "default", model, split)
            checker = RedisClusterTier(cluster.url, prefix="kvf:")
            try:
                await checker.start()
                left_in_cluster = await checker.contains_many(split_keys)
                raw_in_cluster = await checker.contains_many(raw_keys)
            finally:
                await checker.aclose()

        failed = tier_failures(after) - tier_failures(before)
        print(f"\nkill -9 of master {victim}, cluster ok again after {recovered_s:.1f} s: worker results {loads.reasons}, {loads.wrong} wrong; "
              f"kvgate_load_failures_total tier_* +{failed:.0f}, breaker gauge seen {breaker_seen:.0f}, "
              f"breaker trips +{series(after, 'kvgate_tier_breaker_trips_total', 'redis') - series(before, 'kvgate_tier_breaker_trips_total', 'redis'):.0f}; "
              f"batch refused: {refused!r}; rollbacks {series(after, 'kvgate_store_rollbacks_total', 'removed'):.0f} removed, "
              f"{series(after, 'kvgate_store_rollbacks_total', 'left'):.0f} left; split chunks in the cluster: {left_in_cluster}; "
              f"raw frame {raw_answer.status_code}, its chunks in the cluster: {raw_in_cluster}")
        assert loads.wrong == 0
        assert loads.on_tier("remote") > 0 and loads.on_tier("embedded") > 0  # the reason, in both modes
        # the server counts every load it ended on the tier, by reason (both modes' among them)
        assert failed >= loads.on_tier("remote") + loads.on_tier("embedded")
        assert breaker_seen == 1 or series(after, "kvgate_tier_breaker_trips_total", "redis") > 0
        assert refused is not None, "the batch was stored: the failover finished before it reached the dead master"
        # refused whole: each chunk it tried is removed, or counted as left where its master could
        # not be asked (here: the dead one, whose write never reached a replica)
        removed, left = (series(after, "kvgate_store_rollbacks_total", f'outcome="{o}"') for o in ("removed", "left"))
        assert removed + left >= 1 and left_in_cluster.count(True) <= left
        assert left_in_cluster == [False, False]
        # the raw frame: its first envelope was stored, then removed when the second failed
        assert raw_answer.status_code == 503, raw_answer.text
        assert raw_in_cluster == [False, False] and removed >= 1

        promtool = shutil.which("promtool")
        if promtool is None:
            pytest.fail("promtool is needed to check the alert against this failover's series")
        case = tmp_path / "failover.test.yml"
        rules = shipped_rules_without_annotations(tmp_path / "rules.yml")
        case.write_text(promtool_case(rules, tier_failures(before), tier_failures(after)))
        out = subprocess.run([promtool, "test", "rules", str(case)], capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
