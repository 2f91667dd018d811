"""Tensor parallelism of the target model: which rows each rank holds, and the layers that hold them.

One engine replica is one TP group. Attention is split by KV group (each rank holds a contiguous
block of KV heads and the query heads that read them, so GQA stays local to a rank), the MLP by
intermediate rows, embedding and lm_head by vocabulary rows. Splits may be uneven: the first ranks
take one more head / row. Column-parallel projections (q/k/v, gate/up) leave their output sharded;
row-parallel ones (o_proj, down_proj) all-reduce partial sums; the vocab-parallel embedding masks
ids outside its shard and all-reduces; the vocab-parallel lm_head all-gathers fp32 logits so every
rank holds the full vocabulary.

With one rank every factory returns the plain module the model used before TP existed: same class,
same code path, no collectives. Weights load from full HF tensors: each parallel layer picks its
part in `take_shard`, which `load_stacked_weights` calls (see specserve/model/weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from specserve.model.arch import ModelArch
from specserve.model.layers import StackedLinear


@dataclass(frozen=True)
class TPInfo:
    """This process's place in its TP group. `group` None means torch.distributed's default group
    (one replica's ranks are its whole world); with size 1 no collective ever runs."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and 0 <= self.rank < self.size):
            raise ValueError(f"tp_size: rank {self.rank} of size {self.size} is not a valid TP position")

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


NO_TP = TPInfo()  # a single rank: every layer is the plain module, no collectives


# ---- partition math (pure functions) -------------------------------------------------------------


def split_range(total: int, parts: int, index: int) -> range:
    """Part `index` of `total` items cut into `parts` contiguous blocks, the first `total % parts`
    one item longer (so uneven splits stay as balanced as they can)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


@dataclass(frozen=True)
class HeadShard:
    """Query and KV heads one rank holds (contiguous ranges of the checkpoint's heads)."""

    q: range
    kv: range

    def q_rows(self, head_dim: int) -> range:
        """Rows of q_proj (and columns of o_proj) of this rank's query heads."""
        return range(self.q.start * head_dim, self.q.stop * head_dim)

    def kv_rows(self, head_dim: int) -> range:
        return range(self.kv.start * head_dim, self.kv.stop * head_dim)


def partition_heads(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """Split attention by KV group. With fewer KV heads than ranks, each KV head is replicated on
    `tp_size // num_kv_heads` ranks that share its query heads evenly."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp_size:
        kv = split_range(num_kv_heads, tp_size, rank)
        return HeadShard(range(kv.start * group, kv.stop * group), kv)
    replicas = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group % replicas:
        raise ValueError(
            f"tp_size: {tp_size} ranks cannot split {num_heads} query / {num_kv_heads} KV heads (with "
            "fewer KV heads than ranks, tp_size must be a multiple of them and each KV head's query "
            "heads must split evenly over its replicas)"
        )
    kv_head, part = divmod(rank, replicas)
    per_rank = group // replicas
    start = kv_head * group + part * per_rank
    return HeadShard(range(start, start + per_rank), range(kv_head, kv_head + 1))


def partition_rows(total: int, tp_size: int, rank: int, what: str) -> range:
    """An uneven contiguous split that leaves no rank empty (MLP intermediate rows)."""
    if total < tp_size:
        raise ValueError(f"tp_size: {tp_size} ranks exceed the {total} {what} rows to split")
    return split_range(total, tp_size, rank)


@dataclass(frozen=True)
class VocabShard:
    """Vocabulary rows [start, start + count) on this rank, in a table `padded` rows long: every rank
    holds the same shape (the all-gather needs it); the last shard's tail rows are zero padding."""

    start: int
    count: int
    padded: int


def partition_vocab(vocab_size: int, tp_size: int, rank: int) -> VocabShard:
    if vocab_size < tp_size:
        raise ValueError(f"tp_size: {tp_size} ranks exceed the {vocab_size} vocabulary rows")
    padded = -(-vocab_size // tp_size)
    start = min(rank * padded, vocab_size)
    return VocabShard(start, min(padded, vocab_size - start), padded)


# ---- layers --------------------------------------------------------------------------------------


class TPShard:
    """A layer that holds part of a checkpoint tensor; the loader asks it for that part."""

    def take_shard(self, shard: str | None, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor (`shard`: the stacked projection, if any).
        The full extent is checked first: a slice of a wrong-sized tensor could otherwise fit."""
        dim, size = self.split_extent(shard)
        if tensor.shape[dim] != size:
            raise ValueError(
                f"checkpoint shape {tuple(tensor.shape)} does not fit the model ({size} along dim {dim})"
            )
        return self.cut(shard, tensor)

    def split_extent(self, shard: str | None) -> tuple[int, int]:
        """(the dimension split across ranks, its full size in the checkpoint)."""
        raise NotImplementedError

    def cut(self, shard: str | None, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ColumnParallelStacked(StackedLinear, TPShard):
    """This rank's output rows of each stacked projection (q/k/v or gate/up); the output stays
    sharded, so no collective runs here. `sources` names each projection's rows in the checkpoint,
    `full` its full row count."""

    def __init__(self, in_features: int, sources: dict[str, range], full: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, {name: len(rows) for name, rows in sources.items()}, bias)
        self.sources, self.full = sources, full

    def split_extent(self, shard: str | None) -> tuple[int, int]:
        return 0, self.full[shard]

    def cut(self, shard: str | None, tensor: torch.Tensor) -> torch.Tensor:
        rows = self.sources[shard]
        return tensor[rows.start : rows.stop]  # weight rows, or bias entries


class RowParallelLinear(nn.Linear, TPShard):
    """Input columns `columns` of the full projection; partial outputs are summed over the group."""

    def __init__(self, columns: range, full_columns: int, out_features: int, tp: TPInfo) -> None:
        super().__init__(len(columns), out_features, bias=False)  # a bias would be added `size` times
        self.columns, self.full_columns, self.tp = columns, full_columns, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out, group=self.tp.group)
        return out

    def split_extent(self, shard: str | None) -> tuple[int, int]:
        return 1, self.full_columns

    def cut(self, shard: str | None, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[:, self.columns.start : self.columns.stop]


class VocabRows(TPShard):
    """Loading of a vocab-sharded table: this rank's rows, zero-padded to the common shard size."""

    shard: VocabShard
    vocab_size: int

    def split_extent(self, shard: str | None) -> tuple[int, int]:
        return 0, self.vocab_size

    def cut(self, shard: str | None, tensor: torch.Tensor) -> torch.Tensor:
        rows = tensor[self.shard.start : self.shard.start + self.shard.count]
        if self.shard.count == self.shard.padded:
            return rows
        pad = rows.new_zeros(self.shard.padded - self.shard.count, *rows.shape[1:])
        return torch.cat([rows, pad])


class VocabParallelEmbedding(nn.Embedding, VocabRows):
    """Rows of this rank's vocabulary shard; ids outside it embed to zero, and the all-reduce adds
    the one rank's row that holds each id (exact: every other term is zero)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo) -> None:
        self.shard = partition_vocab(vocab_size, tp.size, tp.rank)
        super().__init__(self.shard.padded, hidden)
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.shard.start
        inside = (local >= 0) & (local < self.shard.count)
        out = super().forward(torch.where(inside, local, 0))
        out = out.masked_fill(~inside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.tp.group)
        return out


class VocabParallelLMHead(nn.Linear, VocabRows):
    """Logits of this rank's vocabulary rows, all-gathered in fp32 and trimmed to the vocabulary:
    every rank returns the full [R, vocab] logits (followers' copies are simply not read)."""

    def __init__(self, hidden: int, vocab_size: int, tp: TPInfo) -> None:
        self.shard = partition_vocab(vocab_size, tp.size, tp.rank)
        super().__init__(hidden, self.shard.padded, bias=False)
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 0:  # every rank knows the row count, so all skip the gather together
            return hidden.new_zeros(0, self.vocab_size, dtype=torch.float32)
        local = super().forward(hidden).float()
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        dist.all_gather(parts, local, group=self.tp.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


# ---- factories: the plain module at size 1 -------------------------------------------------------


def qkv_projection(in_features: int, arch: ModelArch, heads: HeadShard, tp: TPInfo) -> StackedLinear:
    d = arch.head_dim
    if tp.size == 1:
        q, kv = len(heads.q) * d, len(heads.kv) * d
        return StackedLinear(in_features, {"q_proj": q, "k_proj": kv, "v_proj": kv}, bias=arch.attention_bias)
    sources = {"q_proj": heads.q_rows(d), "k_proj": heads.kv_rows(d), "v_proj": heads.kv_rows(d)}
    full = {"q_proj": arch.num_heads * d, "k_proj": arch.num_kv_heads * d, "v_proj": arch.num_kv_heads * d}
    return ColumnParallelStacked(in_features, sources, full, arch.attention_bias)


def gate_up_projection(hidden: int, intermediate: int, rows: range, tp: TPInfo) -> StackedLinear:
    if tp.size == 1:
        return StackedLinear(hidden, {"gate_proj": len(rows), "up_proj": len(rows)}, bias=False)
    full = {"gate_proj": intermediate, "up_proj": intermediate}
    return ColumnParallelStacked(hidden, {"gate_proj": rows, "up_proj": rows}, full, bias=False)


def row_projection(columns: range, full_columns: int, out_features: int, tp: TPInfo) -> nn.Linear:
    if tp.size == 1:
        return nn.Linear(len(columns), out_features, bias=False)
    return RowParallelLinear(columns, full_columns, out_features, tp)


def embedding(vocab_size: int, hidden: int, tp: TPInfo) -> nn.Embedding:
    if tp.size > 1:
        return VocabParallelEmbedding(vocab_size, hidden, tp)
    if torch.get_default_device().type == "meta":
        # Built to be loaded (`build_model`): no init, whose normal_ on meta tensors cost ~2.3 s the
        # first time in a process (every server replica and test worker loading a model).
        return nn.Embedding(vocab_size, hidden, _weight=torch.empty(vocab_size, hidden))
    return nn.Embedding(vocab_size, hidden)


def lm_head(hidden: int, vocab_size: int, tp: TPInfo) -> nn.Linear:
    if tp.size == 1:
        return nn.Linear(hidden, vocab_size, bias=False)
    return VocabParallelLMHead(hidden, vocab_size, tp)


def head_shard(num_heads: int, num_kv_heads: int, tp: TPInfo) -> HeadShard:
    return partition_heads(num_heads, num_kv_heads, tp.size, tp.rank)
