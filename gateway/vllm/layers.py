"""Layer-wise loads: the forward starts on the first layers while the rest of a hit loads.

vLLM calls ``wait_for_layer_load(layer)`` before each attention layer of a step that carries
connector metadata. A CPU cache is loaded straight into its blocks, layer by layer across the
chunks (``DataPlane.retrieve``, ``on_layers``): each envelope segment is a whole layer range with
its own tag, so layer ``i`` is in the cache, authentic, before layer ``i + 1`` is decrypted.
``LayerLoads``: ``start(op)`` submits a step's load (its ``at(n)`` is told as layers ``[0, n)``
land); ``wait(layer)`` blocks until every load of the step has that layer or has ended (blocks
not loaded are load errors); ``take()`` hands the loads to ``WorkerSide.finish_loads``.

Loads go layer-wise (``ready``) only once a whole step called the hook for every layer, and every
step checks again: where a forward did not ask for every layer, it may have read one before it was
in place, so every block of that step's layer-wise loads is reported as a load error (vLLM
recomputes). A GPU cache (compact buffer; a CUDA graph replay skips the hook) and remote mode
(``RemoteBackend``) never go layer-wise. Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from gateway.vllm.ledger import LoadOp

__all__ = ["LayerLoad", "LayerLoads"]


@dataclass(eq=False)
class LayerLoad:
    op: LoadOp
    upto: int
    t0: float
    cond: threading.Condition = field(repr=False)
    layers: int = 0  # layers [0, layers) of this load are in place
    done: bool = False
    t_first: float | None = None  # when its first layer was in place: the forward could use it
    t_end: float | None = None
    future: Future[Any] | None = None

    def at(self, layers: int) -> None:
        """From the data path's threads: layers ``[0, layers)`` are in place."""
        with self.cond:
            if layers > self.layers:
                if self.t_first is None:
                    self.t_first = time.perf_counter()
                self.layers = layers
                self.cond.notify_all()

    def ended(self, _future: Future[Any]) -> None:
        with self.cond:
            self.done = True
            self.t_end = time.perf_counter()
            self.cond.notify_all()


class LayerLoads:
    def __init__(self, enabled: bool = True, wait_s: float = 60.0) -> None:
        self.enabled = enabled
        self.wait_s = wait_s  # the longest a layer is waited for (past the load's own timeout)
        self._index: dict[str, int] = {}
        self._cond = threading.Condition()
        self._loads: list[LayerLoad] = []
        self._asked: set[str] = set()  # layers the forward asked for this step
        self._seen_whole_step = False
        self._waited = 0.0

    def register(self, layer_names: Sequence[str]) -> None:
        self._index = {name: i for i, name in enumerate(layer_names)}

    def new_step(self) -> None:
        """At start_load_kv: the step before it, if it asked for every layer, shows the hook works."""
        if self._index and len(self._asked) == len(self._index):
            self._seen_whole_step = True
        self._asked = set()
        self._waited = 0.0

    def ready(self) -> bool:
        return self.enabled and self._seen_whole_step

    def start(self, op: LoadOp, upto: int, t0: float) -> LayerLoad:
        load = LayerLoad(op, upto, t0, self._cond)
        self._loads.append(load)
        return load

    def wait(self, layer_name: str) -> None:
        self._asked.add(layer_name)
        i = self._index.get(layer_name)
        loads = self._loads
        if i is None or not loads:
            return
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: all(x.done or x.layers > i for x in loads), self.wait_s)
        self._waited += time.perf_counter() - t0

    def take(self) -> tuple[list[LayerLoad], bool, float]:
        """The step's loads (then forgotten), whether the forward asked for every layer, and the
        seconds it waited for them."""
        loads, self._loads = self._loads, []
        return loads, len(self._asked) == len(self._index), self._waited
