"""Training batches from generated samples: length-grouped, padded to a token budget, in a seeded order.

An epoch's order is a pure function of (seed, epoch), so a resumed run continues from (epoch,
batch index) exactly where the interrupted one was. Samples are shuffled, grouped into windows of
similar length (little padding), cut into batches of at most `tokens_per_batch` padded tokens, and
the batches shuffled again. Each sample is cut to `max_len` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.train.data import Samples

_WINDOW = 2048  # samples sorted by length together: 64 left a third of each batch padding


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, S] int64, padded with 0 after each sample's end
    # On the CPU whatever the device: the host plans which rows are scored without a device sync.
    lengths: torch.Tensor  # [B] int64
    prompt_lens: torch.Tensor  # [B] int64

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


def epoch_batches(
    samples: Samples, tokens_per_batch: int, max_len: int, seed: int, epoch: int
) -> list[np.ndarray]:
    """Sample indices of every batch of epoch `epoch`, in training order."""
    rng = np.random.default_rng([seed, epoch])
    lengths = np.minimum(samples.lengths, max_len)
    order = rng.permutation(len(samples))
    batches: list[np.ndarray] = []
    for w in range(0, len(order), _WINDOW):
        window = order[w : w + _WINDOW]
        window = window[np.argsort(lengths[window], kind="stable")]
        current: list[int] = []
        for i in window:  # ascending length: sample i sets the batch's width
            if current and lengths[i] * (len(current) + 1) > tokens_per_batch:
                batches.append(np.array(current))
                current = []
            current.append(int(i))
        if current:
            batches.append(np.array(current))
    return [batches[i] for i in rng.permutation(len(batches))]


def make_batch(samples: Samples, indices: np.ndarray, max_len: int, device: torch.device) -> Batch:
    lengths = np.minimum(samples.lengths[indices], max_len)
    ids = np.zeros((len(indices), int(lengths.max())), dtype=np.int64)
    for row, (i, n) in enumerate(zip(indices, lengths, strict=True)):
        ids[row, :n] = samples.sample(int(i))[:n]
    return Batch(
        torch.from_numpy(ids).to(device),
        torch.from_numpy(lengths.astype(np.int64)),
        torch.from_numpy(np.minimum(samples.prompt_lens[indices], lengths).astype(np.int64)),
    )


def draft_vocabulary(samples: Samples, size: int, vocab: int) -> torch.Tensor:
    """The `size` target ids most frequent in the answers (ties to the lower id), ascending: an
    EAGLE-3 head's reduced vocabulary."""
    ranked = token_ranking(np.bincount(samples.response_tokens(), minlength=vocab)[:vocab])[:size]
    return torch.from_numpy(np.sort(ranked).astype(np.int64))


def token_ranking(counts: np.ndarray) -> np.ndarray:
    """Token ids by their count, most frequent first, ties to the lower id (a stable order, so a
    ranking recomputed from the same data is the same file)."""
    return np.lexsort((np.arange(len(counts)), -counts))
