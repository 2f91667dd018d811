"""The KV cache tensors: one flat slot array per layer, addressed through pages.

Slot s of page p is `p * page_size + s`. Page 0 is never handed out: padding rows of a batch
write there, so a kernel never needs a branch for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.model.arch import ModelArch

DUMMY_PAGE = 0


@dataclass(frozen=True)
class KVCache:
    k: torch.Tensor  # [layers, slots, kv_heads, head_dim]
    v: torch.Tensor
    page_size: int

    @classmethod
    def allocate(
        cls,
        arch: ModelArch,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_kv_heads: int | None = None,
    ) -> KVCache:
        """`num_kv_heads`: the heads this rank holds under TP (default: all of the model's)."""
        kv_heads = num_kv_heads or arch.num_kv_heads
        shape = (arch.kv_layers, num_pages * page_size, kv_heads, arch.head_dim)
        # Uninitialised is safe: a request reads only slots it wrote, and padding reads only the dummy
        # page, zeroed here (garbage there could be NaN, and NaN times a zero weight is still NaN).
        k = torch.empty(shape, dtype=dtype, device=device)
        v = torch.empty(shape, dtype=dtype, device=device)
        dummy = slice(DUMMY_PAGE * page_size, (DUMMY_PAGE + 1) * page_size)
        k[:, dummy].zero_()
        v[:, dummy].zero_()
        return cls(k, v, page_size)

    @property
    def num_pages(self) -> int:
        return self.k.shape[1] // self.page_size

    @staticmethod
    def bytes_per_token(arch: ModelArch, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * arch.kv_layers * (num_kv_heads or arch.num_kv_heads) * arch.head_dim * itemsize
