"""A denial takes the same time whether or not the tenant, namespace or chunk exists (issue 3).

Judged on distributions: interleaved samples in random order, a two-sample Kolmogorov-Smirnov
test. The check is a MAC chain and a revocation-set lookup, with no registry access before it, so
existence cannot show; the positive control shows the test can see a real difference.
"""

from __future__ import annotations

import random
import time

from scipy.stats import ks_2samp

from gateway.errors import AccessDenied
from tests.support.gw import ALL_OPS, gateway_runtime, model_for, random_cache, small_geometry

SAMPLES = 300


def _forge(token: str, tenant: str) -> str:
    """A capability with a valid shape for ``tenant`` and a wrong tag."""
    import base64
    import json

    prefix, kid, body, tag = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["t"] = tenant
    raw = base64.urlsafe_b64encode(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode()).rstrip(b"=").decode()
    bad_tag = ("A" if tag[0] != "A" else "B") + tag[1:]
    return ".".join([prefix, kid, raw, bad_tag])


async def _timings(call_a, call_b) -> tuple[list[int], list[int]]:
    order = [0] * SAMPLES + [1] * SAMPLES
    random.shuffle(order)
    out: tuple[list[int], list[int]] = ([], [])
    for which in order:
        fn = call_a if which == 0 else call_b
        t0 = time.perf_counter_ns()
        try:
            await fn()
        except AccessDenied:
            pass
        out[which].append(time.perf_counter_ns() - t0)
    return out


async def _p_value(call_a, call_b) -> float:
    best = 0.0
    for _ in range(3):  # a noisy 2-core machine: take the best of three runs
        a, b = await _timings(call_a, call_b)
        best = max(best, ks_2samp(a, b).pvalue)
        if best >= 0.01:
            break
    return best


async def test_denials_do_not_reveal_existence(tmp_path):
    g = small_geometry()
    model = model_for(g)
    tokens = list(range(32))
    async with gateway_runtime(tmp_path) as rt:
        await rt.admin.create_tenant("acme")
        full = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        await rt.gateway.store(full, model, tokens, random_cache(g, 16), block_ids=list(range(8)))  # it exists
        existing = await rt.gateway.mint_capability("acme", "default", ["lookup"], 600)
        missing = await rt.gateway.mint_capability("acme", "never-used", ["lookup"], 600)

        # a valid capability without the pin operation: existing namespace with chunks vs a namespace never used
        p_ns = await _p_value(lambda: rt.gateway.pin(existing, model, tokens), lambda: rt.gateway.pin(missing, model, tokens))
        # a forged capability naming an existing tenant vs one naming no tenant at all
        p_tenant = await _p_value(
            lambda: rt.gateway.lookup(_forge(existing, "acme"), model, tokens),
            lambda: rt.gateway.lookup(_forge(existing, "zzzz"), model, tokens),  # same length: only existence differs
        )
        assert p_ns >= 0.01, p_ns
        assert p_tenant >= 0.01, p_tenant

        # positive control: a real difference (a hit that reads the tiers vs a denial) is detected
        a, b = await _timings(lambda: rt.gateway.lookup(full, model, tokens * 8), lambda: rt.gateway.pin(existing, model, tokens))
        assert ks_2samp(a, b).pvalue < 1e-6
