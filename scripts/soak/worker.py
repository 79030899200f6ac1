"""One soak worker, a process of its own: a remote worker (``RemoteGateway``) of one tenant and
namespace running a randomized mix of operations through the public APIs until the run ends.

    python -m scripts.soak.worker CONFIG.json

Every operation is a line of its JSON Lines log (monotonic start and end, outcome, error kind,
what was acknowledged). Checked here as it runs: a load's bytes are the ones this tenant stored
for that prompt (the content is a function of tenant, namespace and prompt); another tenant's or
another namespace's prompt misses; a prompt of this worker misses after a clear this worker was
acknowledged, unless a store of it began after the clear did; a capability held before a tenant
clear, and one of a disabled tenant, are refused. Broken ones are ``violation`` lines.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from gateway.chunking import chain_hashes
from gateway.errors import AccessDenied, GatewayError, InvalidRequest
from gateway.remote.client import RemoteGateway, RemoteUnavailable
from gateway.types import KVModel
from kernels.layouts import KVGeometry, KVLayout
from kernels.pack import pack, slots_from_block_ids
from tenancy.capabilities import read_unverified

BLOCK_SIZE = 4
GEOMETRY = KVGeometry(num_layers=4, num_kv_heads=2, head_size=16, dtype=torch.float16, block_size=BLOCK_SIZE,
                      layout=KVLayout.KV_FIRST)
MODEL = KVModel("soak-model", GEOMETRY)
OPS = ("store", "load", "lookup", "peer", "pin", "unpin", "clear_namespace", "clear_tenant", "rotate", "revoke")


def prompt_tokens(seed: int, owner: int, idx: int, min_tokens: int, max_tokens: int) -> list[int]:
    """The tokens of prompt ``idx`` of worker ``owner``: the same in every process."""
    rng = random.Random(f"{seed}/{owner}/{idx}")
    n = rng.randrange(min_tokens // BLOCK_SIZE, max_tokens // BLOCK_SIZE + 1) * BLOCK_SIZE
    return [rng.randrange(1, 32000) for _ in range(n)]


def prompt_kv(tenant: str, namespace: str, owner: int, idx: int, num_tokens: int) -> list[torch.Tensor]:
    """What a tenant stores for a prompt: KV drawn from its tenant, namespace and prompt, so the
    bytes of any other tenant's or namespace's copy differ."""
    digest = hashlib.sha256(f"{tenant}/{namespace}/{owner}/{idx}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    blocks = num_tokens // BLOCK_SIZE
    return [torch.randn(GEOMETRY.layer_shape(blocks), generator=gen).to(GEOMETRY.dtype) for _ in range(GEOMETRY.num_layers)]


def kv_bytes(cache: list[torch.Tensor], blocks: list[int], num_tokens: int) -> torch.Tensor:
    """The KV of a prompt's first ``num_tokens`` tokens, as bytes (bit-exact comparisons)."""
    slots = slots_from_block_ids(blocks, BLOCK_SIZE, 0, num_tokens)
    return pack(cache, slots, GEOMETRY).view(torch.uint8)


def error_kind(exc: BaseException) -> str:
    """A short, stable name for what an operation met (counted per fault in the report)."""
    if isinstance(exc, RemoteUnavailable):
        text = str(exc)
        tail = text.rsplit(": ", 1)[-1].strip()
        return "unavailable:" + (tail.split()[0] if tail else "?")
    if isinstance(exc, AccessDenied):
        return "denied"
    if isinstance(exc, InvalidRequest):
        return "invalid"
    if isinstance(exc, GatewayError):
        return "gateway:" + type(exc).__name__
    if isinstance(exc, httpx.HTTPError):
        return "http:" + type(exc).__name__
    if isinstance(exc, HttpStatus):
        return f"status:{exc.status}"
    return "crash:" + type(exc).__name__


class HttpStatus(Exception):
    """An answer the operation did not expect (its status is the error kind)."""

    def __init__(self, what: str, r: httpx.Response | int) -> None:
        status, text = (r, "") if isinstance(r, int) else (r.status_code, r.text[:200])
        super().__init__(f"{what}: {status} {text}")
        self.status = status


@dataclass
class Prompt:
    owner: int
    idx: int
    tenant: str
    namespace: str
    tokens: list[int]
    kv: list[torch.Tensor]
    blocks: list[int]


