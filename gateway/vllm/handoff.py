"""Prefill/decode hand-off: roles, receipts and the consumer's bounded wait.

    roles(kv_role, ...)    what a connector of vLLM's ``kv_role`` does: (loads, stores)
    Receipt                what a producer stored for a request: store id, namespace epoch,
                           chunks, tokens and its owner tag; travels in ``kv_transfer_params``
    check(receipt, ...)    the consumer's reading of a receipt against its own request: "" (wait
                           for it), or why it is refused (malformed, another owner, stale epoch)
    HandoffWaits           per request, lookups with its own capability that never block the
                           scheduler, until the receipt's tokens are visible or ``wait_s`` has passed
    HandoffStores          a producer worker's hand-off stores, reported once durable

A receipt is not a capability: it grants nothing and names no key. The consumer looks up and
loads with the capability its own middleware minted; a receipt only says how long waiting is
worth it. Its owner tag is a digest of the tenant and namespace, so a receipt handed to another
tenant is told apart (and refused, audited) without waiting. Design notes: docs/architecture.md."""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tenancy.capabilities import read_unverified
from tenancy.errors import CapabilityDenied

if TYPE_CHECKING:
    from gateway.types import KVModel, StoreResult
    from gateway.vllm.backend import Backend

log = logging.getLogger("kvgate.vllm")

__all__ = [
    "EPOCH_PARAM", "FALLBACK_REASONS", "RECEIPT_PARAM", "HandoffStores", "HandoffWaits", "Receipt", "ReceiptInvalid",
    "audit_refused_receipt", "check", "durable_store", "epoch_of", "new_store_id", "owner_tag", "roles", "submit_lookup",
]

RECEIPT_PARAM = "kvgate_receipt"
EPOCH_PARAM = "kvgate_epoch"  # the namespace epoch the middleware minted the capability under

# why a consumer recomputed what a receipt named (counted, logged, traced)
MALFORMED = "receipt_malformed"
OTHER_OWNER = "receipt_other_tenant"
STALE_EPOCH = "receipt_stale_epoch"
LATE = "receipt_late"
FALLBACK_REASONS = (MALFORMED, OTHER_OWNER, STALE_EPOCH, LATE)

_HEX32 = re.compile(r"[0-9a-f]{32}")
_MAX_TOKENS = 1 << 24


class ReceiptInvalid(ValueError):
    """A receipt that does not parse (wrong type, missing or out-of-range field)."""


def roles(kv_role: str | None, *, producer_loads: bool = False, consumer_stores: bool = False) -> tuple[bool, bool]:
    """(loads, stores) of a connector of vLLM's ``kv_role`` (None and ``kv_both``: both)."""
    if kv_role == "kv_producer":
        return producer_loads, True
    if kv_role == "kv_consumer":
        return True, consumer_stores
    return True, True


def owner_tag(capability: str) -> str:
    """The digest of the tenant and namespace ``capability`` names (not verified here: the
    lookup and the load verify it); CapabilityDenied for a token that does not parse."""
    cap = read_unverified(capability)
    data = b"kvgate-receipt/1\x00" + cap.tenant.encode() + b"\x00" + cap.namespace.encode()
    return hashlib.sha256(data).hexdigest()[:32]


def new_store_id() -> str:
    return secrets.token_hex(16)


def epoch_of(kv_transfer_params: Any) -> int | None:
    """The namespace epoch the request's middleware put beside its capability, if any."""
    value = kv_transfer_params.get(EPOCH_PARAM) if isinstance(kv_transfer_params, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass(frozen=True)
class Receipt:
    store_id: str
    owner: str
    chunks: int
    tokens: int
    epoch: int | None = None

    def params(self) -> dict[str, Any]:
        """The receipt as it travels in ``kv_transfer_params[RECEIPT_PARAM]``."""
        doc: dict[str, Any] = {"store": self.store_id, "owner": self.owner, "chunks": self.chunks, "tokens": self.tokens}
        if self.epoch is not None:
            doc["epoch"] = self.epoch
        return doc

    @classmethod
    def parse(cls, doc: Any) -> Receipt:
        """A receipt from ``kv_transfer_params[RECEIPT_PARAM]``; ReceiptInvalid says what is wrong."""
        if not isinstance(doc, Mapping) or set(doc) - {"store", "owner", "chunks", "tokens", "epoch"}:
            raise ReceiptInvalid("a receipt is an object of store, owner, chunks, tokens and epoch")
        store, owner, epoch = doc.get("store"), doc.get("owner"), doc.get("epoch")
        if not (isinstance(store, str) and _HEX32.fullmatch(store) and isinstance(owner, str) and _HEX32.fullmatch(owner)):
            raise ReceiptInvalid("store and owner must be 32 lowercase hex digits")
        counts = [doc.get("chunks"), doc.get("tokens")]
        if not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n <= _MAX_TOKENS for n in counts):
            raise ReceiptInvalid("chunks and tokens must be positive integers")
        if epoch is not None and not (isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0):
            raise ReceiptInvalid("epoch must be a non-negative integer")
        return cls(store, owner, int(doc["chunks"]), int(doc["tokens"]), epoch)


def check(doc: Any, capability: str, epoch: int | None) -> tuple[Receipt | None, str]:
    """The receipt ``doc`` read for a request holding ``capability`` (minted at ``epoch``):
    (the receipt, "") to wait for it, or (None, why it is not waited for)."""
    try:
        receipt = Receipt.parse(doc)
        mine = owner_tag(capability)
    except (ReceiptInvalid, CapabilityDenied):
        return None, MALFORMED
    if not secrets.compare_digest(receipt.owner, mine):
        return None, OTHER_OWNER
    if receipt.epoch is not None and epoch is not None and receipt.epoch != epoch:
        return None, STALE_EPOCH
    return receipt, ""


