"""The optional `vllm-flash-attn` backend: its varlen paged attention over our KV cache pages.

Used only when `attention_backend="flash"` is asked for and the library imports against the
installed torch (its wheels are built for one torch version; a mismatch shows up as an ImportError
or an undefined symbol at import). "auto" never picks it: our Triton kernels stay the default GPU path.

Per layer: RoPE fused with the KV write (`specserve_kernels.rope_store`, as the Triton backend does),
then `flash_attn_varlen_func` over the cache viewed as [pages, page_size, kv_heads, head_dim] with the
step's page table as its `block_table`. The residual-add + RMSNorm fusion is the Triton backend's too,
so a bench against "triton" differs in the attention kernel alone.

The API targeted is vllm-flash-attn 2.6.2's:
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None, *, out=None)
With a `block_table` [B, max_blocks] int32, k/v are the paged caches and `cu_seqlens_k` [B + 1] int32
carries each request's context length (2.6.2 has no `seqused_k`); the causal mask is aligned to the
bottom right, which is exactly "a new token sees its whole prefix and the new tokens up to itself".

Constraints (each a clear error naming the setting): CUDA only (compute capability 8.0 or newer),
fp16/bf16, `page_size` a multiple of 16 (the check in the wheel's binary: "Paged KV cache block size
must be divisible by 16"; its `flash_attn_with_kvcache` docstring still says 256), head_dim at most 256, no CUDA graphs
(capture of the library's calls is unverified). A step with a custom (tree) mask, which the library
cannot express, runs our Triton paged attention over the same cache instead. A step whose
max_query_len is 1 must give every request one query row (the library's GQA decode path reshapes q by
batch size): eager steps always do; only CUDA-graph padding adds requests without rows.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specserve.attention.backend import AttentionBackend, AttentionBatch, AttentionContext
from specserve.attention.triton_backend import TritonAttentionBackend, TritonAttentionContext
from specserve.config import FLASH_PAGE_MULTIPLE
from specserve.engine.kv_cache import KVCache
from specserve_kernels import use_triton

MODULE = "vllm_flash_attn"
FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
INSTALL_HINT = "pip install vllm-flash-attn (a wheel built for the installed torch)"

VarlenFunc = Callable[..., torch.Tensor]
PagedLayers = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]


def flash_available() -> tuple[bool, str]:
    """(True, version) when `vllm_flash_attn` imports here, else (False, why not). Any exception
    counts: a missing package, a missing CUDA runtime, or an undefined symbol from a torch ABI mismatch."""
    try:
        module = importlib.import_module(MODULE)
    except Exception as exc:  # ImportError, OSError, ...: all mean "not usable here"
        return False, f"{MODULE} does not import: {type(exc).__name__}: {exc}"
    version = f"{MODULE} {getattr(module, '__version__', '(unknown version)')}"
    if not callable(getattr(module, "flash_attn_varlen_func", None)):
        return False, f"{version} has no flash_attn_varlen_func"
    return True, version


def check_flash_device(device: torch.device, dtype: torch.dtype) -> None:
    """What the library's kernels run on: a CUDA GPU of compute capability 8.0+, fp16 or bf16."""
    if device.type != "cuda":
        raise ValueError(f"device: attention_backend 'flash' runs on CUDA only, not {device}")
    if dtype not in FLASH_DTYPES:
        raise ValueError(f"dtype: attention_backend 'flash' supports float16 and bfloat16, not {dtype}")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise ValueError(
            f"device: attention_backend 'flash' needs compute capability 8.0 or newer, {device} has {major}.{minor}"
        )


def flash_attention_backend(device: torch.device, dtype: torch.dtype) -> FlashAttentionBackend:
    """The engine's factory for `attention_backend="flash"`: the library must import, the device suit it."""
    ok, why = flash_available()
    if not ok:
        raise ValueError(f"attention_backend: 'flash' needs vllm-flash-attn ({INSTALL_HINT}); {why}")
    check_flash_device(device, dtype)
    return FlashAttentionBackend()


class FlashAttentionContext(TritonAttentionContext):
    """The Triton context (fused RoPE + KV write, fused norm) with the paged attention call swapped
    for the library's. Planning is three small int32 conversions per step, no host sync."""

    def __init__(
        self,
        batch: AttentionBatch,
        layers: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
        paged: PagedLayers,
        varlen: VarlenFunc,
        kernels: bool,
        fused_norm: bool,
    ) -> None:
        super().__init__(batch, layers, kernels, fused_norm)
        self.paged, self.varlen = paged, varlen
        # The library wants int32, contiguous; ours are int64 views of the step's packed buffer.
        self.cu_seqlens_q = batch.query_start.to(torch.int32)
        self.cu_seqlens_k = F.pad(batch.seq_lens.cumsum(0), (1, 0)).to(torch.int32)
        self.block_table = batch.page_table.to(torch.int32)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        b = self.batch
        return self.varlen(
            q,
            self.paged[0][layer],
            self.paged[1][layer],
            self.cu_seqlens_q,
            self.cu_seqlens_k,
            b.max_query_len,
            b.max_seq_len,
            softmax_scale=q.shape[-1] ** -0.5,  # the model's scale, as the other backends use it
            causal=True,
            block_table=self.block_table,
        )


class FlashAttentionBackend(AttentionBackend):
    """Device-agnostic once built: `varlen` is the library's `flash_attn_varlen_func` (imported when
    None); the engine builds it through `flash_attention_backend`, which checks the device."""

    name = "flash"

    def __init__(self, varlen: VarlenFunc | None = None, fused_norm: bool = True) -> None:
        self.varlen = varlen or importlib.import_module(MODULE).flash_attn_varlen_func
        self.fused_norm = fused_norm
        self.tree = TritonAttentionBackend(fused_norm)  # steps with a custom mask
        self._kv: KVCache | None = None
        self._layers: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] = ((), ())
        self._paged: PagedLayers = ((), ())

    def prepare(self, batch: AttentionBatch, kv: KVCache) -> AttentionContext:
        if batch.custom_mask is not None:
            return self.tree.prepare(batch, kv)
        if kv is not self._kv:  # the per-layer views, made once per cache
            _check_cache(kv)
            layers, slots, heads, dim = kv.k.shape
            paged = (layers, slots // kv.page_size, kv.page_size, heads, dim)
            self._kv, self._layers = kv, (kv.k.unbind(0), kv.v.unbind(0))
            self._paged = (kv.k.view(paged).unbind(0), kv.v.view(paged).unbind(0))
        kernels = use_triton(kv.k.device)
        return FlashAttentionContext(batch, self._layers, self._paged, self.varlen, kernels, self.fused_norm)


def _check_cache(kv: KVCache) -> None:
    if kv.page_size % FLASH_PAGE_MULTIPLE:
        raise ValueError(
            f"page_size: attention_backend 'flash' needs a multiple of {FLASH_PAGE_MULTIPLE}, got {kv.page_size}"
        )
    if kv.k.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(
            f"model: attention_backend 'flash' supports head_dim up to {MAX_HEAD_DIM}, got {kv.k.shape[-1]}"
        )
