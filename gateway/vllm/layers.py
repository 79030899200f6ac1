"""Layer-wise loads: the forward starts on the first layers while the rest of a hit loads.

vLLM calls ``wait_for_layer_load(layer)`` before each attention layer of a step that carries
connector metadata. A CPU cache in the chunk format's layout is loaded straight into its blocks,
and the data plane opens a load layer by layer across its chunks (``DataPlane.retrieve``,
``on_layers``): every segment of an envelope is a whole layer range, authenticated on its own,
so layer ``i`` of a chunk can be in the cache, authentic, before layer ``i + 1`` is decrypted.

``LayerLoads`` is the worker side of that:

- ``start(op)`` in start_load_kv: a load of the step, submitted to the backend's loop (not
  waited for); its ``at(n)`` is told from the data path's threads as layers ``[0, n)`` land.
- ``wait(layer)`` in wait_for_layer_load: blocks until every load of the step has that layer in
  place (or has ended: a miss or a failed tag ends it short, and the blocks it did not load are
  load errors, as for a synchronous load).
- ``take()`` in the step's last hooks: the loads, for the worker to wait for to their end and
  report (``WorkerSide.finish_loads``), whether the forward asked for every layer this step, and
  how long it waited.

When loads go layer-wise (``ready``): only once a whole step has been seen calling the hook for
every registered layer (vLLM skips it for steps without metadata, and a model or backend may
not call it at all). And every step checks again: where a step's forward did not ask for every
layer, it may have read one before it was in place, so ``finish_loads`` reports every block of
that step's layer-wise loads as a load error (vLLM recomputes them, and drops what the step
computed from them). A GPU cache never goes layer-wise here (its loads go through a compact
buffer, and a CUDA graph replay skips the hook), and neither does remote mode (``RemoteBackend``
says why: measured slower).
"""

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
    t_end: float | None = None
    future: Future[Any] | None = None

    def at(self, layers: int) -> None:
        """From the data path's threads: layers ``[0, layers)`` are in place."""
        with self.cond:
            if layers > self.layers:
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