@dataclass
class Worker:
    cfg: dict[str, Any]
    rng: random.Random = field(init=False)
    log: Any = field(init=False)
    stores: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # own prompt -> store attempts
    clears: list[tuple[float, float]] = field(default_factory=list)  # own acknowledged clears covering own prompts
    pinned: set[str] = field(default_factory=set)
    prompts: dict[tuple[int, int], Prompt] = field(default_factory=dict)
    last_cap: str | None = None
    pin_cap: tuple[str, float] | None = None  # the pin capability and when it expires
    ephemeral_left: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        c = self.cfg
        self.id: int = c["id"]
        self.tenant: str = c["tenant"]
        self.namespace: str = c["namespace"]
        self.rng = random.Random(f"{c['seed']}/worker/{self.id}")
        self.log = open(c["log"], "w", buffering=1 << 16)  # closed at the end of run()
        self.ephemeral_left = list(c.get("ephemeral", []))
        self.peers: dict[int, dict[str, Any]] = {p["id"]: p for p in c["peers"]}
        self.weights = [float(c["weights"].get(op, 0)) for op in OPS]

    # -- bookkeeping -----------------------------------------------------------------------
    def write(self, rec: dict[str, Any]) -> None:
        rec.setdefault("w", self.id)
        self.log.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def violation(self, kind: str, **evidence: Any) -> None:
        self.write({"op": "violation", "kind": kind, "t": time.monotonic(), **evidence})

    def prompt(self, owner: int, idx: int) -> Prompt:
        key = (owner, idx)
        p = self.prompts.get(key)
        if p is None:
            info = self.peers[owner] if owner != self.id else {"tenant": self.tenant, "namespace": self.namespace}
            tokens = prompt_tokens(self.cfg["seed"], owner, idx, self.cfg["min_tokens"], self.cfg["max_tokens"])
            kv = prompt_kv(info["tenant"], info["namespace"], owner, idx, len(tokens))
            p = Prompt(owner, idx, info["tenant"], info["namespace"], tokens, kv, list(range(len(tokens) // BLOCK_SIZE)))
            self.prompts[key] = p
        return p

    def must_miss(self, idx: int, t0: float) -> bool:
        """A clear this worker was acknowledged before ``t0``, and no store of the prompt that
        began before ``t0`` ended after that clear began: the prompt cannot be readable."""
        stores = self.stores.get(idx, [])
        return any(c1 < t0 and all(s1 < c0 for s0, s1 in stores if s0 < t0) for c0, c1 in self.clears)

    async def note_capability(self) -> str:
        """The worker's capability (minted if needed); a new one is an acknowledged grant."""
        cap = await self.rg.capability()
        if cap != self.last_cap:
            self.last_cap = cap
            self.write({"op": "ack", "t": time.monotonic(), "ack": {"action": "capability.mint", "cap_id": read_unverified(cap).cap_id}})
        return cap

    def headers(self, token: str | None = None, cap: str | None = None) -> dict[str, str]:
        out = {"Authorization": f"Bearer {token or self.cfg['token']}"}
        if cap is not None:
            out["X-KV-Capability"] = cap
        return out

    # -- operations --------------------------------------------------------------------------
    async def op_store(self, rec: dict[str, Any]) -> None:
        rec["op"] = "store"  # also where another operation falls back to this one
        idx = self.rng.randrange(self.cfg["prompts"])
        p = self.prompt(self.id, idx)
        rec["prompt"] = [self.id, idx]
        await self.note_capability()
        t0 = rec["t0"]
        try:
            r = await self.rg.store(MODEL, p.tokens, p.kv, block_ids=p.blocks)
        finally:  # a failed store may have landed in part: it counts as a store for the model
            self.stores.setdefault(idx, []).append((t0, time.monotonic()))
        rec.update(stored=r.stored, skipped=r.skipped)

    async def _load(self, p: Prompt, rec: dict[str, Any], expect: str) -> int:
        dst = [torch.zeros_like(x) for x in p.kv]
        r = await self.rg.retrieve(MODEL, p.tokens, dst, block_ids=p.blocks)
        n = r.loaded_tokens
        rec.update(loaded=n, reason=r.reason, integrity=r.integrity_failures, expect=expect)
        if r.integrity_failures:
            self.violation("integrity_failure", prompt=[p.owner, p.idx], tenant=p.tenant, namespace=p.namespace,
                           count=r.integrity_failures)
        if n:
            want, got = kv_bytes(p.kv, p.blocks, n), kv_bytes(dst, p.blocks, n)
            if not torch.equal(want, got):
                bad = int((want != got).nonzero()[0].item())
                self.violation("wrong_bytes", prompt=[p.owner, p.idx], tenant=p.tenant, namespace=p.namespace,
                               reader_tenant=self.tenant, reader_namespace=self.namespace, loaded_tokens=n,
                               first_bad_byte=bad, expect=expect)
        return n

    async def op_load(self, rec: dict[str, Any]) -> None:
        idx = self.rng.randrange(self.cfg["prompts"])
        p = self.prompt(self.id, idx)
        rec["prompt"] = [self.id, idx]
        await self.note_capability()
        expect = "miss" if self.must_miss(idx, rec["t0"]) else "any"
        n = await self._load(p, rec, expect)
        if n and expect == "miss":
            self.violation("readable_after_clear", prompt=[self.id, idx], loaded_tokens=n, clears=self.clears[-3:],
                           stores=self.stores.get(idx, [])[-3:], t0=rec["t0"])

    async def op_lookup(self, rec: dict[str, Any]) -> None:
        idx = self.rng.randrange(self.cfg["prompts"])
        p = self.prompt(self.id, idx)
        rec["prompt"] = [self.id, idx]
        await self.note_capability()
        expect = "miss" if self.must_miss(idx, rec["t0"]) else "any"
        r = await self.rg.lookup(MODEL, p.tokens)
        rec.update(hit=r.hit_tokens, degraded=r.degraded, expect=expect)
        if r.hit_tokens and expect == "miss":
            self.violation("readable_after_clear", prompt=[self.id, idx], hit_tokens=r.hit_tokens, via="lookup",
                           clears=self.clears[-3:], stores=self.stores.get(idx, [])[-3:], t0=rec["t0"])

    async def op_peer(self, rec: dict[str, Any]) -> None:
        """Another worker's prompt: its tenant and namespace's copy must never reach this one
        (another tenant: the attack; same tenant, other namespace: namespace isolation); a peer of
        the same tenant and namespace is the positive control, its hits checked byte for byte."""
        peer = self.peers[self.rng.choice(sorted(self.peers))]
        idx = self.rng.randrange(peer["prompts"])
        p = self.prompt(peer["id"], idx)
        same = (peer["tenant"], peer["namespace"]) == (self.tenant, self.namespace)
        scope = "same" if same else ("other_namespace" if peer["tenant"] == self.tenant else "other_tenant")
        rec.update(prompt=[peer["id"], idx], scope=scope)
        await self.note_capability()
        if self.rng.random() < 0.5:
            r = await self.rg.lookup(MODEL, p.tokens)
            rec.update(kind="lookup", hit=r.hit_tokens, expect="any" if same else "miss")
            if r.hit_tokens and not same:
                self.violation("cross_" + scope.split("_", 1)[1] + "_read", prompt=[peer["id"], idx], owner_tenant=peer["tenant"],
                               owner_namespace=peer["namespace"], hit_tokens=r.hit_tokens, via="lookup")
            return
        rec["kind"] = "load"
        if same:
            await self._load(p, rec, "any")
            return
        dst = [torch.zeros_like(x) for x in p.kv]
        r = await self.rg.retrieve(MODEL, p.tokens, dst, block_ids=p.blocks)
        rec.update(loaded=r.loaded_tokens, reason=r.reason, expect="miss")
        if r.loaded_tokens:
            theirs = bool(torch.equal(kv_bytes(p.kv, p.blocks, r.loaded_tokens), kv_bytes(dst, p.blocks, r.loaded_tokens)))
            self.violation("cross_" + scope.split("_", 1)[1] + "_read", prompt=[peer["id"], idx], owner_tenant=peer["tenant"],
                           owner_namespace=peer["namespace"], loaded_tokens=r.loaded_tokens, owners_bytes=theirs, via="load")

    def _stored_hash(self) -> str | None:
        stored = [i for i, s in self.stores.items() if s]
        if not stored:
            return None
        p = self.prompt(self.id, self.rng.choice(stored))
        chunks = chain_hashes(p.tokens, MODEL.fingerprint, self.cfg["chunk_tokens"])
        return str(self.rng.choice(chunks).chained_hash.hex())

    async def _pin_call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """A pin request under a capability of its own (op ``pin``), minted again once when
        refused: a tenant clear by this worker or a peer revokes every capability of the tenant."""
        for attempt in (0, 1):
            if self.pin_cap is None or self.pin_cap[1] - 15 < time.time():
                r = await self.http.post("/v1/capabilities", json={"namespace": self.namespace, "ops": ["pin"], "ttl": 120},
                                         headers=self.headers())
                if r.status_code != 201:
                    raise HttpStatus("pin capability", r)
                got = r.json()
                self.pin_cap = (got["capability"], float(got["expires_at"]))
                self.write({"op": "ack", "t": time.monotonic(), "ack": {"action": "capability.mint", "cap_id": got["cap_id"]}})
            r = await self.http.request(method, path, headers=self.headers(cap=self.pin_cap[0]), **kw)
            if r.status_code != 403 or attempt:
                return r
            self.pin_cap = None
        raise AssertionError("unreachable")

    async def op_pin(self, rec: dict[str, Any]) -> None:
        rec["op"] = "pin"  # also where another operation falls back to this one
        if len(self.pinned) >= 8:
            return await self.op_unpin(rec)
        h = self._stored_hash()
        if h is None:
            return await self.op_store(rec)
        r = await self._pin_call("POST", "/v1/pins", json={"hash": h})
        rec["status"] = r.status_code
        if r.status_code == 204:
            self.pinned.add(h)
            rec["ack"] = {"action": "pin", "tenant": self.tenant, "namespace": self.namespace}
        elif r.status_code != 404:  # 404: not stored (evicted or cleared): nothing was done
            raise HttpStatus("pin", r)

    async def op_unpin(self, rec: dict[str, Any]) -> None:
        rec["op"] = "unpin"  # also where another operation falls back to this one
        if not self.pinned:
            return await self.op_pin(rec)
        h = self.rng.choice(sorted(self.pinned))
        r = await self._pin_call("DELETE", f"/v1/pins/{h}")
        rec["status"] = r.status_code
        if r.status_code in (204, 404):  # 404: no longer pinned (a clear removed it)
            self.pinned.discard(h)
        if r.status_code == 204:
            rec["ack"] = {"action": "unpin", "tenant": self.tenant, "namespace": self.namespace}
        elif r.status_code != 404:
            raise HttpStatus("unpin", r)

    async def _clear(self, rec: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        r = await self.http.post("/v1/admin/clear", json=body, headers=self.headers())
        if r.status_code != 200:
            raise HttpStatus("clear", r)
        got: dict[str, Any] = r.json()
        t1 = time.monotonic()
        self.clears.append((rec["t0"], t1))
        self.pinned.clear()
        rec["ack"] = {"action": "clear", "tenant": self.tenant, "namespace": body.get("namespace"), "job_id": got["job_id"],
                      "scope": body["scope"]}
        return got

    async def _probe_cleared(self, rec: dict[str, Any]) -> None:
        """Right after an acknowledged clear: this worker's prompts stored before it must miss."""
        gone = [i for i in sorted(self.stores) if self.must_miss(i, time.monotonic())]
        probes = []
        for idx in self.rng.sample(gone, min(3, len(gone))):
            p = self.prompt(self.id, idx)
            t0 = time.monotonic()
            try:
                got = await self.rg.lookup(MODEL, p.tokens)
            except Exception as exc:
                probes.append({"prompt": idx, "error": error_kind(exc)})
                continue
            probes.append({"prompt": idx, "hit": got.hit_tokens})
            if got.hit_tokens:
                self.violation("readable_after_clear", prompt=[self.id, idx], hit_tokens=got.hit_tokens, via="probe",
                               clear=self.clears[-1], t0=t0)
        rec["probes"] = probes

    async def op_clear_namespace(self, rec: dict[str, Any]) -> None:
        await self._clear(rec, {"scope": "namespace", "tenant": self.tenant, "namespace": self.namespace})
        await self._probe_cleared(rec)

    async def op_rotate(self, rec: dict[str, Any]) -> None:
        rec["op"] = "rotate"  # also where another operation falls back to this one
        r = await self.http.post(f"/v1/admin/tenants/{self.tenant}/keys/rotate", headers=self.headers())
        if r.status_code != 200:
            raise HttpStatus("rotate", r)
        rec["ack"] = {"action": "key.rotate", "tenant": self.tenant, "version": r.json()["key_version"]}

    async def _refused(self, cap: str, token: str | None = None) -> int:
        """The status of a lookup made with ``cap`` (a revoked capability must be refused)."""
        r = await self.http.post("/v1/lookup", json={"hashes": ["00" * 32]}, headers=self.headers(token, cap))
        return r.status_code

    async def op_clear_tenant(self, rec: dict[str, Any]) -> None:
        before = await self.note_capability()
        await self._clear(rec, {"scope": "tenant", "tenant": self.tenant})
        status = await self._refused(before)
        rec["old_capability"] = status
        if 200 <= status < 300:
            self.violation("capability_not_revoked", after="tenant clear", status=status,
                           cap_id=read_unverified(before).cap_id)
        await self._probe_cleared(rec)

    async def op_revoke(self, rec: dict[str, Any]) -> None:
        """A tenant of this worker's own, created, used and disabled by an operator: the
        capability it held and a new mint are refused afterwards."""
        if not self.ephemeral_left:
            return await self.op_rotate(rec)
        eph = self.ephemeral_left.pop(0)
        op = self.headers(self.cfg["operator_token"])
        rec["tenant"] = eph["tenant"]
        r = await self.http.post("/v1/admin/tenants", json={"tenant": eph["tenant"]}, headers=op)
        if r.status_code != 201:
            raise HttpStatus("tenant create", r)
        self.write({"op": "ack", "t": time.monotonic(), "ack": {"action": "tenant.create", "tenant": eph["tenant"]}})
        r = await self.http.post("/v1/capabilities", json={"namespace": "default", "ops": ["lookup", "get"], "ttl": 300},
                                 headers=self.headers(eph["token"]))
        if r.status_code != 201:
            raise HttpStatus("mint", r)
        cap = r.json()["capability"]
        self.write({"op": "ack", "t": time.monotonic(), "ack": {"action": "capability.mint", "cap_id": r.json()["cap_id"]}})
        control = await self._refused(cap, eph["token"])
        if control != 200:  # the control: the capability works before the tenant is disabled
            raise HttpStatus("lookup before disable", control)
        r = await self.http.delete(f"/v1/admin/tenants/{eph['tenant']}", headers=op)
        if r.status_code != 200:
            raise HttpStatus("tenant disable", r)
        rec["ack"] = {"action": "tenant.disable", "tenant": eph["tenant"]}
        status = await self._refused(cap, eph["token"])
        mint = await self.http.post("/v1/capabilities", json={"namespace": "default", "ops": ["lookup"], "ttl": 60},
                                    headers=self.headers(eph["token"]))
        rec.update(old_capability=status, new_mint=mint.status_code)
        if 200 <= status < 300 or mint.status_code == 201:
            self.violation("capability_not_revoked", after="tenant disable", tenant=eph["tenant"], lookup_status=status,
                           mint_status=mint.status_code)

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        c = self.cfg
        self.http = httpx.AsyncClient(base_url=c["url"], timeout=30)
        self.rg = RemoteGateway(c["url"], c["token"], namespace=self.namespace, chunk_tokens=c["chunk_tokens"],
                                ops=("lookup", "get", "put", "pin"), capability_ttl=120, segment_bytes=4096, threads=1)
        print("ready", flush=True)
        go = Path(c["go"])
        while not go.exists():
            await asyncio.sleep(0.05)
        end = float(json.loads(go.read_text())["end"])
        counts: dict[str, int] = {}
        try:
            while time.monotonic() < end:
                op = self.rng.choices(OPS, self.weights)[0]
                rec: dict[str, Any] = {"op": op, "t0": time.monotonic()}
                try:
                    await getattr(self, "op_" + op)(rec)
                    rec["ok"] = True
                except Exception as exc:
                    rec.update(ok=False, err=error_kind(exc), msg=str(exc)[:200])
                    if rec["err"].startswith("crash:"):
                        rec["trace"] = traceback.format_exc()[-1500:]
                rec["t1"] = time.monotonic()
                self.write(rec)
                counts[op] = counts.get(op, 0) + 1
                if not rec["ok"]:
                    await asyncio.sleep(self.rng.uniform(0.05, 0.25))  # back off from a failed dependency
                elif c.get("think_s"):
                    await asyncio.sleep(c["think_s"])
        finally:
            self.write({"op": "end", "t": time.monotonic(), "counts": counts})
            self.log.close()
            await self.rg.aclose()
            await self.http.aclose()


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    asyncio.run(Worker(cfg).run())


if __name__ == "__main__":
    main()