#: (capability, tokens) -> a future of (hit tokens, degraded reason); it does not block
SubmitLookup = Callable[[str, Sequence[int]], "Future[tuple[int, str]]"]


@dataclass
class _Wait:
    t0: float
    polled: float
    future: Future[tuple[int, str]] | None = None
    hit: int = 0
    reason: str = ""


class HandoffWaits:
    """The consumer's waits for receipts, one per request, none of them blocking: ``poll``
    answers None (ask again) while the receipt's tokens are not visible and ``wait_s`` has not
    passed; else what is visible (late: what was, at the last lookup that ended)."""

    def __init__(
        self, submit: SubmitLookup, wait_s: float, poll_s: float, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._submit, self.wait_s, self.poll_s, self._clock = submit, wait_s, poll_s, clock
        self._waits: dict[str, _Wait] = {}

    def poll(self, req_id: str, capability: str, tokens: Sequence[int], need: int) -> tuple[int, str, str, float] | None:
        """None (ask again), or (hit tokens, "" or LATE, the last lookup's degraded reason, seconds
        waited); ``need``: the tokens of ``tokens`` that must be visible (the receipt's, at most
        the prefix the lookup asks for)."""
        now = self._clock()
        w = self._waits.get(req_id)
        if w is None:
            w = self._waits[req_id] = _Wait(t0=now, polled=float("-inf"))
        if w.future is not None and w.future.done():
            future, w.future = w.future, None
            try:
                w.hit, w.reason = future.result()
            except Exception as exc:  # refused, unreachable, timed out: not visible yet
                w.hit, w.reason = 0, _reason(exc)
            if w.hit >= need:
                del self._waits[req_id]
                return w.hit, "", w.reason, now - w.t0
        if now - w.t0 >= self.wait_s:
            del self._waits[req_id]
            return w.hit, LATE, w.reason, now - w.t0
        if w.future is None and now - w.polled >= self.poll_s:
            w.polled = now
            w.future = self._submit(capability, tokens)
        return None

    def waiting(self, req_id: str) -> bool:
        return req_id in self._waits

    def forget(self, req_id: str) -> None:
        self._waits.pop(req_id, None)


class HandoffStores:
    """A producer worker's hand-off stores: ``submitted`` as ``save`` hands each on (None: it
    stored nothing, the blocks need not wait), ``durable`` answers, of the requests vLLM has
    finished, those whose store has ended (get_finished's finished_sending)."""

    def __init__(self, yield_s: float = 0.001) -> None:
        self._stores: dict[str, Future[Any] | None] = {}
        self._finished: set[str] = set()
        self.yield_s = yield_s

    def submitted(self, req_id: str, future: Future[Any] | None) -> None:
        self._stores[req_id] = future

    def durable(self, finished_req_ids: Iterable[str]) -> set[str]:
        self._finished |= {r for r in finished_req_ids if r in self._stores}
        done = {r for r in self._finished if (f := self._stores[r]) is None or f.done()}
        for r in done:
            del self._stores[r]
        self._finished -= done
        if self._finished:
            # vLLM steps without pause while blocks wait for a send: give the backend's loop
            # thread, which runs the stores, the interpreter and the core for a moment
            time.sleep(self.yield_s)
        return done

    def __len__(self) -> int:
        return len(self._stores)


async def durable_store(backend: Backend, store: Awaitable[StoreResult]) -> StoreResult:
    """A hand-off store, ended once the tiers every engine shares hold it (the write-behind
    copies too: the consumer looks up there)."""
    result = await store
    if backend.copies_behind():
        await backend.copies_written()
    return result


def submit_lookup(backend: Backend, model: KVModel, capability: str, tokens: Sequence[int]) -> Future[tuple[int, str]]:
    """A lookup on the backend's loop, not waited for (``HandoffWaits``' ``SubmitLookup``)."""

    async def run() -> tuple[int, str]:
        result = await backend.lookup(capability, model, tokens)
        return result.hit_tokens, result.degraded

    return backend.loop.submit(run())


def audit_refused_receipt(backend: Backend, capability: str, req_id: str, reason: str) -> None:
    """Audit a receipt refused for a request (``authz.denied``, op ``handoff``): embedded, into
    the gateway's audit log; remote, reported to the server (``report_refused_receipt``), which
    verifies the capability and records the same event. Never raises, never waits."""
    log.warning("kvgate refused the hand-off receipt of %s (%s): it loads nothing and recomputes", req_id, reason)
    report = getattr(backend, "report_refused_receipt", None)
    if report is not None:
        try:
            backend.loop.submit(report(capability, req_id, reason))
        except RuntimeError:  # the loop thread is not running
            pass
        return
    runtime = getattr(backend, "runtime", None)
    if runtime is None:
        return
    try:
        cap = read_unverified(capability)
    except CapabilityDenied:
        return
    from gateway.services.access import refused_receipt_event

    event = refused_receipt_event(cap.tenant, cap.namespace, req_id, reason)

    async def emit() -> None:
        runtime.audit.emit(event)

    backend.loop.submit(emit())


def _reason(exc: BaseException) -> str:
    from gateway.vllm.logs import miss_reason

    return miss_reason(exc) if isinstance(exc, ValueError) or hasattr(exc, "reason") else type(exc).__name__
