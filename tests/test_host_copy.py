"""Host-to-device copies through the pinned ring (specserve/engine/host_copy.py)."""

import pytest
import torch

from specserve.engine.host_copy import PinnedRing, to_device


def test_on_the_cpu_the_tensor_is_handed_back():
    host = torch.arange(6).view(2, 3)
    assert to_device(host, "cpu") is host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_refilled_buffer_never_changes_a_copy_still_queued():
    """Two buffers, fifty copies queued behind slow GPU work, each host tensor overwritten at once:
    every device tensor holds what its host tensor held when copied (the ring waits for a buffer's
    last copy before refilling it), across dtypes and growing sizes."""
    device = torch.device("cuda")
    ring = PinnedRing(device, slots=2)
    busy = torch.randn(4096, 4096, device=device)
    expected, copies = [], []
    for i in range(50):
        busy = busy @ busy / 64  # keeps the stream busy, so copies queue up
        dtype = (torch.int64, torch.float32, torch.bool)[i % 3]
        host = (
            (torch.arange(i * 100 + 1) % 7 == 0)
            if dtype is torch.bool
            else torch.arange(i * 100 + 1).to(dtype)
        )
        expected.append(host.clone())
        copies.append(ring.copy(host))
        host.zero_()  # the caller may reuse its tensor at once
    torch.cuda.synchronize()
    for want, got in zip(expected, copies, strict=True):
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
