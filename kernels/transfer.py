"""Moving a chunk's ciphertext between the device and host memory, segment by segment.

    SegmentCopier(device, capacity)   a pinned bounce buffer and a side stream (CUDA); inert on CPU
      .issue_d2h(src, start, end)     after the kernels that wrote ``src[start:end]`` were queued:
                                      copy it to the pinned buffer on the side stream (an event
                                      orders it after them; the compute stream never waits)
      .fetch_d2h(src, start, end, dst) wait for that copy's event only, then host memcpy into ``dst``
      .h2d(src, dst, start, end)      host bytes -> pinned -> ``dst[start:end]`` on the side stream;
                                      the compute stream waits on its event (no host sync)

On CUDA the copy of segment ``i`` runs while the kernels of segment ``i + 1`` do (the side stream),
and only events are waited for, never ``synchronize``. On CPU (and under Triton's interpreter) the
methods are plain copies: ``issue_d2h`` does nothing and ``fetch_d2h`` copies straight from ``src``.
The pinned buffer is this object's own (``capacity`` bytes), unless the caller hands in a host
tensor of its own (``host=``).
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["SegmentCopier"]


class SegmentCopier:
    __slots__ = ("_done", "_host", "_stream", "capacity", "device")

    def __init__(self, device: torch.device | str, capacity: int, *, host: torch.Tensor | None = None) -> None:
        self.device = torch.device(device)
        self.capacity = capacity
        self._done: dict[int, torch.cuda.Event] = {}
        if self.device.type == "cuda":
            self._stream: torch.cuda.Stream | None = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch leaves the CUDA Stream constructor unannotated
            if host is None:
                host = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            elif not host.is_pinned() or host.numel() < capacity:
                raise ValueError("host must be a pinned uint8 tensor of at least capacity bytes")
            self._host: torch.Tensor | None = host
        else:
            self._stream = None
            self._host = None

    @property
    def active(self) -> bool:
        """Whether copies go through the side stream and pinned memory (CUDA)."""
        return self._stream is not None

    def issue_d2h(self, src: torch.Tensor, start: int, end: int) -> None:
        if self._stream is None or self._host is None or end <= start:  # both set on CUDA only
            return
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves the CUDA Event constructor unannotated
        ready.record()  # on the compute stream, after the kernels that wrote src[start:end]
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            self._host[start:end].copy_(src[start:end], non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves the CUDA Event constructor unannotated
            done.record(self._stream)
        src.record_stream(self._stream)
        self._done[start] = done

    def fetch_d2h(self, src: torch.Tensor, start: int, end: int, dst: memoryview) -> None:
        if end <= start:
            return
        out = torch.frombuffer(dst, dtype=torch.uint8)
        if self._stream is None or self._host is None:
            out.copy_(src[start:end])
            return
        done = self._done.pop(start, None)
        if done is None:  # not issued: copy it now (ordered after the compute stream's work)
            self.issue_d2h(src, start, end)
            done = self._done.pop(start)
        done.synchronize()  # this segment's copy only
        out.copy_(self._host[start:end])

    def h2d(self, src: memoryview, dst: torch.Tensor, start: int, end: int) -> None:
        if end <= start:
            return
        with warnings.catch_warnings():  # a read-only envelope: torch only reads it here
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(src, dtype=torch.uint8)
        if self._stream is None or self._host is None:
            dst[start:end].copy_(data)
            return
        self._host[start:end].copy_(data)  # the previous chunk's copies were waited for by its tag check
        with torch.cuda.stream(self._stream):
            dst[start:end].copy_(self._host[start:end], non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves the CUDA Event constructor unannotated
            done.record(self._stream)
        dst.record_stream(self._stream)
        torch.cuda.current_stream(self.device).wait_event(done)
