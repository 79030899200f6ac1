"""A published prefix's warm-up on a named engine (``kvgate prefixes publish --warm-engine``).

``warm_up`` sends the engine's OpenAI server ONE completion (``/v1/completions``, the prefix's
whole chunks as the prompt's token ids, ``max_tokens`` 1) with the publish answer's capability in
``X-KV-Capability`` and the prefix id in ``X-KV-Warm-Up``. The tenant middleware there passes a
warm-up only from a trusted peer or with an operator's token; the connector reports the chunks
(``POST /v1/admin/prefixes/{id}/chunks``) and stores them through the ordinary store path. Then it
waits, bounded, until the chunks are recorded and every one is in a tier this process reads (an
engine's stores end after its answer). Anything short of that is ``WarmUpFailed``.
"""

from __future__ import annotations

import asyncio
import struct
import time
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.errors import GatewayError
from gateway.services.prefixes import Prefixes, Published

__all__ = ["WARM_CAPABILITY_HEADER", "WARM_HEADER", "WarmUpFailed", "WarmUpResult", "warm_up"]

WARM_HEADER = "X-KV-Warm-Up"
WARM_CAPABILITY_HEADER = "X-KV-Capability"


class WarmUpFailed(GatewayError):
    """The warm-up did not leave the prefix warm: the engine could not be reached or refused the
    request, or its chunks were not recorded and stored in time."""


@dataclass(frozen=True, slots=True)
class WarmUpResult:
    engine: str
    whole_chunks: int
    recorded: int  # chunks the connector's report recorded (every fingerprint: each TP rank reports)
    stored: int  # of those, in a tier this process reads
    seconds: float

    @property
    def warm(self) -> bool:
        return self.recorded >= self.whole_chunks and self.stored == self.recorded

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "warm": self.warm, "whole_chunks": self.whole_chunks,
                "recorded": self.recorded, "stored": self.stored, "seconds": round(self.seconds, 3)}


async def warm_up(
    prefixes: Prefixes, published: Published, engine_url: str, *, model: str | None = None, token: str | None = None,
    timeout_s: float = 120.0, poll_s: float = 0.2, http: httpx.AsyncClient | None = None,
) -> WarmUpResult:
    """Warm ``published`` on the engine at ``engine_url`` (its OpenAI server); ``model``: the
    served model name for the request (the engine's default where None); ``token``: a bearer
    token for an engine whose middleware does not trust this host (an operator's)."""
    pub = published.publication
    whole = published.whole_chunks * prefixes.chunk_tokens
    ids = list(struct.unpack(f"<{pub.num_tokens}i", pub.tokens))[:whole]
    body: dict[str, Any] = {"prompt": ids, "max_tokens": 1, "temperature": 0}
    if model:
        body["model"] = model
    headers = {WARM_HEADER: pub.id, WARM_CAPABILITY_HEADER: published.capability}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    url = engine_url.rstrip("/") + "/v1/completions"
    t0 = time.monotonic()
    client = http or httpx.AsyncClient(timeout=timeout_s, follow_redirects=False)
    try:
        r = await client.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise WarmUpFailed(f"the engine at {engine_url} could not be reached ({type(exc).__name__})") from None
    finally:
        if http is None:
            await client.aclose()
    if r.status_code != 200:
        raise WarmUpFailed(f"the engine at {engine_url} answered the warm-up with {r.status_code}: {_detail(r)}")
    recorded = stored = 0
    while True:
        recorded, stored = await prefixes.warm_state(pub.id)
        result = WarmUpResult(engine_url, published.whole_chunks, recorded, stored, time.monotonic() - t0)
        if result.warm:
            return result
        if time.monotonic() - t0 >= timeout_s:
            break
        await asyncio.sleep(poll_s)
    if recorded < published.whole_chunks:
        raise WarmUpFailed(
            f"the engine answered, but {recorded} of {published.whole_chunks} chunks were reported: is its connector "
            "kvgate's, its service token an operator's, and the published model its own?"
        )
    raise WarmUpFailed(f"{stored} of {recorded} recorded chunks were stored within {timeout_s:g} s")


def _detail(r: httpx.Response) -> str:
    try:
        doc = r.json()
    except ValueError:
        return r.text[:200]
    return str(doc.get("detail") or doc.get("message") or doc)[:200] if isinstance(doc, dict) else str(doc)[:200]
