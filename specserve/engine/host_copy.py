"""Host-to-device copies of a step's small inputs through reusable page-locked buffers.

Every step sends a few small host arrays to the GPU (token ids and positions, sampling parameters,
draft tokens). `Tensor.pin_memory()` per copy costs a pinned-ness query and an allocator round trip
each time (about 0.1 ms apiece on the H100 hosts, three times a step: a fifth of a batch-1 step);
a pageable copy is worse, as the host waits for it. Here each device has a ring of page-locked
buffers that grow to the largest input seen; a copy fills the next buffer on the host, queues an
asynchronous copy from it, and records an event, and the buffer is refilled only after that event
has passed (a ring of `SLOTS` is far more than the copies two overlapped steps keep in flight, so
the wait is normally already over).
"""

from __future__ import annotations

import os
import threading

import torch

SLOTS = 32
# SPECSERVE_PINNED_RING=0: pin each copy on its own instead (the way before the ring), to time both.
PINNED_RING = os.environ.get("SPECSERVE_PINNED_RING", "1") != "0"


class PinnedRing:
    """A ring of page-locked staging buffers for copies to one CUDA device."""

    def __init__(self, device: torch.device, slots: int = SLOTS) -> None:
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0
        self._lock = threading.Lock()  # engine, detokeniser and server threads may all copy

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        """`host` (a CPU tensor) on the device, copied asynchronously; `host` may change at once."""
        host = host.contiguous()
        nbytes = host.numel() * host.element_size()
        with self._lock:
            slot = self._next
            self._next = (slot + 1) % len(self._buffers)
            event = self._events[slot]
            if event is not None:
                event.synchronize()  # the last copy out of this buffer has run
            buffer = self._buffers[slot]
            if buffer is None or buffer.numel() < nbytes:
                size = max(nbytes, 2 * (0 if buffer is None else buffer.numel()), 1024)
                buffer = self._buffers[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            staged = buffer[:nbytes].view(host.dtype).view(host.shape)
            staged.copy_(host)
            out = staged.to(self.device, non_blocking=True)
            if event is None:
                event = self._events[slot] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return out


_rings: dict[torch.device, PinnedRing] = {}
_rings_lock = threading.Lock()


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` on `device`: through the device's pinned ring on CUDA (asynchronous), as is on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    if not PINNED_RING:
        return host.pin_memory().to(device, non_blocking=True)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ring = _rings.get(device)
    if ring is None:
        with _rings_lock:
            ring = _rings.setdefault(device, PinnedRing(device))
    return ring.copy(host)
